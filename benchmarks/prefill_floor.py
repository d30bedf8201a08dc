"""The floor under a long prompt's prefill on this device: the 8B shape's matrix products and
whole-prompt attention alone, as a layer stack runs them back to back, against each of the same
kernels timed from an idle device; the SM clock and board power sampled while the stack runs.

    python benchmarks/prefill_floor.py [--long-context results/long_context_h200.json] [--gemm-variants]
        [--out results]

The question it answers: how far can any work outside the matrix products and attention (norms,
rotary, SwiGLU, K/V writes, copies, launch gaps) move the prefill against the long-context
goal of 0.8x transformers' time? The stack is the Llama-3.1-8B layer's four projections
(cuBLAS through `torch.mm`) and causal SDPA with grouped-query heads native (the kernel torch
picks, cuDNN's on an H200), 32 layers, on the token counts the engine runs in one step: whole
prompts up to `--max-batch-tokens` a step, as `long_context.py` configures it. Nothing else
runs, so its time is what those kernels alone cost when the device runs them back to back.

Per step shape: the stack's milliseconds (CUDA events, median of `--reps` after a warm-up);
each operation's milliseconds in the stack (median over layers and repetitions) and from an
idle device (median of three calls after `--idle-s` of idle), with TFLOP/s; the SM clock and
board power (`nvidia-smi` samples) while the stack runs and while the device idles. With
`--long-context` (a `long_context.py` result file) each measured cell also gets its floor
(the steps' stacks), the goal's prefill time (0.8x transformers'), the room the goal leaves
above the floor, and torchhal's measured prefill above the floor. `--gemm-variants` also times
the stack with cuBLASLt preferred and with the weights stored [in, out], interleaved with the
plain cuBLAS stack: whether another kernel choice moves the floor. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _harness import write_json  # noqa: E402

HIDDEN, LAYERS, INTERMEDIATE = 4096, 32, 14336
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PREFILL_GOAL = 0.8  # torchhal's prefill against transformers' (the long-context goal)
CELLS = ((3968, 1), (3968, 8), (3968, 32), (16000, 1), (16000, 8))  # (prompt, batch): long_context's long cells
SMI_FIELDS = "clocks.sm,power.draw"


def step_shapes(prompt: int, batch: int, max_batch_tokens: int) -> tuple[int, int]:
    """(prompts a prefill step holds, steps): the engine admits whole prompts while they fit in
    `max_batch_tokens` (at least one a step)."""
    if prompt < 1 or batch < 1 or max_batch_tokens < 1:
        raise ValueError(f"prompt {prompt}, batch {batch} and max_batch_tokens {max_batch_tokens} must be >= 1")
    per_step = min(batch, max(1, max_batch_tokens // prompt))
    return per_step, math.ceil(batch / per_step)


def operation_flops(tokens: int, prompts: int) -> dict[str, float]:
    """Matrix FLOPs of one layer's operations over `tokens` = `prompts` equally long prompts."""
    length = tokens // prompts
    return {
        "qkv": 2.0 * tokens * HIDDEN * (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM,
        "attention": 4.0 * Q_HEADS * HEAD_DIM * prompts * length * (length + 1) / 2,  # causal
        "o_proj": 2.0 * tokens * Q_HEADS * HEAD_DIM * HIDDEN,
        "gate_up": 2.0 * tokens * HIDDEN * 2 * INTERMEDIATE,
        "down": 2.0 * tokens * INTERMEDIATE * HIDDEN,
    }


def parse_samples(text: str) -> dict[str, float | int | None]:
    """Medians of `nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits`
    lines; lines that do not parse (a partial last line, `[N/A]`) are skipped."""
    clocks, watts = [], []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 2:
            continue
        try:
            clock, power = float(fields[0]), float(fields[1])
        except ValueError:
            continue
        clocks.append(clock)
        watts.append(power)
    return {"samples": len(clocks), "sm_mhz_median": statistics.median(clocks) if clocks else None,
            "power_w_median": statistics.median(watts) if watts else None,
            "power_w_max": max(watts) if watts else None}


def smi_id(device: int = 0) -> str:
    """The device as nvidia-smi names it: its UUID (CUDA_VISIBLE_DEVICES may renumber devices,
    so cuda:0 need not be nvidia-smi's GPU 0)."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


class Sampler:
    """`nvidia-smi` sampling the SM clock and board power every `period_ms` while the block runs
    (no samples where nvidia-smi is missing)."""

    def __init__(self, period_ms: int = 20) -> None:
        self.period_ms = period_ms
        self.samples: dict[str, float | int | None] = parse_samples("")
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> Sampler:
        if shutil.which("nvidia-smi"):
            self._process = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits", "-i", smi_id(),
                 f"--loop-ms={self.period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self._process.terminate()
            out, _ = self._process.communicate(timeout=10)
            self.samples = parse_samples(out)


def device_limits() -> dict[str, str]:
    """The SM clock's maximum and the board's power limit, as nvidia-smi reports them."""
    if not shutil.which("nvidia-smi"):
        return {}
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm,power.limit", "--format=csv,noheader",
                          "-i", smi_id()], capture_output=True, text=True, check=False).stdout.strip()
    clock, _, power = out.partition(",")
    return {"sm_clock_max": clock.strip(), "power_limit": power.strip()}


class LayerStack:
    """The layer's four projections and attention on `prompts` prompts of `length` tokens, each
    operation reading and writing buffers allocated once; q is the engine's layout (a view of
    the rotated [T, Hq + Hkv, D] projection), k and v are [prompts, L, Hkv, D]."""

    def __init__(self, prompts: int, length: int, device: torch.device, layout: str = "tn") -> None:
        tokens, dtype = prompts * length, torch.bfloat16

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, dtype=dtype)

        self.prompts, self.length, self.tokens = prompts, length, tokens
        self.hidden, self.attended, self.act = randn(tokens, HIDDEN), randn(tokens, HIDDEN), randn(tokens, INTERMEDIATE)
        self.weights = {"qkv": randn((Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN) * 0.02,
                        "o_proj": randn(HIDDEN, Q_HEADS * HEAD_DIM) * 0.02,
                        "gate_up": randn(2 * INTERMEDIATE, HIDDEN) * 0.02, "down": randn(HIDDEN, INTERMEDIATE) * 0.02}
        self.outputs = {name: torch.empty(tokens, w.shape[0], device=device, dtype=dtype)
                        for name, w in self.weights.items()}
        qk = randn(tokens, Q_HEADS + KV_HEADS, HEAD_DIM)
        self.q = qk[:, :Q_HEADS].view(prompts, length, Q_HEADS, HEAD_DIM).transpose(1, 2)
        self.k = randn(prompts, length, KV_HEADS, HEAD_DIM).transpose(1, 2)
        self.v = randn(prompts, length, KV_HEADS, HEAD_DIM).transpose(1, 2)
        inputs = {"qkv": self.hidden, "o_proj": self.attended, "gate_up": self.hidden, "down": self.act}
        self.operations: dict[str, Callable[[], object]] = {
            name: self._projection(inputs[name], self.weights[name], self.outputs[name], layout) for name in inputs}
        self.operations["attention"] = self._attention
        self.order = ("qkv", "attention", "o_proj", "gate_up", "down")

    @staticmethod
    def _projection(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, layout: str) -> Callable[[], object]:
        """layout "tn": the [out, in] weight as nn.Linear and the engine store it; "nn": stored
        [in, out], so cuBLAS gets the other operand order (and may pick other kernels)."""
        if layout == "nn":
            stored = weight.t().contiguous()
            return lambda: torch.mm(x, stored, out=out)
        return lambda: torch.mm(x, weight.t(), out=out)

    def _attention(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=True, enable_gqa=True)

    def run(self, events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] | None = None) -> None:
        for _ in range(LAYERS):
            for name in self.order:
                if events is None:
                    self.operations[name]()
                    continue
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.operations[name]()
                end.record()
                events.append((name, start, end))


    def timed(self) -> tuple[float, list[tuple[str, float]]]:
        """One pass through the layers: its milliseconds and each operation's (name, ms), by CUDA events."""
        events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        self.run(events)
        finish.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(finish), [(name, start.elapsed_time(end)) for name, start, end in events]


def measure_step(prompts: int, length: int, reps: int, idle_s: float, device: torch.device) -> dict[str, Any]:
    stack = LayerStack(prompts, length, device)
    stack.run()  # warm-up: cuBLAS / cuDNN plans
    torch.cuda.synchronize()
    idle: dict[str, float] = {}
    for name in stack.order:  # each operation from an idle device, before the stack heats it
        time.sleep(idle_s)
        calls = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            stack.operations[name]()
            end.record()
            calls.append((start, end))
        torch.cuda.synchronize()
        idle[name] = statistics.median(s.elapsed_time(e) for s, e in calls)
    stack_ms: list[float] = []
    in_stack: dict[str, list[float]] = {name: [] for name in stack.order}
    with Sampler() as sampler:
        for _ in range(reps):
            total, timed_operations = stack.timed()
            stack_ms.append(total)
            for name, ms in timed_operations:
                in_stack[name].append(ms)
    flops = operation_flops(stack.tokens, prompts)
    operations = {}
    for name in stack.order:
        hot = statistics.median(in_stack[name])
        operations[name] = {"idle_ms": idle[name], "stack_ms": hot, "idle_tflop_s": flops[name] / idle[name] / 1e9,
                            "stack_tflop_s": flops[name] / hot / 1e9, "stack_over_idle": hot / idle[name]}
    del stack
    torch.cuda.empty_cache()
    return {"tokens": prompts * length, "stack_ms": statistics.median(stack_ms), "stack_ms_all": stack_ms,
            "stack_ms_at_idle_rates": LAYERS * sum(idle.values()), "operations": operations,
            "while_stack_runs": sampler.samples}


#: the GEMM variants `--gemm-variants` times: (name, weight layout, torch's preferred BLAS library)
GEMM_VARIANTS = (("cublas", "tn", "cublas"), ("cublaslt", "tn", "cublaslt"), ("cublas_nn_weights", "nn", "cublas"))


def measure_gemm_variants(prompts: int, length: int, reps: int, device: torch.device) -> dict[str, Any]:
    """The same stack under each of GEMM_VARIANTS, interleaved rep by rep (order alternating), so
    a drift of the device's clock under its power limit falls on every variant alike: whether
    the floor is cuBLAS's choice of kernel or the device's rate."""
    stacks = {name: LayerStack(prompts, length, device, layout) for name, layout, _ in GEMM_VARIANTS}
    library = {name: blas for name, _, blas in GEMM_VARIANTS}
    before = torch.backends.cuda.preferred_blas_library()
    times: dict[str, list[float]] = {name: [] for name in stacks}
    try:
        for rep in range(reps + 1):  # the first round is the warm-up (plans for each library)
            names = list(stacks) if rep % 2 else list(stacks)[::-1]
            for name in names:
                torch.backends.cuda.preferred_blas_library(library[name])
                begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                stacks[name].run()
                finish.record()
                torch.cuda.synchronize()
                if rep:
                    times[name].append(begin.elapsed_time(finish))
    finally:
        torch.backends.cuda.preferred_blas_library(before)
    del stacks
    torch.cuda.empty_cache()
    base = statistics.median(times["cublas"])
    return {name: {"stack_ms": statistics.median(t), "stack_ms_all": t,
                   "over_cublas": statistics.median(t) / base} for name, t in times.items()}


def judge_cells(steps: dict[str, dict[str, Any]], long_context: dict[str, Any] | None,
                max_batch_tokens: int) -> dict[str, Any]:
    """Each long cell's prefill floor (its steps' stack time) and, given a long-context result,
    the goal's time, the room it leaves above the floor and torchhal's measured time above it."""
    cells: dict[str, Any] = {}
    for prompt, batch in CELLS:
        per_step, count = step_shapes(prompt, batch, max_batch_tokens)
        key = f"{per_step}x{prompt}"
        if key not in steps:
            continue
        floor_s = count * steps[key]["stack_ms"] / 1e3
        cell: dict[str, Any] = {"step": key, "steps": count, "floor_s": floor_s}
        measured = (long_context or {}).get("cells", {}).get(f"{prompt}x{batch}")
        if measured is not None:
            peer, ours = measured["prefill_s"]["transformers"], measured["prefill_s"]["torchhal"]
            goal = PREFILL_GOAL * peer
            cell.update({"transformers_prefill_s": peer, "torchhal_prefill_s": ours, "goal_s": goal,
                         "floor_over_transformers": floor_s / peer, "room_above_floor_s": goal - floor_s,
                         "torchhal_above_floor_s": ours - floor_s})
        cells[f"{prompt}x{batch}"] = cell
    return cells


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--long-context", help="a long_context.py result file to judge the cells against")
    parser.add_argument("--max-batch-tokens", type=int, default=32768, help="the engine's (long_context.py's)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--idle-s", type=float, default=1.0, help="idle before each operation's idle-device timing")
    parser.add_argument("--gemm-variants", action="store_true",
                        help="also time the stack under cuBLASLt and with [in, out] weights, interleaved")
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    long_context = json.loads(Path(args.long_context).read_text())["results"] if args.long_context else None
    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    with Sampler() as idle_sampler:
        time.sleep(2.0)
    shapes = sorted({(step_shapes(prompt, batch, args.max_batch_tokens)[0], prompt) for prompt, batch in CELLS})
    steps = {}
    for prompts, length in shapes:
        steps[f"{prompts}x{length}"] = measure_step(prompts, length, args.reps, args.idle_s, device)
        print(f"{prompts}x{length}: stack {steps[f'{prompts}x{length}']['stack_ms']:.1f} ms", flush=True)
    results = {"gpu": torch.cuda.get_device_name(0), "limits": device_limits(), "while_idle": idle_sampler.samples,
               "max_batch_tokens": args.max_batch_tokens, "steps": steps,
               "cells": judge_cells(steps, long_context, args.max_batch_tokens)}
    if args.gemm_variants:
        results["gemm_variants"] = {}
        for prompts, length in shapes:
            variants = measure_gemm_variants(prompts, length, args.reps, device)
            results["gemm_variants"][f"{prompts}x{length}"] = variants
            print(f"{prompts}x{length}: " + ", ".join(f"{n} {v['stack_ms']:.1f} ms" for n, v in variants.items()),
                  flush=True)
    write_json("prefill_floor", results, args.out)
    return results


if __name__ == "__main__":
    main()
