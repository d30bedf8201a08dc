"""Graph runner on CPU: the eager path, segmenting, buckets and padding (emulated).

CPU declares no graphs, so capture/replay itself is tested on a CUDA GPU
(tests/test_gpu_engine.py, marker gpu). `emulate=True` runs the bucketed,
padded path on static buffers without graphs, which checks everything but replay.
"""

import warnings

import pytest
import torch
from torch import nn

import torchhal
from torchhal.core.engine import EngineConfig, GenerationEngine, PrefillGraphConfig
from torchhal.core.graphs import GraphRunner, resolve_layer_stack
from torchhal.core.graphs.program import BreakStep, GraphStep, split_segments
from torchhal.core.model import ModelConfig, ReferenceDecoder

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 10, [300, 3], [7] * 33, [2]]


def runner_factory(**kwargs):
    def make(engine):
        return GraphRunner(
            engine.model, engine.platform, engine.device_index,
            hidden_size=engine.model_config.hidden_size, dtype=engine.config.dtype, **kwargs,
        )

    return make


def test_split_segments_ends_a_segment_at_each_break():
    g = [GraphStep(f"g{i}", lambda s: None) for i in range(4)]
    b = [BreakStep(f"b{i}", lambda s, n, m: None) for i in range(2)]
    parts = split_segments([g[0], b[0], g[1], g[2], b[1], g[3]])
    assert [p if isinstance(p, BreakStep) else [s.name for s in p] for p in parts] == [
        ["g0"], b[0], ["g1", "g2"], b[1], ["g3"],
    ]


def test_reference_model_program_has_one_break_per_layer():
    model = ReferenceDecoder(ModelConfig(num_layers=3))
    parts = split_segments(model.layer_program())
    breaks = [p for p in parts if isinstance(p, BreakStep)]
    assert [b.name for b in breaks] == ["layer0.attention", "layer1.attention", "layer2.attention"]
    assert len(parts) - len(breaks) == 4  # graph segments: layers + 1


def test_cpu_runs_eager_with_the_same_api_and_outputs():
    engine = GenerationEngine(EngineConfig(max_kv_slots=1024), runner_factory=runner_factory())
    assert engine.runner.eager_reason == "platform 'cpu' declares no graph support"
    assert not engine.runner.graphs_enabled and not engine.runner.can_run(1)
    reference = GenerationEngine(EngineConfig(max_kv_slots=1024)).generate(PROMPTS, 5)
    assert [r.output for r in engine.generate(PROMPTS, 5)] == [r.output for r in reference]


def test_emulated_buckets_pad_and_match_eager_for_mixed_batches():
    reference = GenerationEngine(EngineConfig(max_kv_slots=1024)).generate(PROMPTS, 6)
    engine = GenerationEngine(
        EngineConfig(max_kv_slots=1024), runner_factory=runner_factory(buckets=(4, 16, 32), emulate=True)
    )
    runner = engine.runner
    assert runner.can_run(32) and not runner.can_run(33)  # the 33-token prompt runs eager
    assert [runner.bucket_for(n) for n in (1, 4, 5, 16, 17, 32)] == [4, 4, 16, 16, 32, 32]
    assert [r.output for r in engine.generate(PROMPTS, 6)] == [r.output for r in reference]


def test_copy_into_captured_copies_only_the_tensors_a_break_replaced():
    from torchhal.core.graphs import copy_into_captured

    captured = {"q": torch.zeros(4, 2), "attn_out": torch.zeros(4, 2), "kept": torch.zeros(4, 2)}
    kept = captured["kept"]
    live = dict(captured)
    kept.fill_(5)  # written in place: already where the graphs read it
    live["attn_out"] = torch.ones(3, 2)  # a new tensor of the step's 3 rows
    live["extra"] = torch.ones(1)  # no captured tensor: nothing to copy into
    copy_into_captured(captured, live)
    assert captured["attn_out"].tolist() == [[1, 1]] * 3 + [[0, 0]]  # the padded row untouched
    assert captured["kept"] is kept and captured["q"].eq(0).all() and "extra" not in captured


def test_a_prefill_without_padded_rows_takes_attentions_own_output():
    """The decoder hands `out` to the backend only where the step's rows are fewer than the
    state's (a bucket's padding) or for a decode; an eager prefill takes the tensor the backend
    returns, so a dense kernel's output is not copied into a buffer. Either way the hidden
    states equal the backend's."""
    from torchhal.attention import ReferenceBackend
    from torchhal.core.engine import EagerRunner
    from torchhal.core.model import AttentionMetadata

    class Recording(ReferenceBackend):
        def __init__(self) -> None:
            self.given_out: list[bool] = []

        def prefill(self, query, k_cache, v_cache, meta, *, out=None, **kwargs):
            self.given_out.append(out is not None)
            return super().prefill(query, k_cache, v_cache, meta, out=out, **kwargs)

    engine = GenerationEngine(EngineConfig(max_kv_slots=1024),
                              runner_factory=runner_factory(buckets=(32,), emulate=True))
    layers = engine.model_config.num_layers
    lengths = [3, 5, 9]
    tables = [[1], [2], [3]]
    ids = torch.tensor([7, 8, 9, 1, 2, 3, 4, 5] + [6] * 9)
    backend = Recording()
    meta = AttentionMetadata.build(tables, lengths, lengths, 16, engine.device, backend)
    eager = EagerRunner(engine.model).forward(ids, meta).clone()
    padded = engine.runner.forward(ids, meta).clone()  # 17 tokens in the bucket of 32
    assert backend.given_out == [False] * layers + [True] * layers
    torch.testing.assert_close(padded, eager)
    plain = AttentionMetadata.build(tables, lengths, lengths, 16, engine.device, engine.attention.backend)
    torch.testing.assert_close(EagerRunner(engine.model).forward(ids, plain), eager)


def test_resolver_explicit_guessed_and_unresolvable():
    explicit = resolve_layer_stack(ReferenceDecoder(ModelConfig()))
    assert explicit.how == "explicit layer_program()"

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(10, 8)
            self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    class HFStyle(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

    with pytest.warns(UserWarning, match="guessed the layer stack HFStyle.model.layers \\(2 layers\\)"):
        guessed = resolve_layer_stack(HFStyle())
    assert guessed.how == "guessed model.layers" and len(guessed.program()) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        resolve_layer_stack(HFStyle())
    reason = resolve_layer_stack(nn.Linear(2, 2))
    assert isinstance(reason, str) and "cannot find the layer stack of Linear" in reason


def test_unresolvable_model_runs_eager_and_says_why(make_registry):
    make_registry()

    class Plain(nn.Module):
        def forward(self, ids, meta):
            return ids.float()[:, None]

    runner = GraphRunner(Plain(), torchhal.current_platform(), 0, hidden_size=1, dtype=torch.float32)
    assert "cannot find the layer stack of Plain" in runner.eager_reason
    assert runner.forward(torch.tensor([1, 2]), None).tolist() == [[1.0], [2.0]]


def test_bad_buckets_are_rejected(make_registry):
    make_registry()
    with pytest.raises(ValueError, match="buckets = \\(0, 8\\)"):
        GraphRunner(ReferenceDecoder(ModelConfig()), torchhal.current_platform(), 0,
                    hidden_size=128, dtype=torch.float32, buckets=(0, 8))


# -- the engine's own setting: EngineConfig.prefill_graphs ------------------------------------------
def test_prefill_graphs_build_the_runner_record_it_and_run_fitting_steps_on_buckets():
    reference = GenerationEngine(EngineConfig(max_kv_slots=1024)).generate(PROMPTS, 6)
    engine = GenerationEngine(EngineConfig(max_kv_slots=1024, prefill_graphs=PrefillGraphConfig(
        token_buckets=(4, 16, 32), emulate=True)))
    runner = engine.runner
    assert isinstance(runner, GraphRunner) and runner.bucket_sizes == [4, 16, 32] and runner.graphs_enabled
    [event] = [e for e in engine.trace if e["kind"] == "prefill_graphs"]
    assert event["buckets"] == [4, 16, 32] and event["eager_reason"] is None
    sizes = []
    real_forward = runner.forward

    def forward(ids, meta, rows):
        sizes.append((ids.numel(), runner.bucketed_steps))
        return real_forward(ids, meta, rows)

    runner.forward = forward
    assert [r.output for r in engine.generate(PROMPTS, 6)] == [r.output for r in reference]
    # The first step prefills all 54 prompt tokens (past the largest bucket: eager); every later
    # step (6 decodes) fits the 16-token bucket and runs on it.
    assert sizes[0] == (54, 0) and all(n == 6 for n, _ in sizes[1:])
    assert runner.bucketed_steps == len(sizes) - 1 == 5


def test_prefill_graphs_without_graph_support_run_eagerly_and_say_why():
    engine = GenerationEngine(EngineConfig(max_kv_slots=1024, prefill_graphs=PrefillGraphConfig()))
    [event] = [e for e in engine.trace if e["kind"] == "prefill_graphs"]
    assert event["eager_reason"] == "platform 'cpu' declares no graph support"
    reference = GenerationEngine(EngineConfig(max_kv_slots=1024)).generate(PROMPTS[:3], 4)
    assert [r.output for r in engine.generate(PROMPTS[:3], 4)] == [r.output for r in reference]
    assert engine.runner.bucketed_steps == 0


def test_prefill_graphs_and_a_runner_factory_are_refused_together():
    with pytest.raises(ValueError, match="prefill_graphs and runner_factory both choose"):
        GenerationEngine(EngineConfig(max_kv_slots=1024, prefill_graphs=PrefillGraphConfig(emulate=True)),
                         runner_factory=runner_factory())


@pytest.mark.parametrize("buckets", [(), [16, 32], (0, 16), (16, True), (16, 2.0), "16"])
def test_bad_token_buckets_are_refused_with_an_example(buckets):
    with pytest.raises(ValueError, match=r"PrefillGraphConfig.token_buckets = .* e\.g\. \(16, 64, 256\)"):
        PrefillGraphConfig(token_buckets=buckets)


def test_prefill_graphs_must_be_a_prefill_graph_config():
    with pytest.raises(TypeError, match="prefill_graphs = .* must be a PrefillGraphConfig or None"):
        EngineConfig(prefill_graphs=(16, 32))  # type: ignore[arg-type]


def test_prefill_graphs_are_on_by_default_and_a_runner_factory_replaces_them():
    """The default config runs short prefills on graphs where the platform captures them (here:
    eagerly, said why); a runner_factory with the default config is the caller's runner, not a
    refusal, while explicit prefill settings beside a runner_factory still are."""
    assert EngineConfig().prefill_graphs == PrefillGraphConfig(token_buckets=(16, 32, 64, 128, 256))
    engine = GenerationEngine(EngineConfig(max_kv_slots=1024))
    assert isinstance(engine.runner, GraphRunner)
    [event] = [e for e in engine.trace if e["kind"] == "prefill_graphs"]
    assert event["eager_reason"] == "platform 'cpu' declares no graph support"
    made = []

    def factory(engine):
        made.append(runner_factory()(engine))
        return made[-1]

    custom = GenerationEngine(EngineConfig(max_kv_slots=1024), runner_factory=factory)
    assert custom.runner is made[0] and not any(e["kind"] == "prefill_graphs" for e in custom.trace)
