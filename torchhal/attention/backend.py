"""What an attention backend is, what it declares, and how one is chosen for a model.

A backend computes attention for a step's queries over the paged KV cache
(`torchhal.attention.layout`). It declares what it can do in an
`AttentionCapability`; `choose_backend` picks the first declared backend that can run
the model's `AttentionSpec`, else the portable reference, and says why. The spec and the
capability are checked where they are made; a backend's calls trust them and the metadata
(`PagedMetadata` checks itself), so the layer calls carry no checks of their own.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from torchhal.attention.layout import PagedMetadata
from torchhal.values import as_index, as_indices, check_bool

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FLAGS = ("prefill", "sliding_window", "soft_cap", "graph_capture", "step_kv")


@dataclass(frozen=True)
class AttentionCapability:
    """What one backend supports. A feature it lacks makes `choose_backend` pass it over.

    name:           short name for reports ("triton-paged", "reference").
    dtypes:         query/cache dtypes it computes in.
    head_dims:      head dims it accepts; None = any.
    block_sizes:    KV block sizes it accepts; None = any.
    prefill:        variable-length causal prefill over the paged cache, queries at an
                    offset into a context already cached (chunked prefill).
    sliding_window: a window of the last W positions per query.
    soft_cap:       logits soft-capping (cap * tanh(logits / cap)).
    graph_capture:  `decode` has no host syncs and no data-dependent shapes, so it can be
                    captured in a device graph (checked through the platform's graph support).
    step_kv:        `prefill` takes the step's own K/V (`key`, `value`: what `write_kv` just
                    stored at the step's slots) and may read a whole prompt's K/V from them
                    instead of back out of the cache. Engines pass them only to a backend
                    that declares this.
    note:           one line for reports.
    """

    name: str
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...] | None = None
    block_sizes: tuple[int, ...] | None = None
    prefill: bool = True
    sliding_window: bool = True
    soft_cap: bool = True
    graph_capture: bool = False
    step_kv: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        # A plugin's declaration is checked where it is made, not when selection reads it.
        def sizes(value: object) -> bool:
            return value is None or (isinstance(value, tuple) and bool(value) and as_indices(value, 1) is not None)

        musts = {
            "name": (isinstance(self.name, str) and bool(self.name), "a non-empty str naming the backend "
                                                                     "(e.g. 'triton-paged')"),
            "dtypes": (isinstance(self.dtypes, tuple) and bool(self.dtypes)
                       and all(isinstance(d, torch.dtype) for d in self.dtypes),
                       "a non-empty tuple of torch dtypes, e.g. (torch.bfloat16,)"),
            "head_dims": (sizes(self.head_dims), "None (any) or a non-empty tuple of ints >= 1"),
            "block_sizes": (sizes(self.block_sizes), "None (any) or a non-empty tuple of ints >= 1"),
            **{flag: (isinstance(getattr(self, flag), bool), "True or False") for flag in _FLAGS},
            "note": (isinstance(self.note, str), "a str"),
        }
        for field, (ok, must) in musts.items():
            if not ok:
                raise TypeError(f"AttentionCapability.{field} is {getattr(self, field)!r}; it must be {must}")
        # A dtype no AttentionSpec may ask for could never be chosen, nor checked by the suite.
        unknown = [d for d in self.dtypes if d not in _DTYPES]
        if unknown:
            raise ValueError(f"AttentionCapability.dtypes is {self.dtypes!r}, with {', '.join(map(str, unknown))}, "
                             f"which no AttentionSpec asks for; declare only {', '.join(map(str, _DTYPES))}")


@dataclass(frozen=True)
class AttentionSpec:
    """The attention a model needs: shapes, dtype and features (what selection checks).
    Every backend call of the model passes its `sliding_window` and `soft_cap` as they are
    here, so this is where they are checked."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    sliding_window: int | None = None
    soft_cap: float | None = None
    needs_prefill: bool = True
    needs_graph: bool = False

    def __post_init__(self) -> None:
        # Integers of any kind (numpy's too, as the metadata builders take) are kept as plain
        # ints, a real soft_cap as a float: the spec's numbers go to kernels as they are.
        for label in ("num_q_heads", "num_kv_heads", "head_dim", "block_size", "sliding_window"):
            value = getattr(self, label)
            if label == "sliding_window" and value is None:
                continue
            index = as_index(value)
            if index is None or index < 1:  # a bool or a float is refused, not truncated
                optional = "None or " if label == "sliding_window" else ""
                raise ValueError(f"AttentionSpec.{label} is {value!r}; it must be {optional}an int >= 1")
            object.__setattr__(self, label, index)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"AttentionSpec: num_q_heads {self.num_q_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}; grouped-query attention needs whole groups")
        if self.dtype not in _DTYPES:
            raise ValueError(f"AttentionSpec.dtype is {self.dtype}; use one of {', '.join(map(str, _DTYPES))}")
        cap = self.soft_cap
        if cap is not None:  # an infinite or NaN cap turns every output into NaN without an error
            if not isinstance(cap, numbers.Real) or isinstance(cap, bool) or not math.isfinite(cap) or not cap > 0:
                raise ValueError(f"AttentionSpec.soft_cap is {cap!r}; it must be None or a finite number > 0")
            object.__setattr__(self, "soft_cap", float(cap))
        check_bool("AttentionSpec.needs_prefill", self.needs_prefill)
        check_bool("AttentionSpec.needs_graph", self.needs_graph)


@runtime_checkable
class AttentionBackend(Protocol):
    """Attention over the paged KV cache. Every method leaves the cache's other slots alone.

    Shapes: query [num_tokens, num_q_heads, head_dim]; caches [num_blocks, block_size,
    num_kv_heads, head_dim] (one layer's, contiguous; `meta.block_size` is their block size);
    output like query. Query head h reads KV head h // (num_q_heads // num_kv_heads) (no
    copies of KV heads). A query at position p attends cached positions j <= p, and with a
    window W only p - j < W. A padded row (seq_len 0) outputs zeros. `out`, when given,
    receives the result (and is returned); without it, a new tensor like the query, which
    engines use as it is (no copy). The engine calls these with what the model's
    `AttentionSpec` and the metadata's constructor admitted, so they check nothing again.
    """

    capability: AttentionCapability

    def write_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store a step's K/V ([num_tokens, num_kv_heads, head_dim], each with its own
        strides: views into the projections' outputs) into their slots."""
        ...

    def decode(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata, *,
        scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query token per row (query [batch, ...]); graph-capturable where declared."""
        ...

    def prefill(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata, *,
        scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
        out: torch.Tensor | None = None, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Variable-length causal attention: request i's queries are rows
        meta.query_start[i]:meta.query_start[i + 1], its last tokens. `key`/`value`: the
        step's K/V, row t for query row t, as `write_kv` just stored them; given only to a
        backend declaring `step_kv`."""
        ...


@dataclass(frozen=True)
class AttentionChoice:
    """The backend chosen for a model, and one line saying why."""

    backend: AttentionBackend
    why: str

    @property
    def name(self) -> str:
        return self.backend.capability.name


def unsupported_reason(capability: AttentionCapability, spec: AttentionSpec) -> str | None:
    """Why a backend with `capability` cannot run `spec`, or None when it can."""
    if spec.dtype not in capability.dtypes:
        return f"dtype {spec.dtype} is not among {', '.join(map(str, capability.dtypes))}"
    if capability.head_dims is not None and spec.head_dim not in capability.head_dims:
        return f"head_dim {spec.head_dim} is not among {list(capability.head_dims)}"
    if capability.block_sizes is not None and spec.block_size not in capability.block_sizes:
        return f"block_size {spec.block_size} is not among {list(capability.block_sizes)}"
    if spec.needs_prefill and not capability.prefill:
        return "no paged prefill"
    if spec.sliding_window is not None and not capability.sliding_window:
        return "no sliding window"
    if spec.soft_cap is not None and not capability.soft_cap:
        return "no logit soft-capping"
    if spec.needs_graph and not capability.graph_capture:
        return "decode cannot be captured in a graph"
    return None


def choose_backend(declared: tuple[AttentionBackend, ...], spec: AttentionSpec,
                   fallback: AttentionBackend) -> AttentionChoice:
    """The first declared backend that runs `spec`, else `fallback`, with the reason."""
    if not isinstance(spec, AttentionSpec):  # a dict or None would pass as "no backend declared"
        raise TypeError(f"choose_attention: spec is {spec!r} ({type(spec).__name__}); pass a "
                        "torchhal.attention.AttentionSpec(num_q_heads, num_kv_heads, head_dim, dtype, block_size)")
    passed_over = []
    for backend in declared:
        reason = unsupported_reason(backend.capability, spec)
        if reason is None:
            return AttentionChoice(backend, f"{backend.capability.name}: the platform's backend supports this model")
        passed_over.append(f"{backend.capability.name}: {reason}")
    if not declared:
        return AttentionChoice(fallback, f"{fallback.capability.name}: the platform declares no attention backend")
    return AttentionChoice(fallback, f"{fallback.capability.name}: passed over " + "; ".join(passed_over))
