"""Engine and graph runner on a real CUDA GPU (marker gpu; skipped without one)."""

from dataclasses import replace

import pytest
import torch

from torchhal.core.engine import EagerRunner, EngineConfig, GenerationEngine
from torchhal.core.graphs import GraphRunner
from torchhal.core.model import ModelConfig

has_gpu = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu, reason="needs a GPU with graph support (none here)")]

PROMPTS = [[1 + i, 2, 3 + i] * (1 + i % 4) for i in range(16)]


def graph_factory(buckets=(16, 32, 64, 128, 256)):
    def make(engine):
        return GraphRunner(engine.model, engine.platform, engine.device_index,
                           hidden_size=engine.model_config.hidden_size, dtype=engine.config.dtype, buckets=buckets)

    return make


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.05)])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_replayed_hidden_states_match_eager(dtype, atol, batch):
    config = EngineConfig(model=ModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=688),
                          dtype=dtype, max_kv_slots=8192)
    engine = GenerationEngine(config, runner_factory=graph_factory())
    runner = engine.runner
    assert runner.graphs_enabled and runner.report.graphs == 5 * 5  # (layers + 1) segments x buckets
    eager = EagerRunner(engine.model)
    # Prefill then two decode steps of a mixed batch, comparing runner and eager on the same KV state.
    from torchhal.core.model import AttentionMetadata

    block = engine.config.kv_block_size
    tables = [list(range(1 + i * 4, 5 + i * 4)) for i in range(batch)]  # 4 blocks of 16 per row
    lengths = [len(p) for p in PROMPTS[:batch]]
    counts = list(lengths)
    ids = torch.tensor([t for p in PROMPTS[:batch] for t in p], device=engine.device)
    for _ in range(3):
        meta = AttentionMetadata.build(tables, lengths, counts, block, engine.device, engine.attention.backend)
        expected = eager.forward(ids, meta).clone()
        got = runner.forward(ids, meta).clone()
        torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0.02)
        lengths = [n + 1 for n in lengths]
        counts = [1] * batch
        ids = torch.arange(batch, device=engine.device) + 5


def test_a_step_of_exactly_a_buckets_tokens_replays_with_attentions_own_output_copied_in():
    """A prefill of exactly a bucket's tokens has no padded rows, so attention hands the state
    its own output tensor; the runner copies it into the tensor the graph after it reads.
    Two different steps in a row: a stale output of the first would show in the second."""
    from torchhal.core.model import AttentionMetadata

    config = EngineConfig(model=ModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=688),
                          dtype=torch.float32, max_kv_slots=8192)
    engine = GenerationEngine(config, runner_factory=graph_factory())
    runner, eager = engine.runner, EagerRunner(engine.model)
    block = engine.config.kv_block_size
    for step, lengths in enumerate(([8, 8, 8, 8], [5, 11, 16])):  # 32 tokens each: the bucket of 32
        tables = [[1 + 4 * row + 16 * step + b for b in range(4)] for row in range(len(lengths))]
        ids = torch.randint(0, config.model.vocab_size, (sum(lengths),), device=engine.device)
        meta = AttentionMetadata.build(tables, lengths, lengths, block, engine.device, engine.attention.backend)
        before = runner.bucketed_steps
        got = runner.forward(ids, meta).clone()
        assert runner.bucketed_steps == before + 1
        expected = eager.forward(ids, meta)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_the_step_after_one_whose_tokens_land_later_is_launched_without_a_device_sync():
    """While a step's tokens are on their way, the next step is planned, uploaded and launched
    with no synchronizing CUDA call (a blocking upload would wait for the step before and
    undo the overlap); only landing the tokens waits."""
    config = EngineConfig(model=ModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=688),
                          max_kv_slots=8192, max_batch_tokens=64)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(40)] for i in range(3)]  # one whole prompt a step
    expected = [r.output for r in GenerationEngine(config).generate(prompts, 1)]
    engine = GenerationEngine(config)
    rids = [engine.add_request(p, 1) for p in prompts]
    engine.step()
    assert engine.executor.in_flight is not None
    real_land = engine.executor.land

    def land(landing):
        torch.cuda.set_sync_debug_mode(0)
        return real_land(landing)

    engine.executor.land = land
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert [r.rid for r in engine.step()] == rids[:1]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    while any(rid not in engine.results for rid in rids):
        engine.step()
    assert [engine.results[rid].output for rid in rids] == expected


def test_generation_with_graphs_matches_eager_and_graph_count_is_independent_of_batch():
    config = EngineConfig(model=ModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=688),
                          max_kv_slots=8192)
    reference = GenerationEngine(config).generate(PROMPTS, 8)
    engine = GenerationEngine(config, runner_factory=graph_factory())
    graphs_before = engine.runner.report.graphs
    results = engine.generate(PROMPTS, 8)
    assert [r.output for r in results] == [r.output for r in reference]
    assert engine.runner.report.graphs == graphs_before  # no capture per batch size


def test_capture_does_not_empty_the_cache_and_reports_pool_memory():
    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del block
    reserved = torch.cuda.memory_reserved()
    engine = GenerationEngine(EngineConfig(max_kv_slots=4096), runner_factory=graph_factory((16, 64)))
    assert torch.cuda.memory_reserved() >= reserved
    assert engine.runner.report.seconds > 0 and engine.runner.report.pool_bytes is not None


def test_sleep_wake_keeps_the_prefill_graphs_and_the_outputs():
    engine = GenerationEngine(EngineConfig(max_kv_slots=4096), runner_factory=graph_factory((16, 64)))
    before = engine.generate(PROMPTS[:4], 6)
    graphs = list(engine.runner._buckets.values())
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    kept = list(engine.runner._buckets.values())
    assert engine.runner.graphs_enabled and all(a is b for a, b in zip(kept, graphs, strict=True))  # not captured again
    assert [r.output for r in engine.generate(PROMPTS[:4], 6)] == [r.output for r in before]


def test_weight_update_while_asleep_survives_wake_with_graphs():
    # On a GPU pin_memory copies: wake must bring back the update, not the copy taken at sleep.
    config = EngineConfig(max_kv_slots=4096)
    expected = GenerationEngine(EngineConfig(model=ModelConfig(seed=7), max_kv_slots=4096)).generate(PROMPTS[:4], 6)
    engine = GenerationEngine(config, runner_factory=graph_factory((16, 64)))
    assert [r.output for r in engine.generate(PROMPTS[:4], 6)] != [r.output for r in expected]
    new_weights = {name: t.detach().to("cpu") for name, t in
                   GenerationEngine(EngineConfig(model=ModelConfig(seed=7), max_kv_slots=64)).model.named_parameters()}
    free_awake = torch.cuda.mem_get_info()[0]
    engine.release_memory_occupation()
    assert all(p.device.type == "cpu" and p.is_pinned() for p in engine.model.parameters())  # the region's backup
    assert torch.cuda.mem_get_info()[0] > free_awake
    engine.update_weights_from_tensors(new_weights)
    engine.resume_memory_occupation()
    assert all(p.device.type == "cuda" for p in engine.model.parameters())
    assert [r.output for r in engine.generate(PROMPTS[:4], 6)] == [r.output for r in expected]


def test_a_failed_step_with_graphs_rolls_back_and_continues_unchanged(monkeypatch):
    config = EngineConfig(max_kv_slots=4096, decode_graphs=None)  # every step on the prefill graphs' runner
    reference = GenerationEngine(config).generate(PROMPTS, 8)
    engine = GenerationEngine(config, runner_factory=graph_factory())
    rids = [engine.add_request(p, 8) for p in PROMPTS]
    engine.step()
    engine.step()
    before = (engine.blocks.available, [(r.rid, r.kv_tokens) for r in engine.running])
    real_forward = engine.runner.forward
    calls = {"n": 0}

    def fail_first(ids, meta, rows):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real_forward(ids, meta, rows)

    monkeypatch.setattr(engine.runner, "forward", fail_first)
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        engine.step()
    assert (engine.blocks.available, [(r.rid, r.kv_tokens) for r in engine.running]) == before
    while any(rid not in engine.results for rid in rids):
        engine.step()
    assert [engine.results[rid].output for rid in rids] == [r.output for r in reference]


def test_graph_replay_and_logits_record_no_autograd_history():
    engine = GenerationEngine(EngineConfig(max_kv_slots=4096), runner_factory=graph_factory((16, 64)))
    from torchhal.core.model import AttentionMetadata

    meta = AttentionMetadata.build([[1]], [3], [3], engine.config.kv_block_size, engine.device,
                                   engine.attention.backend)
    hidden = engine.runner.forward(torch.tensor([1, 2, 3], device=engine.device), meta)
    assert not hidden.requires_grad
    recorded = []
    real_logits = engine.model.logits

    def logits(h, index):
        out = real_logits(h, index)
        recorded.append(out.requires_grad)
        return out

    engine.model.logits = logits
    engine.generate(PROMPTS[:2], 3)
    assert recorded and not any(recorded)


def test_prefill_graphs_capture_with_compiled_layers_and_give_the_eager_engines_tokens():
    """EngineConfig.prefill_graphs on a GPU: real graphs, compiled layers, full-graph decode beside
    them; tokens equal the same engine without prefill graphs (fp32, so one kernel set each way)."""
    from torchhal.core.engine import DecodeGraphConfig, PrefillGraphConfig

    config = EngineConfig(model=ModelConfig(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                            intermediate_size=688), max_kv_slots=8192, compile_layers="inductor",
                          decode_graphs=DecodeGraphConfig(batch_buckets=(16,), context_buckets=(64,)))
    reference = GenerationEngine(config).generate(PROMPTS, 6)
    engine = GenerationEngine(replace(config, prefill_graphs=PrefillGraphConfig(token_buckets=(16, 128))))
    runner = engine.runner
    assert isinstance(runner, GraphRunner) and runner.report is not None and runner.report.graphs == 2 * 5
    assert [r.output for r in engine.generate(PROMPTS, 6)] == [r.output for r in reference]
    assert runner.bucketed_steps >= 1  # the 120-token prefill replayed the 128-token bucket
