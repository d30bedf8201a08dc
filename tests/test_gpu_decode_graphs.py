"""Full-graph decode replayed on a real GPU (marker gpu; skipped without one)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from torchhal.core.engine import EngineConfig, GenerationEngine
from torchhal.core.graphs import GraphRunner
from torchhal.core.model import ModelConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from decode_vs_transformers import engine_step, new_decode_runner  # noqa: E402

has_gpu = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu, reason="needs a GPU with graph support (none here)")]

PROMPTS = [[1 + i, 2, 3 + i] * (1 + i % 4) for i in range(12)]
NEW_TOKENS = [4 + (5 * i) % 11 for i in range(12)]
CONFIG = EngineConfig(model=ModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=688),
                      max_kv_slots=8192, max_running=6)


def prefill_graphs(engine: GenerationEngine) -> GraphRunner:
    return GraphRunner(engine.model, engine.platform, engine.device_index,
                       hidden_size=engine.config.model.hidden_size, dtype=engine.config.dtype, buckets=(16, 64, 256))


def run(engine: GenerationEngine, decode) -> list[tuple[int, ...]]:  # type: ignore[no-untyped-def]
    rids = [engine.add_request(p, n) for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
    while any(rid not in engine.results for rid in rids):
        engine_step(engine, decode)
    return [engine.results.pop(rid).output for rid in rids]


def test_replayed_decode_matches_eager_tokens_while_requests_finish_and_join():
    reference = run(GenerationEngine(CONFIG), None)
    engine = GenerationEngine(CONFIG, runner_factory=prefill_graphs)
    decode = new_decode_runner(engine, batch_buckets=(1, 2, 4, 8), context_buckets=(32, 64))
    assert decode.graphs_enabled and decode.report is not None and decode.report.graphs == 4 * 2
    assert run(engine, decode) == reference
    assert decode.steps >= 10 and decode.slots.rows_moved >= 1


def test_decode_capture_does_not_empty_the_cache_and_reports_pool_memory():
    engine = GenerationEngine(CONFIG)
    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del block
    reserved = torch.cuda.memory_reserved()
    decode = new_decode_runner(engine, batch_buckets=(1, 8), context_buckets=(64,))
    assert torch.cuda.memory_reserved() >= reserved
    assert decode.report is not None and decode.report.seconds > 0 and decode.report.pool_bytes is not None


def test_sleep_wake_recaptures_decode_graphs():
    engine = GenerationEngine(CONFIG)
    decode = new_decode_runner(engine, batch_buckets=(4, 16), context_buckets=(64,))
    before = run(engine, decode)
    engine.release_memory_occupation()
    decode.release()
    engine.resume_memory_occupation()
    assert engine.slots.allocate(1) == [decode.scratch_slot]  # the allocator was reset: take the scratch slot again
    decode.resume()
    assert decode.graphs_enabled
    assert run(engine, decode) == before
