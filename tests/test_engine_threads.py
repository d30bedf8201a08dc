"""The engine under threads (CPU, greedy, fp32, reference model): concurrent generate calls
share the continuous batch and each returns exactly its own tokens; steps, submissions and
lifecycle calls from other threads are serialized with the steps; a step that fails in one
thread loses no other thread's request; a call back into the engine from inside a step is
refused. The GIL's switch interval is shortened so that threads interleave inside steps:
on the engine without its lock these tests fail (wrong tokens, internal errors)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine, PauseMode, RequestState

PROMPTS = [[1 + i, 2 + 3 * i, (7 * i) % 50 + 3, 40 + i][: 2 + i % 3] for i in range(12)]
NEW_TOKENS = 6
GRAPHS = DecodeGraphConfig(batch_buckets=(1, 2, 4, 8, 16), context_buckets=(16, 32), emulate=True)


def engine(decode: str = "eager", **overrides: Any) -> GenerationEngine:
    graphs = GRAPHS if decode == "graphs" else None
    return GenerationEngine(EngineConfig(**{"max_kv_slots": 512, "decode_graphs": graphs, **overrides}))


@pytest.fixture(autouse=True)
def frequent_thread_switches() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


@pytest.fixture(scope="module")
def expected() -> list[tuple[int, ...]]:
    """Each prompt's tokens from one sequential generate of all of them."""
    return [r.output for r in engine().generate(PROMPTS, NEW_TOKENS)]


@pytest.fixture(scope="module")
def expected_long() -> list[tuple[int, ...]]:
    return [r.output for r in engine().generate(PROMPTS, 20)]


def run_threads(work: Callable[[int], Any], count: int, timeout: float = 30.0) -> list[Any]:
    """`work(i)` on `count` threads started together; each one's return value, or the exception it raised."""
    outcomes: list[Any] = [None] * count
    start = threading.Barrier(count)

    def run(index: int) -> None:
        start.wait()
        try:
            outcomes[index] = work(index)
        except BaseException as exc:  # reported to the test, not lost in the thread
            outcomes[index] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread is still running (deadlock or a generate spinning)"
    return outcomes


def assert_idle(e: GenerationEngine) -> None:
    assert e.pending() is None and not e.results
    assert e.blocks.available == e.blocks.num_blocks  # every KV slot came back exactly once


@pytest.mark.parametrize("decode", ["eager", "graphs"])
def test_generate_from_three_threads_gives_each_exactly_its_sequential_tokens(expected, decode):
    e = engine(decode)
    threads, per_thread = 3, len(PROMPTS) // 3
    for _ in range(5):  # the same engine, round after round
        outcomes = run_threads(lambda i: e.generate(PROMPTS[i * per_thread : (i + 1) * per_thread], NEW_TOKENS),
                               threads)
        for i, results in enumerate(outcomes):
            assert not isinstance(results, BaseException), repr(results)
            mine = slice(i * per_thread, (i + 1) * per_thread)
            assert [list(r.prompt) for r in results] == PROMPTS[mine]
            assert [r.output for r in results] == expected[mine]
            assert all(r.state is RequestState.FINISHED for r in results)
        assert_idle(e)


def step_from_two_threads(e: GenerationEngine) -> list[int]:
    rids = [e.add_request(p, NEW_TOKENS) for p in PROMPTS]

    def step_until_done(_: int) -> None:
        while any(rid not in e.results for rid in rids):
            e.step()

    outcomes = run_threads(step_until_done, 2)
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    return rids


def test_two_threads_stepping_one_batch(expected):
    e = engine()
    for _ in range(5):
        rids = step_from_two_threads(e)
        assert [e.results.pop(rid).output for rid in rids] == expected
        assert_idle(e)


def submit_from_threads_while_one_steps(e: GenerationEngine, submitters: int, each: int) -> list[tuple[int, int]]:
    """(rid, prompt index) of every request submitted."""
    submitted: list[list[tuple[int, int]]] = [[] for _ in range(submitters)]
    done = threading.Event()

    def work(index: int) -> None:
        if index == submitters:  # the stepping thread
            while not done.is_set() or e.pending() is not None:
                e.step()
            return
        for n in range(each):
            submitted[index].append((e.add_request(PROMPTS[n % len(PROMPTS)], 2), n % len(PROMPTS)))
            if n % 10 == 9:
                time.sleep(0.001)  # the stepper runs dry and steps idle: where a submission used to race it
        if sum(map(len, submitted)) == submitters * each:
            done.set()

    outcomes = run_threads(work, submitters + 1)
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    return [entry for batch in submitted for entry in batch]


def test_submitting_from_four_threads_while_one_steps(expected):
    e = engine()
    for _ in range(4):
        submitted = submit_from_threads_while_one_steps(e, 4, 150)
        results = [(e.results.pop(rid), index) for rid, index in submitted]
        assert len({r.rid for r, _ in results}) == 600
        failed = [r.error for r, _ in results if r.state is not RequestState.FINISHED]
        assert failed == []  # no spurious "needs N KV slots but the pool has 512"
        assert all(r.output == expected[index][:2] for r, index in results)
        assert_idle(e)


def test_generate_returns_only_its_own_results(expected):
    e = engine()
    others = [e.add_request(p, NEW_TOKENS) for p in PROMPTS[:4]]  # queued by someone else, run by generate's steps
    results = e.generate(PROMPTS[4:], NEW_TOKENS)
    assert [r.output for r in results] == expected[4:]
    assert [e.results.pop(rid).output for rid in others] == expected[:4]  # left for their owner
    assert_idle(e)


# -- lifecycle calls from another thread during generate ------------------------------------------
class GenerateInThread:
    """`e.generate(prompts, n)` on a thread, counting the steps it runs."""

    def __init__(self, e: GenerationEngine, prompts: list[list[int]], new_tokens: int) -> None:
        self.steps = 0
        real_step = e.step

        def counted_step() -> Any:
            self.steps += 1
            return real_step()

        e.step = counted_step  # type: ignore[method-assign]  # generate calls self.step()
        self.outcome: Any = None
        self.thread = threading.Thread(target=self._run, args=(e, prompts, new_tokens), daemon=True)
        self.thread.start()

    def _run(self, e: GenerationEngine, prompts: list[list[int]], new_tokens: int) -> None:
        try:
            self.outcome = e.generate(prompts, new_tokens)
        except BaseException as exc:
            self.outcome = exc

    def wait_for_steps(self, count: int) -> None:
        deadline = time.monotonic() + 10
        while self.steps < count and self.thread.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.0005)

    def join(self) -> Any:
        self.thread.join(30)
        assert not self.thread.is_alive(), "generate did not return"
        assert not isinstance(self.outcome, BaseException), repr(self.outcome)
        return self.outcome


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_pause_from_another_thread_holds_generate_without_stepping_until_continue(expected_long, mode):
    e = engine()
    run = GenerateInThread(e, PROMPTS, 20)
    run.wait_for_steps(3)
    assert e.pause_generation(mode) == []
    steps_at_pause, cpu_at_pause = run.steps, time.process_time()
    time.sleep(0.3)
    assert run.thread.is_alive() and run.steps == steps_at_pause  # waits; no step() while paused
    assert time.process_time() - cpu_at_pause < 0.1  # and no busy loop either: it sleeps until continue
    # an RL loop's weight update while paused (the same values: the tokens must not change)
    update = {name: p.detach().clone() for name, p in e.model.named_parameters()}
    assert e.update_weights_from_tensors(update).weight_version == 1
    assert run.thread.is_alive() and run.steps == steps_at_pause
    e.continue_generation()
    assert [r.output for r in run.join()] == expected_long
    assert_idle(e)


def test_an_abort_pause_from_another_thread_returns_the_aborted_requests(expected_long):
    e = engine()
    run = GenerateInThread(e, PROMPTS, 20)
    run.wait_for_steps(3)
    ended = e.pause_generation(PauseMode.ABORT)
    results = run.join()  # returns without a continue: nothing of it is left to run
    assert sorted(r.rid for r in ended) == [r.rid for r in results]
    assert all(r.state is RequestState.ABORTED for r in results)
    for result, want in zip(results, expected_long, strict=True):  # stopped part-way, with the right tokens so far
        assert len(result.output) < 20 and result.output == want[: len(result.output)]
    e.continue_generation()
    assert_idle(e)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_close_wakes_a_generate_waiting_out_a_pause_with_a_clear_error(mode):
    # The waiting caller was never woken: continue_generation() is refused after close().
    e = engine()
    run = GenerateInThread(e, PROMPTS, 20)
    run.wait_for_steps(3)
    e.pause_generation(mode)
    time.sleep(0.2)  # the caller is waiting for continue_generation() now
    e.close()
    run.thread.join(10)
    assert not run.thread.is_alive(), "generate waited for ever"
    assert isinstance(run.outcome, RuntimeError) and "closed engine" in str(run.outcome)
    assert not e.results and e.blocks.available == e.blocks.num_blocks


def test_prompts_are_read_before_the_engine_lock_is_taken(expected):
    # A lazy iterable fed by a thread that calls the engine deadlocked: generate held the lock
    # inside next(prompts), and the feeding thread waited for it.
    import queue

    e = engine()
    asked, fed = threading.Event(), queue.Queue()

    def streamed() -> Iterator[list[int]]:
        for _ in range(3):
            asked.set()
            yield fed.get(timeout=10)

    def feeder() -> None:
        for prompt in PROMPTS[:3]:
            asked.wait(10)
            asked.clear()
            e.pending()  # any engine call takes the lock
            fed.put(prompt)

    threading.Thread(target=feeder, daemon=True).start()
    outputs = run_threads(lambda _: [r.output for r in e.generate(streamed(), NEW_TOKENS)], 1, timeout=20)[0]
    assert outputs == expected[:3]


def test_weight_updates_and_sleep_from_another_thread_land_between_steps(expected_long):
    e = engine()
    seen_mid_step: list[tuple[int, int]] = []
    real_forward = e.runner.forward

    def slow_forward(*args: Any) -> Any:  # a step long enough for another thread to try to cut in
        before = e.weight_version
        time.sleep(0.002)
        hidden = real_forward(*args)
        seen_mid_step.append((before, e.weight_version))
        return hidden

    e.runner.forward = slow_forward  # type: ignore[method-assign]
    update = {name: p.detach().clone() for name, p in e.model.named_parameters()}
    run = GenerateInThread(e, PROMPTS, 20)
    run.wait_for_steps(1)
    for _ in range(5):
        e.update_weights_from_tensors(update)
        with pytest.raises(RuntimeError, match="cannot sleep: 12 running"):
            e.release_memory_occupation()  # refused while busy, from any thread
    assert [r.output for r in run.join()] == expected_long
    assert e.weight_version == 5
    assert all(before == after for before, after in seen_mid_step)  # no update landed inside a step
    e.release_memory_occupation()
    e.resume_memory_occupation()
    assert [r.output for r in e.generate(PROMPTS, 20)] == expected_long


# -- failures ----------------------------------------------------------------------------------
def test_a_step_failing_in_one_thread_loses_no_request_of_another(expected_long):
    e = engine()
    first, second = PROMPTS[:6], PROMPTS[6:]
    fired = threading.Event()
    real_forward = e.runner.forward

    def fail_once_both_are_running(*args: Any) -> Any:
        running = {tuple(r.prompt) for r in e.running}
        both = any(tuple(p) in running for p in first) and any(tuple(p) in running for p in second)
        if both and not fired.is_set():
            fired.set()
            raise ValueError("simulated failure in a shared step")
        return real_forward(*args)

    e.runner.forward = fail_once_both_are_running  # type: ignore[method-assign]
    outcomes = run_threads(lambda i: e.generate([first, second][i], 20), 2)
    assert fired.is_set()
    failed = [i for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
    assert len(failed) == 1 and isinstance(outcomes[failed[0]], ValueError)
    survivor = 1 - failed[0]  # the other call's requests were in that step: rolled back, then finished
    assert [r.output for r in outcomes[survivor]] == expected_long[survivor * 6 : survivor * 6 + 6]
    assert_idle(e)  # the failed call's requests were withdrawn


def test_a_call_back_into_the_engine_from_inside_a_step_is_refused(expected):
    e = engine()
    real_forward = e.runner.forward
    calls: list[Callable[[], Any]] = [e.pending, e.step, lambda: e.add_request([1, 2], 2),
                                      lambda: e.generate([[1, 2]], 2), lambda: e.pause_generation("retract")]

    def calling_back(*args: Any) -> Any:
        if calls:
            calls.pop(0)()
        return real_forward(*args)

    e.runner.forward = calling_back  # type: ignore[method-assign]
    rids = [e.add_request(p, NEW_TOKENS) for p in PROMPTS]
    for _ in range(5):
        with pytest.raises(RuntimeError, match=r"called from inside a step on the same thread .* not re-entrant"):
            e.step()
    assert e.paused is None and len(e.waiting) == len(PROMPTS)  # each refused step was rolled back whole
    while any(rid not in e.results for rid in rids):
        e.step()
    assert [e.results.pop(rid).output for rid in rids] == expected
    assert_idle(e)
