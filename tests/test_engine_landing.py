"""A step whose tokens nothing next depends on lands them after the next step is launched
(CPU): when every request that emits ends with that token, the host plans and launches the
next step before it reads them, so the device does not idle between the steps of prompts
prefilled for one token each. Tokens, results and every lifecycle path stay as without it."""

import pytest
import torch

from torchhal.core.engine import EngineConfig, GenerationEngine, RequestState
from torchhal.platforms import ReleasePoint

# Whole prompts of at most 8 tokens under a budget of 8: one prompt a step.
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21]]


def engine(**overrides):
    return GenerationEngine(EngineConfig(**{"max_kv_slots": 512, "max_batch_tokens": 8, **overrides}))


class FaultyEvent:
    """A landing's copy event whose wait fails, as on a device fault."""

    def synchronize(self):
        raise RuntimeError("device fault")


@pytest.fixture(scope="module")
def one_token():
    """Each prompt's first token, computed alone."""
    return [engine().generate([p], 1)[0].output for p in PROMPTS]


def watch_forward(e):
    """Record, at each runner call, the requests whose KV is all written but whose token has
    not landed: this step's emitting requests, and an earlier step's whose tokens are on their way."""
    seen: list[list[int]] = []
    real = e.runner.forward

    def forward(input_ids, meta, rows=None):
        seen.append([r.rid for r in e.running if r.pending == 0 and not r.output])
        return real(input_ids, meta, rows)

    e.runner.forward = forward
    return seen


def test_the_next_step_is_launched_before_the_tokens_of_one_that_ends_its_requests_land(one_token):
    e = engine()
    seen = watch_forward(e)
    rids = [e.add_request(p, 1) for p in PROMPTS]
    returned = [e.step() for _ in range(len(PROMPTS) + 1)]
    # Step k+1 ran while step k's request still waited for its token; step k+1 returned it.
    assert seen == [[rids[0]]] + [[a, b] for a, b in zip(rids, rids[1:], strict=False)]
    assert [[r.rid for r in done] for done in returned] == [[]] + [[rid] for rid in rids]
    assert [e.results[rid].output for rid in rids] == one_token
    assert all(e.results[rid].state is RequestState.FINISHED for rid in rids)
    assert e.executor.in_flight is None and e.blocks.available == e.blocks.num_blocks


def test_generate_returns_every_token_and_frees_every_block(one_token):
    e = engine()
    assert [r.output for r in e.generate(PROMPTS, 1)] == one_token
    assert e.executor.in_flight is None and e.pending() is None and e.blocks.available == e.blocks.num_blocks


def test_a_request_that_goes_on_decoding_has_its_token_read_before_the_next_step(one_token):
    e = engine()
    seen = watch_forward(e)
    expected = [engine().generate([PROMPTS[0]], 3)[0].output, one_token[1]]
    rids = [e.add_request(PROMPTS[0], 3), e.add_request(PROMPTS[1], 1)]
    while any(rid not in e.results for rid in rids):
        e.step()
    assert seen[:2] == [[rids[0]], [rids[1]]], seen  # the first prompt decodes next: its token was read first
    assert [e.results[rid].output for rid in rids] == expected


def test_a_running_request_that_decodes_next_keeps_the_step_synchronous():
    # Request 0 decodes for many steps; request 1, admitted beside it, wants one token: its
    # step also carries request 0's decode, so that step's tokens are read at once.
    e = engine(max_batch_tokens=16)
    seen = watch_forward(e)
    expected = [r.output for r in engine(max_batch_tokens=16).generate([PROMPTS[0]], 6)]
    first = e.add_request(PROMPTS[0], 6)
    e.step()
    e.add_request(PROMPTS[1], 1)
    while first not in e.results:
        e.step()
    assert all(len(ids) <= 2 for ids in seen) and all(len(ids) < 2 or first in ids for ids in seen), seen
    assert e.results[first].output == expected[0]


def test_drain_and_the_lifecycle_calls_land_the_tokens_first(one_token):
    e = engine()
    rid = e.add_request(PROMPTS[0], 1)
    e.step()
    assert e.executor.in_flight is not None and rid not in e.results
    e.drain()
    assert e.executor.in_flight is None and e.results[rid].output == one_token[0]
    e.add_request(PROMPTS[1], 1)
    e.step()
    assert e.flush_cache(empty_cache=False).flushed  # landed, so nothing was pending
    e.add_request(PROMPTS[2], 1)
    e.step()
    assert [r.output for r in e.pause_generation("abort")] == []  # landed and finished, not aborted
    assert [r.output for r in e.results.values()][-1] == one_token[2]


def test_a_failing_next_step_still_lands_the_tokens_and_is_rolled_back(monkeypatch, one_token):
    e = engine()
    rids = [e.add_request(p, 1) for p in PROMPTS[:2]]
    e.step()  # prompt 0's tokens on their way
    free = e.blocks.available
    real = e.runner.forward
    monkeypatch.setattr(e.runner, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("step fault")))
    with pytest.raises(RuntimeError, match="step fault"):
        e.step()
    assert e.results[rids[0]].output == one_token[0]  # landed despite the failure
    assert e.executor.in_flight is None and e.running == [] and [r.rid for r in e.waiting] == [rids[1]]
    assert e.blocks.available == e.blocks.num_blocks > free
    monkeypatch.setattr(e.runner, "forward", real)
    while rids[1] not in e.results:
        e.step()
    assert e.results[rids[1]].output == one_token[1]


def test_out_of_memory_in_the_next_step_lands_the_tokens_and_retracts_the_step(monkeypatch, empties, one_token):
    e = engine()
    rids = [e.add_request(p, 1) for p in PROMPTS[:2]]
    e.step()
    real = e.runner.forward
    calls = []

    def out_of_memory_once(*args, **kwargs):
        if not calls:
            calls.append(True)
            raise torch.OutOfMemoryError("simulated: the next step")
        return real(*args, **kwargs)

    monkeypatch.setattr(e.runner, "forward", out_of_memory_once)
    done = e.step()  # not raised: the step's batch is retracted and prefills again
    assert [r.rid for r in done] == [rids[0]] and empties == [ReleasePoint.OOM]
    while rids[1] not in e.results:
        e.step()
    assert [e.results[rid].output for rid in rids] == one_token[:2]


def test_tokens_that_fail_to_land_are_computed_again(one_token):
    e = engine()
    rids = [e.add_request(p, 1) for p in PROMPTS[:2]]
    e.step()
    landing = e.executor.in_flight
    assert landing is not None

    landing.done = FaultyEvent()
    with pytest.raises(RuntimeError, match="device fault"):
        e.step()  # launches prompt 1, then fails to read prompt 0's token
    assert e.results == {} and e.running[0].rid == rids[1]
    assert [r.rid for r in e.waiting] == [rids[0]]  # retracted: its prompt prefills again
    while any(rid not in e.results for rid in rids):
        e.step()
    assert [e.results[rid].output for rid in rids] == one_token[:2]
    assert e.blocks.available == e.blocks.num_blocks


def test_tokens_that_fail_to_land_after_a_step_that_read_its_own_keep_that_steps_tokens(one_token):
    # Prompt 1 goes on decoding, so its step reads its token at once; prompt 0's fail to land.
    expected = engine().generate([PROMPTS[1]], 3)[0].output
    e = engine()
    first = e.add_request(PROMPTS[0], 1)
    e.step()
    second = e.add_request(PROMPTS[1], 3)
    landing = e.executor.in_flight
    assert landing is not None

    landing.done = FaultyEvent()
    with pytest.raises(RuntimeError, match="device fault"):
        e.step()
    assert [r.rid for r in e.running] == [second] and len(e.running[0].output) == 1  # kept, not stalled
    for _ in range(20):
        if first in e.results and second in e.results:
            break
        e.step()
    assert e.results[first].output == one_token[0] and e.results[second].output == expected
    assert e.blocks.available == e.blocks.num_blocks


@pytest.mark.parametrize("error", [RuntimeError("step fault"), torch.OutOfMemoryError("simulated: the step")])
def test_a_step_and_its_landing_failing_together_undo_the_step_before_dropping_the_landing(monkeypatch, error):
    # The landing step ends request a (its last decode) and starts x's prefill (x emits
    # nothing yet); the next step continues x. Both fail: x must be retracted once, cleanly.
    a_prompt, x_prompt = [1, 2, 3], list(range(10, 40))
    expected = [engine().generate([a_prompt], 2)[0].output, engine().generate([x_prompt], 1)[0].output]
    e = engine()
    a = e.add_request(a_prompt, 2)
    e.step()
    x = e.add_request(x_prompt, 1)
    e.step()
    landing = e.executor.in_flight
    assert landing is not None and [r.rid for r in landing.requests] == [a, x]

    landing.done = FaultyEvent()
    real = e.runner.forward
    monkeypatch.setattr(e.runner, "forward", lambda *args, **kwargs: (_ for _ in ()).throw(error))
    if isinstance(error, torch.OutOfMemoryError):
        assert e.step() == []  # retracted, as an OOM in any step
    else:
        with pytest.raises(RuntimeError, match="step fault"):  # the step's error, not the landing's
            e.step()
    assert e.running == [] and all(r.kv_tokens == 0 and not r.blocks for r in e.waiting)
    monkeypatch.setattr(e.runner, "forward", real)
    for _ in range(20):
        if a in e.results and x in e.results:
            break
        e.step()
    assert [e.results[a].output, e.results[x].output] == expected
    assert e.blocks.available == e.blocks.num_blocks


def test_a_landing_that_fails_breaks_a_tensor_parallel_engine(monkeypatch):
    """A failed landing is a failed step: under tensor parallel (`_break`) the engine stops."""
    e = engine()
    e.add_request(PROMPTS[0], 1)
    e.step()
    broken = []
    monkeypatch.setattr(e, "_break", lambda error: broken.append(str(error)))

    e.executor.in_flight.done = FaultyEvent()
    with pytest.raises(RuntimeError, match="device fault"):
        e.drain()
    assert broken == ["device fault"]


def test_a_generate_that_meets_an_error_lands_the_tokens_of_other_callers(monkeypatch, one_token):
    e = engine()
    other = e.add_request(PROMPTS[0], 1)
    e.step()  # another caller's step: its token is on its way
    checks = []
    real = e._check_can_run

    def refuse_in_the_step():  # generate's own check passes; the step's refuses, before it plans
        checks.append(True)
        if len(checks) > 1:
            raise RuntimeError("refused mid-call")
        real()

    monkeypatch.setattr(e, "_check_can_run", refuse_in_the_step)
    with pytest.raises(RuntimeError, match="refused mid-call"):
        e.generate([PROMPTS[1]], 1)
    assert e.results[other].output == one_token[0] and e.executor.in_flight is None
    assert e.pending() is None and e.blocks.available == e.blocks.num_blocks


def test_a_step_that_leaves_a_request_one_prompt_token_short_reads_its_tokens_at_once():
    # Step 2 gives request 0 its last token and leaves request 1 one prompt token short:
    # that token runs next as a decode, so step 2's tokens are read before step 3 is planned.
    e = engine()
    running = []
    real = e.runner.forward

    def forward(input_ids, meta, rows=None):
        running.append([r.rid for r in e.running])
        return real(input_ids, meta, rows)

    e.runner.forward = forward
    first = e.add_request([1, 2, 3], 2)
    e.step()
    second = e.add_request(list(range(30, 38)), 1)  # 8 tokens; the step has 7 left beside the decode
    while second not in e.results:
        e.step()
    assert running == [[first], [first, second], [second]]
    assert e.results[first].output == engine().generate([[1, 2, 3]], 2)[0].output
