"""The generation engine's scheduler and memory lifecycle, on the CPU platform.

CPU has no caching allocator, so these tests check decisions (what is emptied,
when, with which reason; what is refused) and outputs; the memory effect of the
continue-time empty is measured on a GPU (benchmarks/weight_update_loop.py).
"""

import time

import pytest
import torch
from safetensors.torch import save_file

import torchhal
from torchhal.core.engine import EngineConfig, GenerationEngine, PauseMode, RequestState
from torchhal.core.model import ModelConfig
from torchhal.platforms import ReleasePoint

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 10, [300, 3], [17, 18, 19, 20]]


def engine(**overrides):
    return GenerationEngine(EngineConfig(**{"max_kv_slots": 512, **overrides}))


def reference_outputs(max_new_tokens=6):
    return [engine().generate([p], max_new_tokens)[0].output for p in PROMPTS]


def test_batched_outputs_equal_one_at_a_time():
    results = engine().generate(PROMPTS, 6)
    assert [r.output for r in results] == reference_outputs()
    assert all(r.state is RequestState.FINISHED and len(r.output) == 6 for r in results)


def test_kv_pool_is_sized_from_memory_info(make_registry):
    make_registry()
    e = GenerationEngine(EngineConfig(kv_fraction=0.01, max_kv_slots=1 << 30))
    free = torchhal.current_platform().memory_info().free
    assert e.kv_sizing.num_blocks == pytest.approx(free * 0.01 // e.kv_sizing.bytes_per_block, rel=0.05)
    assert e.model.kv.num_blocks == e.kv_sizing.num_blocks + 1  # + the scratch block
    with pytest.raises(ValueError, match=r"EngineConfig.kv_fraction = 1.5 must be a fraction of free memory"):
        GenerationEngine(EngineConfig(kv_fraction=1.5))


def test_bad_prompts_fail_alone_and_are_reported():
    results = engine().generate([[1, 2], [], [99999], [3, 4]], 3)
    states = [r.state for r in results]
    assert states == [RequestState.FINISHED, RequestState.FAILED, RequestState.FAILED, RequestState.FINISHED]
    assert "empty" in results[1].error and "99999" in results[2].error


def test_prompt_larger_than_the_pool_fails_with_a_clear_error():
    results = engine(max_kv_slots=8, kv_block_size=4).generate([[1] * 20, [2, 3]], 2)
    assert results[0].state is RequestState.FAILED
    assert "needs KV for 20 tokens but the pool holds 2 blocks of 4" in results[0].error
    assert results[1].state is RequestState.FINISHED


def test_small_pool_retracts_and_still_matches():
    # 6 blocks of 4 cannot hold all five requests' KV at once: the scheduler retracts and re-prefills.
    results = engine(max_kv_slots=24, kv_block_size=4).generate(PROMPTS, 6)
    assert [r.output for r in results] == reference_outputs()


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_and_continue_give_identical_greedy_tokens(mode):
    expected = reference_outputs(8)
    e = engine()
    rids = [e.add_request(p, 8) for p in PROMPTS]
    for _ in range(3):
        e.step()
    assert e.pause_generation(mode) == []
    assert e.step() == []  # paused: nothing runs
    if mode == "retract":
        assert not e.running and len(e.waiting) == len(PROMPTS)
    else:
        assert len(e.running) == len(PROMPTS)
    e.continue_generation()
    while any(rid not in e.results for rid in rids):
        e.step()
    assert [e.results[rid].output for rid in rids] == expected


def test_abort_returns_every_in_flight_request():
    e = engine(max_running=2)
    rids = [e.add_request(p, 8) for p in PROMPTS]
    e.step()
    ended = e.pause_generation(PauseMode.ABORT)
    assert sorted(r.rid for r in ended) == rids  # running and waiting: none lost
    assert all(r.state is RequestState.ABORTED for r in ended)
    assert e.blocks.available == e.blocks.num_blocks
    e.continue_generation()
    assert e.generate([PROMPTS[0]], 6)[0].output == reference_outputs()[0]


def test_pause_twice_and_continue_unpaused_are_refused():
    e = engine()
    with pytest.raises(RuntimeError, match="not paused"):
        e.continue_generation()
    e.pause_generation("in_place")
    with pytest.raises(RuntimeError, match="already paused \\(in_place\\)"):
        e.pause_generation("abort")
    with pytest.raises(ValueError):
        PauseMode("sideways")


def test_continue_empties_once_with_resume_reason(empties):
    e = engine()
    e.pause_generation("in_place")
    report = e.continue_generation()
    assert empties == [ReleasePoint.RESUME_GENERATION]
    assert report.reserved_before is None  # CPU: no allocator counters
    e.pause_generation("in_place")
    e.continue_generation(empty_cache=False)
    assert empties == [ReleasePoint.RESUME_GENERATION]


def test_generation_itself_never_empties(empties):
    engine().generate(PROMPTS, 4)
    assert empties == []


def test_flush_only_when_idle(empties):
    e = engine()
    e.add_request([1, 2, 3], 4)
    e.step()
    result = e.flush_cache()
    assert not result.flushed and "1 running" in result.message
    assert empties == []
    e.pause_generation("in_place")
    assert "paused in_place" in e.flush_cache().message
    e.continue_generation(empty_cache=False)
    while e.running:
        e.step()
    result = e.flush_cache()
    assert result.flushed and empties == [ReleasePoint.USER]
    assert e.blocks.available == e.blocks.num_blocks


@pytest.mark.parametrize("busy", [True, False])
def test_a_flush_reason_that_is_no_release_point_is_refused_before_the_pool_is_touched(empties, busy):
    # Busy, it returned "cannot flush while busy"; idle, the platform refused it after the pool was reset.
    e = engine()
    e.add_request([1, 2, 3], 4)
    e.step()
    if not busy:
        while e.running:
            e.step()
    held = e.blocks.available
    for reason in ("user", None):
        with pytest.raises(TypeError, match=rf"flush_cache\(reason={reason!r}\): pass a ReleasePoint"):
            e.flush_cache(reason=reason)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="pass a ReleasePoint"):
            e.flush_cache(empty_cache=False, reason=reason)  # type: ignore[arg-type]
    assert e.blocks.available == held and empties == []


def test_weight_update_validates_before_applying():
    e = engine()
    before = {k: v.clone() for k, v in e.model.state_dict().items()}
    good = torch.zeros_like(e.model.lm_head.weight)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=f"nothing applied.*'{q_proj}' has shape \\(3, 3\\)"):
        e.update_weights_from_tensors({"lm_head.weight": good, q_proj: torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="unknown weight 'nope'"):
        e.update_weights_from_tensors([("lm_head.weight", good), ("nope", good)])
    with pytest.raises(ValueError, match="dtype torch.int64"):
        e.update_weights_from_tensors({"lm_head.weight": good.long()})
    for k, v in e.model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a rejected update"


def test_weight_update_applies_post_processing_and_changes_outputs(empties):
    e = engine()
    other = GenerationEngine(EngineConfig(model=ModelConfig(seed=7), max_kv_slots=512))
    expected = other.generate([PROMPTS[1]], 6)[0].output
    assert e.generate([PROMPTS[1]], 6)[0].output != expected
    result = e.update_weights_from_tensors(other.model.named_parameters(), flush_cache=True)
    assert result.weight_version == 1 and result.flush.flushed
    assert empties == [ReleasePoint.WEIGHT_UPDATE]
    attn = e.model.model.layers[0].self_attn
    assert torch.equal(attn.fused_weight[: attn.q_proj.weight.shape[0]], attn.q_proj.weight)  # fused
    assert e.generate([PROMPTS[1]], 6)[0].output == expected


def test_weight_update_from_disk_while_paused_in_place_keeps_kv(tmp_path):
    e = engine()
    rid = e.add_request(PROMPTS[2], 8)
    e.step()
    e.step()
    e.pause_generation("in_place")
    kv_blocks = (list(e.running[0].blocks), e.running[0].kv_tokens)
    same = {k: v.detach().clone().contiguous() for k, v in e.model.named_parameters()}
    path = tmp_path / "weights.safetensors"
    save_file(same, str(path))
    result = e.update_weights_from_disk(str(path), flush_cache=True)
    assert result.flush is not None and not result.flush.flushed  # busy: flush refused, update kept
    assert (e.running[0].blocks, e.running[0].kv_tokens) == kv_blocks
    e.continue_generation()
    while rid not in e.results:
        e.step()
    assert e.results[rid].output == reference_outputs(8)[2]


def test_sleep_and_wake(empties):
    e = engine()
    before = e.generate(PROMPTS[:2], 5)
    e.add_request([1, 2], 3)
    with pytest.raises(RuntimeError, match="cannot sleep: 1 waiting"):
        e.release_memory_occupation()
    while e.waiting or e.running:
        e.step()
    e.release_memory_occupation()
    assert e.asleep_tags == ("weights", "kv_cache") and empties == [ReleasePoint.SLEEP]
    with pytest.raises(RuntimeError, match="asleep"):
        e.step()
    e.resume_memory_occupation()
    after = e.generate(PROMPTS[:2], 5)
    assert [r.output for r in after] == [r.output for r in before]


def test_oom_in_a_step_retracts_empties_once_and_keeps_serving(empties, monkeypatch):
    e = engine()
    real_forward = e.runner.forward
    calls = {"n": 0}

    def flaky(ids, meta, rows):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("simulated: tried to allocate 2 GiB")
        return real_forward(ids, meta, rows)

    monkeypatch.setattr(e.runner, "forward", flaky)
    results = e.generate(PROMPTS, 6)
    assert empties == [ReleasePoint.OOM]
    assert [r.output for r in results] == reference_outputs()


def test_repeated_oom_fails_the_request_with_a_clear_error(empties, monkeypatch):
    e = engine()

    def always(ids, meta, rows):
        raise torch.OutOfMemoryError("simulated OOM")

    monkeypatch.setattr(e.runner, "forward", always)
    results = e.generate([PROMPTS[0]], 3)
    assert results[0].state is RequestState.FAILED and "out of memory twice" in results[0].error
    assert empties == [ReleasePoint.OOM, ReleasePoint.OOM]


def test_idle_interval_empties_once(empties):
    e = engine(idle_empty_after_s=0.0)
    e.generate([PROMPTS[0]], 2)
    e.step()  # idle since the last working step ended: empty
    e.step()  # already emptied
    assert empties == [ReleasePoint.IDLE]


def test_the_idle_clock_starts_when_the_work_ends_not_at_the_first_idle_step(empties, monkeypatch):
    # It started at the first step() that found nothing to do: an engine idle for longer than
    # the interval emptied only at the step after that one.
    clock = {"now": 100.0}
    monkeypatch.setattr(time, "monotonic", lambda: clock["now"])
    e = engine(idle_empty_after_s=5.0)
    e.generate([PROMPTS[0]], 2)  # its last step ends at 100
    clock["now"] = 104.0
    e.step()
    assert empties == []  # 4 s idle
    clock["now"] = 105.5
    e.step()
    assert empties == [ReleasePoint.IDLE]
    e.add_request(PROMPTS[1], 1)
    e.step()  # work again: the clock restarts when it ends, and the cache may be emptied again
    clock["now"] = 108.0
    e.step()
    assert empties == [ReleasePoint.IDLE]
    clock["now"] = 110.6
    e.step()
    assert empties == [ReleasePoint.IDLE, ReleasePoint.IDLE]


@pytest.mark.parametrize("field, value", [("max_running", 0), ("max_batch_tokens", -1), ("max_kv_slots", 1.5),
                                          ("idle_empty_after_s", -2.0), ("compile_layers", ""),
                                          ("compile_layers", 3), ("device", -1), ("device", "cuda:0"),
                                          ("device", True)])
def test_nonsensical_engine_config_is_refused(field, value):
    with pytest.raises(ValueError, match=f"EngineConfig.{field} = {value!r}"):
        EngineConfig(**{field: value})


def test_weight_update_converts_other_float_dtypes_on_the_host():
    e = engine()
    target = torch.randn_like(e.model.lm_head.weight, dtype=torch.float64)
    e.update_weights_from_tensors({"lm_head.weight": target})
    assert e.model.lm_head.weight.dtype == torch.float32
    torch.testing.assert_close(e.model.lm_head.weight.detach(), target.float())


def test_a_request_ends_on_any_of_the_eos_tokens():
    full = engine().generate(PROMPTS[:1], 8)[0].output
    stop_a, stop_b = full[2], full[5]
    first_a = full.index(stop_a)
    assert engine(eos_tokens=(stop_a,)).generate(PROMPTS[:1], 8)[0].output == full[: first_a + 1]
    assert engine(eos_token=stop_a).generate(PROMPTS[:1], 8)[0].output == full[: first_a + 1]
    unrelated = next(t for t in range(512) if t not in full)
    both = engine(eos_tokens=(unrelated, stop_b)).generate(PROMPTS[:1], 8)[0].output
    assert both == full[: full.index(stop_b) + 1]
    with pytest.raises(ValueError, match=r"eos_tokens = \[2\] must be a tuple"):
        EngineConfig(eos_tokens=[2])  # type: ignore[arg-type]
