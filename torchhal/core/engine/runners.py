"""Model runners: what runs the layer stack for one batch (eager here, graphs in core.graphs)."""

from __future__ import annotations

from typing import Protocol

import torch

from torchhal.core.graphs.program import StackState, run_for_rows
from torchhal.core.model import AttentionMetadata, Model


class ModelRunner(Protocol):
    """Runs the model's layer stack for one batch: eager, or replayed graphs."""

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """[T] ids -> the hidden states of `rows` ([R] int64 token indices, in their order),
        or of every token when None; this step's KV is written either way."""
        ...

    def release(self) -> None: ...

    def resume(self) -> None: ...


class EagerRunner:
    """The model's layer program, run eagerly (the program is the whole stack: `Model`)."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        with torch.no_grad():
            state: StackState = {"hidden": self.model.embed_tokens(input_ids), "positions": meta.positions}
            return run_for_rows(self.model.layer_program(), state, input_ids.numel(), meta, rows)

    def release(self) -> None:
        return None

    def resume(self) -> None:
        return None
