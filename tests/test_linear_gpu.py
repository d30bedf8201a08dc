"""The CUDA plugin's Triton GEMV on a real GPU (marker gpu; skipped without CUDA and Triton):
the linear conformance clause, the custom op inside torch.compile, and an engine whose one-row
projections run it, with graph and eager decode giving the same tokens."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine
from torchhal.core.model import ModelConfig

from .conftest import conformance_group_results

ready = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ready, reason="needs a CUDA GPU and Triton (none here)")]

MODEL = ModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=688)
PROMPTS = [[1 + i, 2, 3 + i] * (1 + i % 4) for i in range(6)]
NEW_TOKENS = [4 + (5 * i) % 11 for i in range(6)]


def run(engine: GenerationEngine) -> list[tuple[int, ...]]:
    rids = [engine.add_request(p, n) for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
    while any(rid not in engine.results for rid in rids):
        engine.step()
    return [engine.results.pop(rid).output for rid in rids]


def test_the_cuda_kernel_keeps_the_linear_clause(tmp_path):
    out, results = conformance_group_results(tmp_path, str(Path(__file__).parents[1]), "cuda", "linear")
    outcomes = {name: t["outcome"] for name, t in results.items()}
    assert out.returncode == 0 and set(outcomes.values()) == {"passed"}, out.stdout[-3000:]


def test_the_custom_op_compiles_as_one_call_with_the_eager_bits():
    from torchhal.plugins.cuda_linear import triton_gemv

    support = triton_gemv()
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(6144, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, b: F.silu(support.kernel(x, w, b)), fullgraph=True)
    assert torch.equal(compiled(x, w, b), F.silu(support.kernel(x, w, b)))
    torch._dynamo.reset()


def test_one_row_decode_runs_the_gemv_with_graph_and_eager_tokens_equal():
    settings = DecodeGraphConfig(batch_buckets=(1, 2, 4), context_buckets=(32, 64), steps_per_sync=8)
    config = EngineConfig(model=MODEL, max_kv_slots=8192, max_running=1, dtype=torch.bfloat16,
                          decode_graphs=settings, compile_layers="inductor")
    torch._dynamo.reset()
    engine = GenerationEngine(config)
    [event] = [e for e in engine.trace if e["kind"] == "linear_kernel"]
    assert event["kernel"] == "triton-gemv", event
    graphs = engine.decode_runner
    assert graphs is not None and graphs.graphs_enabled
    engine.executor.decode = None
    eager = run(engine)
    engine.executor.decode = graphs
    assert run(engine) == eager
    assert graphs.steps >= 10
    torch._dynamo.reset()
