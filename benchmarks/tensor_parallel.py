"""Tensor-parallel throughput: the 8B Llama shape at TP = 1, 2 (and 4), and the 70B shape, which does
not fit one device in bf16, at TP = 2 or 4.

Each TP size runs as one launch (`torchhal.cli.launch.launch`: one process per rank, one device each,
`init_group` inside). Weights are seeded random and built on the devices: every rank builds its shard
on the meta device, allocates it on its device, and fills each parameter with its slice of a whole HF
tensor generated there from a seed of (seed, name), one tensor at a time; so every TP size serves the
same model, and a 70B model needs no 140 GB checkpoint on disk. The engine is configured as a user
would (full-graph decode over the cells' batches and contexts, compiled layers on a GPU, chunked
prefill). Each cell is the median of `--reps` timed `generate` calls after a warm-up: tokens/s
including prefill, and each rank's peak device memory.

Goal (issue: tensor-parallel serving): TP=2 on two H200s >= 1.7x the tokens/s of TP=1 at batch 32
for the 8B shape. The JSON has every cell, the ratios to TP=1 and the goal judged.

    python benchmarks/tensor_parallel.py --shape 8b --tp 1 2
    python benchmarks/tensor_parallel.py --shape 70b --tp 2 --cells 32x1 32x8 32x32
    python benchmarks/tensor_parallel.py --shape tiny --tp 1 2          # CPU: gloo, fp32
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _harness import engine_tokens, environment, median_run, write_json  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
               intermediate_size=14336, max_position=32768, rope_theta=500000.0, rms_eps=1e-5),
    "70b": dict(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                intermediate_size=28672, max_position=32768, rope_theta=500000.0, rms_eps=1e-5),
    "tiny": dict(vocab_size=250, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2,
                 intermediate_size=128, max_position=4096, rms_eps=1e-5),
}
#: New tokens per prompt length.
NEW_TOKENS = {32: 128, 3968: 64, 8: 16, 200: 8}
CELLS = ((32, 1), (32, 8), (32, 32), (3968, 1), (3968, 8), (3968, 32))
TINY_CELLS = ((8, 1), (8, 4), (200, 2))
GOAL_RATIO_TP2_BATCH32 = 1.7


def model_config(shape: str) -> Any:
    from torchhal.core.model import ModelConfig

    return ModelConfig(**SHAPES[shape])


def random_rank_model(config: Any, world_size: int, rank: int, device: torch.device, dtype: torch.dtype,
                      seed: int) -> Any:
    """This rank's shard of a seeded random decoder, built on `device` one whole tensor at a time."""
    from torchhal.core.model import LlamaDecoder
    from torchhal.core.model.parallel import TensorParallelPlan

    plan = (TensorParallelPlan(config, world_size), rank) if world_size > 1 else None
    with torch.device("meta"):
        model = LlamaDecoder(config, plan).to(dtype)
    model.materialize(device)
    shard = model.shard
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            full_shape = shard.full_shape(name, tuple(param.shape)) if shard is not None else tuple(param.shape)
            generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.randn(full_shape, generator=generator, device=device, dtype=dtype)
            full.mul_(0.1 if "embed_tokens" in name else 1 / math.sqrt(full_shape[-1]))
            param.copy_(shard.take(name, full) if shard is not None else full)
            del full
    model.process_weights()
    return model.eval()


def engine_config(cells: tuple[tuple[int, int], ...], dtype: torch.dtype, on_gpu: bool) -> Any:
    from torchhal.core.engine import DecodeGraphConfig, EngineConfig

    longest = max(prompt + NEW_TOKENS[prompt] for prompt, _ in cells)
    widest = max(batch for _, batch in cells)
    contexts = tuple(sorted({c for c in (256, 4096) if c < longest} | {longest}))
    return EngineConfig(
        dtype=dtype, max_kv_slots=widest * longest + 1024, max_batch_tokens=16384, max_running=widest,
        decode_graphs=DecodeGraphConfig(batch_buckets=tuple(sorted({b for _, b in cells})), context_buckets=contexts,
                                        emulate=not on_gpu),
        compile_layers="inductor" if on_gpu else None,
    )


def prompts_for(prompt: int, batch: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(prompt * 7919 + batch)
    return torch.randint(1, vocab, (batch, prompt), generator=generator).tolist()


def rank_run(shape: str, cells: tuple[tuple[int, int], ...], dtype_name: str, reps: int, seed: int) -> dict[str, Any]:
    """One rank's part: its group, its shard, its engine, every cell timed."""
    import torchhal
    from torchhal.core.engine import GenerationEngine
    from torchhal.distributed import init_group

    group = init_group()
    platform = torchhal.current_platform()
    on_gpu = group.device.type != "cpu"
    dtype = getattr(torch, dtype_name)
    config = model_config(shape)
    started = time.perf_counter()
    model = random_rank_model(config, group.world_size, group.rank, group.device, dtype, seed)
    engine = GenerationEngine(engine_config(cells, dtype, on_gpu), platform=platform, model=model, group=group)
    setup_s = time.perf_counter() - started

    def sync() -> None:
        platform.synchronize(engine.device_index)

    results = []
    for prompt, batch in cells:
        prompts, new = prompts_for(prompt, batch, config.vocab_size), NEW_TOKENS[prompt]

        def generate(prompts: list[list[int]] = prompts, new: int = new) -> list[list[int]]:
            return engine_tokens(engine, prompts, new)

        platform.reset_peak_memory(engine.device_index)
        seconds, tokens = median_run(generate, warmups=1, reps=reps, sync=sync)
        peak = platform.peak_memory(engine.device_index)
        results.append({"prompt": prompt, "batch": batch, "new_tokens": new, "seconds": seconds,
                        "tokens_per_s": batch * new / seconds, "peak_allocated_bytes": peak.allocated,
                        "tokens_crc": zlib.crc32(repr(tokens).encode())})
    group.close()
    return {"rank": group.rank, "device": str(engine.device), "setup_s": setup_s, "cells": results,
            "kv_blocks": engine.kv_sizing.num_blocks, "attention": engine.attention.name,
            "communicator": type(group.comm).__name__}


def judge(by_tp: dict[int, list[dict[str, Any]]], shape: str) -> dict[str, Any]:
    """Ratios to TP=1 per cell, and the batch-32 goal where TP=1 and TP=2 both ran."""
    base = {(c["prompt"], c["batch"]): c["tokens_per_s"] for c in by_tp[1][0]["cells"]} if 1 in by_tp else {}
    ratios = {}
    for tp, ranks in by_tp.items():
        if tp == 1 or not base:
            continue
        ratios[str(tp)] = {f"{c['prompt']}x{c['batch']}": c["tokens_per_s"] / base[(c["prompt"], c["batch"])]
                           for c in ranks[0]["cells"] if (c["prompt"], c["batch"]) in base}
    tokens = {tp: [[c["tokens_crc"] for c in rank["cells"]] for rank in ranks] for tp, ranks in by_tp.items()}
    agreement = {
        # Every rank greedy-decodes the same all-gathered logits: they must agree, always.
        "ranks_agree": {str(tp): all(t == per_rank[0] for t in per_rank) for tp, per_rank in tokens.items()},
        # Equal in fp32; in bf16 another reduction order may flip a near-tie, so this is reported, not required.
        "equal_to_tp1": {str(tp): per_rank[0] == tokens[1][0] for tp, per_rank in tokens.items() if 1 in tokens},
    }
    goal = None
    if shape == "8b" and "2" in ratios:
        at_32 = [v for k, v in ratios["2"].items() if k.endswith("x32")]
        goal = {"goal": f"TP=2 >= {GOAL_RATIO_TP2_BATCH32}x TP=1 at batch 32", "ratios": at_32,
                "met": bool(at_32) and min(at_32) >= GOAL_RATIO_TP2_BATCH32}
    return {"ratio_to_tp1": ratios, "tokens": agreement, "goal": goal}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cells", nargs="*", help="PROMPTxBATCH, e.g. 32x8 (default: the shape's cells)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for each TP size's launch")
    parser.add_argument("--out", default=None, help="results folder (default results/)")
    args = parser.parse_args(argv)
    import torchhal
    from torchhal.core.model.parallel import check_tensor_parallel
    from torchhal.distributed import launch

    platform = torchhal.current_platform()
    dtype_name = "float32" if platform.device_type == "cpu" else "bfloat16"
    if args.cells:
        cells = tuple(tuple(int(x) for x in cell.split("x")) for cell in args.cells)
    else:
        cells = TINY_CELLS if args.shape == "tiny" else CELLS
    for prompt, _ in cells:
        if prompt not in NEW_TOKENS:
            parser.error(f"prompt length {prompt} has no new-token count; use one of {sorted(NEW_TOKENS)}")
    for tp in args.tp:
        check_tensor_parallel(model_config(args.shape), tp)
    by_tp: dict[int, list[dict[str, Any]]] = {}
    for tp in args.tp:
        print(f"TP={tp} {args.shape} on {platform.name}", flush=True)
        by_tp[tp] = launch(rank_run, tp, (args.shape, cells, dtype_name, args.reps, args.seed), timeout=args.timeout)
        for cell in by_tp[tp][0]["cells"]:
            peak = cell["peak_allocated_bytes"]
            shown = f"peak {peak / 2**30:6.1f} GiB" if peak is not None else "peak n/a"
            print(f"  {cell['prompt']:>5}x{cell['batch']:<3} {cell['tokens_per_s']:10.1f} tok/s  {shown}", flush=True)
    results = {"benchmark": "tensor_parallel", "shape": args.shape, "shape_fields": SHAPES[args.shape],
               "dtype": dtype_name, "platform": platform.name, "environment": environment(),
               "runs": {str(tp): ranks for tp, ranks in by_tp.items()}, **judge(by_tp, args.shape)}
    write_json(f"tensor_parallel_{args.shape}", results, args.out)
    return results


if __name__ == "__main__":
    main()
