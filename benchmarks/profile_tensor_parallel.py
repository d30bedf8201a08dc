"""Where a tensor-parallel decode step's time goes: the 8B shape at TP = 1 and 2 (each size one
launch, as `tensor_parallel.py` runs it: seeded random weights built on the devices, full-graph
decode, compiled layers), one decode step of each cell profiled on every rank under
torch.profiler, graph replays included.

Per rank and cell: the step's span (first kernel's start to last one's end), the kernels grouped
as collective (NCCL's kernels and the peer-memory all-reduce) / GEMM / attention / norm /
elementwise / copy, the top kernels, and the time the rank's share of the weights takes to read
at 4.8 TB/s. A step whose collectives and weights do not account for its span says what else
does not shrink with the TP size.

    python benchmarks/profile_tensor_parallel.py --tp 1 2 --cells 32x1 32x32
    python benchmarks/profile_tensor_parallel.py --shape tiny --tp 1 2 --cells 8x1   # CPU: plumbing only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _harness import environment, write_json  # noqa: E402
from profile_long_context import kernel_class, pure_decode  # noqa: E402
from tensor_parallel import NEW_TOKENS, SHAPES, engine_config, model_config, prompts_for, random_rank_model  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
#: Decode steps profiled per cell (one engine step runs a window of 8).
STEPS = 16
COLLECTIVE_WORDS = ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "symm")


def step_class(name: str) -> str:
    """`kernel_class`, with the collectives apart (their names would read as reductions)."""
    return "collective" if any(word in name.lower() for word in COLLECTIVE_WORDS) else kernel_class(name)


def summary(step: dict[str, Any], weight_bytes: int, top: int = 12) -> dict[str, Any]:
    """One profiled step: its span, each class's device time, the top kernels (ms a step)."""
    classes: dict[str, float] = {}
    for name, (us, _) in step["kernels"].items():
        kind = step_class(name)
        classes[kind] = classes.get(kind, 0.0) + us / 1e3
    ranked = sorted(step["kernels"].items(), key=lambda kv: -kv[1][0])[:top]
    return {"steps_profiled": step["steps"], "span_ms": step["span_us"] / 1e3, "busy_ms": step["busy_us"] / 1e3,
            "classes_ms": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
            "weights_read_ms_at_4_8_tb_s": weight_bytes / HBM_BYTES_PER_S * 1e3,
            "top_kernels": [{"name": name[:120], "ms": us / 1e3, "count": count} for name, (us, count) in ranked]}


def rank_profile(shape: str, cells: tuple[tuple[int, int], ...], dtype_name: str, seed: int) -> dict[str, Any]:
    """One rank's part: its shard and engine, one decode step of each cell profiled."""
    import torchhal
    from torchhal.core.engine import GenerationEngine
    from torchhal.distributed import init_group

    group = init_group()
    platform = torchhal.current_platform()
    on_gpu = group.device.type != "cpu"
    dtype = getattr(torch, dtype_name)
    config = model_config(shape)
    model = random_rank_model(config, group.world_size, group.rank, group.device, dtype, seed)
    # The embedding table is not read whole by a decode step: only the LM head's share counts.
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    engine = GenerationEngine(engine_config(cells, dtype, on_gpu), platform=platform, model=model, group=group)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for prompt, batch in cells:
            prompts = prompts_for(prompt, batch, config.vocab_size)
            pure_decode(engine, prompts, STEPS, Path(folder), f"warm_{prompt}x{batch}", on_gpu, config.num_layers)
            step = pure_decode(engine, prompts, STEPS, Path(folder), f"{prompt}x{batch}", on_gpu, config.num_layers)
            results[f"{prompt}x{batch}"] = summary(step, weight_bytes)
    group.close()
    return {"rank": group.rank, "communicator": type(group.comm).__name__, "weight_bytes": weight_bytes,
            "cells": results}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cells", nargs="+", default=["32x1", "32x32"], help="PROMPTxBATCH, e.g. 32x8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for each TP size's launch")
    parser.add_argument("--out", default=None, help="results folder (default results/)")
    args = parser.parse_args(argv)
    import torchhal
    from torchhal.core.model.parallel import check_tensor_parallel
    from torchhal.distributed import launch

    try:
        cells = tuple((int(p), int(b)) for p, b in (cell.split("x") for cell in args.cells))
    except ValueError:
        parser.error(f"--cells takes PROMPTxBATCH, e.g. 32x8; got {args.cells}")
    for prompt, _ in cells:
        if prompt not in NEW_TOKENS:
            parser.error(f"prompt length {prompt} has no new-token count; use one of {sorted(NEW_TOKENS)}")
    for tp in args.tp:
        check_tensor_parallel(model_config(args.shape), tp)
    platform = torchhal.current_platform()
    dtype_name = "float32" if platform.device_type == "cpu" else "bfloat16"
    runs = {}
    for tp in args.tp:
        runs[str(tp)] = launch(rank_profile, tp, (args.shape, cells, dtype_name, args.seed), timeout=args.timeout)
        for cell, step in runs[str(tp)][0]["cells"].items():
            shown = ", ".join(f"{k} {v:.3f}" for k, v in step["classes_ms"].items())
            print(f"TP={tp} {cell}: span {step['span_ms']:.3f} ms (weights at 4.8 TB/s "
                  f"{step['weights_read_ms_at_4_8_tb_s']:.3f}); {shown}", flush=True)
    results = {"benchmark": "profile_tensor_parallel", "shape": args.shape, "dtype": dtype_name,
               "platform": platform.name, "environment": environment(), "runs": runs}
    write_json(f"profile_tensor_parallel_{args.shape}", results, args.out)
    return results


if __name__ == "__main__":
    main()
