"""Graph runner decoupled from batch size: breakable layer-stack graphs.

Only the layer stack is captured, never logits or sampling, so one graph per
token-count bucket serves any number of requests. Breakable ops (attention)
end a segment: replay runs segment graph, eager op with the live batch's
metadata, segment graph, ... All segments of all buckets share one memory
pool from the platform. Without graph support the same API runs eagerly.
"""

from __future__ import annotations

import bisect
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchhal.attention.layout import check_rows
from torchhal.core.devices import check_device_index
from torchhal.core.graphs.program import (
    BreakStep,
    GraphStep,
    StackState,
    Step,
    check_step_inputs,
    copy_into_captured,
    run_eager,
    run_for_rows,
    split_segments,
)
from torchhal.platforms import Platform
from torchhal.values import check_buckets

if TYPE_CHECKING:  # core.model imports core.graphs.program: a runtime import here would be circular
    from torchhal.core.model import Model

_warned_guesses: set[str] = set()


@dataclass(frozen=True)
class ResolvedStack:
    program: Callable[[], list[Step]]
    embed: Callable[[torch.Tensor], torch.Tensor]
    how: str


def resolve_layer_stack(model: Model | nn.Module) -> ResolvedStack | str:
    """The model's layer stack, or the reason there is none.

    A `torchhal.core.model.Model`: `model.layer_program()` and `model.embed_tokens()`.
    Guessed layouts (`model.model.layers`, `model.language_model.model.layers`)
    are captured layer by layer with no breaks, which is only right for layers
    that need no per-batch metadata; the guess is warned about once.
    """
    program, embed = getattr(model, "layer_program", None), getattr(model, "embed_tokens", None)
    if callable(program) and callable(embed):
        return ResolvedStack(program, embed, "explicit layer_program()")
    for parent in ("model", "language_model.model"):
        base: Any = model
        for part in parent.split("."):
            base = getattr(base, part, None)
        layers = getattr(base, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            path = f"{parent}.layers"
            embed = getattr(base, "embed_tokens", None)
            if embed is None:
                return f"guessed {path} but {parent}.embed_tokens is missing"
            key = f"{type(model).__name__}:{path}"
            if key not in _warned_guesses:
                _warned_guesses.add(key)
                warnings.warn(
                    f"graph runner guessed the layer stack {type(model).__name__}.{path} ({len(layers)} layers) "
                    "and captures each layer whole; implement layer_program() to mark breakable ops",
                    stacklevel=3,
                )

            def program(layers: nn.ModuleList = layers) -> list[Step]:
                def make(layer: nn.Module) -> GraphStep:
                    def run(state: StackState) -> None:
                        state["hidden"] = layer(state["hidden"])

                    return GraphStep(type(layer).__name__, run)

                return [make(layer) for layer in layers]

            return ResolvedStack(program, embed, f"guessed {path}")
    return (
        f"cannot find the layer stack of {type(model).__name__}: implement layer_program() and "
        "embed_tokens(), or use a model.layers / language_model.model.layers layout"
    )


def _check_hidden_size(model: Model | nn.Module, hidden_size: object) -> int:
    """The runner's hidden size: the model's (`config.hidden_size`), or the one given, which
    must be a positive int and, where the model states one, the same."""
    stated = getattr(getattr(model, "config", None), "hidden_size", None)
    if hidden_size is None:
        if isinstance(stated, bool) or not isinstance(stated, int):
            raise ValueError(
                f"GraphRunner cannot read hidden_size from {type(model).__name__}.config; pass hidden_size="
            )
        return stated
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
        raise ValueError(f"hidden_size = {hidden_size!r} must be a positive int (the model's hidden width)")
    if isinstance(stated, int) and hidden_size != stated:
        raise ValueError(f"hidden_size = {hidden_size} but {type(model).__name__}.config.hidden_size is {stated}; "
                         "leave hidden_size out to use the model's")
    return hidden_size


def _check_dtype(model: Model | nn.Module, dtype: object) -> None:
    """A floating torch.dtype that the model's weights are in (the static buffers feed its layers)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype = {dtype!r} must be the floating torch.dtype of the model's weights, e.g. "
                         "torch.bfloat16 (an engine's runner_factory: dtype=e.config.dtype)")
    weights = {p.dtype for _, p in model.named_parameters() if p.is_floating_point()}
    if weights and dtype not in weights:
        held = ", ".join(sorted(map(str, weights)))
        raise ValueError(f"dtype = {dtype} but {type(model).__name__}'s weights are {held}; pass the weights' "
                         "dtype (an engine's runner_factory: dtype=e.config.dtype)")


@dataclass
class _Bucket:
    inputs: tuple[torch.Tensor, torch.Tensor]  # static hidden [B, H] and positions [B]
    state: StackState  # the tensors the captured graphs read and write
    parts: list[Any] | None  # graphs and (BreakStep, state at that point) in order; None when emulating


@dataclass(frozen=True)
class CaptureReport:
    buckets: tuple[int, ...]
    graphs: int
    seconds: float
    pool_bytes: int | None


class GraphRunner:
    """Runs a layer stack for a token-major batch; replays graphs where it can."""

    def __init__(
        self,
        model: Model | nn.Module,
        platform: Platform,
        device_index: int | None,
        *,
        hidden_size: int | None = None,
        dtype: torch.dtype,
        buckets: Sequence[int] = (8, 16, 32, 64, 128, 256, 512),
        emulate: bool = False,
        pool: Any = None,
    ) -> None:
        """`device_index` is one of the platform's devices (None: its current device).
        `hidden_size` defaults to `model.config.hidden_size` (one given must match it);
        `dtype` is the floating dtype of the model's weights. `emulate=True` runs the
        bucketed, padded path without graphs (CPU tests, debugging). `pool`: the graph pool
        handle every bucket captures into (None: a new one of the platform's). Every argument is
        checked here, before anything is allocated."""
        device_index = check_device_index(platform, device_index, "device_index")
        if not isinstance(emulate, bool):  # "no" is truthy
            raise ValueError(f"emulate must be True or False, got {emulate!r}")
        bucket_sizes = list(check_buckets("buckets", buckets))
        hidden_size = _check_hidden_size(model, hidden_size)
        _check_dtype(model, dtype)
        self.model, self.platform, self.device_index = model, platform, device_index
        self.hidden_size, self.dtype = hidden_size, dtype
        self.bucket_sizes = bucket_sizes
        self.emulate, self.pool = emulate, pool
        self._buckets: dict[int, _Bucket] = {}
        self.report: CaptureReport | None = None
        self.bucketed_steps = 0  # forwards run on a bucket (replayed, or padded and eager when emulating)
        resolved = resolve_layer_stack(model)
        self.stack = resolved if isinstance(resolved, ResolvedStack) else None
        support = platform.graph_support
        if self.stack is None:
            self.eager_reason: str | None = str(resolved)
        elif support is None and not emulate:
            self.eager_reason = f"platform {platform.name!r} declares no graph support"
        else:
            self.eager_reason = None
            self.capture()

    @property
    def graphs_enabled(self) -> bool:
        return bool(self._buckets)

    def can_run(self, num_tokens: int) -> bool:
        return self.graphs_enabled and num_tokens <= self.bucket_sizes[-1]

    def bucket_for(self, num_tokens: int) -> int:
        index = bisect.bisect_left(self.bucket_sizes, num_tokens)
        if index == len(self.bucket_sizes):
            raise ValueError(f"{num_tokens} tokens exceed the largest bucket ({self.bucket_sizes[-1]}); can_run() "
                             "says when a step fits")
        return self.bucket_sizes[index]

    # -- capture -------------------------------------------------------------------------
    def capture(self) -> CaptureReport:
        """Capture (or, emulating, allocate) every bucket; refused for a runner that runs eagerly."""
        if self.stack is None or self.eager_reason is not None:
            hint = "; pass emulate=True to run the bucketed path without graphs" if self.stack is not None else ""
            raise RuntimeError(f"cannot capture: {self.eager_reason}{hint}")
        support = None if self.emulate else self.platform.graph_support
        device = self.platform.device(self.device_index)
        before = self.platform.memory_info(self.device_index).reserved
        started = time.perf_counter()
        pool = (self.pool if self.pool is not None else support.new_pool()) if support else None
        stream = self.platform.new_stream(self.device_index)
        graphs = 0
        self._buckets = {}  # kept only once every bucket is captured: a failed capture leaves none, not some
        self.report = None
        buckets: dict[int, _Bucket] = {}
        with torch.no_grad():
            for size in sorted(self.bucket_sizes, reverse=True):  # largest first: smaller ones fit its pool
                state: StackState = {
                    "hidden": torch.zeros(size, self.hidden_size, device=device, dtype=self.dtype),
                    "positions": torch.zeros(size, dtype=torch.long, device=device),
                }
                inputs = (state["hidden"], state["positions"])
                if support is None:  # emulation: the padded path runs eagerly
                    buckets[size] = _Bucket(inputs, state, None)
                    continue
                segments = split_segments(self.stack.program())
                self._warm_up(segments, dict(state), stream)
                parts: list[Any] = []
                for part in segments:
                    if isinstance(part, BreakStep):
                        # The break reads and writes the tensors live at *this* point of the
                        # stack (later segments rebind the names), so keep that view of the state.
                        parts.append((part, dict(state)))
                        continue
                    graph = support.graph_class()
                    with support.capture(graph, pool, stream):
                        for step in part:
                            step.run(state)
                    parts.append(graph)
                    graphs += 1
                buckets[size] = _Bucket(inputs, state, parts)
        self.platform.synchronize(self.device_index)
        self._buckets = buckets
        after = self.platform.memory_info(self.device_index).reserved
        pool_bytes = after - before if after is not None and before is not None else None
        self.report = CaptureReport(tuple(self.bucket_sizes), graphs, time.perf_counter() - started, pool_bytes)
        return self.report

    def _warm_up(self, segments: list[Any], state: StackState, stream: Any) -> None:
        """Run each graph segment once on the capture stream (lazy library init happens here)."""
        stream.wait_stream(self.platform.current_stream(self.device_index))
        with self.platform.use_stream(stream):
            for part in segments:
                if not isinstance(part, BreakStep):
                    for step in part:
                        step.run(state)
        self.platform.current_stream(self.device_index).wait_stream(stream)

    # -- replay --------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, meta: Any, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states for the batch: of `rows` ([R] int64 token indices, in their order), or
        [T, H] of every token when None. With graphs and no `rows`, a view of a static buffer:
        consume it before the next forward."""
        # no_grad, not inference_mode: the static buffers written here persist across calls.
        with torch.no_grad():
            return self._forward(input_ids, meta, rows)

    def _forward(self, input_ids: torch.Tensor, meta: Any, rows: torch.Tensor | None) -> torch.Tensor:
        check_step_inputs("GraphRunner.forward", input_ids, meta)
        num_tokens = input_ids.numel()
        if self.stack is not None and not self.can_run(num_tokens):
            # Past the buckets: eager, and the program may narrow to the rows (run_for_rows checks them).
            state: StackState = {"hidden": self.stack.embed(input_ids), "positions": meta.positions}
            return run_for_rows(self.stack.program(), state, num_tokens, meta, rows, label="GraphRunner.forward")
        if rows is not None:
            check_rows("GraphRunner.forward", rows, num_tokens, input_ids.device)
        if self.stack is None:
            hidden = self.model.forward(input_ids, meta)
            return hidden if rows is None else hidden.index_select(0, rows)
        hidden = self.stack.embed(input_ids)
        bucket = self._buckets[self.bucket_for(num_tokens)]
        static_hidden, static_positions = bucket.inputs
        if hidden.shape != (num_tokens, self.hidden_size) or hidden.dtype != self.dtype:
            # copy_ into the static buffer would broadcast a row or cast the dtype: wrong, and no error
            raise ValueError(f"{type(self.model).__name__}.embed_tokens returned {tuple(hidden.shape)} {hidden.dtype} "
                             f"for {num_tokens} tokens; a Model embeds [T] ids as [T, {self.hidden_size}] "
                             f"{self.dtype}")
        self.bucketed_steps += 1
        static_hidden[:num_tokens].copy_(hidden)
        static_positions[:num_tokens].copy_(meta.positions)
        static_positions[num_tokens:].zero_()  # padded rows: in range, and every op but attention is per token
        if bucket.parts is None:  # emulation: every row, as the captured graphs compute them
            state = {"hidden": static_hidden, "positions": static_positions}
            run_eager(self.stack.program(), state, num_tokens, meta)
        else:
            for part in bucket.parts:
                if isinstance(part, tuple):
                    step, state_at_break = part
                    live = dict(state_at_break)
                    step.run(live, num_tokens, meta)
                    copy_into_captured(state_at_break, live)
                else:
                    part.replay()
            state = bucket.state
        hidden = state["hidden"][:num_tokens]  # the bucket's padding rows are never a step's
        return hidden if rows is None else hidden.index_select(0, rows)

    # -- lifecycle (sleep / wake) -------------------------------------------------------------
    def release(self) -> None:
        self._buckets = {}

    def resume(self) -> None:
        if self.eager_reason is None:
            self.capture()
