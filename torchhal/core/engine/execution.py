"""Device execution of planned steps: the runners, full-graph decode windows, and the tokens on
their way to the host.

A step's plan (`Scheduler.plan`) runs here. Its tokens come back one of two ways: read at once,
or left in flight (`InFlight`) and landed at the next step, after that step is launched, so the
device runs on while the host works. Two kinds of work leave tokens in flight: a window of decode
steps on the decode-graph runner (its tokens feed each other on the device), and a step whose
every emitting request ends with its token (nothing the next step does depends on them). Either
way the same record holds them and one path lands them; a landing that fails gives back the KV
its requests reserved for the work, so they compute it again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchhal.core.engine.records import GenerationResult, Request, RequestState
from torchhal.core.engine.requests import RequestBook
from torchhal.core.engine.runners import ModelRunner
from torchhal.core.engine.scheduler import Scheduler, StepInputs, StepPlan
from torchhal.core.graphs.decode import BlockTable, DecodeGraphRunner
from torchhal.core.model import AttentionMetadata, Model
from torchhal.core.model.greedy import greedy_tokens
from torchhal.platforms import Platform


@dataclass
class InFlight:
    """Tokens on their way to the host: request i gets `counts[i]` of them, token j at
    `host.flatten()[j * stride + rows[i]]`, valid once the event `done` has completed.
    If it fails, a window's requests give back the KV tokens they reserved for it (`reserved[i]`),
    a step's are retracted and prefilled again (`reserved` None): the KV of their inputs is
    written, but their tokens are lost."""

    requests: list[Request]
    reserved: list[int] | None
    counts: list[int]
    rows: list[int]
    stride: int
    host: torch.Tensor
    done: Any
    window: bool  # decode steps on the graph runner (which keeps the requests' rows)

    def tokens(self) -> list[list[int]]:
        flat = self.host.flatten().tolist()
        return [[flat[j * self.stride + row] for j in range(count)]
                for row, count in zip(self.rows, self.counts, strict=True)]


class StepExecutor:
    """Runs plans on `runner` (every step) and `decode` (pure decode steps that fit its
    buckets), and brings their tokens back. `wait(event, what)` waits for device work (under
    tensor parallel with graph-captured collectives: within the group's timeout)."""

    def __init__(self, model: Model, platform: Platform, device_index: int, book: RequestBook,
                 scheduler: Scheduler, runner: ModelRunner, decode: DecodeGraphRunner | None, rows: BlockTable,
                 block_size: int, dtype: torch.dtype, wait: Callable[[Any, str], None],
                 backend: Any, eos: frozenset[int], on_failure: Callable[[BaseException], None]) -> None:
        """`eos`: the tokens that end a request; `on_failure(error)`: told of every landing that
        fails (under tensor parallel it ends the engine: the ranks may now disagree)."""
        self.model, self.platform, self.device_index = model, platform, device_index
        self.device = platform.device(device_index)
        self.book, self.scheduler = book, scheduler
        self.runner, self.decode, self.rows = runner, decode, rows
        self.block_size, self.dtype, self.wait, self.backend = block_size, dtype, wait, backend
        self.eos, self.on_failure = eos, on_failure
        self.in_flight: InFlight | None = None

    # -- running a plan ---------------------------------------------------------------------
    def run(self, plan: StepPlan) -> list[list[int]] | None:
        """This step's new tokens per request of `plan.batch`; None when they are left in flight."""
        decode = self.decode
        if decode is not None and not plan.prefills:
            longest = max(r.kv_tokens for r in plan.decodes)  # this step's token included
            if decode.can_run(len(plan.decodes), longest):
                # Waiting requests are admitted between steps: run single steps until they are.
                steps = 1 if self.book.waiting else decode.window_for(longest)
                new = self.scheduler.widen(plan, steps)
                self.in_flight = self._launch_window(list(plan.decodes), list(new), chained=False)
                return None
        if plan.prefills:
            inputs = self.scheduler.build_inputs(plan, self.block_size, self.device, self.backend)
        else:
            inputs = self._decode_inputs(plan.decodes)
        # The runner returns the sampled rows' hidden states only (in order): the model may
        # skip the rest of its last layer for the others.
        hidden = self.runner.forward(inputs.input_ids, inputs.meta, inputs.sample_rows)
        wanted = int(inputs.sample_rows.shape[0])
        expected = (wanted, self.model.config.hidden_size)
        if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape) != expected or hidden.dtype != self.dtype:
            got = (f"hidden states {tuple(hidden.shape)} {hidden.dtype}" if isinstance(hidden, torch.Tensor)
                   else f"a {type(hidden).__name__}")
            raise TypeError(f"{type(self.runner).__name__}.forward returned {got} for {wanted} rows; a runner returns "
                            f"[len(rows), hidden_size] = {list(expected)} {self.dtype}, the rows it is given in "
                            "their order")
        counts = [int(emitting) for emitting in inputs.emits]
        if not wanted:
            return [[] for _ in counts]
        on_device = greedy_tokens(self.model.logits(hidden, torch.arange(wanted, device=hidden.device)))
        if self._lands_later(plan.batch, counts):
            self.in_flight = self._leave_in_flight(on_device, list(plan.batch), counts)
            return None
        done = self.platform.new_event()
        done.record(self.platform.current_stream(self.device_index))
        self.wait(done, "a step's sampled tokens")
        sampled = iter(on_device.tolist())
        return [[next(sampled)] if count else [] for count in counts]

    def _lands_later(self, batch: list[Request], counts: list[int]) -> bool:
        """Whether a step's tokens may be read after the next step is launched: nothing that
        step does depends on them. Every request that emits ends with this token (by length,
        whatever the token), so none of them is in the next plan, and no running request
        decodes next, so planning it retracts nobody (a request retracted before its token
        landed would be prefilled again for nothing)."""
        return (all(r.max_new_tokens - len(r.output) == 1 for r, count in zip(batch, counts, strict=True) if count)
                and all(r.pending != 1 for r in self.book.running))

    def _leave_in_flight(self, on_device: torch.Tensor, batch: list[Request], counts: list[int]) -> InFlight:
        host = self.platform.pin_memory(torch.empty(on_device.shape[0], dtype=torch.long))
        host.copy_(on_device, non_blocking=True)
        done = self.platform.new_event()
        done.record(self.platform.current_stream(self.device_index))
        rows, emitted = [], 0
        for count in counts:
            rows.append(emitted)
            emitted += count
        return InFlight(batch, None, counts, rows, max(emitted, 1), host, done, window=False)

    def _decode_inputs(self, decodes: list[Request]) -> StepInputs:
        """A pure decode step's inputs from the device rows (`rows`): the host writes each row's
        token, position and slot and the blocks it newly started, so a step's host work does not
        grow with the context."""
        table = self.rows
        rows = table.prepare([(r.rid, r.last_token, r.blocks, r.kv_tokens, 1) for r in decodes], len(decodes))
        count = len(decodes)
        meta = AttentionMetadata(table.metadata(count, max(r.kv_tokens for r in decodes)),
                                 table.step_inputs[1, :count], self.backend, decode=True)
        sample_rows = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return StepInputs(table.step_inputs[0, :count], meta, sample_rows, [True] * count)

    # -- decode windows ---------------------------------------------------------------------
    def _launch_window(self, requests: list[Request], new: list[int], chained: bool) -> InFlight:
        decode = self.decode
        assert decode is not None
        # A chained window's input tokens are the ones the window before left on the device.
        batch = [(r.rid, 0 if chained else r.last_token, r.blocks, r.kv_tokens, n)
                 for r, n in zip(requests, new, strict=True)]
        rows, host, done = decode.launch(batch, max(new), chained=chained)
        return InFlight(requests, new, new, rows, host.shape[1], host, done, window=True)

    def advance(self) -> list[GenerationResult]:
        """A window in flight: queue the next window of the same requests behind it when they
        all continue, then land it. If either fails, both give their KV back and the error
        propagates."""
        flight, self.in_flight = self.in_flight, None
        assert flight is not None and flight.window
        chained: InFlight | None = None
        try:
            with torch.no_grad():
                chained = self._chain(flight)
            tokens = self._read(flight)
        except BaseException as exc:
            for work in (chained, flight):
                if work is not None:
                    self.give_back(work)
            self.on_failure(exc)
            raise
        self.in_flight = chained
        return self.append(flight.requests, tokens)

    def _chain(self, flight: InFlight) -> InFlight | None:
        """The next window of `flight`'s requests, queued before its tokens are read; None when
        that cannot be right or useful: a request waits for admission, the running batch
        changed, a request ends by length within `flight` (its row's last token is not its next
        input), or KV blocks or context run out."""
        decode, requests, running = self.decode, flight.requests, self.book.running
        if (decode is None or self.book.waiting or len(running) != len(requests)
                or any(a is not b for a, b in zip(running, requests, strict=True))):
            return None
        remaining = [r.max_new_tokens - len(r.output) - n for r, n in zip(requests, flight.counts, strict=True)]
        if min(remaining) < 1:
            return None
        steps = decode.window_for(max(r.kv_tokens for r in requests) + 1)
        if steps < 1:
            return None
        want = [min(steps, left) for left in remaining]
        if not self.scheduler.reserve(requests, want):
            return None
        try:
            return self._launch_window(requests, want, chained=True)
        except BaseException:
            self._shrink(requests, want)
            raise

    # -- landing ----------------------------------------------------------------------------
    def append(self, batch: list[Request], tokens: list[list[int]]) -> list[GenerationResult]:
        return self.book.append(batch, tokens, self.eos)

    def land(self, flight: InFlight) -> list[GenerationResult]:
        """Wait for `flight`'s tokens and append them; if that fails, its requests give back what
        they reserved (they compute it again) and the error propagates."""
        try:
            tokens = self._read(flight)
        except BaseException as exc:
            self.give_back(flight)
            self.on_failure(exc)
            raise
        return self.append(flight.requests, tokens)

    def land_or_drop(self, flight: InFlight | None) -> list[GenerationResult]:
        """Land tokens on an error path: a second error there drops them instead (their
        requests compute them again), so the first error is the one raised."""
        if flight is None:
            return []
        try:
            return self.land(flight)
        except BaseException:
            return []

    def drain(self) -> list[GenerationResult]:
        """Land whatever is in flight."""
        flight = self.take()
        return self.land(flight) if flight is not None else []

    def drop(self) -> None:
        """A launched window gives back its KV without its tokens (they are computed again); a
        step's tokens on their way land (or, if that fails, are computed again)."""
        flight = self.take()
        if flight is not None and flight.window:
            self.give_back(flight)
        else:
            self.land_or_drop(flight)

    def _read(self, flight: InFlight) -> list[list[int]]:
        self.wait(flight.done, "a decode window's tokens" if flight.window else "a step's tokens landing")
        return flight.tokens()

    def take(self) -> InFlight | None:
        flight, self.in_flight = self.in_flight, None
        return flight

    def give_back(self, flight: InFlight) -> None:
        """`flight` failed: its requests give back what they reserved for it (see `InFlight`)."""
        if flight.reserved is not None:
            self._shrink(flight.requests, flight.reserved)
            return
        for request in reversed(flight.requests):
            if request.state is RequestState.RUNNING:
                self.book.retract(request)

    def _shrink(self, requests: list[Request], counts: list[int]) -> None:
        for request, count in zip(reversed(requests), reversed(counts), strict=True):
            if request.state is RequestState.RUNNING and count:
                self.book.blocks.shrink(request, count)
            self.forget(request.rid)

    def forget(self, rid: int) -> None:
        """The request left the running batch (or its step failed): its device rows go."""
        self.rows.forget(rid)
        if self.decode is not None:
            self.decode.forget(rid)

    # -- graphs across sleep and close ----------------------------------------------------------
    def reset_rows(self) -> None:
        """No request holds a row (the KV pool was cleared; graphs are kept)."""
        self.rows.reset()
        if self.decode is not None:
            self.decode.rows.reset()
