"""Continuous batching with chunked prefill: which requests run this step, the KV they
reserve, and the batch tensors.

Every running request has tokens whose KV is not written yet (`Request.pending`): one for
a decode, more while its prompt is prefilled. A step gives each decode its token first,
then prefills in chunks within `max_batch_tokens`: requests part-way through their prompt
continue, then waiting requests are admitted. So a long prompt shares its steps with the
running requests' decodes instead of stalling them. A waiting prompt is cut into chunks
only when it is the step's first prefill; a later one that does not fit in what is left
waits for the next step, so it prefills whole: a prompt with nothing cached before it
attends through the backend's dense kernel over its own K/V, and a cut one's later chunks
through the slower paged kernel.

A step's reservations are recorded in a `StepPlan`, so a step that fails gives them all
back (`rollback`), leaving the free list as it was.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from torchhal.attention import AttentionBackend
from torchhal.core.engine.records import Request
from torchhal.core.engine.requests import RequestBook
from torchhal.core.model import AttentionMetadata


@dataclass
class StepPlan:
    decodes: list[Request]  # running requests with one pending token, each reserving it (or a window's)
    prefills: list[Request]  # prefilling this step: continuing ones first, then those admitted
    chunks: list[int] = field(default_factory=list)  # per prefill: tokens it prefills this step
    admitted: int = 0  # how many of `prefills` (the last ones) were admitted this step
    new_tokens: list[int] = field(default_factory=list)  # per decode: tokens reserved this step

    @property
    def batch(self) -> list[Request]:
        return self.decodes + self.prefills


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] this step's tokens, request by request
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [E] the last token in input_ids of each request that emits, in batch order
    emits: list[bool]  # per request: this step reaches its last token, so it yields one


class Scheduler:
    def __init__(self, book: RequestBook, max_batch_tokens: int, max_running: int) -> None:
        self.book = book
        self.max_batch_tokens, self.max_running = max_batch_tokens, max_running

    def plan(self) -> StepPlan:
        """Reserve each decode's token, then prefill chunks within the token budget."""
        decodes = self._reserve_decodes()
        budget = self.max_batch_tokens - len(decodes)
        prefills, chunks = self._continue_prefills(budget)
        budget -= sum(chunks)
        admitted, first_chunks = self._admit(budget, may_cut=not prefills)
        return StepPlan(decodes, prefills + admitted, chunks + first_chunks, len(admitted), [1] * len(decodes))

    def widen(self, plan: StepPlan, steps: int) -> list[int]:
        """Turn a pure decode plan into a window of up to `steps` steps: each request
        reserves one token per token it still needs, up to `steps`. Returns the new token
        count per request (recorded in the plan, so `rollback` frees them). A pool too short
        for the whole window leaves every request at one token."""
        want = [min(steps, r.max_new_tokens - len(r.output)) for r in plan.decodes]
        if steps <= 1 or sum(want) == len(want) or not self.reserve(plan.decodes, [w - 1 for w in want]):
            return plan.new_tokens
        plan.new_tokens = want
        return want

    def reserve(self, requests: list[Request], counts: list[int]) -> bool:
        """Reserve `counts[i]` more tokens for request i, all or none (False: the pool is short)."""
        return self.book.blocks.grow(requests, counts)

    def rollback(self, plan: StepPlan) -> None:
        """Give back exactly what `plan()` reserved, in reverse order (the free list ends as it was)."""
        blocks = self.book.blocks
        for request in reversed(plan.prefills[len(plan.prefills) - plan.admitted :]):
            self.book.retract(request)  # waits at the front again, as before it was admitted
        continued = plan.prefills[: len(plan.prefills) - plan.admitted]
        for request, chunk in zip(reversed(continued), reversed(plan.chunks[: len(continued)]), strict=True):
            blocks.shrink(request, chunk)
        # A window's extra tokens were reserved after the one-per-request: give them back first.
        for request, count in zip(reversed(plan.decodes), reversed(plan.new_tokens), strict=True):
            if count > 1:
                blocks.shrink(request, count - 1)
        for request in reversed(plan.decodes):
            blocks.shrink(request, 1)

    @staticmethod
    def build_inputs(plan: StepPlan, block_size: int, device: torch.device,
                     backend: AttentionBackend | None = None) -> StepInputs:
        """Token ids and metadata from host lists (prefill rows: chunks of the prompt)."""
        ids = array("q")  # a C buffer: a 16k-token prompt becomes a tensor 4x faster than from a list
        counts: list[int] = []
        for request in plan.decodes:
            ids.append(request.last_token)
            counts.append(1)
        for request, chunk in zip(plan.prefills, plan.chunks, strict=True):
            tokens = request.tokens
            ids.extend(tokens[request.kv_tokens - chunk : request.kv_tokens])
            counts.append(chunk)
        batch = plan.batch
        meta = AttentionMetadata.build([r.blocks for r in batch], [r.kv_tokens for r in batch], counts, block_size,
                                       device, backend)
        # A prefill chunk short of its request's last token yields nothing: no row to sample.
        emits = [r.kv_tokens == len(r.prompt) + len(r.output) for r in batch]
        ends, total = [], 0
        for count, emitting in zip(counts, emits, strict=True):
            total += count
            if emitting:
                ends.append(total - 1)
        # Uploaded without waiting (a blocking copy waits for the device to finish the step
        # before, which may still be running: its tokens land after this step is launched).
        sample_rows = torch.tensor(ends, dtype=torch.long).to(device, non_blocking=True)
        input_ids = torch.frombuffer(ids, dtype=torch.int64) if ids else torch.empty(0, dtype=torch.int64)
        return StepInputs(input_ids.to(device, non_blocking=True), meta, sample_rows, emits)

    def _reserve_decodes(self) -> list[Request]:
        """One token per decoding request; retract the newest requests while the pool is short."""
        book = self.book
        while True:
            decodes = [r for r in book.running if r.pending == 1]
            if book.blocks.grow(decodes, [1] * len(decodes)):
                return decodes
            book.retract(book.running[-1])

    def _continue_prefills(self, budget: int) -> tuple[list[Request], list[int]]:
        """The next chunk of each request part-way through its prefill, as far as the budget
        and the free blocks reach (a request that gets no block waits this step)."""
        blocks = self.book.blocks
        requests, chunks = [], []
        for request in self.book.running:
            if request.pending <= 1 or budget < 1:
                continue
            room = (len(request.blocks) * blocks.block_size - request.kv_tokens) + blocks.available * blocks.block_size
            chunk = min(request.pending, budget, room)
            if chunk < 1:
                continue
            taken = blocks.grow([request], [chunk])
            assert taken  # `room` counted the blocks
            requests.append(request)
            chunks.append(chunk)
            budget -= chunk
        return requests, chunks

    def _admit(self, budget: int, may_cut: bool) -> tuple[list[Request], list[int]]:
        """Waiting requests in order, each whole while it fits; the first prefill of a step
        (`may_cut`, nothing admitted yet) is cut to the budget, any later one that does
        not fit waits for the next step, where it comes first."""
        book = self.book
        admitted: list[Request] = []
        chunks: list[int] = []
        pool_slots = book.blocks.num_blocks * book.blocks.block_size
        while book.waiting and len(book.running) < self.max_running and budget > 0:
            length = len(book.waiting[0].tokens)
            if length > pool_slots:
                # It can never run: prefilled chunk by chunk up to the pool's last slot, it would
                # retract itself for its next token and start again. It waits, and the step that
                # runs nothing fails it (RequestBook.fail_unservable).
                break
            if length > budget and (admitted or not may_cut):
                break
            chunk = min(length, budget)
            request = book.admit_next(chunk)
            if request is None:
                break
            admitted.append(request)
            chunks.append(chunk)
            budget -= chunk
        return admitted, chunks
