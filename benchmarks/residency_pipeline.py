"""Residency manager on a GPU: an empty after every use (the baseline) vs explicit release points,
and layerwise streaming against a resident stack.

    python benchmarks/residency_pipeline.py [--out results]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torch  # noqa: E402
from _harness import write_json  # noqa: E402
from diffusion_pipeline import default_placements, make_components, run_request  # noqa: E402

import torchhal  # noqa: E402
from torchhal.core.residency import ComponentUse, LayerwiseStrategy, ResidencyManager, Stage, Strategy  # noqa: E402

HIDDEN, LAYERS, STEPS, TOKENS = 2048, 16, 4, 4096
MiB = 1 << 20


def pipeline(platform, transformer: str, empty_every_use: bool, encoder_intensive: bool, requests: int = 6) -> dict:
    platform.empty_cache(torchhal.ReleasePoint.USER)
    manager = ResidencyManager(make_components(HIDDEN, LAYERS, torch.bfloat16),
                               default_placements(transformer, prefetch_layers=1),
                               empty_after_every_use=empty_every_use)
    tokens = torch.randn(TOKENS, HIDDEN, device=manager.device, dtype=torch.bfloat16)
    run_request(manager, tokens, STEPS, encoder_memory_intensive=encoder_intensive)  # warm up
    platform.synchronize()
    platform.reset_peak_memory()
    start_events = len(manager.trace.events)
    latencies = []
    for _ in range(requests):
        t0 = time.perf_counter()
        run_request(manager, tokens, STEPS, encoder_memory_intensive=encoder_intensive)
        platform.synchronize()
        latencies.append(time.perf_counter() - t0)
    empties = [e for e in manager.trace.events[start_events:] if e["kind"] == "empty_cache"]
    trace = manager.trace.last_request()
    manager.close()  # nothing of this row may stay on the device into the next row's peak
    return {
        "transformer": transformer,
        "empty_every_use": empty_every_use,
        "text_encoder_memory_intensive": encoder_intensive,
        "median_latency_ms": statistics.median(latencies) * 1e3,
        "peak_reserved_bytes": platform.peak_memory().reserved,
        "empties_per_request": len(empties) / requests,
        "every_use_empties": sum(e["where"] == "every_use" for e in empties),
        # the last request's timeline: where reserved memory rises and falls
        "last_request_trace": [[e["kind"], e["component"], e["reserved"] // MiB, e["used"] // MiB]
                               for e in trace],
    }


def layerwise_step(platform, prefetch_layers: int, tokens: int) -> dict:
    """One transformer forward, layerwise vs resident: time and peak memory of the stack."""
    results = {}
    for strategy in ("resident", "layerwise"):
        platform.empty_cache(torchhal.ReleasePoint.USER)
        components = {"transformer": make_components(HIDDEN, LAYERS, torch.bfloat16)["transformer"]}
        placement = LayerwiseStrategy(prefetch_layers) if strategy == "layerwise" else Strategy(strategy)
        manager = ResidencyManager(components, {"transformer": placement})
        x = torch.randn(tokens, HIDDEN, device=manager.device, dtype=torch.bfloat16)
        stage = [Stage("denoise", (ComponentUse("transformer", memory_intensive=True),))]
        layer_bytes = sum(p.numel() * p.element_size() for p in components["transformer"].layers[0].parameters())
        times = []
        with torch.no_grad():
            for i in range(6):
                platform.synchronize()
                base = platform.memory_info().allocated
                platform.reset_peak_memory()
                t0 = time.perf_counter()
                with manager.request(stage), manager.use_component("transformer") as model:
                    model(x)
                platform.synchronize()
                if i:
                    times.append(time.perf_counter() - t0)
                peak = platform.peak_memory().allocated - base
        manager.close()
        results[strategy] = {"median_ms": statistics.median(times) * 1e3, "peak_over_base_bytes": peak,
                             "layer_bytes": layer_bytes}
    lw, rs = results["layerwise"], results["resident"]
    lw["weights_bound_bytes"] = (2 * prefetch_layers + 1) * lw["layer_bytes"]
    lw["peak_minus_bound_bytes"] = lw["peak_over_base_bytes"] - lw["weights_bound_bytes"]
    return {"prefetch_layers": prefetch_layers, "tokens": tokens, **results,
            "layerwise_over_resident": lw["median_ms"] / rs["median_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    platform = torchhal.current_platform()
    results: dict = {"hidden": HIDDEN, "layers": LAYERS, "denoise_steps": STEPS, "tokens": TOKENS, "pipeline": []}
    for transformer in ("offload", "layerwise"):
        # (a) an empty after every use, then (b) release points with the example's declaration
        # and with the text encoder left undeclared (the earlier example; its cached block fragments).
        for every_use, encoder_intensive in ((True, True), (False, True), (False, False)):
            row = pipeline(platform, transformer, every_use, encoder_intensive)
            print(row, flush=True)
            results["pipeline"].append(row)
    results["layerwise"] = []
    for p, tokens in ((1, 4096), (1, 32768), (2, 32768)):
        row = layerwise_step(platform, p, tokens)
        print(row, flush=True)
        results["layerwise"].append(row)
    write_json("residency_pipeline", results, args.out)


if __name__ == "__main__":
    main()
