"""The `Model` protocol: what the engine and the graph runner need from a model.

Any `nn.Module` with these members plugs into `GenerationEngine(config, model=...)`
and `GraphRunner` without editing either; `ReferenceDecoder` is one implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: this file depends on no model implementation at run time
    import torch
    from torch import nn

    from torchhal.core.graphs.program import Step
    from torchhal.core.model import AttentionMetadata, KVCache, ModelConfig

# Members checked when a model is handed to the engine (a clear error beats an AttributeError mid-step).
MODEL_MEMBERS = (
    "config",
    "layer_program",
    "embed_tokens",
    "logits",
    "forward",
    "process_weights",
    "named_parameters",
    "state_dict",
    "load_state_dict",
    "to",
    "_apply",
    "eval",
)


@runtime_checkable
class Model(Protocol):
    """A decoder the engine can run.

    `config` gives the model facts: the engine reads `vocab_size` and `max_position`,
    sizes the paged KV cache through `KVCache.bytes_per_block(config, dtype, block_size)`
    and builds the attention spec from the head counts, `head_dim` and `sliding_window`.
    The engine sets `kv` (and clears it while asleep). Each step's `AttentionMetadata`
    carries the paged metadata and the backend to attend with. Weights are updated in place through
    `named_parameters()`; after every update the engine calls `process_weights()`,
    which must rebuild derived weights (fused projections, ...) *in place*, so that
    captured graphs keep reading valid addresses.
    """

    config: ModelConfig
    kv: KVCache | None

    def layer_program(self) -> list[Step]:
        """The layer stack as graph steps and breakable steps (see `graphs.program`).

        State in: "hidden" [T, H] (embedded tokens, which the program may update in place:
        runners pass a fresh embedding or a buffer they refill each step) and "positions" [T],
        and from the engine's runners `OUTPUT_ROWS` [R], the rows it samples; state out: "hidden" [T, H],
        ready for `logits`, or [R, H] when the program narrowed to those rows and removed
        the key (`graphs.program.OUTPUT_ROWS`: a program may ignore it)."""
        ...

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, H] hidden states."""
        ...

    def logits(self, hidden: torch.Tensor, last_token_index: torch.Tensor) -> torch.Tensor:
        """Hidden states and [B] row indices into them -> [B, vocab] float logits."""
        ...

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Eager layer stack: [T] ids -> [T, H] hidden states (writes this step's KV). The
        engine's runners run `layer_program()`; the graph runner falls back on this only
        for a model whose layer stack it cannot find."""
        ...

    def process_weights(self) -> None:
        """Rebuild derived weights in place from the current parameters."""
        ...

    # The nn.Module methods the engine uses.
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any: ...

    def to(self, *args: Any, **kwargs: Any) -> Any: ...

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """What `.to()` runs on every tensor; sleep runs it with a move into pinned host memory.
        Override it (calling super) when parameters view storage of their own (fused weights)."""
        ...

    def eval(self) -> Any: ...


def missing_model_members(model: object) -> list[str]:
    """The protocol members `model` lacks (empty when it conforms)."""
    return [name for name in MODEL_MEMBERS if not hasattr(model, name)]
