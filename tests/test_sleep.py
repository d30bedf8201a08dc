"""Sleep and wake on the CPU: levels, wake by tag, graphs kept on virtual-memory regions and
captured again under host offload, and an RL-shaped loop (the CPU platform's regions are its
reference: host pages given back with madvise)."""

from __future__ import annotations

import pytest
import torch

from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine, WeightUpdateIncomplete
from torchhal.core.model import ModelConfig

from .sim_graphs import SimGraphsPlatform, SimGraphsWithoutRegions, sim_graphs_platform

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
CONFIG = EngineConfig(model=ModelConfig(num_layers=2), max_kv_slots=512)


def outputs(engine: GenerationEngine) -> list[tuple[int, ...]]:
    return [r.output for r in engine.generate(PROMPTS, 6)]


@pytest.fixture(scope="module")
def reference() -> list[tuple[int, ...]]:
    return outputs(GenerationEngine(CONFIG))


def test_level_1_gives_the_region_memory_back_and_wakes_the_same_engine(reference):
    engine = GenerationEngine(CONFIG)
    assert outputs(engine) == reference
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    released = engine.release_memory_occupation(level=1)
    assert released is not None and released >= weights  # the weights' region and the KV cache's
    assert engine.asleep_tags == ("weights", "kv_cache")
    with pytest.raises(RuntimeError, match=r"asleep \(weights, kv_cache\).*resume_memory_occupation"):
        engine.generate(PROMPTS, 2)
    engine.resume_memory_occupation()
    assert not engine.asleep and outputs(engine) == reference
    assert [e["kind"] for e in engine.trace].count("sleep") == 1


def test_level_2_discards_the_weights_until_an_update_brings_them_back(reference):
    engine = GenerationEngine(CONFIG)
    saved = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    engine.release_memory_occupation(level=2)
    with pytest.raises(RuntimeError, match=r"discarded by a level-2 sleep.*tags=\('weights',\)"):
        engine.update_weights_from_tensors(saved)  # nowhere to write them: wake the weights first
    with pytest.raises(ValueError, match="wake the weights first"):
        engine.resume_memory_occupation(tags=("kv_cache",))
    engine.resume_memory_occupation(tags=("weights",))
    assert engine.asleep_tags == ("kv_cache",)
    engine.update_weights_from_tensors(saved)  # the trainer's update, before the KV cache wakes
    engine.resume_memory_occupation(tags=("kv_cache",))
    assert outputs(engine) == reference


def test_after_a_level_2_wake_generation_is_refused_until_every_weight_is_updated(reference):
    engine = GenerationEngine(CONFIG)
    saved = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    engine.release_memory_occupation(level=2)
    engine.resume_memory_occupation()
    with pytest.raises(WeightUpdateIncomplete, match="discarded by a level-2 sleep"):
        engine.generate(PROMPTS, 2)
    first = next(iter(saved))
    engine.update_weights_from_tensors({first: saved[first]})
    with pytest.raises(WeightUpdateIncomplete, match="not yet updated"):
        engine.generate(PROMPTS, 2)
    engine.update_weights_from_tensors(saved)
    assert outputs(engine) == reference


@pytest.mark.parametrize("tags, error, says", [
    ("weights", ValueError, "pass a tuple of"),
    ((), ValueError, "pass a tuple of"),
    (("weights", "graphs"), ValueError, "pass a tuple of 'weights', 'kv_cache'"),
    (5, ValueError, "pass a tuple of"),
])
def test_bad_wake_tags_are_refused_and_leave_the_engine_asleep(tags, error, says):
    engine = GenerationEngine(CONFIG)
    engine.release_memory_occupation()
    with pytest.raises(error, match=says):
        engine.resume_memory_occupation(tags=tags)
    assert engine.asleep_tags == ("weights", "kv_cache")


@pytest.mark.parametrize("level", [0, 3, True, "1", 1.0])
def test_a_bad_level_is_refused_and_the_engine_stays_awake(level):
    engine = GenerationEngine(CONFIG)
    with pytest.raises(ValueError, match="pass 1 .* or 2"):
        engine.release_memory_occupation(level=level)
    assert not engine.asleep


def test_waking_what_is_awake_is_refused():
    engine = GenerationEngine(CONFIG)
    with pytest.raises(RuntimeError, match="not asleep"):
        engine.resume_memory_occupation()


def graphs_platform(make_registry, regions: bool):
    """The CPU platform with graph support, with or without its virtual memory."""
    return sim_graphs_platform(make_registry, SimGraphsPlatform if regions else SimGraphsWithoutRegions)


@pytest.mark.parametrize("regions", [True, False], ids=["regions", "host offload"])
def test_regions_keep_the_graphs_and_host_offload_captures_them_again(make_registry, regions):
    platform = graphs_platform(make_registry, regions)
    graphs = DecodeGraphConfig(batch_buckets=(1, 2), context_buckets=(64,))
    engine = GenerationEngine(EngineConfig(model=ModelConfig(num_layers=1), max_kv_slots=256, decode_graphs=graphs),
                              platform=platform)
    runner = engine.decode_runner
    assert runner is not None and runner.captures == 2
    mode = next(e["how"] for e in engine.trace if e["kind"] == "sleep_mode")
    assert ("same addresses" in mode) == regions
    for _ in range(3):
        engine.release_memory_occupation()
        engine.resume_memory_occupation()
    assert runner.captures == (2 if regions else 8)


def test_an_update_made_asleep_at_level_1_lands_in_what_wake_brings_back(reference):
    engine = GenerationEngine(CONFIG)
    other = GenerationEngine(EngineConfig(model=ModelConfig(num_layers=2, seed=5), max_kv_slots=512))
    expected = outputs(other)
    engine.release_memory_occupation(level=1)
    engine.update_weights_from_tensors(dict(other.model.named_parameters()))
    engine.resume_memory_occupation()
    assert outputs(engine) == expected != reference


def test_an_rl_loop_sleeps_trains_and_wakes_with_flat_memory_and_right_tokens(reference):
    engine = GenerationEngine(CONFIG)
    saved = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    regions = engine.occupation.regions
    held = [regions.region_bytes(tag) for tag in ("weights", "kv_cache")]
    for _ in range(5):
        engine.release_memory_occupation(level=2)
        trainer = torch.ones(8 << 20, dtype=torch.uint8)  # the trainer's step, in the memory the engine gave back
        del trainer
        engine.resume_memory_occupation(tags=("weights",))
        engine.update_weights_from_tensors(saved)
        engine.resume_memory_occupation(tags=("kv_cache",))
        assert outputs(engine) == reference
    assert [regions.region_bytes(tag) for tag in ("weights", "kv_cache")] == held  # nothing grew


def test_close_while_asleep_leaves_a_model_a_new_engine_can_serve(reference):
    engine = GenerationEngine(CONFIG)
    model = engine.model
    engine.release_memory_occupation(level=1)
    assert engine.close() == []
    again = GenerationEngine(CONFIG, model=model)
    assert outputs(again) == reference


def test_the_trace_keeps_the_latest_events_only():
    from torchhal.core.engine.events import EngineEvents

    engine = GenerationEngine(CONFIG)
    for _ in range(EngineEvents.KEPT):
        engine.pause_generation("in_place")
        engine.continue_generation(empty_cache=False)
    trace = engine.trace
    assert len(trace) == EngineEvents.KEPT and trace[-1]["kind"] == "continue"
