"""Model runners: what runs the layer stack for one batch (eager here, graphs in core.graphs)."""

from __future__ import annotations

from typing import Protocol

import torch

from torchhal.core.model import AttentionMetadata, Model


class ModelRunner(Protocol):
    """Runs the model's layer stack for one batch: eager, or replayed graphs."""

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...

    def release(self) -> None: ...

    def resume(self) -> None: ...


class EagerRunner:
    def __init__(self, model: Model) -> None:
        self.model = model

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        with torch.no_grad():
            return self.model.forward(input_ids, meta)

    def release(self) -> None:
        return None

    def resume(self) -> None:
        return None
