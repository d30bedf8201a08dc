"""Tiny benchmark harness: medians of repeated timings, JSON out.

Each figure is the median over `repeat` samples of the mean over `number`
calls, so per-call costs far below the timer resolution are still resolved.
"""

from __future__ import annotations

import json
import platform as host
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def per_call_ns(fn: Callable[[], Any], *, number: int = 10_000, repeat: int = 15) -> dict[str, float]:
    """Median / min / max nanoseconds per call of `fn`."""
    for _ in range(min(number, 1000)):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter_ns() - start) / number)
    return {"median_ns": statistics.median(samples), "min_ns": min(samples), "max_ns": max(samples),
            "calls_per_sample": number, "samples": repeat}


def _alternating(
    fn: Callable[[], Any], baseline: Callable[[], Any], number: int, pairs: int
) -> list[tuple[float, float]]:
    """(ns per call of `fn`, ns per call of `baseline`) for each pair, timed back to back so
    clock and host drift (which moves separate medians by hundreds of ns on a busy host)
    hits both sides alike."""
    for _ in range(min(number, 1000)):
        fn()
        baseline()
    timed = []
    for _ in range(pairs):
        pair = []
        for call in (fn, baseline):
            start = time.perf_counter_ns()
            for _ in range(number):
                call()
            pair.append((time.perf_counter_ns() - start) / number)
        timed.append((pair[0], pair[1]))
    return timed


def paired_overhead_ns(
    fn: Callable[[], Any], baseline: Callable[[], Any], *, number: int = 20_000, pairs: int = 31
) -> dict[str, float]:
    """Median over `pairs` of (ns per call of `fn`) - (ns per call of `baseline`)."""
    differences = [a - b for a, b in _alternating(fn, baseline, number, pairs)]
    return {"median_ns": statistics.median(differences), "min_ns": min(differences), "max_ns": max(differences),
            "calls_per_sample": number, "pairs": pairs}


def paired_ratio(
    fn: Callable[[], Any], baseline: Callable[[], Any], *, number: int = 2_000, pairs: int = 31
) -> dict[str, float]:
    """Median over `pairs` of (time per call of `fn`) / (time per call of `baseline`)."""
    ratios = [a / b for a, b in _alternating(fn, baseline, number, pairs)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "calls_per_sample": number, "pairs": pairs}


def median_run(fn: Callable[[], Any], warmups: int, reps: int, sync: Callable[[], None]) -> tuple[float, Any]:
    """Median seconds of `reps` calls of `fn` after `warmups` untimed ones (compiles, captures),
    each timed between device syncs; and the last call's result."""
    out = None
    for _ in range(warmups):
        out = fn()
    samples = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), out


def random_llama(shape: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int = 0) -> Any:
    """A seeded random-weight LlamaForCausalLM on `device` whose greedy choices are decisive
    (weights with spread, small embeddings). `shape`: LlamaConfig fields; max_position_embeddings
    defaults to 4096, rms_norm_eps to 1e-5."""
    import math

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, **shape},
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)  # type: ignore[arg-type]  # transformers types .to without self
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            noise = torch.randn(param.shape, generator=generator, device=device, dtype=torch.float32)
            scale = 0.1 if "embed_tokens" in name else 1 / math.sqrt(param.shape[1])
            param.copy_(noise * scale)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def engine_tokens(engine: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """`engine.generate`'s new tokens per prompt; a failed request raises (a benchmark must not
    time a failure)."""
    results = engine.generate(prompts, new_tokens)
    failed = [r.error for r in results if r.error]
    if failed:
        raise RuntimeError(f"torchhal generate failed: {failed[0]}")
    return [list(r.output) for r in results]


def environment() -> dict[str, Any]:
    clock = time.get_clock_info("perf_counter")
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "machine": host.machine(),
        "timer": "time.perf_counter_ns",
        "timer_resolution_ns": clock.resolution * 1e9,
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
    return env


def write_json(name: str, results: dict[str, Any], out_dir: str | None = None) -> Path:
    folder = Path(out_dir or "results")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "environment": environment(), "results": results}, indent=2))
    print(json.dumps(results, indent=2))
    print(f"wrote {path}")
    return path
