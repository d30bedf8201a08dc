"""Programmatic dependent launch on a real GPU (marker gpu; skipped without CUDA, Triton and
sm_90): the compile clause passes with the CUDA plugin's inductor options, and an engine with
compiled layers, the GEMV and decode graphs gives the same tokens with PDL as without
(`TORCHHAL_CUDA_PDL=0`, in another process: the switch is read once per process)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import conformance_group_results

ROOT = Path(__file__).parents[1]
ready = (torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
         and torch.cuda.get_device_capability()[0] >= 9)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ready, reason="needs an sm_90+ CUDA GPU and Triton")]

ENGINE_RUN = """
import json, torch
from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine
from torchhal.core.model import ModelConfig
model = ModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=688)
settings = DecodeGraphConfig(batch_buckets=(1, 2, 4), context_buckets=(32, 64), steps_per_sync=8)
engine = GenerationEngine(EngineConfig(model=model, max_kv_slots=8192, max_running=2, dtype=torch.bfloat16,
                                       decode_graphs=settings, compile_layers="inductor"))
prompts = [[1 + i, 2, 3 + i] * (1 + i % 4) for i in range(6)]
rids = [engine.add_request(p, 4 + (5 * i) % 11) for i, p in enumerate(prompts)]
while any(rid not in engine.results for rid in rids):
    engine.step()
[event] = [e for e in engine.trace if e["kind"] == "compile_options"]
print(json.dumps({"tokens": [list(engine.results[r].output) for r in rids], "options": event["options"],
                  "graph_steps": engine.decode_runner.steps}))
"""


def engine_run(pdl: bool) -> dict[str, object]:
    env = {**os.environ, "TORCHHAL_CUDA_PDL": "1" if pdl else "0"}
    out = subprocess.run([sys.executable, "-c", ENGINE_RUN], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_the_cuda_plugin_keeps_the_compile_clause(tmp_path):
    out, results = conformance_group_results(tmp_path, str(ROOT), "cuda", "compile")
    outcomes = {name: t["outcome"] for name, t in results.items()}
    assert out.returncode == 0 and set(outcomes.values()) == {"passed"}, out.stdout[-3000:]


def test_an_engine_gives_the_same_tokens_with_and_without_pdl():
    with_pdl, without = engine_run(True), engine_run(False)
    assert with_pdl["options"] == {"triton.enable_pdl": True}
    assert without["options"] is None
    assert with_pdl["tokens"] == without["tokens"]
    assert isinstance(with_pdl["graph_steps"], int) and with_pdl["graph_steps"] >= 10
