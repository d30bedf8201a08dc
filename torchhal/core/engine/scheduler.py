"""Continuous batching: which requests run this step, their slots, and the batch tensors.

A step's reservations (one decode slot per running request, the slots of admitted
prefills) are recorded in a `StepPlan`, so a step that fails can give them all back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torchhal.core.engine.records import Request, RequestState
from torchhal.core.engine.requests import RequestBook
from torchhal.core.model import AttentionMetadata


@dataclass
class StepPlan:
    decodes: list[Request]  # running requests, each holding new slots for this step (one, or a window's)
    prefills: list[Request]  # admitted this step, holding slots for their whole prompt
    new_slots: list[int] = field(default_factory=list)  # per decode request: slots reserved this step

    @property
    def batch(self) -> list[Request]:
        return self.decodes + self.prefills


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] this step's tokens, request by request
    meta: AttentionMetadata
    last_index: torch.Tensor  # [B] each request's last token in input_ids


class Scheduler:
    def __init__(self, book: RequestBook, max_batch_tokens: int, max_running: int) -> None:
        self.book = book
        self.max_batch_tokens, self.max_running = max_batch_tokens, max_running

    def plan(self) -> StepPlan:
        """Reserve a decode slot per running request and admit prefills within the token budget."""
        decodes = self._reserve_decode_slots()
        prefills = self._admit(budget=self.max_batch_tokens - len(decodes))
        return StepPlan(decodes, prefills, [1] * len(decodes))

    def widen(self, plan: StepPlan, steps: int) -> list[int]:
        """Turn a pure decode plan into a window of up to `steps` steps: each request gets
        one slot per token it still needs, up to `steps`. Returns the new slot count per
        request (recorded in the plan, so `rollback` frees them). A pool too short for the
        whole window leaves every request at one slot."""
        want = [min(steps, r.max_new_tokens - len(r.output)) for r in plan.decodes]
        if steps <= 1 or sum(want) == len(want) or not self.reserve(plan.decodes, [w - 1 for w in want]):
            return plan.new_slots
        plan.new_slots = want
        return want

    def reserve(self, requests: list[Request], counts: list[int]) -> bool:
        """Append `counts[i]` new slots to request i, all or none (False: the pool is short)."""
        taken = self.book.slots.allocate(sum(counts)) if sum(counts) <= self.book.slots.available else None
        if taken is None:
            return False
        start = 0
        for request, count in zip(requests, counts, strict=True):
            request.slots.extend(taken[start : start + count])
            start += count
        return True

    def rollback(self, plan: StepPlan) -> None:
        """Give back exactly what `plan()` reserved, in reverse order (the free list ends as it was)."""
        book = self.book
        for request in reversed(plan.prefills):
            book.slots.free(request.slots)
            request.slots, request.state = [], RequestState.WAITING
            book.running.remove(request)
            book.waiting.appendleft(request)
        # The window's extra slots were allocated after the one-per-request: free them first.
        for request, count in zip(reversed(plan.decodes), reversed(plan.new_slots), strict=True):
            if count > 1:
                book.slots.free(request.slots[-(count - 1) :])
                del request.slots[-(count - 1) :]
        for request in reversed(plan.decodes):
            book.slots.free([request.slots.pop()])

    @staticmethod
    def build_inputs(plan: StepPlan, device: torch.device) -> StepInputs:
        ids: list[int] = []
        counts: list[int] = []
        for request in plan.decodes:
            ids.append(request.last_token)
            counts.append(1)
        for request in plan.prefills:
            ids.extend(request.tokens)
            counts.append(len(request.tokens))
        batch = plan.batch
        meta = AttentionMetadata.build([r.slots for r in batch], counts, device)
        ends, total = [], 0
        for count in counts:
            total += count
            ends.append(total - 1)
        last_index = torch.tensor(ends, dtype=torch.long, device=device)
        return StepInputs(torch.tensor(ids, dtype=torch.long, device=device), meta, last_index)

    def _reserve_decode_slots(self) -> list[Request]:
        """One new slot per running request; retract the newest ones if the pool is short."""
        book = self.book
        while book.running and book.slots.available < len(book.running):
            book.retract(book.running[-1])
        # One allocation for all: the same slots, in the same order, as one allocate(1) per request.
        new_slots = book.slots.allocate(len(book.running))
        assert new_slots is not None
        for request, slot in zip(book.running, new_slots, strict=True):
            request.slots.append(slot)
        return list(book.running)

    def _admit(self, budget: int) -> list[Request]:
        book = self.book
        admitted: list[Request] = []
        while book.waiting and len(book.running) < self.max_running:
            need = len(book.waiting[0].tokens)
            if need > budget and (admitted or book.running):
                break
            slots = book.slots.allocate(need)
            if slots is None:
                break
            admitted.append(book.admit_next(slots))
            budget -= need
        return admitted
