"""Full-graph decode: one graph replay per decode step, on the paged KV cache.

A decode step of B running requests is padded to a batch bucket and a context
bucket, and the whole step (embedding, every layer with the model's own attention
op reading the paged cache through the chosen backend's `decode`, final norm, logits,
greedy argmax) is one captured graph reading static buffers:

    inputs [4 + W, rows]     this step's input token, position, KV slot and liveness per
                             row, then the KV slot of each later step of the window
    block_tables [rows, M]   each row's KV blocks (SCRATCH_BLOCK where unused)

Each step builds its `PagedMetadata` on the device from these (context length =
position + 1 for a live row, 0 for a padded one), so a step's host work does not grow
with the context. The graph ends by feeding itself: its greedy token becomes the next
input, the position advances and the next slot comes from the window rows. So a window
of up to W steps is W replays back to back with one host copy before and one token
read-back after. A request needing fewer tokens than the window gets fewer slots; its
extra steps write the scratch block and their tokens are dropped.

Each running request keeps its row between windows: a request's block table is written
once, when it joins (or moves row after others finish), and after that only the blocks
it newly starts are uploaded. Padded rows write the scratch block, which no request
owns. Prefill and mixed batches stay on the breakable runner (`GraphRunner`);
`reason(...)` says when this runner cannot take a batch.
"""

from __future__ import annotations

import bisect
import re
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchhal.attention import SCRATCH_BLOCK, AttentionBackend, PagedMetadata
from torchhal.core.graphs.program import BreakStep, StackState, Step, run_eager
from torchhal.core.model.greedy import greedy_tokens
from torchhal.core.model.kv_cache import AttentionMetadata
from torchhal.platforms import Platform
from torchhal.values import ceil_div

DecodeRow = tuple[Hashable, int, Sequence[int], int, int]
"""(request key, input token, the request's KV blocks, its KV tokens including this
window's new ones, how many of them are new: the tokens it wants from this window, 1..steps)."""

_ATTENTION_NAME = re.compile(r"layer(\d+)\.attention")


def attention_layer(step: BreakStep) -> int | None:
    """The KV-cache layer of an attention break: its `layer` field, else its name."""
    if step.layer is not None:
        return step.layer
    match = _ATTENTION_NAME.fullmatch(step.name)
    return int(match.group(1)) if match else None


def pick_bucket(buckets: Sequence[int], size: int) -> int | None:
    """The smallest bucket >= size (buckets sorted ascending), or None if none fits."""
    index = bisect.bisect_left(buckets, size)
    return buckets[index] if index < len(buckets) else None


class BlockTable:
    """Rows of the padded decode batch and their block tables, on the device, updated in place.

    Live rows are kept dense in [0, live): when a request leaves, the highest live
    rows move into the holes (a device row copy), so the batch bucket follows the
    live count. The host keeps, per row, the request key, its KV length, how many of its
    blocks are on the device and its first block, to tell a request that merely grew
    from one whose blocks changed (retracted and admitted again), which gets its row
    rewritten.
    """

    def __init__(self, max_rows: int, max_context: int, block_size: int, device: torch.device, max_steps: int = 1,
                 pin: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """pin: puts a host tensor in page-locked memory (the platform's `pin_memory`), so the
        inputs' copy does not wait for the device to finish queued work."""
        assert max_steps >= 1 and block_size >= 1
        self.max_rows, self.max_context, self.block_size = max_rows, max_context, block_size
        self.max_blocks = ceil_div(max_context, block_size)
        self.max_steps = max_steps
        self._pin = pin
        self.scratch_slot = SCRATCH_BLOCK * block_size
        self.table = torch.full((max_rows, self.max_blocks), SCRATCH_BLOCK, dtype=torch.int32, device=device)
        self._query_start = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        # One buffer, so a window's inputs are one host-to-device copy.
        self.inputs = torch.zeros(4 + max_steps, max_rows, dtype=torch.long, device=device)
        self.step_inputs = self.inputs[:4]  # token, position, slot, live (1) or padded (0)
        self.future = self.inputs[4:]  # future[j]: the slot of window step j + 1 (scratch past a row's new tokens)
        self._row_of: dict[Hashable, int] = {}
        self._length = [0] * max_rows
        self._written = [0] * max_rows  # blocks of the row on the device
        self._first = [SCRATCH_BLOCK] * max_rows
        self.rows_written = 0  # full row writes (join or retract)
        self.block_uploads = 0  # uploads of blocks a continuing row newly started
        self.rows_moved = 0
        self.reset()

    def reset(self) -> None:
        """No request holds a row; every row's inputs are padding (token 0, position 0, scratch)."""
        self._row_of.clear()
        self.reset_inputs()

    def reset_inputs(self) -> None:
        self.inputs.zero_()
        self.inputs[2].fill_(self.scratch_slot)
        self.inputs[4:].fill_(self.scratch_slot)

    @property
    def live(self) -> int:
        return len(self._row_of)

    def row_of(self, key: Hashable) -> int | None:
        return self._row_of.get(key)

    def forget(self, key: Hashable) -> None:
        """Drop a request's row (finished, aborted or retracted); unknown keys are ignored."""
        self._row_of.pop(key, None)

    def prepare(
        self, batch: Sequence[DecodeRow], padded_rows: int, steps: int = 1, keep_tokens: bool = False
    ) -> list[int]:
        """Place every request of a decode window of `steps` steps in a row and fill its inputs.

        Returns the row of each request, in batch order. Rows in [len(batch), padded_rows)
        are padding: token 0 at position 0, context 0, writing the scratch block. Requests
        absent from the batch lose their rows. keep_tokens: every request continues in its
        row and its input token is already on the device (left by the previous window); only
        positions, slots and new blocks are written. The batch is the engine's: each request's
        blocks hold exactly its KV tokens (`BlockAllocator`), so it is trusted as it is.
        """
        assert 1 <= len(batch) <= padded_rows <= self.max_rows and 1 <= steps <= self.max_steps
        if not self._all_continue(batch):
            assert not keep_tokens, "a chained decode window continues every row of the one before in place"
            self._place(batch)
        self._upload_new_blocks(batch)
        # One flat host list -> one small tensor -> one copy: token, position, slot, live, future rows.
        row_of, lengths, size, scratch = self._row_of, self._length, self.block_size, self.scratch_slot
        tokens, positions, out_slots = [0] * padded_rows, [0] * padded_rows, [scratch] * padded_rows
        live = [0] * padded_rows
        future = [[scratch] * padded_rows for _ in range(steps)]  # the last row stays scratch
        rows: list[int] = []
        for key, token, blocks, length, new in batch:
            row = row_of[key]
            rows.append(row)
            position = length - new
            lengths[row] = length
            tokens[row], positions[row], live[row] = token, position, 1
            out_slots[row] = blocks[position // size] * size + position % size
            for step in range(1, new):
                later = position + step
                future[step - 1][row] = blocks[later // size] * size + later % size
        flat = tokens + positions + out_slots + live
        for later_slots in future:
            flat += later_slots
        host = torch.tensor(flat, dtype=torch.long).view(4 + steps, padded_rows)
        first = 1 if keep_tokens else 0
        if self._pin is not None:  # async: the host may run ahead of a window still on the device
            self.inputs[first : 4 + steps, :padded_rows].copy_(self._pin(host[first:]), non_blocking=True)
        else:  # pageable: the copy has read the host tensor by the time copy_ returns
            self.inputs[first : 4 + steps, :padded_rows].copy_(host[first:])
        return rows

    def metadata(self, rows: int, context: int) -> PagedMetadata:
        """The paged metadata of the first `rows` rows' current step, their tables cut to
        `context` positions, built on the device from the buffers `prepare` filled (no host
        sync, so a graph can capture it; padded rows get context 0)."""
        _, positions, out_slots, live = self.step_inputs[:, :rows]
        return PagedMetadata(
            block_tables=self.table[:rows, : ceil_div(context, self.block_size)],
            seq_lens=((positions + 1) * live).to(torch.int32),  # a live row's context ends at its position
            query_start=self._query_start[: rows + 1],
            slot_mapping=out_slots,
            max_query_len=1,
            block_size=self.block_size,
        )

    def _upload_new_blocks(self, batch: Sequence[DecodeRow]) -> None:
        """The blocks each row started since its table was written, in one indexed copy."""
        rows: list[int] = []
        columns: list[int] = []
        values: list[int] = []
        for key, _, blocks, _, _ in batch:
            row = self._row_of[key]
            written = self._written[row]
            if len(blocks) > written:
                rows += [row] * (len(blocks) - written)
                columns += range(written, len(blocks))
                values += blocks[written:]
                self._written[row] = len(blocks)
        if values:
            device = self.table.device
            self.table[torch.tensor(rows, device=device), torch.tensor(columns, device=device)] = torch.tensor(
                values, dtype=torch.int32).to(device)
            self.block_uploads += 1

    def _all_continue(self, batch: Sequence[DecodeRow]) -> bool:
        """True when the batch is exactly the live rows, dense in [0, len(batch)), each only grown."""
        row_of, live = self._row_of, len(batch)
        if len(row_of) != live:
            return False
        for key, _, blocks, length, new in batch:
            row = row_of.get(key)
            # A row at or above `live` (a hole left by a forgotten request) needs compaction.
            if row is None or row >= live or not self._continues(row, blocks, length, new):
                return False
        return True

    def _place(self, batch: Sequence[DecodeRow]) -> None:
        """Drop absent or changed requests, compact the live rows, and give new requests rows."""
        keys = {row_data[0] for row_data in batch}
        for key in [k for k in self._row_of if k not in keys]:
            self.forget(key)
        fresh: list[DecodeRow] = []
        for row_data in batch:
            key, _, blocks, length, new = row_data
            row = self._row_of.get(key)
            if row is not None and not self._continues(row, blocks, length, new):
                self.forget(key)
            if key not in self._row_of:
                fresh.append(row_data)
        self._compact(self.live)
        free_rows = iter(sorted(set(range(len(batch))) - set(self._row_of.values())))
        for key, _, blocks, _, _ in fresh:
            row = next(free_rows)
            self._row_of[key] = row
            self._write_row(row, blocks)

    def _continues(self, row: int, blocks: Sequence[int], length: int, new: int) -> bool:
        """True when `blocks` is this row's table grown by `new` tokens."""
        written = self._written[row]
        return length == self._length[row] + new and len(blocks) >= written and blocks[0] == self._first[row]

    def _compact(self, live: int) -> None:
        """Move live rows at or above `live` into the free rows below it."""
        holes = sorted(set(range(live)) - set(self._row_of.values()))
        movers = sorted(row for row in self._row_of.values() if row >= live)
        if not movers:
            return
        src = torch.tensor(movers, dtype=torch.long, device=self.table.device)
        dst = torch.tensor(holes, dtype=torch.long, device=self.table.device)
        self.table.index_copy_(0, dst, self.table.index_select(0, src))
        key_of = {row: key for key, row in self._row_of.items()}
        for old, new in zip(movers, holes, strict=True):
            self._row_of[key_of[old]] = new
            self._length[new], self._written[new], self._first[new] = self._length[old], self._written[old], \
                self._first[old]
        self.rows_moved += len(movers)

    def _write_row(self, row: int, blocks: Sequence[int]) -> None:
        padded = list(blocks) + [SCRATCH_BLOCK] * (self.max_blocks - len(blocks))
        self.table[row].copy_(torch.tensor(padded, dtype=torch.int32))
        self._written[row], self._first[row] = len(blocks), blocks[0]
        self.rows_written += 1


@dataclass(frozen=True)
class DecodeCaptureReport:
    batch_buckets: tuple[int, ...]
    context_buckets: tuple[int, ...]
    graphs: int
    seconds: float
    pool_bytes: int | None


def unsupported_reason(model: nn.Module, emulate: bool = False) -> str | None:
    """Why this model's decode step cannot be one graph, or None when it can.

    The decode graph runs the model's own layer program, its attention breaks with decode
    metadata built on the device (`AttentionMetadata(decode=True)`), so those breaks must be
    capturable: the decoder's attention is (it calls the backend's `decode`). A model whose
    breaks are not says so with a `decode_graph_refusal` string attribute. Other breaks (a
    tensor-parallel all-reduce on a communicator that cannot be captured) refuse the graph;
    `emulate` runs the same path eagerly, so they are fine there."""
    missing = [name for name in ("layer_program", "embed_tokens", "logits") if not callable(getattr(model, name, None))]
    if missing:
        return (
            f"{type(model).__name__} lacks {', '.join(missing)}(); "
            "full-graph decode needs the explicit layer program"
        )
    refusal = getattr(model, "decode_graph_refusal", None)
    if refusal:
        return str(refusal)
    if getattr(model, "kv", None) is None:
        return f"{type(model).__name__}.kv is not allocated; allocate the KV cache before building the decode runner"
    program: list[Step] = getattr(model, "layer_program")()  # noqa: B009  # an nn.Module attribute, typed Tensor
    for step in program:
        if isinstance(step, BreakStep) and attention_layer(step) is None and not emulate:
            return (
                f"break step {step.name!r} is not attention (no layer index, name is not 'layer<N>.attention'); "
                "only attention breaks run inside a decode graph (a tensor-parallel all-reduce is a break when "
                "the group's communicator cannot be captured)"
            )
    return None


class DecodeGraphRunner:
    """Runs pure decode steps as one graph replay each; `emulate=True` runs the same
    padded static path eagerly (CPU tests, debugging).

    The engine builds it from a checked `DecodeGraphConfig`: the buckets are positive ints and
    `block_size` is the model's KV cache's. `pool` (a graph pool handle of the platform's, such
    as one in a virtual-memory region) backs every graph; None: a new one of the platform's."""

    def __init__(
        self,
        model: nn.Module,
        platform: Platform,
        device_index: int,
        *,
        block_size: int,
        backend: AttentionBackend,
        batch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
        context_buckets: Sequence[int] = (128, 256, 512, 1024, 2048, 4096),
        steps_per_sync: int = 1,
        emulate: bool = False,
        pool: Any = None,
    ) -> None:
        self.batch_buckets, self.context_buckets = sorted(set(batch_buckets)), sorted(set(context_buckets))
        cache = getattr(model, "kv", None)
        assert cache is None or cache.block_size == block_size, "block tables of another size address other slots"
        self.model, self.platform, self.device_index = model, platform, device_index
        self.backend, self.emulate, self.pool = backend, emulate, pool
        self.device = platform.device(device_index)
        self.report: DecodeCaptureReport | None = None
        self.steps_per_sync = steps_per_sync  # may be lowered later (the window buffers keep their size)
        self.steps = 0  # decode steps run (replayed or emulated)
        self.windows = 0  # token read-backs: one per window of up to steps_per_sync steps
        self.chained = 0  # windows queued behind the previous one before its tokens were read
        self.captures = 0  # graphs captured over the runner's life
        self._graphs: dict[tuple[int, int], Any] = {}
        # Why windows are refused for now: released (sleep), or a capture that did not finish
        # (its graphs are dropped). Without it a window ran eagerly, step by step, unnoticed.
        self._idle: str | None = None
        max_rows = self.batch_buckets[-1]
        self.rows = BlockTable(max_rows, self.context_buckets[-1], block_size, self.device, steps_per_sync,
                               pin=platform.pin_memory)
        self.history = torch.zeros(steps_per_sync, max_rows, dtype=torch.long, device=self.device)  # tokens
        self._cursor = torch.zeros(1, dtype=torch.long, device=self.device)  # the window step being run
        self._row_index = torch.arange(self.batch_buckets[-1], device=self.device)
        self.unsupported: str | None = unsupported_reason(model, emulate)
        if self.unsupported is None and platform.graph_support is None and not emulate:
            self.unsupported = f"platform {platform.name!r} declares no graph support"
        if self.unsupported is None and not emulate:
            self.capture()

    # -- what it can take ------------------------------------------------------------------
    def reason(self, batch_size: int, max_length: int) -> str | None:
        """Why a pure decode step of `batch_size` requests, the longest holding `max_length`
        KV tokens (this step's included), must run elsewhere; None when this runner takes it."""
        if self.unsupported is not None:
            return self.unsupported
        if self._idle is not None:
            return self._idle
        if batch_size > self.batch_buckets[-1]:
            return f"decode batch {batch_size} exceeds the largest batch bucket {self.batch_buckets[-1]}"
        if max_length > self.context_buckets[-1]:
            return f"context of {max_length} tokens exceeds the largest context bucket {self.context_buckets[-1]}"
        return None

    def can_run(self, batch_size: int, max_length: int) -> bool:
        return batch_size >= 1 and self.reason(batch_size, max_length) is None

    def window_for(self, max_length: int) -> int:
        """The most steps a window may run when its longest request holds `max_length` tokens
        with one new: bounded by `steps_per_sync` and by the room left in the largest
        context bucket (0 when there is none)."""
        steps = min(self.steps_per_sync, self.rows.max_steps)
        return max(0, min(steps, self.context_buckets[-1] - max_length + 1))

    def buckets_for(self, batch_size: int, max_length: int) -> tuple[int, int]:
        batch = pick_bucket(self.batch_buckets, batch_size)
        context = pick_bucket(self.context_buckets, max_length)
        assert batch is not None and context is not None, self.reason(batch_size, max_length)  # can_run said so
        return batch, context

    # -- a decode window ------------------------------------------------------------------------
    def decode(self, batch: Sequence[DecodeRow], steps: int = 1) -> list[list[int]]:
        """Greedy tokens of each request, in batch order: `new` of them for a row with `new`
        new tokens. Runs `steps` steps back to back (one replay each) and syncs once to read
        the tokens back."""
        rows, tokens, done = self.launch(batch, steps)
        done.synchronize()
        by_step = tokens.tolist()
        return [[by_step[step][row] for step in range(new)] for row, (*_, new) in zip(rows, batch, strict=True)]

    def launch(self, batch: Sequence[DecodeRow], steps: int = 1, *,
               chained: bool = False) -> tuple[list[int], torch.Tensor, Any]:
        """Queue a window of `steps` decode steps and the copy of its tokens to the host;
        returns at once (the device may still be running the window before) with each request's
        row, the host copy ([steps, padded rows], valid once the event has completed) and the
        event: token `j` of request `i` is at `[j, rows[i]]`.

        chained=True continues the window queued last on exactly the same rows, each with
        `steps` new tokens: the input tokens are the ones that window's last step left on
        the device (the host does not know them yet), so only positions and slots are
        written. The caller has asked `can_run` for the batch and its reach."""
        assert self.unsupported is None and self._idle is None, self.unsupported or self._idle
        # The window's last step reads positions up to length - new + steps - 1.
        reach = max(length - new + steps for _, _, _, length, new in batch)
        padded, context = self.buckets_for(len(batch), reach)
        rows = self.rows.prepare(batch, padded, steps, keep_tokens=chained)
        self._cursor.zero_()
        graph = self._graphs.get((padded, context))
        for _ in range(steps):
            if graph is None:
                with torch.no_grad():
                    self._step(padded, context)
            else:
                graph.replay()
        self.steps += steps
        self.windows += 1
        self.chained += chained
        # A host buffer per window: the next window may be queued before this one is read.
        host = self.platform.pin_memory(torch.empty(steps, padded, dtype=torch.long))
        host.copy_(self.history[:steps, :padded], non_blocking=True)
        done = self.platform.new_event()
        done.record(self.platform.current_stream(self.device_index))
        return rows, host, done

    def forget(self, key: Hashable) -> None:
        """The request left the running batch (finished, aborted, retracted)."""
        self.rows.forget(key)

    def step_metadata(self, batch: int, context: int) -> PagedMetadata:
        """The paged metadata of the current step of a (batch, context) bucket, built on the
        device from the static buffers (no host sync: it is part of the captured graph)."""
        return self.rows.metadata(batch, context)

    def advance_inputs(self, batch: int, next_tokens: torch.Tensor) -> None:
        """Feed the next step of the window: its token, position and slot, all on the device."""
        tokens, positions, out_slots, _ = self.rows.step_inputs[:, :batch]
        self.history[:, :batch].index_copy_(0, self._cursor, next_tokens[None])
        tokens.copy_(next_tokens)
        positions.add_(1)
        out_slots.copy_(self.rows.future[:, :batch].index_select(0, self._cursor)[0])
        self._cursor.add_(1).remainder_(self.rows.max_steps)  # never indexes past the window buffers

    def _step(self, batch: int, context: int) -> None:
        """The whole decode step for a (batch, context) bucket on the static buffers."""
        model: Any = self.model
        tokens, positions = self.rows.step_inputs[0, :batch], self.rows.step_inputs[1, :batch]
        meta = AttentionMetadata(self.step_metadata(batch, context), positions, self.backend, decode=True)
        state: StackState = {"hidden": model.embed_tokens(tokens), "positions": positions}
        run_eager(model.layer_program(), state, batch, meta)
        self.advance_inputs(batch, greedy_tokens(model.logits(state["hidden"], self._row_index[:batch])))

    # -- capture ---------------------------------------------------------------------------------
    def capture(self) -> DecodeCaptureReport:
        """Capture every (batch, context) bucket into one pool. Run it while no request
        holds a row: warm-up and capture write only the scratch block (every row is padding)."""
        support = self.platform.graph_support
        # __init__ and resume capture only what can be captured.
        assert support is not None and self.unsupported is None, self.unsupported or "no graph support"
        before = self.platform.memory_info(self.device_index).reserved
        started = time.perf_counter()
        pool = self.pool if self.pool is not None else support.new_pool()
        stream = self.platform.new_stream(self.device_index)
        current = self.platform.current_stream(self.device_index)
        self._graphs = {}  # kept only once every bucket is captured: a failed capture leaves none, not some
        self._idle, self.report = "decode graph capture did not finish; resume() captures them again", None
        graphs: dict[tuple[int, int], Any] = {}
        self.rows.reset()  # warm-up and capture then touch only the scratch block
        with torch.no_grad():
            # Largest first, so smaller graphs reuse the pool's blocks.
            for batch in reversed(self.batch_buckets):
                for context in reversed(self.context_buckets):
                    stream.wait_stream(current)
                    with self.platform.use_stream(stream):  # warm-up: lazy library init off the capture
                        self._step(batch, context)
                    current.wait_stream(stream)
                    self.platform.synchronize(self.device_index)
                    self.rows.reset_inputs()  # the warm-up advanced them; capture reads padding
                    graph = support.graph_class()
                    with support.capture(graph, pool, stream):
                        self._step(batch, context)
                    graphs[(batch, context)] = graph
                    self.captures += 1
        self.platform.synchronize(self.device_index)
        self._graphs, self._idle = graphs, None
        after = self.platform.memory_info(self.device_index).reserved
        pool_bytes = after - before if after is not None and before is not None else None
        self.report = DecodeCaptureReport(
            tuple(self.batch_buckets), tuple(self.context_buckets), len(self._graphs),
            time.perf_counter() - started, pool_bytes,
        )
        return self.report

    @property
    def graphs_enabled(self) -> bool:
        return bool(self._graphs)

    # -- lifecycle (sleep / wake) ----------------------------------------------------------------
    def release(self) -> None:
        """Drop the graphs and every row (the KV pool goes away with sleep); windows are
        refused until `resume()`."""
        self._graphs = {}
        self._idle = "decode graphs are released (sleep); resume() captures them again"
        self.rows.reset()

    def resume(self) -> None:
        """Recapture after wake; the model's KV pool is a new tensor, so graphs must be new too."""
        if self.unsupported is None and not self.emulate:
            self.capture()
        else:  # nothing to capture: emulation runs the same steps eagerly
            self._idle = None

