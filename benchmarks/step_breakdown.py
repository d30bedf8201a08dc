"""Where a scheduler step's time goes: metadata, layer stack, logits+sampling.

    python benchmarks/step_breakdown.py [--out results]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _harness import write_json  # noqa: E402
from graph_runner import BUCKETS, SIZES, make_factory  # noqa: E402

from torchhal.core.engine import EngineConfig, GenerationEngine  # noqa: E402
from torchhal.core.model import AttentionMetadata  # noqa: E402


def breakdown(graphs: bool, batch: int = 8) -> dict:
    config = SIZES["h1024_l8"]
    engine = GenerationEngine(EngineConfig(model=config, dtype=torch.bfloat16, max_kv_slots=64 * 1024,
                                           kv_fraction=0.2), runner_factory=make_factory(BUCKETS) if graphs else None)
    sync = engine.platform.synchronize
    for i in range(batch):
        engine.add_request([(7 * i + j) % 1000 for j in range(16)], 200)
    for _ in range(5):
        engine.step()
    phases: dict[str, list[float]] = {"step": [], "metadata": [], "stack": [], "logits_sample": []}
    for _ in range(20):
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        phases["step"].append(time.perf_counter() - t0)
        seqs = [r.slots + [0] for r in engine.running]
        t1 = time.perf_counter()
        meta = AttentionMetadata.build(seqs, [1] * len(seqs), engine.device)
        sync()
        t2 = time.perf_counter()
        ids = torch.zeros(len(seqs), dtype=torch.long, device=engine.device)
        hidden = engine.runner.forward(ids, meta)
        sync()
        t3 = time.perf_counter()
        last = torch.arange(len(seqs), device=engine.device)
        with torch.no_grad():  # as in GenerationEngine.step
            engine.model.logits(hidden, last).argmax(-1).tolist()
        t4 = time.perf_counter()
        phases["metadata"].append(t2 - t1)
        phases["stack"].append(t3 - t2)
        phases["logits_sample"].append(t4 - t3)
    return {k: statistics.median(v) * 1e3 for k, v in phases.items()}


def profile_eager_decode(batch: int = 8, steps: int = 10) -> str:
    """Profiler table of eager decode steps (each step has a new context length)."""
    config = SIZES["h1024_l8"]
    engine = GenerationEngine(EngineConfig(model=config, dtype=torch.bfloat16, max_kv_slots=64 * 1024, kv_fraction=0.2))
    for i in range(batch):
        engine.add_request([(7 * i + j) % 1000 for j in range(16)], 200)
    for _ in range(5):
        engine.step()
    with torch.profiler.profile(activities=list(torch.profiler.supported_activities())) as prof:
        for _ in range(steps):
            engine.step()
        engine.platform.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    parser.add_argument("--profile", action="store_true", help="also print a profile of eager decode steps")
    args = parser.parse_args()
    if args.profile:
        print(profile_eager_decode())
    results = {"unit": "ms (median of 20 decode steps, batch 8)", "eager": breakdown(False), "graphs": breakdown(True)}
    write_json("step_breakdown", results, args.out)


if __name__ == "__main__":
    main()
