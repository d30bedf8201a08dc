"""Kernel profile of the long-context benchmark's torchhal side, and the levers it names, timed before/after.

    python benchmarks/profile_long_context.py [--out DIR] [--levers NAME ...] [--skip-levers] [--skip-profile]
                                               [--idle] [--max-batch-tokens N] [--budget-before N] [--tiny]

The engine is the one `long_context.py` times (same checkpoint shape, seeded weights, prompts
and `engine_config`: full-graph decode, compiled layers, chunked prefill). torch.profiler
records every kernel (graph replays included) of:

- `decode_1x32`: batch-1 decode at a short context (prompt 32), 32 steps (four windows of 8);
- `decode_1x16000`, `decode_8x16000`: batch-1 and batch-8 decode at 16k context, 16 steps;
- `prefill_1x3968`, `prefill_8x3968`, `prefill_1x16000`, `prefill_32x32`: prefill alone (one new token).

A decode step's kernels are those of engine steps taken once every request of the cell is past
its prefill (no prefill shares them), divided by the decode steps they ran. Each scenario gets the top kernels by
device time (count, share) and the kernels grouped in classes (GEMM, attention, norm,
elementwise, copy, other) plus the launch gaps (the span from the first kernel's start to the
last kernel's end that no kernel covers). Each class carries the bytes or FLOPs the model says
it must move or do and the achieved fraction of 4.8 TB/s or of the measured bf16 matrix rate.

Levers (each timed before and after in this process, tokens compared; `--levers NAME ...`
picks them; the first two by default, the others were this file's earlier levers):

- `prefill_graphs`: the engine's breakable graphs for short prefills (`PrefillGraphConfig`, as
  `engine_config` sets it) against the eager runner, on 32x1, 32x8 and 32x32 prefill alone;
- `linear_kernel`: the platform's kernel for one-row projections (`linear_support`, the engine's
  choice) against F.linear everywhere, on the captured decode step and end to end at 32x1 and
  16000x1 (decode graphs re-captured for each side);
- `write_kv_kernel`: the CUDA backend's one-launch Triton `write_kv` (strided K/V) against the
  generic indexed copy (patched back in), on prefill alone (32x1, 32x8, 3968x8) and on the
  captured decode step (32x1, 16000x8; graphs re-captured for each);
- `whole_prompt_admission`: the scheduler cutting only a step's first prefill (a later prompt that
  does not fit waits a step and prefills whole) against cutting every waiting prompt to fill the
  step (the previous rule, `cut_to_fill`, patched in), on 3968x8 and 16000x8 prefill alone;
- `flash_prefill_runs`: whole prompts of equal length in one SDPA call (the backend now)
  against one call per prompt (the previous code, patched back in), on 32x32 and 8x3968 prefill;
- `gemv_eviction`: the platform GEMV's weights loaded evict-first (the kernel now) against plain
  loads (the previous kernel, patched back in), sides alternating over three rounds, decode graphs
  re-captured for each: the captured decode step and end to end at 32x1, 3968x1 and 16000x1;
- `step_overlap`: prefill alone of several steps (3968x8, 3968x32, 16000x8), alternating over
  three rounds: each step's tokens read before the next is planned and whole-prompt attention's
  output copied into the step's buffer (both patched back in), the tokens landing after the next
  step's launch, and that plus SDPA's own output (the engine now);
- `step_kv`: prefill alone (3968x1, 3968x8, 16000x1, 16000x8), alternating over three rounds:
  whole prompts' K/V read back out of the cache (the backend's `step_kv` declaration patched
  off, so the engine does not pass them) against the step's own K/V, read in place (the engine now);
- `residual_in_product`: every output projection left for the next norm's kernel to add
  (`LayerMath.into_residual` patched so) against the product adding itself to the residual
  where cuBLAS runs it (the engine now), alternating over three rounds, graphs re-captured for
  each: prefill alone at 3968x1, 3968x8 and 16000x1, end to end at 32x32 and 3968x8;
- `step_budget`: the scheduler's token budget a step at `--budget-before` (16384 by default,
  half a 16k prompt pair) against the engine's own `--max-batch-tokens`
  (32768 by default, as `long_context.py`'s), alternating over three rounds
  on one engine: prefill alone at 3968x8, 3968x32 and 16000x8 (two 16k prompts a step instead
  of one), end to end at 16000x8;
- `decode_splits`: the split-K paged decode kernel at batch 8 and 1 / 16k context, graph-replayed,
  per split count, then the engine's decode step (16000x8, 16000x1) with each batch's best count
  against the current rule.

`--idle` profiles each prefill scenario once more with Python stacks and charges the device's
idle time to what the host was running then (`host_during_idle`).

`--tiny` runs a tiny model on the CPU (no profile of device kernels: the script's plumbing only).
"""

from __future__ import annotations

import argparse
import bisect
import functools
import gc
import hashlib
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _harness import engine_tokens, median_run, write_json  # noqa: E402
from long_context import (  # noqa: E402
    CELLS,
    HBM_BYTES_PER_S,
    LLAMA31_8B,
    PROMPTS,
    TINY,
    engine_config,
    kv_bytes_per_token,
    prompts_for,
    save_model,
)

import torchhal  # noqa: E402
from torchhal.core.engine import GenerationEngine  # noqa: E402

try:  # only the GEMV lever's 'before' kernel needs Triton
    import triton
    import triton.language as tl

    from torchhal.plugins.cuda_pdl import wait_for_previous_kernels
except ImportError:
    _plain_gemv: Any = None
else:
    @triton.jit
    def _plain_gemv(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_ym, HAS_BIAS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
        wait_for_previous_kernels(USE_PDL)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row = tl.program_id(1).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
        x_ptrs = x_ptr + row * stride_xm + rk
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + rk < K
            w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)

#: (name, cell, decode steps; 0 = prefill alone)
SCENARIOS = (("decode_1x32", "32x1", 32), ("decode_1x16000", "16000x1", 16), ("decode_8x16000", "16000x8", 16),
             ("prefill_1x3968", "3968x1", 0), ("prefill_8x3968", "3968x8", 0), ("prefill_1x16000", "16000x1", 0),
             ("prefill_32x32", "32x32", 0))
TINY_SCENARIOS = (("decode_1x32", "32x1", 4), ("prefill_32x32", "32x32", 0))
#: Decode steps a lever profiles per cell: the decode scenarios' own counts.
DECODE_STEPS = {cell: steps for _, cell, steps in SCENARIOS if steps}
CLASSES = ("gemm", "attention", "norm", "elementwise", "copy", "other")
LEVERS = ("prefill_graphs", "linear_kernel", "write_kv_kernel", "whole_prompt_admission", "flash_prefill_runs",
          "decode_splits", "gemv_eviction", "step_overlap", "step_kv", "residual_in_product", "step_budget")


def kernel_class(name: str) -> str:
    """A kernel's class from its name (cuBLAS / CUTLASS, flash / Triton paged, inductor, aten)."""
    low = name.lower()
    if low.startswith("triton_"):  # inductor's fused kernels, named after what they fuse (a GEMV's input too)
        return "norm" if "rms" in low else "elementwise"
    if any(k in low for k in ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk", "cublas", "_mm_", "matmul")):
        return "gemm"
    if any(k in low for k in ("flash", "fmha", "attention", "merge_splits", "attn")):
        return "attention"
    if "rsqrt" in low or "rms" in low or "layer_norm" in low:
        return "norm"
    if any(k in low for k in ("copy", "index", "gather", "scatter", "memcpy", "memset", "cat", "put_", "write_kv")):
        return "copy"
    if any(k in low for k in ("elementwise", "triton_poi", "triton_per", "triton_red", "reduce", "argmax")):
        return "elementwise"
    return "other"


def trace_events(trace_path: Path) -> list[dict[str, Any]]:
    return list(json.loads(trace_path.read_text())["traceEvents"])


def kernels_of(events: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every kernel, memcpy and memset among trace events."""
    return [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]


def device_kernels(trace_path: Path) -> list[tuple[str, float, float]]:
    """`kernels_of` a chrome trace file."""
    return kernels_of(trace_events(trace_path))


def busy_and_span(kernels: list[tuple[str, float, float]]) -> tuple[float, float]:
    """(us some kernel runs, us from the first kernel's start to the last one's end)."""
    if not kernels:
        return 0.0, 0.0
    intervals = sorted((start, start + dur) for _, start, dur in kernels)
    busy, (cur_start, cur_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy, intervals[-1][1] - intervals[0][0]


def idle_intervals(kernels: list[tuple[str, float, float]], least_us: float) -> list[tuple[float, float]]:
    """The spans of at least `least_us` between the first kernel's start and the last one's end
    that no kernel covers (the device waiting for the host)."""
    intervals = sorted((start, start + dur) for _, start, dur in kernels)
    idle, reach = [], intervals[0][1] if intervals else 0.0
    for start, end in intervals[1:]:
        if start - reach >= least_us:
            idle.append((reach, start))
        reach = max(reach, end)
    return idle


CALL = "profiled_call"  # the annotation `profiled` wraps around the call and its synchronize


def call_edges(trace_path: Path) -> dict[str, float]:
    """How long the profiled call took (`CALL`'s annotation) and how much of it lies outside the
    kernels' span: host work before the first kernel starts, and after the last one ends."""
    events = trace_events(trace_path)
    calls = [e for e in events if e.get("name") == CALL and "dur" in e]
    kernels = kernels_of(events)
    if not calls or not kernels:
        return {}
    begin, end = float(calls[0]["ts"]), float(calls[0]["ts"]) + float(calls[0]["dur"])
    first, last = min(k[1] for k in kernels), max(k[1] + k[2] for k in kernels)
    return {"call_us": end - begin, "before_first_kernel_us": first - begin, "after_last_kernel_us": end - last}


def host_during_idle(trace_path: Path, least_us: float = 10.0, step_us: float = 2.0,
                     top: int = 20) -> dict[str, Any]:
    """What the host ran while the device idled: each idle span is sampled every `step_us` and
    each sample is charged to the innermost host event covering it (a Python frame, an aten op
    or a runtime call such as a synchronize), on the thread that launched the kernels. The time
    from the start of `CALL`'s annotation (when the trace has one) to the first kernel is
    charged the same way, apart (`before_first_kernel`): the device idles then too."""
    events = trace_events(trace_path)
    kernels = kernels_of(events)
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and "dur" in e]
    if not kernels or not launches:
        return {"idle_us": 0.0, "spans": 0, "host": []}
    thread = max({e["tid"] for e in launches}, key=lambda t: sum(1 for e in launches if e["tid"] == t))
    host = sorted(((float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e["name"])) for e in events
                  if e.get("cat") in ("python_function", "cpu_op", "cuda_runtime", "user_annotation")
                  and e.get("tid") == thread and "dur" in e and e.get("name") != CALL), key=lambda h: h[0])
    starts = [h[0] for h in host]

    def charge(spans: list[tuple[float, float]]) -> list[dict[str, Any]]:
        charged: dict[str, float] = defaultdict(float)
        for begin, end in spans:
            t = begin + step_us / 2
            while t < end:
                # The latest-starting event that covers t is the innermost (host events nest).
                i, name = bisect.bisect_right(starts, t) - 1, "(no host event)"
                for j in range(i, max(i - 5000, -1), -1):
                    if host[j][1] >= t:
                        name = host[j][2][:160]
                        break
                charged[name] += step_us
                t += step_us
        ranked = sorted(charged.items(), key=lambda kv: -kv[1])[:top]
        return [{"name": name, "us": us} for name, us in ranked]

    idle = idle_intervals(kernels, least_us)
    report: dict[str, Any] = {"idle_us": sum(e - b for b, e in idle), "spans": len(idle), "host": charge(idle)}
    calls = [float(e["ts"]) for e in events if e.get("name") == CALL and "dur" in e]
    if calls:
        lead = (calls[0], min(k[1] for k in kernels))
        report["before_first_kernel"] = {"us": lead[1] - lead[0], "host": charge([lead])}
    return report


def profiled(fn: Callable[[], Any], folder: Path, label: str, on_gpu: bool) -> dict[str, Any]:
    """Per-kernel totals (us, count), busy and span of one profiled call of `fn`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof, torch.profiler.record_function(CALL):
        fn()
        if on_gpu:
            torch.cuda.synchronize()
    path = folder / f"{label}.json"
    prof.export_chrome_trace(str(path))
    kernels = device_kernels(path)
    edges = call_edges(path)
    path.unlink()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, _, dur in kernels:
        totals[name][0] += dur
        totals[name][1] += 1
    busy, span = busy_and_span(kernels)
    return {"kernels": {k: tuple(v) for k, v in totals.items()}, "busy_us": busy, "span_us": span, **edges}


def idle_profile(fn: Callable[[], Any], folder: Path, label: str) -> dict[str, Any]:
    """`host_during_idle` of one call of `fn`, recorded with Python stacks (which slow the host:
    the shares say where the device waits, the microseconds are inflated)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof, \
            torch.profiler.record_function(CALL):
        fn()
        torch.cuda.synchronize()
    path = folder / f"{label}_idle.json"
    prof.export_chrome_trace(str(path))
    report = host_during_idle(path)
    path.unlink()
    return report


def pure_decode(engine: GenerationEngine, batch_prompts: list[list[int]], steps: int, folder: Path, label: str,
                on_gpu: bool, layers: int) -> dict[str, Any]:
    """Per decode step: the kernels of engine steps taken once every request is past its
    prefill (so no prefill shares them), divided by the decode steps they ran (paged attention
    launches / layers; each window runs up to `steps_per_sync` steps)."""
    rids = [engine.add_request(p, steps + 40) for p in batch_prompts]
    while engine.waiting or any(not r.output for r in engine.running):
        engine.step()
    engine.drain()
    calls = max(1, steps // 8)
    raw = profiled(lambda: [engine.step() for _ in range(calls)], folder, label, on_gpu)
    while not all(rid in engine.results for rid in rids):
        engine.step()
    tokens = [list(engine.results.pop(rid).output) for rid in rids]
    launches = sum(count for name, (_, count) in raw["kernels"].items() if "paged_attention" in name)
    ran = max(launches / layers, 1.0) if on_gpu else float(calls)
    return {"kernels": {k: (us / ran, count / ran) for k, (us, count) in raw["kernels"].items()},
            "busy_us": raw["busy_us"] / ran, "span_us": raw["span_us"] / ran, "steps": ran, "tokens": tokens}


def model_work(shape: dict[str, Any], prompt: int, batch: int, steps: int, element: int) -> dict[str, dict[str, float]]:
    """Bytes / FLOPs each class must move / do for one decode step (steps > 0) or one prefill."""
    hidden, layers, inter = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    q_heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim, vocab = hidden // q_heads, shape["vocab_size"]
    layer_params = hidden * (q_heads + 2 * kv_heads) * head_dim + q_heads * head_dim * hidden + 3 * hidden * inter
    weight_bytes = (layers * layer_params + hidden * vocab) * element
    tokens = batch if steps else batch * prompt
    logit_rows = batch  # the LM head runs on each request's last token
    # Past its K/V projection the last layer runs for those rows only (a decode step: every row).
    after_qkv = layer_params - hidden * (q_heads + 2 * kv_heads) * head_dim
    gemm_flops = 2 * (tokens * layers * layer_params - (tokens - logit_rows) * after_qkv + logit_rows * hidden * vocab)
    if steps:
        context = prompt + steps / 2  # mean over the profiled steps
        kv_bytes = batch * context * kv_bytes_per_token(shape, torch.bfloat16 if element == 2 else torch.float32)
        attention = {"bytes": kv_bytes, "flops": 4 * layers * q_heads * head_dim * batch * context}
    else:
        pairs = (layers - 1) * batch * prompt * (prompt + 1) / 2 + batch * prompt  # the last layer: its last rows
        attention = {"flops": 4 * q_heads * head_dim * pairs,
                     "bytes": tokens * layers * (2 * q_heads + 2 * kv_heads) * head_dim * element}
    # Norms read and write the hidden state twice a layer (and once at the end); elementwise:
    # rotary (q, k in and out), SwiGLU (gate, up in, product out), two residual adds (2 in, 1 out).
    norm_bytes = tokens * (2 * layers + 1) * hidden * 2 * element
    elementwise_bytes = tokens * layers * element * (2 * (q_heads + kv_heads) * head_dim + 3 * inter + 6 * hidden)
    # Copies: the K/V written into the cache, and (prefill) read back out for the dense kernel.
    copy_bytes = tokens * layers * 2 * kv_heads * head_dim * element * (2 if steps else 4)
    return {"gemm": {"bytes": weight_bytes, "flops": gemm_flops}, "attention": attention,
            "norm": {"bytes": norm_bytes}, "elementwise": {"bytes": elementwise_bytes}, "copy": {"bytes": copy_bytes}}


def summarize(raw: dict[str, Any], work: dict[str, dict[str, float]], matrix_flops: float | None,
              top: int = 15) -> dict[str, Any]:
    """Top kernels and class totals with achieved bandwidth / matrix-rate fractions."""
    total = sum(us for us, _ in raw["kernels"].values()) or 1.0
    ranked = sorted(raw["kernels"].items(), key=lambda kv: -kv[1][0])
    classes: dict[str, dict[str, Any]] = {c: {"us": 0.0, "kernels": 0.0} for c in CLASSES}
    for name, (us, count) in raw["kernels"].items():
        row = classes[kernel_class(name)]
        row["us"] += us
        row["kernels"] += count
    for name, row in classes.items():
        row["share"] = row["us"] / total
        need = work.get(name, {})
        seconds = row["us"] / 1e6
        if seconds > 0 and "bytes" in need:
            row["bytes"] = need["bytes"]
            row["hbm_fraction"] = need["bytes"] / seconds / HBM_BYTES_PER_S
        if seconds > 0 and "flops" in need:
            row["flops"] = need["flops"]
            row["tflop_s"] = need["flops"] / seconds / 1e12
            if matrix_flops:
                row["matrix_rate_fraction"] = need["flops"] / seconds / matrix_flops
    gaps = max(raw["span_us"] - raw["busy_us"], 0.0)
    edges: dict[str, Any] = {key: raw[key] for key in ("call_us", "before_first_kernel_us", "after_last_kernel_us",
                                       "unprofiled_call_us") if key in raw}
    return {
        "device_us": total, "busy_us": raw["busy_us"], "span_us": raw["span_us"], **edges,
        "launch_gaps_us": gaps, "launch_gap_share_of_span": gaps / raw["span_us"] if raw["span_us"] else 0.0,
        "classes": classes,
        "top_kernels": [{"name": name[:160], "us": us, "count": count, "share": us / total,
                         "class": kernel_class(name)} for name, (us, count) in ranked[:top]],
    }


# -- the levers ---------------------------------------------------------------------------------------
def per_prompt_flash(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, run: tuple[int, int, int],
                     scale: float) -> torch.Tensor:
    """The backend's whole-prompt path before runs: one SDPA call per prompt of the run (the
    'before'); `keys`/`values` are the run's rows, as the backend hands them to `_flash_prefill`."""
    import torch.nn.functional as F

    first, count, length = run
    out = query.new_empty((count * length, *query.shape[1:]))
    for prompt in range(count):
        rows = slice(prompt * length, (prompt + 1) * length)
        q = query[first + prompt * length : first + (prompt + 1) * length].transpose(0, 1)[None]
        k = keys[rows].transpose(0, 1)[None]
        v = values[rows].transpose(0, 1)[None]
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        out[rows] = attended[0].transpose(0, 1)
    return out


def flash_prefill_lever(generate: Callable[[list[list[int]], int], list[list[int]]],
                        prompts: dict[str, list[list[int]]], sync: Callable[[], None]) -> dict[str, Any]:
    from torchhal.plugins import cuda_attention

    backend_class = cuda_attention.TritonPagedAttention
    runs = backend_class.__dict__["_flash_prefill"]  # the staticmethod itself
    rows: dict[str, Any] = {}
    for cell in ("32x32", "3968x8"):
        batch_prompts = prompts[cell]
        row: dict[str, Any] = {}
        for label, impl in (("before_per_prompt", staticmethod(per_prompt_flash)), ("after_runs", runs)):
            backend_class._flash_prefill = impl  # type: ignore[method-assign]
            try:
                seconds, _ = median_run(functools.partial(generate, batch_prompts, 1), 1, 5, sync)
                row[label] = {"prefill_s": seconds, "tokens": generate(batch_prompts, 8)}
            finally:
                backend_class._flash_prefill = runs  # type: ignore[method-assign]
        row["tokens_equal"] = row["before_per_prompt"].pop("tokens") == row["after_runs"].pop("tokens")
        row["speedup"] = row["before_per_prompt"]["prefill_s"] / row["after_runs"]["prefill_s"]
        rows[cell] = row
        print(f"  lever flash runs {cell}: {row}", flush=True)
    return rows


def split_kernel_sweep(device: torch.device, shape: dict[str, Any], batch: int, context: int,
                       capacity: int) -> dict[str, Any]:
    """The paged decode kernel at one (batch, context), graph-replayed, per split count."""
    import triton.testing

    from torchhal.attention import build_metadata
    from torchhal.plugins import cuda_attention

    q_heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim, block = shape["hidden_size"] // q_heads, 16
    per_row = -(-context // block)
    torch.manual_seed(0)
    tables = (torch.randperm(batch * per_row, device=device) + 1).view(batch, per_row).tolist()
    cache_shape = (batch * per_row + 1, block, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device=device)
    meta = build_metadata(tables, [context] * batch, [1] * batch, block, device, max_blocks=capacity // block)
    query = torch.randn(batch, q_heads, head_dim, dtype=torch.bfloat16, device=device)
    backend = cuda_attention.TritonPagedAttention()
    scale = head_dim**-0.5
    current = cuda_attention.decode_splits(batch, kv_heads, capacity, cuda_attention._multiprocessors(0))
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
    reference = None
    rows = []
    for splits in sorted({1, 2, 4, current, 8, 11, 16, 22, 32, 48, 64, 96, 128}):
        out = torch.empty_like(query)

        def call(s: int = splits, o: torch.Tensor = out) -> None:
            backend._launch(query, k_cache, v_cache, meta, 1, s, scale, None, None, o)

        call()
        if reference is None:
            reference = out.float().clone()
        error = float((out.float() - reference).abs().max())
        ms = float(triton.testing.do_bench_cudagraph(call, rep=200, return_mode="median"))
        rows.append({"splits": splits, "ms": ms, "hbm_fraction": kv_bytes / (ms / 1e3) / HBM_BYTES_PER_S,
                     "max_abs_diff_vs_1_split": error})
    best = min(rows, key=lambda r: r["ms"])
    return {"batch": batch, "context": context, "capacity": capacity, "current_rule_splits": current,
            "kv_bytes_per_layer": kv_bytes, "rows": rows, "best": best}


def decode_splits_lever(engine: GenerationEngine, generate: Callable[[list[list[int]], int], list[list[int]]],
                        prompts: dict[str, list[list[int]]], shape: dict[str, Any],
                        sync: Callable[[], None]) -> dict[str, Any]:
    """The split-K decode kernel swept per split count at batch 8 and 1 (16k context) and batch 1
    at a short one; then the engine's captured decode step at 16000x1 and 16000x8, the rule's
    split count against the kernel sweep's best for that batch (graphs re-captured for each)."""
    from torchhal.plugins import cuda_attention

    device = engine.device
    result: dict[str, Any] = {"kernel": [split_kernel_sweep(device, shape, b, c, cap)
                                         for b, c, cap in ((8, 16016, 16384), (1, 16016, 16384), (1, 160, 256))]}
    for sweep in result["kernel"]:
        print(f"  lever splits kernel b{sweep['batch']} ctx{sweep['context']}: current {sweep['current_rule_splits']}"
              f" best {sweep['best']}", flush=True)
    layers, rule = shape["num_hidden_layers"], cuda_attention.decode_splits
    folder = Path(tempfile.mkdtemp())

    def engine_step(cell: str, label: str) -> dict[str, Any]:
        assert engine.decode_runner is not None
        engine.decode_runner.capture()  # the split count is baked into the captured graphs
        raw = pure_decode(engine, prompts[cell], 16, folder, label, True, layers)
        row = {"device_ms": raw["busy_us"] / 1e3, "span_ms": raw["span_us"] / 1e3, "steps": raw["steps"],
               "attention_ms": sum(us for name, (us, _) in raw["kernels"].items()
                                   if kernel_class(name) == "attention") / 1e3, "tokens": raw["tokens"]}
        print(f"  lever splits engine {cell} {label}: {row['span_ms']:.2f} ms a step, attention "
              f"{row['attention_ms']:.2f} ms", flush=True)
        return row

    result["engine"] = {}
    for cell, sweep in (("16000x8", result["kernel"][0]), ("16000x1", result["kernel"][1])):
        best, batch = sweep["best"]["splits"], sweep["batch"]
        before = engine_step(cell, "current rule")
        try:
            cuda_attention.decode_splits = lambda b, *rest, n=best, at=batch: n if b == at else rule(b, *rest)
            after = engine_step(cell, f"{best} splits at batch {batch}")
        finally:
            cuda_attention.decode_splits = rule
            engine.decode_runner.capture()  # type: ignore[union-attr]
        result["engine"][cell] = {"best_splits": best, "before": before, "after": after,
                                  "tokens_equal": before["tokens"] == after["tokens"]}
    return result


def gemv_eviction_lever(engine: GenerationEngine, generate: Callable[[list[list[int]], int], list[list[int]]],
                        prompts: dict[str, list[list[int]]], sync: Callable[[], None],
                        rounds: int = 3) -> dict[str, Any]:
    """The GEMV with plain weight loads against evict-first ones, alternating, graphs re-captured."""
    from torchhal.plugins import cuda_linear  # imports Triton: _plain_gemv is defined too

    kernels = {"before_plain_loads": _plain_gemv, "after_evict_first": cuda_linear._gemv_kernel}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {label: {} for label in kernels}
    assert engine.decode_runner is not None
    try:
        for _ in range(rounds):
            for label, kernel in kernels.items():
                cuda_linear._gemv_kernel = kernel
                engine.decode_runner.capture()  # the GEMVs are captured inside the decode graphs
                for cell in ran(("32x1", "3968x1", "16000x1"), prompts):
                    new = PROMPTS[len(prompts[cell][0])]
                    e2e_s, tokens = median_run(functools.partial(generate, prompts[cell], new), 1, 3, sync)
                    prefill_s, _ = median_run(functools.partial(generate, prompts[cell], 1), 1, 3, sync)
                    runs[label].setdefault(cell, []).append({
                        "e2e_s": e2e_s, "prefill_s": prefill_s, "tokens": tokens,
                        "decode_step_ms": (e2e_s - prefill_s) / (new - 1) * 1e3})
    finally:
        cuda_linear._gemv_kernel = kernels["after_evict_first"]
        engine.decode_runner.capture()
    result: dict[str, Any] = {}
    for cell in runs["after_evict_first"]:
        before, after = runs["before_plain_loads"][cell], runs["after_evict_first"][cell]
        row: dict[str, Any] = {label: {key: [run[key] for run in side] for key in ("decode_step_ms", "e2e_s")}
                               for label, side in (("before_plain_loads", before), ("after_evict_first", after))}
        row["decode_step_ms_median"] = {"before": statistics.median(row["before_plain_loads"]["decode_step_ms"]),
                                        "after": statistics.median(row["after_evict_first"]["decode_step_ms"])}
        row["tokens_equal"] = all(run["tokens"] == before[0]["tokens"] for run in before + after)
        result[cell] = row
    print(f"  lever GEMV eviction: {result}", flush=True)
    return result


def step_overlap_lever(engine: GenerationEngine, generate: Callable[[list[list[int]], int], list[list[int]]],
                       prompts: dict[str, list[list[int]]], sync: Callable[[], None],
                       rounds: int = 3) -> dict[str, Any]:
    """Prefill alone (one new token) of several steps, three settings alternating over `rounds`:
    `before` reads each step's tokens before the next step is planned (landing patched off)
    and copies whole-prompt attention's output into the step's buffer (an `out` handed to the
    backend, as before); `landing` lands the tokens after the next step's launch; `after`
    also takes SDPA's own output (the engine now)."""
    from torchhal.plugins import cuda_attention

    backend_class = cuda_attention.TritonPagedAttention
    real_prefill = backend_class.prefill

    def copying_prefill(self: Any, query: torch.Tensor, *args: Any, out: torch.Tensor | None = None,
                        **kwargs: Any) -> torch.Tensor:
        return real_prefill(self, query, *args, out=torch.empty_like(query) if out is None else out, **kwargs)

    settings = {"before": (False, True), "landing": (True, True), "after": (True, False)}  # lands later, copies
    runs: dict[str, dict[str, list[float]]] = {label: {} for label in settings}
    tokens: dict[str, list[Any]] = {}
    try:
        for _ in range(rounds):
            for label, (lands_later, copies) in settings.items():
                if lands_later:
                    engine.executor.__dict__.pop("_lands_later", None)
                else:
                    engine.executor._lands_later = lambda batch, counts: False  # type: ignore[method-assign]
                backend_class.prefill = copying_prefill if copies else real_prefill  # type: ignore[method-assign]
                for cell in ran(("3968x8", "3968x32", "16000x8"), prompts):
                    seconds, out = median_run(functools.partial(generate, prompts[cell], 1), 1, 3, sync)
                    runs[label].setdefault(cell, []).append(seconds)
                    tokens.setdefault(cell, []).append(out)
    finally:
        engine.__dict__.pop("_lands_later", None)
        backend_class.prefill = real_prefill  # type: ignore[method-assign]
    result: dict[str, Any] = {}
    for cell, seen in tokens.items():
        medians = {label: statistics.median(runs[label][cell]) for label in settings}
        result[cell] = {"prefill_s": {label: runs[label][cell] for label in settings}, "median_s": medians,
                        "after_over_before": medians["after"] / medians["before"],
                        "landing_over_before": medians["landing"] / medians["before"],
                        "tokens_equal": all(t == seen[0] for t in seen)}
    print(f"  lever step overlap: {result}", flush=True)
    return result


def step_kv_lever(generate: Callable[[list[list[int]], int], list[list[int]]], prompts: dict[str, list[list[int]]],
                  sync: Callable[[], None], rounds: int = 3) -> dict[str, Any]:
    """Prefill alone (one new token), two settings alternating over `rounds`: `before` has
    the CUDA backend's `step_kv` declaration patched off (the engine then passes no K/V and
    whole prompts' K/V are gathered out of the cache), `after` is the engine now."""
    from dataclasses import replace

    from torchhal.plugins import cuda_attention

    backend_class = cuda_attention.TritonPagedAttention
    declared = backend_class.capability
    settings = {"before": replace(declared, step_kv=False), "after": declared}
    runs: dict[str, dict[str, list[float]]] = {label: {} for label in settings}
    tokens: dict[str, list[Any]] = {}
    try:
        for _ in range(rounds):
            for label, capability in settings.items():
                backend_class.capability = capability  # the decoder reads it at every call
                for cell in ran(("3968x1", "3968x8", "16000x1", "16000x8"), prompts):
                    seconds, out = median_run(functools.partial(generate, prompts[cell], 1), 1, 3, sync)
                    runs[label].setdefault(cell, []).append(seconds)
                    tokens.setdefault(cell, []).append(out)
    finally:
        backend_class.capability = declared
    result: dict[str, Any] = {}
    for cell, seen in tokens.items():
        medians = {label: statistics.median(runs[label][cell]) for label in settings}
        result[cell] = {"prefill_s": {label: runs[label][cell] for label in settings}, "median_s": medians,
                        "after_over_before": medians["after"] / medians["before"],
                        "tokens_equal": all(t == seen[0] for t in seen)}
    print(f"  lever step K/V: {result}", flush=True)
    return result


def residual_in_product_lever(engine: GenerationEngine,
                              generate: Callable[[list[list[int]], int], list[list[int]]],
                              prompts: dict[str, list[list[int]]], sync: Callable[[], None],
                              rounds: int = 3) -> dict[str, Any]:
    """Two settings alternating over `rounds`: `before` leaves every output projection pending
    for the next norm's kernel to add (`LayerMath.into_residual` patched to do so), `after` is
    the engine now (the product adds itself to the residual where cuBLAS runs it). Prefill
    alone at 3968x1, 3968x8 and 16000x1; end to end at 32x32 and 3968x8, for their decode
    steps (batch 32 and 8 run cuBLAS), the decode graphs re-captured for each setting (the
    short prefill graphs are not: 32x32 prefills with the engine's kernels on both sides)."""
    layer_math: Any = engine.model.layer_math  # type: ignore[attr-defined]

    def pending_always(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
        return layer_math.linear(x, weight, bias)

    def recapture() -> None:
        if engine.decode_runner is not None:
            engine.decode_runner.capture()

    def apply(label: str) -> None:
        if label == "before":
            layer_math.into_residual = pending_always
        else:
            layer_math.__dict__.pop("into_residual", None)
        recapture()

    try:
        result = alternating(apply, generate, prompts, sync, rounds, prefill=("3968x1", "3968x8", "16000x1"),
                             end_to_end=("32x32", "3968x8"))
    finally:
        layer_math.__dict__.pop("into_residual", None)
        recapture()
    print(f"  lever residual in product: {result}", flush=True)
    return result


def step_budget_lever(engine: GenerationEngine,
                      generate: Callable[[list[list[int]], int], list[list[int]]],
                      prompts: dict[str, list[list[int]]], sync: Callable[[], None], before: int,
                      rounds: int = 3) -> dict[str, Any]:
    """Two step budgets alternating over `rounds` on one engine: `before` tokens a step against
    the budget the engine was built with (lowering the scheduler's budget is safe: the engine
    sizes nothing else by it above the prefill graphs' buckets)."""
    scheduler = engine.scheduler
    built = scheduler.max_batch_tokens
    if before > built:
        raise ValueError(f"--budget-before {before} exceeds the engine's --max-batch-tokens {built}: the engine's "
                         "buffers are sized by the larger; build it with the larger budget")
    budgets = {"before": before, "after": built}

    def apply(label: str) -> None:
        scheduler.max_batch_tokens = budgets[label]

    try:
        result = alternating(apply, generate, prompts, sync, rounds, prefill=("3968x8", "3968x32", "16000x8"),
                             end_to_end=("16000x8",))
    finally:
        scheduler.max_batch_tokens = built
    result = {"budgets": budgets, **result}
    print(f"  lever step budget: {result}", flush=True)
    return result


def alternating(apply: Callable[[str], None], generate: Callable[[list[list[int]], int], list[list[int]]],
                prompts: dict[str, list[list[int]]], sync: Callable[[], None], rounds: int,
                prefill: tuple[str, ...], end_to_end: tuple[str, ...]) -> dict[str, Any]:
    """`before` and `after` alternating over `rounds` (`apply(label)` sets one up): prefill alone
    of the `prefill` cells and whole runs of the `end_to_end` ones, median of 3 each; per cell,
    every round's seconds, the medians, after / before and whether the tokens agree."""
    settings = ("before", "after")
    runs: dict[str, dict[str, list[float]]] = {label: {} for label in settings}
    tokens: dict[str, list[Any]] = {}
    for _ in range(rounds):
        for label in settings:
            apply(label)
            for kind, cells in (("prefill", prefill), ("e2e", end_to_end)):
                for cell in ran(cells, prompts):
                    new = 1 if kind == "prefill" else PROMPTS[len(prompts[cell][0])]
                    seconds, out = median_run(functools.partial(generate, prompts[cell], new), 1, 3, sync)
                    runs[label].setdefault(f"{cell} {kind}", []).append(seconds)
                    tokens.setdefault(f"{cell} {kind}", []).append(out)
    result: dict[str, Any] = {}
    for key, seen in tokens.items():
        medians = {label: statistics.median(runs[label][key]) for label in settings}
        result[key] = {"s": {label: runs[label][key] for label in settings}, "median_s": medians,
                       "after_over_before": medians["after"] / medians["before"],
                       # bf16: the two settings may round the sums differently, so tokens may differ between them
                       "tokens_equal_within_each_setting": all(t == seen[first] for first in (0, 1)
                                                               for t in seen[first::2]),
                       "tokens_equal_across_settings": seen[0] == seen[1]}
    return result


def ran(cells: tuple[str, ...], prompts: dict[str, list[list[int]]]) -> list[str]:
    """The cells a lever names that this run has prompts for (`--tiny` keeps the short ones)."""
    return [cell for cell in cells if cell in prompts]


def prefill_medians(generate: Callable[[list[list[int]], int], list[list[int]]], prompts: dict[str, list[list[int]]],
                    cells: tuple[str, ...], sync: Callable[[], None]) -> dict[str, Any]:
    """Prefill alone (median of 5 after a warm-up) and the first 8 tokens, per cell (those of
    `cells` that `prompts` holds: `--tiny` keeps the short ones)."""
    rows: dict[str, Any] = {}
    for cell in ran(cells, prompts):
        seconds, _ = median_run(functools.partial(generate, prompts[cell], 1), 1, 5, sync)
        rows[cell] = {"prefill_s": seconds, "tokens": generate(prompts[cell], 8)}
    return rows


def compare(before: dict[str, Any], after: dict[str, Any], key: str) -> dict[str, Any]:
    """Per cell: both rows, before / after of `key`, and whether the tokens are equal."""
    return {cell: {"before": before[cell], "after": after[cell], "speedup": before[cell][key] / after[cell][key],
                   "tokens_equal": before[cell].get("tokens") == after[cell].get("tokens")} for cell in before}


def write_kv_lever(engine: GenerationEngine, generate: Callable[[list[list[int]], int], list[list[int]]],
                   prompts: dict[str, list[list[int]]], shape: dict[str, Any],
                   sync: Callable[[], None]) -> dict[str, Any]:
    from torchhal.attention import PagedWriter
    from torchhal.plugins import cuda_attention

    backend_class = cuda_attention.TritonPagedAttention
    kernel_write = backend_class.write_kv
    folder = Path(tempfile.mkdtemp())
    sides: dict[str, Any] = {}
    writes: tuple[tuple[str, Callable[..., None]], ...] = (("before_index_copy", PagedWriter.write_kv),
                                                           ("after_triton", kernel_write))
    for label, write in writes:
        backend_class.write_kv = write  # type: ignore[method-assign]
        try:
            assert engine.decode_runner is not None
            engine.decode_runner.capture()  # the write is captured inside the decode graphs
            prefill = prefill_medians(generate, prompts, ("32x1", "32x8", "3968x8"), sync)
            decode = {}
            for cell in ran(("32x1", "16000x8"), prompts):
                raw = pure_decode(engine, prompts[cell], DECODE_STEPS[cell], folder, f"{label}_{cell}", True,
                                  shape["num_hidden_layers"])
                decode[cell] = {"span_ms": raw["span_us"] / 1e3, "device_ms": raw["busy_us"] / 1e3,
                                "kernels": sum(count for _, count in raw["kernels"].values()), "tokens": raw["tokens"]}
            sides[label] = {"prefill": prefill, "decode": decode}
        finally:
            backend_class.write_kv = kernel_write  # type: ignore[method-assign]
    engine.decode_runner.capture()  # type: ignore[union-attr]
    before, after = sides["before_index_copy"], sides["after_triton"]
    result = {"prefill": compare(before["prefill"], after["prefill"], "prefill_s"),
              "decode_step": compare(before["decode"], after["decode"], "span_ms")}
    print(f"  lever write_kv: {result}", flush=True)
    return result


def cut_to_fill(self: Any, budget: int, may_cut: bool) -> tuple[list[Any], list[int]]:
    """The scheduler's previous admission (the 'before'): every waiting prompt cut to fill the step."""
    book, admitted, chunks = self.book, [], []
    while book.waiting and len(book.running) < self.max_running and budget > 0:
        chunk = min(len(book.waiting[0].tokens), budget)
        request = book.admit_next(chunk)
        if request is None:
            break
        admitted.append(request)
        chunks.append(chunk)
        budget -= chunk
    return admitted, chunks


def whole_prompt_lever(generate: Callable[[list[list[int]], int], list[list[int]]],
                       prompts: dict[str, list[list[int]]], sync: Callable[[], None]) -> dict[str, Any]:
    from torchhal.core.engine.scheduler import Scheduler

    rule = Scheduler._admit
    sides = {}
    for label, admit in (("before_cut_to_fill", cut_to_fill), ("after_whole_prompts", rule)):
        Scheduler._admit = admit  # type: ignore[method-assign]
        try:
            sides[label] = prefill_medians(generate, prompts, ("3968x8", "16000x8"), sync)
        finally:
            Scheduler._admit = rule  # type: ignore[method-assign]
    result = compare(sides["before_cut_to_fill"], sides["after_whole_prompts"], "prefill_s")
    print(f"  lever whole prompts: {result}", flush=True)
    return result


def linear_kernel_lever(engine: GenerationEngine, generate: Callable[[list[list[int]], int], list[list[int]]],
                        prompts: dict[str, list[list[int]]], shape: dict[str, Any],
                        sync: Callable[[], None]) -> dict[str, Any]:
    """F.linear everywhere against the platform's linear kernel for one-row projections (the
    engine's choice); the decode graphs are re-captured for each side."""
    support = engine.platform.linear_support
    model: Any = engine.model
    if support is None:
        return {"skipped": "the platform supplies no linear kernel"}
    folder = Path(tempfile.mkdtemp())
    sides: dict[str, Any] = {}
    try:
        for label, choice in (("before_f_linear", None), ("after_platform_kernel", support)):
            model.use_linear(choice)
            assert engine.decode_runner is not None
            engine.decode_runner.capture()  # the projections are captured inside the decode graphs
            rows: dict[str, Any] = {}
            for cell in ran(("32x1", "16000x1"), prompts):
                new = PROMPTS[len(prompts[cell][0])]
                e2e_s, _ = median_run(functools.partial(generate, prompts[cell], new), 1, 3, sync)
                raw = pure_decode(engine, prompts[cell], DECODE_STEPS[cell], folder, f"{label}_{cell}", True,
                                  shape["num_hidden_layers"])
                rows[cell] = {"e2e_s": e2e_s, "new_tokens": new, "span_ms": raw["span_us"] / 1e3,
                              "device_ms": raw["busy_us"] / 1e3,
                              "kernels": sum(count for _, count in raw["kernels"].values()), "tokens": raw["tokens"]}
            sides[label] = rows
    finally:
        model.use_linear(support)
        engine.decode_runner.capture()  # type: ignore[union-attr]
    result = {"decode_step": compare(sides["before_f_linear"], sides["after_platform_kernel"], "span_ms"),
              "e2e": compare(sides["before_f_linear"], sides["after_platform_kernel"], "e2e_s")}
    print(f"  lever linear kernel: {result}", flush=True)
    return result


def prefill_graphs_lever(engine: GenerationEngine, generate: Callable[[list[list[int]], int], list[list[int]]],
                         prompts: dict[str, list[list[int]]], sync: Callable[[], None]) -> dict[str, Any]:
    from torchhal.core.engine import EagerRunner

    graphs = engine.runner
    sides = {}
    for label, runner in (("before_eager", EagerRunner(engine.model)), ("after_graphs", graphs)):
        engine.executor.runner = runner
        try:
            sides[label] = prefill_medians(generate, prompts, ("32x1", "32x8", "32x32"), sync)
        finally:
            engine.executor.runner = graphs
    result = compare(sides["before_eager"], sides["after_graphs"], "prefill_s")
    print(f"  lever prefill graphs: {result}", flush=True)
    return result


def matrix_rate(device: torch.device) -> float:
    """Measured bf16 matrix FLOP/s (8192^3 product, random data)."""
    import triton.testing

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms = float(triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median"))
    return 2 * 8192**3 / (ms / 1e3)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", default="results")
    parser.add_argument("--skip-levers", action="store_true")
    parser.add_argument("--skip-profile", action="store_true", help="the levers only, no kernel profile")
    parser.add_argument("--levers", nargs="+", choices=LEVERS, default=list(LEVERS[:2]))
    parser.add_argument("--tiny", action="store_true", help="a tiny model on whatever device there is")
    parser.add_argument("--scenarios", nargs="+", help="profile only these scenarios (default: all)")
    parser.add_argument("--idle", action="store_true",
                        help="also profile each prefill scenario with Python stacks: what the host ran while the "
                        "device idled")
    parser.add_argument("--max-batch-tokens", type=int, default=32768,
                        help="the engine's token budget a step, as long_context.py's")
    parser.add_argument("--budget-before", type=int, default=16384,
                        help="the budget the `step_budget` lever compares with --max-batch-tokens (at most that)")
    args = parser.parse_args(argv)
    platform = torchhal.current_platform()
    device = platform.device(platform.current_device())
    on_gpu = device.type != "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shape = TINY if args.tiny else LLAMA31_8B
    scenarios: tuple[tuple[str, str, int], ...] = TINY_SCENARIOS if args.tiny else SCENARIOS
    if args.scenarios:
        unknown = sorted(set(args.scenarios) - {name for name, _, _ in scenarios})
        if unknown:
            parser.error(f"--scenarios {' '.join(unknown)}: choose from {', '.join(n for n, _, _ in scenarios)}")
        scenarios = tuple(s for s in scenarios if s[0] in args.scenarios)
    prompts = prompts_for(CELLS, shape["vocab_size"])  # the benchmark's own prompts
    if args.tiny:  # its positions stop at 4096
        prompts = {cell: prompts[cell] for _, cell, _ in scenarios}
    results: dict[str, Any] = {"platform": platform.name, "dtype": str(dtype), "scenarios": {}}
    if on_gpu:
        results["matrix_flop_s"] = matrix_rate(device)
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        seconds, _ = median_run(lambda: src.clone(), 1, 5, platform.synchronize)
        results["copy_bandwidth_Bps"] = 2 * (1 << 30) / seconds
        del src
    with tempfile.TemporaryDirectory() as directory:
        save_model(shape, dtype, device, directory)
        gc.collect()
        platform.empty_cache(torchhal.ReleasePoint.USER)
        started = time.perf_counter()
        config = replace(engine_config(dtype), max_batch_tokens=args.max_batch_tokens)
        engine = GenerationEngine.from_checkpoint(directory, config)
        results["engine_setup_s"] = time.perf_counter() - started
        report = getattr(engine.runner, "report", None)  # the prefill graphs' capture (None: eager runner)
        results["prefill_graphs"] = None if report is None else {
            "buckets": list(report.buckets), "graphs": report.graphs, "capture_s": report.seconds,
            "pool_bytes": report.pool_bytes}

        def generate(batch_prompts: list[list[int]], new: int) -> list[list[int]]:
            return engine_tokens(engine, batch_prompts, new)

        folder = Path(directory)
        element = torch.empty((), dtype=dtype).element_size()
        for name, cell, steps in () if args.skip_profile else scenarios:
            batch_prompts = prompts[cell]
            prompt, batch = len(batch_prompts[0]), len(batch_prompts)
            generate(batch_prompts, 1 + steps)  # warm-up: compiles, first replays
            if steps:
                raw = pure_decode(engine, batch_prompts, steps, folder, name, on_gpu, shape["num_hidden_layers"])
                steps = raw.pop("steps")
                tokens = raw.pop("tokens")
            else:
                raw = profiled(functools.partial(generate, batch_prompts, 1), folder, name, on_gpu)
                tokens = generate(batch_prompts, 1)
                # The same call unprofiled, as long_context.py times it: what the span leaves out.
                raw["unprofiled_call_us"] = 1e6 * median_run(functools.partial(generate, batch_prompts, 1), 1, 3,
                                                             platform.synchronize)[0]
            summary = summarize(raw, model_work(shape, prompt, batch, steps, element), results.get("matrix_flop_s"))
            summary.update({"cell": cell, "decode_steps_profiled": steps,
                            # equal digests: two runs (another setting, say) gave the same tokens
                            "tokens_digest": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
                            "what": "one pure decode step (mean over the profiled steps)" if steps else
                            "prefill alone (generate with one new token)"})
            if args.idle and on_gpu and not steps:
                summary["host_during_idle"] = idle_profile(functools.partial(generate, batch_prompts, 1), folder, name)
                for row in summary["host_during_idle"]["host"][:8]:
                    print(f"   idle {row['us'] / 1e3:8.3f} ms  {row['name'][:100]}")
                for row in summary["host_during_idle"].get("before_first_kernel", {}).get("host", [])[:8]:
                    print(f"   lead {row['us'] / 1e3:8.3f} ms  {row['name'][:100]}")
            results["scenarios"][name] = summary
            print(f"== {name}: {summary['device_us'] / 1e3:.2f} ms of kernels, span {summary['span_us'] / 1e3:.2f} ms, "
                  + " ".join(f"{key[:-3]} {summary[key] / 1e3:.2f} ms" for key in
                             ("call_us", "before_first_kernel_us", "after_last_kernel_us", "unprofiled_call_us")
                             if key in summary), flush=True)
            for cls, row in summary["classes"].items():
                extra = " ".join(f"{k}={row[k]:.2f}" for k in ("hbm_fraction", "matrix_rate_fraction") if k in row)
                print(f"   {cls:11s} {row['us'] / 1e3:8.3f} ms {row['share']:6.1%} x{row['kernels']:.0f} {extra}")
            for k in summary["top_kernels"][:6]:
                print(f"   {k['us'] / 1e3:8.3f} ms x{k['count']:.0f} {k['class']:10s} {k['name'][:90]}")
        if on_gpu and not args.skip_levers:
            sync = platform.synchronize
            run_lever = {
                "prefill_graphs": lambda: prefill_graphs_lever(engine, generate, prompts, sync),
                "linear_kernel": lambda: linear_kernel_lever(engine, generate, prompts, shape, sync),
                "write_kv_kernel": lambda: write_kv_lever(engine, generate, prompts, shape, sync),
                "whole_prompt_admission": lambda: whole_prompt_lever(generate, prompts, sync),
                "flash_prefill_runs": lambda: flash_prefill_lever(generate, prompts, sync),
                "decode_splits": lambda: decode_splits_lever(engine, generate, prompts, shape, sync),
                "gemv_eviction": lambda: gemv_eviction_lever(engine, generate, prompts, sync),
                "step_overlap": lambda: step_overlap_lever(engine, generate, prompts, sync),
                "step_kv": lambda: step_kv_lever(generate, prompts, sync),
                "residual_in_product": lambda: residual_in_product_lever(engine, generate, prompts, sync),
                "step_budget": lambda: step_budget_lever(engine, generate, prompts, sync, args.budget_before),
            }
            results["levers"] = {name: run_lever[name]() for name in args.levers}
    for lever in results.get("levers", {}).values():
        _drop_tokens(lever)
    write_json("profile_long_context" + ("_tiny" if args.tiny else ""), results, args.out)
    return results


def _drop_tokens(value: Any) -> None:
    if isinstance(value, dict):
        value.pop("tokens", None)
        for item in value.values():
            _drop_tokens(item)
    elif isinstance(value, list):
        for item in value:
            _drop_tokens(item)


if __name__ == "__main__":
    main()
