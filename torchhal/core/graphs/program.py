"""A layer stack as a program: graph-safe steps and breakable ops.

The model describes its layer stack as an ordered list of steps over a dict of
token-major tensors (`StackState`). A `GraphStep` is a pure per-token
computation and may live in a device graph; a `BreakStep` (attention first of
all) needs per-batch metadata and always runs eagerly. A break step writes its
results *in place* into tensors that already exist in the state, so that the
graph segment after it reads them from fixed addresses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

StackState = dict[str, torch.Tensor]


@dataclass(frozen=True)
class GraphStep:
    name: str
    run: Callable[[StackState], None]


@dataclass(frozen=True)
class BreakStep:
    """Runs eagerly with the live batch's metadata: `run(state, num_tokens, metadata)`.

    `layer`: for attention, the index of its layer's KV pool; lets a full-graph decode
    runner put its own capturable attention in this step's place (None: not attention,
    or unknown; such runners then fall back to the name `layer{N}.attention`).
    """

    name: str
    run: Callable[[StackState, int, Any], None]
    layer: int | None = None


Step = GraphStep | BreakStep


def split_segments(steps: list[Step]) -> list[list[GraphStep] | BreakStep]:
    """Merge consecutive graph steps into segments; each break stands alone."""
    out: list[list[GraphStep] | BreakStep] = []
    for step in steps:
        if isinstance(step, BreakStep):
            out.append(step)
        elif out and isinstance(out[-1], list):
            out[-1].append(step)
        else:
            out.append([step])
    return out


def run_eager(steps: list[Step], state: StackState, num_tokens: int, metadata: Any) -> None:
    for step in steps:
        if isinstance(step, BreakStep):
            step.run(state, num_tokens, metadata)
        else:
            step.run(state)
