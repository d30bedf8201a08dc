"""The RL weight-update loop: pause in place, update weights, continue; 100 iterations,
with and without the continue-time empty_cache.

    python benchmarks/weight_update_loop.py [--out results] [--iterations 100]

Each iteration keeps one request in flight (KV kept across the in-place pause),
updates every weight (timed: validation, staging, the write and post-processing), and
runs post-update processing that allocates odd-size transient tensors, as
quantisation repacking does. Reports peak reserved vs live allocated, and
whether the in-flight request's tokens equal an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _harness import write_json  # noqa: E402

import torchhal  # noqa: E402
from torchhal.core.engine import EngineConfig, GenerationEngine  # noqa: E402
from torchhal.core.model import ModelConfig  # noqa: E402

MiB = 1 << 20
CONFIG = ModelConfig(vocab_size=32000, hidden_size=2048, num_layers=8, num_heads=16, intermediate_size=5504)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


def post_processing_transients(engine: GenerationEngine, iteration: int, growth_mib: int) -> None:
    """Odd-size scratch tensors that live only during post-processing."""
    device = engine.device
    scratch = []
    for k in range(4):
        size = (37 + 13 * k + growth_mib * iteration) * MiB + 4099 * (iteration + k)  # odd, a little larger each time
        scratch.append(torch.empty(size, dtype=torch.uint8, device=device))
    for tensor in scratch:
        tensor.fill_(1)
    engine.platform.synchronize(engine.device_index)


def counted(nbytes: int | None) -> int:
    """An allocator counter the GPU platform reports (None only where a platform cannot tell)."""
    assert nbytes is not None, "this benchmark needs a platform that reports its allocator's bytes"
    return nbytes


def run(iterations: int, empty_on_continue: bool, growth_mib: int) -> dict[str, Any]:
    platform = torchhal.current_platform()
    platform.empty_cache(torchhal.ReleasePoint.USER)
    engine = GenerationEngine(EngineConfig(model=CONFIG, dtype=torch.bfloat16, kv_fraction=0.02, max_kv_slots=1 << 16))
    host_weights = {name: t.detach().to("cpu") for name, t in engine.model.named_parameters()}
    reference = GenerationEngine(
        EngineConfig(model=CONFIG, dtype=torch.bfloat16, kv_fraction=0.02, max_kv_slots=1 << 16)
    ).generate([PROMPT], iterations + 8)[0].output
    device = engine.device_index
    # The reference engine is gone; its freed weights and KV pool must not sit in the
    # cache, or every peak below would include them (the loop starts at reserved ~ live).
    platform.empty_cache(torchhal.ReleasePoint.USER)
    platform.reset_peak_memory(device)
    rid = engine.add_request(PROMPT, iterations + 8)
    engine.step()
    reserved_trace: list[int] = []
    allocated_trace: list[int] = []
    update_seconds: list[float] = []
    for iteration in range(iterations):
        engine.step()
        engine.pause_generation("in_place")
        platform.synchronize(device)
        started = time.perf_counter()
        engine.update_weights_from_tensors(host_weights)  # same values: tokens must not change
        platform.synchronize(device)
        update_seconds.append(time.perf_counter() - started)  # validate, stage, write, process_weights
        post_processing_transients(engine, iteration, growth_mib)
        engine.continue_generation(empty_cache=empty_on_continue)
        mem = platform.memory_info(device)
        reserved_trace.append(counted(mem.reserved))
        allocated_trace.append(counted(mem.allocated))
    while rid not in engine.results:
        engine.step()
    tokens = engine.results[rid].output
    live = counted(platform.memory_info(device).allocated)
    peak_reserved = counted(platform.peak_memory(device).reserved)
    peak_allocated = counted(platform.peak_memory(device).allocated)
    del engine
    return {
        "empty_on_continue": empty_on_continue,
        "transient_growth_mib_per_iteration": growth_mib,
        "iterations": iterations,
        "live_allocated_bytes": live,
        "peak_reserved_bytes": peak_reserved,
        "peak_reserved_over_live": peak_reserved / live,
        "peak_allocated_bytes": peak_allocated,
        "peak_reserved_over_peak_allocated": peak_reserved / peak_allocated,
        "max_reserved_after_continue_over_live": max(reserved_trace) / live,
        "reserved_first_last": [reserved_trace[0], reserved_trace[-1]],
        "reserved_growth_bytes": reserved_trace[-1] - reserved_trace[0],
        "tokens_identical_to_uninterrupted": list(tokens) == list(reference),
        "weight_update_ms_median": statistics.median(update_seconds) * 1e3,
        "reserved_trace_mib": [r // MiB for r in reserved_trace],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--growth-mib", type=int, nargs="+", default=[1, 7],
                        help="MiB each of the 4 scratch tensors grows per iteration (1: ~15%% of live at the end, "
                             "like the issue's probe; 7: ~70%%)")
    args = parser.parse_args()
    results: dict[str, Any] = {"model": dataclasses.asdict(CONFIG), "runs": []}
    for growth, empty in [(g, e) for g in args.growth_mib for e in (False, True)]:
        row = run(args.iterations, empty, growth)
        print({k: v for k, v in row.items() if k != "reserved_trace_mib"}, flush=True)
        results["runs"].append(row)
    write_json("weight_update_loop", results, args.out)


if __name__ == "__main__":
    main()
