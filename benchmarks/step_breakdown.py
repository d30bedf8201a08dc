"""Where a scheduler step's time goes: metadata, layer stack, logits+sampling; and one decode
step before/after full-graph decode (breakable graphs vs one replay per step).

    python benchmarks/step_breakdown.py [--out results] [--profile]
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

from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine  # noqa: E402
from torchhal.core.model import AttentionMetadata  # noqa: E402

WINDOW = 8  # decode steps per token read-back in the windowed rows


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
        running = engine.running  # a decode step's metadata (rewriting each request's newest token)
        seqs = [r.blocks for r in running]
        t1 = time.perf_counter()
        meta = AttentionMetadata.build(seqs, [r.kv_tokens for r in running], [1] * len(seqs),
                                       engine.config.kv_block_size, engine.device, engine.attention.backend)
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


def decode_step(batch: int, steps: int = 20) -> dict:
    """Median ms of one scheduler decode step: breakable graphs vs full-graph decode, interleaved
    on the same engine and requests; for full-graph, also the host's share (block-table update)."""
    config = SIZES["h1024_l8"]
    graphs = DecodeGraphConfig(batch_buckets=(1, 2, 4, 8, 16, 32), context_buckets=(128, 256, 512),
                               steps_per_sync=WINDOW)
    engine = GenerationEngine(EngineConfig(model=config, dtype=torch.bfloat16, max_kv_slots=64 * 1024,
                                           kv_fraction=0.2, decode_graphs=graphs), runner_factory=make_factory(BUCKETS))
    decode = engine.decode_runner
    assert decode is not None
    sync = engine.platform.synchronize
    prepare_s: list[float] = []
    prepare = decode.rows.prepare

    def timed_prepare(*args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        rows = prepare(*args, **kwargs)
        prepare_s.append(time.perf_counter() - start)
        return rows

    decode.rows.prepare = timed_prepare  # type: ignore[method-assign]
    for i in range(batch):
        engine.add_request([(7 * i + j) % 1000 for j in range(16)], (2 + WINDOW) * steps + 10)
    for _ in range(5):
        engine.step()  # prefill, then decode warm-up
    samples: dict[str, list[float]] = {"breakable": [], "full_graph": [], "full_graph_window": []}
    modes = (("breakable", None, 1), ("full_graph", decode, 1), ("full_graph_window", decode, WINDOW))
    for _ in range(steps):
        for name, runner, window in modes:
            engine.drain()  # the previous mode's window lands before the runner changes
            engine.executor.decode = runner  # detached: the step runs on the breakable runner
            decode.steps_per_sync = window
            sync()
            start = time.perf_counter()
            engine.step()
            sync()
            samples[name].append((time.perf_counter() - start) / window)  # per decode step
    breakable, full, windowed = (statistics.median(samples[k]) * 1e3 for k, _, _ in modes)
    report = decode.report
    return {"breakable_step_ms": breakable, "full_graph_step_ms": full, "speedup": breakable / full,
            "full_graph_window_step_ms": windowed, "window": WINDOW,
            "full_graph_host_update_ms": statistics.median(prepare_s[-steps:]) * 1e3 if prepare_s else None,
            "decode_graphs": report.graphs if report else None, "capture_s": report.seconds if report else None,
            "pool_bytes": report.pool_bytes if report else None, "graphs_enabled": decode.graphs_enabled,
            "reason": decode.unsupported}


def profile_decode(full_graph: bool, batch: int = 8, steps: int = 10, window: int = 1) -> str:
    """Profiler table of engine steps through the breakable runner or full-graph decode
    (`window` decode steps per engine step and token read-back)."""
    config = SIZES["h1024_l8"]
    graphs = (DecodeGraphConfig(batch_buckets=(8,), context_buckets=(128, 256), steps_per_sync=window)
              if full_graph else None)
    engine = GenerationEngine(EngineConfig(model=config, dtype=torch.bfloat16, max_kv_slots=64 * 1024,
                                           kv_fraction=0.2, decode_graphs=graphs), runner_factory=make_factory(BUCKETS))
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
    parser.add_argument("--profile", action="store_true", help="also print profiles of decode steps")
    args = parser.parse_args()
    if args.profile:
        print(profile_eager_decode())
        for full_graph, window in ((False, 1), (True, 1), (True, WINDOW)):
            label = f"full-graph decode, {window} step(s) per read-back" if full_graph else "breakable graphs"
            print(f"10 engine steps, {label}, batch 8")
            print(profile_decode(full_graph, window=window))
    results = {"unit": "ms; eager/graphs: median of 20 decode steps at batch 8; decode_step: median of 20 "
                       "interleaved steps per batch (breakable graphs, full-graph decode, and full-graph "
                       f"windows of {WINDOW} steps per read-back divided by {WINDOW}; same engine)",
               "eager": breakdown(False), "graphs": breakdown(True),
               "decode_step": {f"batch{b}": decode_step(b) for b in (1, 8, 32)}}
    write_json("step_breakdown", results, args.out)


if __name__ == "__main__":
    main()
