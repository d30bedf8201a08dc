"""A layer stack as a program: graph-safe steps and breakable ops.

The model describes its layer stack as an ordered list of steps over a dict of
token-major tensors (`StackState`). A `GraphStep` is a pure per-token
computation and may live in a device graph; a `BreakStep` (attention first of
all) needs per-batch metadata and always runs eagerly. A break step leaves its
results under names that already exist in the state: written in place, or as a
new tensor of at most as many rows (attention's output as its kernel made it,
say). A runner that replays the segments from graphs reads fixed addresses, so
it copies such a tensor into the one it captured (`copy_into_captured`).

A caller that wants some rows' hidden states only (the tokens it samples from) names them
under `OUTPUT_ROWS`; `run_for_rows` runs the program and returns those rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchhal.attention.layout import check_rows
from torchhal.values import short_repr

StackState = dict[str, torch.Tensor]

#: State key of the rows ([R] int64) whose hidden states the caller wants, in its order. A
#: program may narrow its state to them once nothing reads the other rows (the last layer
#: after its attention has written the step's KV); it then removes the key, so the rows are
#: not taken twice. A program that ignores the key computes every row, and the rows are
#: selected from its output.
OUTPUT_ROWS = "output_rows"


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


def copy_into_captured(captured: StackState, live: StackState) -> None:
    """After a break step ran on `live`, a copy of the state the graphs were captured with:
    each tensor it replaced is copied into the captured one (its first rows), whose address
    the graph segments after it read."""
    for name, tensor in live.items():
        target = captured.get(name)
        if target is not None and tensor is not target:
            target[: tensor.shape[0]].copy_(tensor)


_TOKEN_ID_DTYPES = (torch.int64, torch.int32)


def check_step_inputs(label: str, input_ids: object, metadata: Any) -> None:
    """`input_ids` a 1-D integer tensor with one token per position of `metadata` (host facts
    only: no device sync). A [1, T] batch or float ids failed deep in a layer, and a runner's
    static buffers broadcast a mismatched count instead of refusing it."""
    if (not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1
            or input_ids.dtype not in _TOKEN_ID_DTYPES):
        shown = (f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, torch.Tensor)
                 else short_repr(input_ids))
        raise ValueError(f"{label}: input_ids is {shown}; pass a 1-D integer tensor of the step's token ids "
                         "(int64)")
    positions = getattr(metadata, "positions", None)
    if isinstance(positions, torch.Tensor) and positions.shape[0] != input_ids.shape[0]:
        raise ValueError(f"{label}: input_ids has {input_ids.shape[0]} tokens but meta.positions "
                         f"{positions.shape[0]}; build the metadata for this step's tokens")


def run_eager(steps: list[Step], state: StackState, num_tokens: int, metadata: Any) -> None:
    for step in steps:
        if isinstance(step, BreakStep):
            step.run(state, num_tokens, metadata)
        else:
            step.run(state)


def run_for_rows(steps: list[Step], state: StackState, num_tokens: int, metadata: Any,
                 rows: torch.Tensor | None, label: str = "forward") -> torch.Tensor:
    """Run the program eagerly: the hidden states of `rows` ([R, H], in their order), or of
    the first `num_tokens` tokens when `rows` is None. No rows (a step whose prefill chunks
    all stop short of their prompts' ends): the program runs as for every row, so no
    kernel is handed an empty input, and none is returned. Bad rows are refused first, in an
    error that starts with `label` (the caller's name)."""
    if rows is not None:
        check_rows(label, rows, num_tokens, state["hidden"].device)
    if rows is None or rows.shape[0] == 0:
        run_eager(steps, state, num_tokens, metadata)
        return state["hidden"][:num_tokens] if rows is None else state["hidden"][:0]
    state[OUTPUT_ROWS] = rows
    run_eager(steps, state, num_tokens, metadata)
    if state.pop(OUTPUT_ROWS, None) is None:  # the program narrowed to the rows itself
        return state["hidden"]
    return state["hidden"].index_select(0, rows)
