"""The request lifecycle: queue, admit, retract, finish; the results nobody collected yet."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import torch

from torchhal.core.engine.kv_pool import BlockAllocator, blocks_for
from torchhal.core.engine.records import GenerationResult, Request, RequestState
from torchhal.values import as_index, short_repr


def check_prompt(prompt: object, max_new_tokens: object, vocab_size: int, max_position: int) -> list[int]:
    """The prompt as a list of token ids; TypeError/ValueError naming what is wrong."""
    if not isinstance(prompt, (list, tuple)):
        hint = "; from a torch.Tensor, pass prompt.tolist()" if isinstance(prompt, torch.Tensor) else ""
        raise TypeError(f"prompt {short_repr(prompt)} is a {type(prompt).__name__}; pass a list of int token ids{hint}")
    if not prompt:
        raise ValueError("prompt is empty; pass at least one token id")
    # Checked in C first (a 16k-token prompt costs ~0.1 ms, not ~1 ms); the loops only name the culprit.
    if not set(map(type, prompt)) <= {int}:
        for position, token in enumerate(prompt):
            if type(token) is not int:  # not a bool either: True would run as token 1
                hint = "; from a numpy array or a tensor, pass .tolist()" if as_index(token) is not None else ""
                raise TypeError(f"token {short_repr(token)} at position {position} is a {type(token).__name__}, "
                                f"not an int token id{hint}")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        bad = next(t for t in prompt if not 0 <= t < vocab_size)
        raise ValueError(f"token id {bad!r} is outside the vocabulary 0..{vocab_size - 1}")
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    needed = len(prompt) + max_new_tokens
    if needed > max_position:
        raise ValueError(f"prompt + max_new_tokens = {needed} exceeds max_position {max_position}")
    return list(prompt)


def check_max_new_tokens(max_new_tokens: object) -> int:
    """`max_new_tokens` as a plain int (an integer of any kind but bool: True would run one token)."""
    count = as_index(max_new_tokens)
    if count is None:
        raise TypeError(f"max_new_tokens {short_repr(max_new_tokens)} must be a positive int, e.g. 16")
    if count < 1:
        raise ValueError(f"max_new_tokens {count} must be a positive int, e.g. 16")
    return count


def output_complete(request: Request, eos: frozenset[int]) -> bool:
    """The request has every token it will get: by length, or its last one ends it."""
    output = request.output
    return len(output) >= request.max_new_tokens or bool(output) and output[-1] in eos


class RequestBook:
    """Owns every request from queueing to result, and the KV blocks they hold."""

    def __init__(self, blocks: BlockAllocator, vocab_size: int, max_position: int,
                 grow_pool: str = "raise EngineConfig.kv_fraction") -> None:
        self.blocks = blocks
        self.vocab_size, self.max_position = vocab_size, max_position
        self.grow_pool = grow_pool  # the fix a request too long for the pool is told
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.results: dict[int, GenerationResult] = {}
        # Every request queued and not yet ended, in arrival order: a request a cut-short step
        # held in neither queue is still found here (`recover`).
        self.live: dict[int, Request] = {}
        self._next_rid = 0
        self.steps = 0  # steps whose tokens were appended
        # Called with the rid of every request that leaves the running batch (finished,
        # aborted, failed, retracted, discarded): per-request state elsewhere is dropped.
        self.on_leave: Callable[[int], None] | None = None

    def _left(self, request: Request) -> None:
        if self.on_leave is not None:
            self.on_leave(request.rid)

    def add(self, prompt: object, max_new_tokens: int) -> int:
        """Queue a prompt; raises TypeError/ValueError naming a bad token or length (nothing queued)."""
        tokens = check_prompt(prompt, max_new_tokens, self.vocab_size, self.max_position)
        rid = self._new_rid()
        request = Request(rid, tokens, check_max_new_tokens(max_new_tokens))  # a numpy count as a plain int
        self.waiting.append(request)
        self.live[rid] = request  # last: cut short before it, the request is dropped by `recover`
        return rid

    def add_all(self, prompts: list[object], max_new_tokens: int, rids: list[int]) -> None:
        """Queue each prompt, its rid appended to `rids` as it is queued (interrupted part-way, the
        caller knows what to withdraw); one that is refused gets a failed result instead."""
        for prompt in prompts:
            try:
                rids.append(self.add(prompt, max_new_tokens))
            except (TypeError, ValueError) as exc:
                rids.append(self.fail_unqueued(prompt, str(exc)))

    def fail_unqueued(self, prompt: object, error: str) -> int:
        """A result for a prompt that was never queued (its prompt: the tokens when there is a sequence)."""
        rid = self._new_rid()
        tokens = tuple(prompt) if isinstance(prompt, (list, tuple)) else ()
        self.results[rid] = GenerationResult(rid, tokens, (), RequestState.FAILED, error)
        return rid

    def admit_next(self, tokens: int) -> Request | None:
        """The first waiting request starts running with `tokens` of its tokens reserved
        (its first prefill chunk); None (nothing changed) when the blocks are short."""
        request = self.waiting[0]
        if not self.blocks.grow([request], [tokens]):
            return None
        self.waiting.popleft()
        request.state = RequestState.RUNNING
        self.running.append(request)
        return request

    def retract(self, request: Request) -> None:
        """Free the request's KV; it waits at the front and prefills again."""
        self.blocks.release(request)
        request.state = RequestState.WAITING
        self.running.remove(request)
        self.waiting.appendleft(request)
        self._left(request)

    def finish(self, request: Request, state: RequestState) -> GenerationResult:
        self.blocks.release(request)
        request.state = state
        if request in self.running:
            self.running.remove(request)
        self._left(request)
        result = GenerationResult(request.rid, tuple(request.prompt), tuple(request.output), state, request.error)
        self.results[request.rid] = result
        self.live.pop(request.rid, None)  # after the result: a request is always live or has one
        return result

    def fail_unservable(self) -> list[GenerationResult]:
        """Called when a step could run nothing: a request part-way through its prefill that
        gets no block (decodes would have run, retracting it, so nothing else holds any), or
        with nothing running, a waiting request that cannot be admitted, never will."""
        if self.running:
            request = self.running[-1]
        elif self.waiting:
            request = self.waiting.popleft()
        else:
            return []
        request.error = (
            f"request {request.rid} needs KV for {len(request.tokens)} tokens but the pool holds "
            f"{self.blocks.num_blocks} blocks of {self.blocks.block_size}; {self.grow_pool}, or shorten the prompt"
        )
        return [self.finish(request, RequestState.FAILED)]

    def append(self, batch: list[Request], tokens: list[list[int]], eos: frozenset[int]) -> list[GenerationResult]:
        """Give each request its new tokens; finish those that reach a stop (a window's tokens
        past a stop are dropped: their KV goes with the request)."""
        self.steps += 1
        done = []
        for request, new in zip(batch, tokens, strict=True):
            if request.state is not RequestState.RUNNING:
                continue  # ended by an earlier window's stop while this window was in flight
            for token in new:
                request.output.append(token)
                if output_complete(request, eos):
                    done.append(self.finish(request, RequestState.FINISHED))
                    break
        return done

    def after_out_of_memory(self, batch: list[Request], error: BaseException) -> list[GenerationResult]:
        """A batch that ran out of memory: each request waits again, or fails on its second time."""
        failed = []
        for request in reversed(batch):
            request.oom_retries += 1
            if request.oom_retries > 1:
                request.error = f"out of memory twice while running a batch of {len(batch)} request(s): {error}"
                failed.append(self.finish(request, RequestState.FAILED))
            elif request.state is RequestState.RUNNING:
                self.retract(request)
        return failed

    def abort_all(self, reason: str) -> list[GenerationResult]:
        ended = []
        for request in [*self.running, *self.waiting]:
            request.error = reason
            ended.append(self.finish(request, RequestState.ABORTED))
        self.waiting.clear()
        return ended

    def retract_all(self) -> None:
        for request in reversed(list(self.running)):
            self.retract(request)

    def discard(self, rids: Iterable[int]) -> None:
        """Forget these requests wherever they are (queued, running, or finished), freeing their KV."""
        wanted = set(rids)
        for request in [r for r in self.running if r.rid in wanted]:
            self.blocks.release(request)
            self.running.remove(request)
            self._left(request)
        self.waiting = deque(r for r in self.waiting if r.rid not in wanted)
        for rid in wanted:
            self.results.pop(rid, None)
            self.live.pop(rid, None)

    def recover(self, eos: frozenset[int]) -> None:
        """After bookkeeping was cut short (Ctrl-C inside a step, say): every live request gives
        its KV back and waits again in arrival order, to be prefilled with what it has generated
        so far (nothing is lost, at the price of computing its KV again); one whose output is
        already complete (by length or an end token in `eos`) finishes. The free list is made
        again from scratch, so a block half moved between it and a request is not lost."""
        self.running.clear()
        self.waiting.clear()
        self.blocks.reset()
        for request in list(self.live.values()):
            if request.rid in self.results:  # ended, cut short before it left `live`
                del self.live[request.rid]
                continue
            request.blocks.clear()
            request.kv_tokens = 0
            self._left(request)
            if output_complete(request, eos):
                self.finish(request, RequestState.FINISHED)
            else:
                request.state = RequestState.WAITING
                self.waiting.append(request)

    def inconsistencies(self, eos: frozenset[int], in_flight: Iterable[Request] = ()) -> list[str]:
        """What is wrong with the book, in words (empty when nothing is): each live request in
        exactly one queue, in its queue's state, holding the blocks its reserved tokens need
        (a running one with tokens left to compute and its output not complete, unless its
        tokens are `in_flight`), and every block free or held by exactly one request.
        O(requests + blocks): for tests and for a step that failed, not for every step."""
        problems: list[str] = []
        flying = {id(r) for r in in_flight}
        queued = [(r, RequestState.RUNNING) for r in self.running] + [(r, RequestState.WAITING) for r in self.waiting]
        seen: set[int] = set()
        for request, state in queued:
            rid = request.rid
            if self.live.get(rid) is not request:
                problems.append(f"request {rid} is {state.value} but not live")
            if rid in seen:
                problems.append(f"request {rid} is queued twice")
            seen.add(rid)
            if request.state is not state:
                problems.append(f"request {rid} is in the {state.value} queue in state {request.state.value}")
            if state is RequestState.WAITING and (request.blocks or request.kv_tokens):
                problems.append(f"waiting request {rid} holds {request.kv_tokens} KV tokens")
            if len(request.blocks) != blocks_for(request.kv_tokens, self.blocks.block_size):
                problems.append(f"request {rid} holds {len(request.blocks)} blocks for {request.kv_tokens} KV tokens")
            if state is RequestState.RUNNING and id(request) not in flying:
                if not 0 < request.kv_tokens < len(request.prompt) + len(request.output):
                    problems.append(f"running request {rid} has {request.kv_tokens} KV tokens for "
                                    f"{len(request.prompt) + len(request.output)} tokens")
                if output_complete(request, eos):
                    problems.append(f"running request {rid} has its whole output")
        for rid in self.live.keys() - seen:
            problems.append(f"live request {rid} is in no queue" if rid not in self.results
                            else f"request {rid} has a result but is still live")
        held = [b for r in self.running for b in r.blocks] + self.blocks.free_blocks()
        if sorted(held) != self.blocks.all_blocks():
            problems.append(f"the {len(held)} blocks held or free are not each of the pool's blocks once")
        return problems

    def pending(self) -> str | None:
        """What keeps the engine from being idle, in words; None when idle."""
        parts = []
        if self.running:
            parts.append(f"{len(self.running)} running")
        if self.waiting:
            parts.append(f"{len(self.waiting)} waiting")
        return ", ".join(parts) if parts else None

    def _new_rid(self) -> int:
        rid = self._next_rid
        self._next_rid += 1
        return rid
