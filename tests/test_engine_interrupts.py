"""A step cut short anywhere (CPU, greedy, fp32, reference model): Ctrl-C arrives wherever
Python checks for signals in the engine's own code, not only where a step calls out to the
model. Afterwards every request still ends with the tokens an uninterrupted run gives it,
every KV block comes back exactly once, and `GenerationEngine.check_consistent()` passes.

The interrupt is raised by a profile function at the n-th place the engine's bookkeeping
modules could see a signal (a Python function starting, a C function such as
`deque.popleft` returning: where CPython runs signal handlers), for n spread over a whole
run: a sample by default, a denser sweep under `python -m pytest -m slow`. Requests queued with `add_request` stand for
other callers' (another thread's `generate`): nothing discards them after the interrupt, so
a reservation, admission, retraction or token left half-done shows as a request that never
finishes, a wrong token, or a block lost or owned twice."""

from __future__ import annotations

import inspect
import sys
from types import FrameType
from typing import Any

import pytest
import torch

from torchhal.core.engine import (
    DecodeGraphConfig,
    EngineConfig,
    GenerationEngine,
    execution,
    kv_pool,
    requests,
    scheduler,
    serial,
)
from torchhal.core.engine import engine as engine_module

PROMPTS = [[1 + i, 2 + 3 * i, (7 * i) % 50 + 3, 40 + i, 9, 17 + i][: 2 + i % 5] for i in range(6)]
NEW_TOKENS = 5
GRAPHS = DecodeGraphConfig(batch_buckets=(1, 2, 4, 8), context_buckets=(16, 32), emulate=True)
BOOKKEEPING = {m.__file__ for m in (engine_module, execution, serial, scheduler, requests, kv_pool)}
MAX_STEPS = 200  # an uninterrupted run takes about 20
#: How many of a run's signal checks a test interrupts: a sample spread over the whole run by
#: default, a denser sweep under `-m slow` (minutes on two cores).
SWEEPS = [pytest.param(1, id="sampled"), pytest.param(4, id="dense", marks=pytest.mark.slow)]


def spread(total: int, count: int) -> range:
    """About `count` of the checks 1..total-1, evenly spaced."""
    return range(1, total, max(1, total // count))


def engine(decode: str) -> GenerationEngine:
    # A pool of 8 blocks of 4 slots: requests are retracted and re-admitted for lack of KV.
    return GenerationEngine(EngineConfig(max_kv_slots=32, kv_block_size=4, max_batch_tokens=16,
                                         decode_graphs=GRAPHS if decode == "graphs" else None))


class InterruptAt:
    """A profile function raising KeyboardInterrupt at the `at`-th signal check in BOOKKEEPING:
    a Python function called from there (or running there) starts, or a C function called
    from there returns (its result is then lost, as a signal would lose it). Raised once, as
    one Ctrl-C is."""

    def __init__(self, at: int) -> None:
        self.at, self.checks = at, 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            if frame.f_code.co_flags & inspect.CO_GENERATOR:
                return  # a generator resumed, or closed: raised there, Python would only print it
                # (a signal is not lost so: it is raised at the next check)
            caller = frame.f_back
            here = frame.f_code.co_filename in BOOKKEEPING or (
                caller is not None and caller.f_code.co_filename in BOOKKEEPING)
        else:
            here = event == "c_return" and frame.f_code.co_filename in BOOKKEEPING
        if here:
            self.checks += 1
            if self.checks == self.at:
                raise KeyboardInterrupt


def run(e: GenerationEngine, interrupt: InterruptAt | None) -> tuple[list[tuple[int, ...]], bool]:
    """Queue PROMPTS, step until every one has a result; the outputs and whether a step was interrupted."""
    rids = [e.add_request(p, NEW_TOKENS) for p in PROMPTS]
    interrupted = False
    for _ in range(MAX_STEPS):
        if all(rid in e.results for rid in rids):
            break
        sys.setprofile(interrupt)
        try:
            e.step()
        except KeyboardInterrupt:
            interrupted = True
            e.check_consistent()  # at once: the next step must not be what repairs it
        finally:
            sys.setprofile(None)
    else:
        pending = [rid for rid in rids if rid not in e.results]
        raise AssertionError(f"requests {pending} never finished: {e.pending()}")
    e.drain()
    return [e.results.pop(rid).output for rid in rids], interrupted


@pytest.fixture(scope="module")
def expected() -> list[tuple[int, ...]]:
    outputs, _ = run(engine("eager"), None)
    return outputs


@pytest.mark.parametrize("density", SWEEPS)
@pytest.mark.parametrize("decode", ["eager", "graphs"])
def test_a_step_interrupted_at_any_signal_check_loses_no_request_token_or_block(expected, decode, density):
    counter = InterruptAt(0)
    outputs, _ = run(engine(decode), counter)  # at=0 never fires: it counts the run's checks
    assert outputs == expected
    total = counter.checks
    tried = 0
    for at in spread(total, 40 * density):
        e = engine(decode)
        outputs, interrupted = run(e, InterruptAt(at))
        assert interrupted, f"check {at} of {total} was not reached"
        assert outputs == expected, f"interrupted at check {at} of {total}"
        assert e.pending() is None and e.blocks.available == e.blocks.num_blocks, f"check {at}"
        e.check_consistent()
        tried += 1
    assert tried >= 30 * density


@pytest.mark.parametrize("density", SWEEPS)
@pytest.mark.parametrize("decode", ["eager", "graphs"])
def test_generate_interrupted_at_any_signal_check_leaves_the_engine_as_new(expected, decode, density):
    # The single-caller case (a notebook cell interrupted): the call's own requests are
    # withdrawn, and the same engine then gives every prompt its tokens.
    counter = InterruptAt(0)
    sys.setprofile(counter)
    try:
        engine(decode).generate(PROMPTS, NEW_TOKENS)
    finally:
        sys.setprofile(None)
    for at in spread(counter.checks, 15 * density):
        e = engine(decode)
        sys.setprofile(InterruptAt(at))
        try:
            e.generate(PROMPTS, NEW_TOKENS)
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        e.check_consistent()
        assert e.pending() is None and not e.results and e.blocks.available == e.blocks.num_blocks, f"check {at}"
        assert [r.output for r in e.generate(PROMPTS, NEW_TOKENS)] == expected, f"check {at}"


@pytest.mark.parametrize("density", SWEEPS)
@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
@pytest.mark.parametrize("decode", ["eager", "graphs"])
def test_pause_interrupted_at_any_signal_check_loses_nothing(expected, decode, mode, density):
    # Pausing drains a window or tokens on their way first, then aborts or retracts: a
    # request half-aborted or half-retracted was stuck. Whatever the pause got to, every
    # request not aborted still ends with its tokens.
    def paused_run(interrupt: InterruptAt | None) -> tuple[GenerationEngine, list[int]]:
        e = engine(decode)
        rids = [e.add_request(p, NEW_TOKENS) for p in PROMPTS]
        for _ in range(4):
            e.step()
        sys.setprofile(interrupt)
        try:
            e.pause_generation(mode)
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        e.check_consistent()
        return e, rids

    counter = InterruptAt(0)
    paused_run(counter)
    assert counter.checks > 10
    for at in spread(counter.checks + 1, 12 * density):
        e, rids = paused_run(InterruptAt(at))
        if e.paused is not None:
            e.continue_generation()
        for _ in range(MAX_STEPS):
            if all(rid in e.results for rid in rids):
                break
            e.step()
        results = [e.results.pop(rid) for rid in rids]
        for result, tokens in zip(results, expected, strict=True):
            if result.state.value == "aborted":
                assert mode == "abort" and tokens[: len(result.output)] == result.output, f"check {at}"
            else:
                assert result.output == tokens, f"check {at} of {counter.checks}"
        assert e.pending() is None and e.blocks.available == e.blocks.num_blocks, f"check {at}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with graph support (none here)")
def test_on_a_gpu_with_captured_decode_graphs_one_engine_survives_every_interrupt():
    # Windows in flight on a real stream and tokens landing through pinned memory are dropped
    # by the recovery while the device still works on them; the same engine goes on after each.
    # fp32: a request recovered is prefilled again, and its tokens must equal the decode's.
    graphs = DecodeGraphConfig(batch_buckets=(1, 2, 4, 8), context_buckets=(16, 32))
    e = GenerationEngine(EngineConfig(max_kv_slots=32, kv_block_size=4, max_batch_tokens=16, dtype=torch.float32,
                                      decode_graphs=graphs))
    assert e.platform.name == "cuda" and e.decode_runner is not None
    counter = InterruptAt(0)
    expected, _ = run(e, counter)
    total = counter.checks
    for at in range(1, total, max(1, total // 150)):
        outputs, interrupted = run(e, InterruptAt(at))
        assert interrupted and outputs == expected, f"interrupted at check {at} of {total}"
        assert e.pending() is None and e.blocks.available == e.blocks.num_blocks, f"check {at}"
