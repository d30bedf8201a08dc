"""Whole-prompt prefill attention at the 8B shape: SDPA (cuDNN's kernel on an H200) against
FlashAttention-4 (the `fa4` extra), the two kernels `torchhal.plugins.cuda_flash` chooses
between, alone and inside the layer stack of `prefill_floor.py` (the 8B layer's projections
and attention back to back, so the device runs at its power limit as a real prefill does).

    python benchmarks/prefill_attention.py [--reps 7] [--steps 1x3968,4x3968,1x16000] [--out results]

Per step shape (by default the engine's whole-prompt batches for `long_context.py`'s cells:
1 x 3968, 4 x 3968, 1 x 16000; `--steps` for others, such as shorter prompts): each kernel's
milliseconds alone (CUDA events, median of 10 after a warm-up, from a device that has idled
between shapes); the stack's milliseconds with each kernel, interleaved rep by rep in
alternating order so a drift of the clock falls on both alike, and each kernel's median
milliseconds inside the stack; FA4's first-call (compile) seconds; the largest difference
between the two outputs, and each one's from float32 on one KV group at the first step shape.
q is the engine's layout (a view into the rotated [T, Hq + Hk, D] projection). Needs a CUDA
GPU and flash-attn-4.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _harness import write_json  # noqa: E402
from prefill_floor import HEAD_DIM, KV_HEADS, Q_HEADS, LayerStack  # noqa: E402

from torchhal.plugins import cuda_flash  # noqa: E402

STEPS = "1x3968,4x3968,1x16000"  # prompts x tokens each
SCALE = HEAD_DIM**-0.5
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def kernels() -> dict[str, Attention]:
    """The two kernels `cuda_flash.dense_causal` chooses between: [count, L, H, D] in and out."""
    if cuda_flash._fa4_function() is None:
        raise SystemExit("flash-attn-4 does not import: pip install 'torchhal[fa4]'")
    return {"sdpa": lambda q, k, v: cuda_flash.sdpa_causal(q, k, v, SCALE),
            "fa4": lambda q, k, v: cuda_flash.fa4_causal(q, k, v, SCALE)}


def median_ms(call: Callable[[], object], reps: int = 10) -> float:
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def parse_steps(text: str) -> list[tuple[int, int]]:
    """'1x3968,4x3968' -> [(1, 3968), (4, 3968)]: prompts x tokens each."""
    steps = []
    for step in text.split(","):
        count, _, length = step.strip().partition("x")
        if not (count.isdigit() and length.isdigit() and int(count) > 0 and int(length) > 0):
            raise argparse.ArgumentTypeError(f"step {step!r} is not PROMPTSxTOKENS, e.g. 4x3968")
        steps.append((int(count), int(length)))
    return steps


def alone(count: int, length: int, attend: dict[str, Attention], device: torch.device,
          check_float32: bool) -> dict[str, Any]:
    qk = torch.randn(count * length, Q_HEADS + KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    q = qk[:, :Q_HEADS].view(count, length, Q_HEADS, HEAD_DIM)
    k = qk[:, Q_HEADS:].view(count, length, KV_HEADS, HEAD_DIM)
    v = torch.randn(count, length, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    started = time.perf_counter()
    outputs = {name: kernel(q, k, v) for name, kernel in attend.items()}
    torch.cuda.synchronize()
    row: dict[str, Any] = {"first_calls_s": time.perf_counter() - started,
                           "max_abs_diff": (outputs["fa4"].float() - outputs["sdpa"].float()).abs().max().item()}
    for name, kernel in attend.items():
        row[f"{name}_ms"] = median_ms(lambda kernel=kernel: kernel(q, k, v))  # type: ignore[misc]
    if check_float32:  # float32 on the first KV group's query heads
        group = Q_HEADS // KV_HEADS
        qf, kf, vf = (t.float().transpose(1, 2) for t in (q[:, :, :group], k[:, :, :1], v[:, :, :1]))
        exact = F.scaled_dot_product_attention(qf, kf.expand(-1, group, -1, -1), vf.expand(-1, group, -1, -1),
                                               is_causal=True, scale=SCALE).transpose(1, 2)
        for name, out in outputs.items():
            row[f"{name}_max_abs_diff_vs_float32"] = (out[:, :, :group].float() - exact).abs().max().item()
    return row


def in_stack(count: int, length: int, attend: dict[str, Attention], reps: int,
             device: torch.device) -> dict[str, Any]:
    stack = LayerStack(count, length, device)
    q, k, v = (t.transpose(1, 2) for t in (stack.q, stack.k, stack.v))  # back to [count, L, H, D]
    calls = {name: (lambda kernel=kernel: kernel(q, k, v)) for name, kernel in attend.items()}
    totals: dict[str, list[float]] = {name: [] for name in calls}
    attention_ms: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(reps + 1):  # the first round warms both up
        for name in (list(calls) if rep % 2 else list(calls)[::-1]):
            stack.operations["attention"] = calls[name]
            total, operations = stack.timed()
            if rep:
                totals[name].append(total)
                attention_ms[name] += [ms for op, ms in operations if op == "attention"]
    row: dict[str, Any] = {name: {"stack_ms": statistics.median(totals[name]), "stack_ms_all": totals[name],
                                  "attention_ms": statistics.median(attention_ms[name])} for name in calls}
    row["fa4_over_sdpa_stack"] = row["fa4"]["stack_ms"] / row["sdpa"]["stack_ms"]
    row["fa4_over_sdpa_attention"] = row["fa4"]["attention_ms"] / row["sdpa"]["attention_ms"]
    del stack
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--reps", type=int, default=7, help="stack runs per kernel after one warm-up round")
    parser.add_argument("--steps", type=parse_steps, default=parse_steps(STEPS),
                        help=f"comma-separated PROMPTSxTOKENS step shapes (default {STEPS})")
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    attend = kernels()
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "cudnn": torch.backends.cudnn.version(),
                               "flash_attn_4": cuda_flash.fa4_version()[0], "alone": {}, "stack": {}}
    for index, (count, length) in enumerate(args.steps):
        time.sleep(1.0)  # each shape's kernels alone from an idle device
        results["alone"][f"{count}x{length}"] = alone(count, length, attend, device, check_float32=index == 0)
    for count, length in args.steps:
        results["stack"][f"{count}x{length}"] = row = in_stack(count, length, attend, args.reps, device)
        print(f"{count}x{length}: stack fa4/sdpa {row['fa4_over_sdpa_stack']:.3f}, "
              f"attention {row['fa4_over_sdpa_attention']:.3f}", flush=True)
    write_json("prefill_attention", results, args.out)
    return results


if __name__ == "__main__":
    main()
