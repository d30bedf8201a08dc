"""Full-graph decode inside the engine, replayed on a real GPU (marker gpu; skipped without one)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from torchhal.attention import SCRATCH_BLOCK
from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine, PauseMode
from torchhal.core.graphs import GraphRunner
from torchhal.core.model import ModelConfig

has_gpu = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu, reason="needs a GPU with graph support (none here)")]

PROMPTS = [[1 + i, 2, 3 + i] * (1 + i % 4) for i in range(12)]
NEW_TOKENS = [4 + (5 * i) % 11 for i in range(12)]
MODEL = ModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=688)
CONFIG = EngineConfig(model=MODEL, max_kv_slots=8192, max_running=6)


def with_graphs(batch_buckets: tuple[int, ...] = (1, 2, 4, 8), context_buckets: tuple[int, ...] = (32, 64),
                steps_per_sync: int = 8, **overrides: object) -> EngineConfig:
    settings = DecodeGraphConfig(batch_buckets=batch_buckets, context_buckets=context_buckets,
                                 steps_per_sync=steps_per_sync)
    return EngineConfig(**{"model": MODEL, "max_kv_slots": 8192, "max_running": 6, **overrides},
                        decode_graphs=settings)


def prefill_graphs(engine: GenerationEngine) -> GraphRunner:
    return GraphRunner(engine.model, engine.platform, engine.device_index,
                       hidden_size=engine.model_config.hidden_size, dtype=engine.config.dtype, buckets=(16, 64, 256))


def run(engine: GenerationEngine) -> list[tuple[int, ...]]:
    rids = [engine.add_request(p, n) for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
    while any(rid not in engine.results for rid in rids):
        engine.step()
    return [engine.results.pop(rid).output for rid in rids]


def decode_runner(engine: GenerationEngine):  # type: ignore[no-untyped-def]
    runner = engine.decode_runner
    assert runner is not None
    return runner


@pytest.mark.parametrize("steps_per_sync", [1, 8])
def test_replayed_decode_matches_eager_tokens_while_requests_finish_and_join(steps_per_sync):
    reference = run(GenerationEngine(CONFIG))
    engine = GenerationEngine(with_graphs(steps_per_sync=steps_per_sync), runner_factory=prefill_graphs)
    decode = decode_runner(engine)
    assert decode.graphs_enabled and decode.report is not None and decode.report.graphs == 4 * 2
    assert run(engine) == reference
    assert decode.steps >= 10 and decode.rows.live == 0
    assert engine.blocks.available == engine.blocks.num_blocks
    if steps_per_sync == 1:
        assert decode.rows.rows_moved >= 1 and decode.windows == decode.steps
    else:
        assert decode.windows < decode.steps  # replays ran back to back between read-backs


def test_compiled_layers_give_graphs_and_eager_the_same_tokens_in_bf16():
    """Inductor's fused kernels inside the captured windows; the same engine's eager decode
    (decode runner detached) runs the same compiled functions, so tokens must match exactly."""
    torch._dynamo.reset()
    engine = GenerationEngine(replace(with_graphs(steps_per_sync=8, dtype=torch.bfloat16), compile_layers="inductor"))
    graphs = decode_runner(engine)
    assert graphs.graphs_enabled
    engine.executor.decode = None
    eager = run(engine)
    engine.executor.decode = graphs
    assert run(engine) == eager
    assert graphs.steps >= 10 and engine.blocks.available == engine.blocks.num_blocks
    torch._dynamo.reset()


def test_replayed_windows_stop_at_an_eos_token_like_single_steps():
    reference = run(GenerationEngine(CONFIG))
    stop = next(out[2] for out in reference if len(out) > 6)
    eager = run(GenerationEngine(replace(CONFIG, eos_token=stop)))
    engine = GenerationEngine(with_graphs(steps_per_sync=8, eos_token=stop), runner_factory=prefill_graphs)
    assert run(engine) == eager
    assert engine.blocks.available == engine.blocks.num_blocks


def test_decode_capture_empties_the_cache_only_where_the_weights_moved_and_reports_pool_memory(monkeypatch):
    import torchhal

    platform = torchhal.current_platform()
    reasons = []
    real = platform.empty_cache
    monkeypatch.setattr(platform, "empty_cache", lambda reason, *a: reasons.append(reason) or real(reason, *a))
    engine = GenerationEngine(with_graphs((1, 8), (64,)))
    # The weights' old copies, once in the regions (ReleasePoint.COMPONENT_RELEASE); never the capture.
    assert reasons == [torchhal.ReleasePoint.COMPONENT_RELEASE]
    report = decode_runner(engine).report
    assert report is not None and report.seconds > 0 and report.pool_bytes is not None


def test_sleep_wake_keeps_the_decode_graphs_and_the_scratch_block_stays_out_of_the_allocator():
    engine = GenerationEngine(with_graphs((4, 16), (64,)))
    decode = decode_runner(engine)
    before = run(engine)
    steps, captures = decode.steps, decode.captures
    for level in (1, 2):
        saved = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
        free_awake = torch.cuda.mem_get_info()[0]
        engine.release_memory_occupation(level=level)
        assert decode.graphs_enabled and torch.cuda.mem_get_info()[0] > free_awake
        engine.resume_memory_occupation(tags=("weights",))
        if level == 2:
            engine.update_weights_from_tensors(saved)
        engine.resume_memory_occupation(tags=("kv_cache",))
        assert run(engine) == before and decode.steps > steps
    assert decode.captures == captures  # the graphs replayed after every wake, none captured again
    every = engine.blocks.allocate(engine.blocks.available)
    assert every is not None and SCRATCH_BLOCK not in every
    assert engine.model.kv is not None and engine.model.kv.num_blocks == engine.blocks.num_blocks + 1


def test_in_place_weight_update_keeps_the_captured_graphs_valid():
    expected = run(GenerationEngine(EngineConfig(model=replace(MODEL, seed=7),
                                                 max_kv_slots=8192, max_running=6)))
    new_weights = {name: t.detach().cpu() for name, t in GenerationEngine(
        EngineConfig(model=replace(MODEL, seed=7), max_kv_slots=64)).model.named_parameters()}
    engine = GenerationEngine(with_graphs())
    decode = decode_runner(engine)
    assert run(engine) != expected
    graphs = dict(decode._graphs)
    steps = decode.steps
    engine.update_weights_from_tensors(new_weights)
    assert decode._graphs == graphs  # no recapture: the update wrote the captured weights in place
    assert run(engine) == expected and decode.steps > steps


def test_pause_continue_mid_flight_with_decode_graphs():
    reference = run(GenerationEngine(CONFIG))
    engine = GenerationEngine(with_graphs())
    for mode in PauseMode:
        if mode is PauseMode.ABORT:
            continue  # aborted requests have no tokens to compare
        rids = [engine.add_request(p, n) for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
        for _ in range(4):
            engine.step()
        engine.pause_generation(mode)
        engine.continue_generation()
        while any(rid not in engine.results for rid in rids):
            engine.step()
        assert [engine.results.pop(rid).output for rid in rids] == reference


def test_weight_update_while_asleep_with_decode_graphs_pins_and_survives_wake():
    expected = run(GenerationEngine(EngineConfig(model=replace(MODEL, seed=7),
                                                 max_kv_slots=8192, max_running=6)))
    new_weights = {name: t.detach().cpu() for name, t in GenerationEngine(
        EngineConfig(model=replace(MODEL, seed=7), max_kv_slots=64)).model.named_parameters()}
    engine = GenerationEngine(with_graphs())
    run(engine)
    engine.release_memory_occupation()
    assert all(p.device.type == "cpu" and p.is_pinned() for p in engine.model.parameters())
    engine.update_weights_from_tensors(new_weights)
    engine.resume_memory_occupation()
    assert run(engine) == expected
