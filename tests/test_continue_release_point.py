"""The continue-time release point of the generation engine, on every pause mode.

`continue_generation()` empties the cache once, with reason RESUME_GENERATION, while
the engine is still paused (nothing of a step can allocate in between), whatever the
pause mode; the requests then go on as if never paused (retract, in place) or are gone
(abort).
"""

import pytest

from torchhal.core.engine import EngineConfig, GenerationEngine, PauseMode, RequestState
from torchhal.platforms import ReleasePoint, hookimpl

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 10, [17, 18, 19, 20]]


@pytest.fixture
def watched(make_registry):
    """An engine and what it looked like at each cache empty."""
    seen: list[tuple[ReleasePoint, PauseMode | None, int]] = []
    engines: list[GenerationEngine] = []

    class Observer:
        @hookimpl
        def torchhal_cache_emptied(self, reason):
            seen.append((reason, engines[0].paused, len(engines[0].running)))

    make_registry(Observer())
    engines.append(GenerationEngine(EngineConfig(max_kv_slots=512, max_running=2)))
    return engines[0], seen


def reference(max_new_tokens):
    return [GenerationEngine(EngineConfig(max_kv_slots=512)).generate([p], max_new_tokens)[0].output
            for p in PROMPTS]


@pytest.mark.parametrize("mode", list(PauseMode))
def test_continue_empties_once_while_still_paused(watched, mode):
    engine, seen = watched
    rids = [engine.add_request(p, 6) for p in PROMPTS]
    for _ in range(2):
        engine.step()
    running_at_pause = len(engine.running)
    ended = engine.pause_generation(mode)
    assert seen == []  # pausing is not a release point
    engine.continue_generation()
    expected_running = running_at_pause if mode is PauseMode.IN_PLACE else 0
    assert seen == [(ReleasePoint.RESUME_GENERATION, mode, expected_running)]
    assert engine.paused is None
    while engine.running or engine.waiting:
        engine.step()
    if mode is PauseMode.ABORT:
        assert sorted(r.rid for r in ended) == rids
        assert all(r.state is RequestState.ABORTED for r in ended)
        assert engine.blocks.available == engine.blocks.num_blocks
        assert engine.generate([PROMPTS[0]], 6)[0].output == reference(6)[0]  # the engine serves again
    else:
        assert ended == []
        assert [engine.results[rid].output for rid in rids] == reference(6)
    assert [reason for reason, _, _ in seen] == [ReleasePoint.RESUME_GENERATION]  # running never empties


@pytest.mark.parametrize("mode", list(PauseMode))
def test_continue_without_the_empty_empties_nothing(watched, mode):
    engine, seen = watched
    for p in PROMPTS:
        engine.add_request(p, 4)
    engine.step()
    engine.pause_generation(mode)
    report = engine.continue_generation(empty_cache=False)
    assert seen == [] and report.bytes_released is None and engine.paused is None
