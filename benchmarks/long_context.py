"""torchhal vs transformers' static-cache compiled `generate` at long context, on the same weights.

    python benchmarks/long_context.py [--out DIR] [--side peer|torchhal|both] [--peer-json FILE]
        [--against FILE] [--cells 32x1,3968x8,...] [--tiny] [--budget-s 500]

The model is Llama-3.1-8B-shaped (hidden 4096, 32 layers, 32 query / 8 KV heads, head dim
128, vocab 128256, Llama 3 rope scaling, max_position_embeddings 32768) with seeded random
weights built on the device and written with `save_pretrained`; transformers loads it in a
child process (`from_pretrained`) and torchhal through its public API
(`GenerationEngine.from_checkpoint`) with `EngineConfig`'s defaults: what a user gets without
tuning. Each cell is a prompt length and a batch; both sides
generate greedily from the same random prompts and report, as the median of `--reps` runs
after one warm-up (which holds transformers' compile and torchhal's graph capture):

- end-to-end tokens/s (prefill included: batch x new tokens / seconds);
- prefill alone (the same call with one new token);
- decode time per step ((end-to-end - prefill) / (new tokens - 1));
- bytes a decode step must read (every weight but the embeddings, plus the KV cache of the
  batch at the mean context of the decode steps) and the fraction of 4.8 TB/s (the H200's
  HBM bandwidth) and of the measured copy bandwidth that reading them in one step time is.

The issue's goals are judged in the JSON (`goals`): end-to-end >= 1.5x transformers in every
cell; prefill <= 0.8x transformers' time at 4k and 16k; a 16k decode step <= 1.25x the time to
read its weights + KV at 80% of 4.8 TB/s; batch-1 short-context decode >= 0.75 of 4.8 TB/s.

The two sides run in separate processes one after the other (never sharing the device), and
`--side` runs one of them so a lease too short for both can run them in two calls; `--peer-json`
then merges the other side's figures; `--against` judges this run's torchhal figures against an
earlier run's, cell by cell (within 3%). `--tiny` runs a tiny model on whatever device there is
(the CPU: float32, no compile, no graphs), so the script is checked end to end before a GPU.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _harness import engine_tokens, median_run, random_llama, write_json  # noqa: E402

import torchhal  # noqa: E402
from torchhal.core.engine import EngineConfig, GenerationEngine  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200
LLAMA31_8B: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, max_position_embeddings=32768, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
TINY: dict[str, Any] = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=4096)
#: (prompt tokens, new tokens) by prompt label; prompt + new stays within 4k / 16k contexts.
PROMPTS = {32: 128, 3968: 64, 16000: 32}
CELLS = ((32, 1), (32, 8), (32, 32), (3968, 1), (3968, 8), (3968, 32), (16000, 1), (16000, 8))
TINY_CELLS = ((8, 1), (8, 4), (200, 2))
TINY_NEW = {8: 16, 200: 8}


# -- the model ----------------------------------------------------------------------------------------
def save_model(shape: dict[str, Any], dtype: torch.dtype, device: torch.device, directory: str) -> int:
    """Seeded random weights with spread (decisive greedy choices), built on `device` and saved;
    returns the bytes a decode step reads (every weight but the embedding table)."""
    model = random_llama(shape, dtype, device)
    model.save_pretrained(directory)
    embed = model.model.embed_tokens.weight
    read = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    del model, embed
    gc.collect()
    return read


def kv_bytes_per_token(shape: dict[str, Any], dtype: torch.dtype) -> int:
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * element


def prompts_for(cells: tuple[tuple[int, int], ...], vocab: int) -> dict[str, list[list[int]]]:
    generator = torch.Generator().manual_seed(1)
    return {f"{p}x{b}": torch.randint(0, vocab, (b, p), generator=generator).tolist() for p, b in cells}


def timed_cells(generate: Callable[[list[list[int]], int], list[list[int]]], prompts: dict[str, list[list[int]]],
                new_tokens: dict[int, int], reps: int, sync: Callable[[], None], deadline: float) -> dict[str, Any]:
    """End-to-end and prefill-alone medians for every cell; cells past the deadline are skipped."""
    rows: dict[str, Any] = {}
    for cell, batch_prompts in prompts.items():
        if time.perf_counter() > deadline:
            rows[cell] = {"skipped": "time budget spent (--budget-s)"}
            continue
        new = new_tokens[len(batch_prompts[0])]
        try:
            e2e_s, tokens = median_run(functools.partial(generate, batch_prompts, new), 1, reps, sync)
            prefill_s, _ = median_run(functools.partial(generate, batch_prompts, 1), 1, reps, sync)
        except torch.OutOfMemoryError as exc:
            rows[cell] = {"skipped": f"out of memory: {str(exc).splitlines()[0]}"}
            gc.collect()
            continue
        batch = len(batch_prompts)
        rows[cell] = {"tok_s": batch * new / e2e_s, "s": e2e_s, "prefill_s": prefill_s,
                      "decode_step_ms": (e2e_s - prefill_s) / (new - 1) * 1e3, "new_tokens": new,
                      "tokens": tokens}
        print(f"  {cell}: {rows[cell]['tok_s']:.1f} tok/s, prefill {prefill_s:.3f} s, "
              f"step {rows[cell]['decode_step_ms']:.2f} ms", flush=True)
    return rows


# -- the two sides ------------------------------------------------------------------------------------
def transformers_side(directory: str, dtype: torch.dtype, prompts: dict[str, list[list[int]]],
                      new_tokens: dict[int, int], reps: int, deadline: float) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    platform = torchhal.current_platform()
    device = platform.device(platform.current_device())
    for limit in ("recompile_limit", "cache_size_limit"):  # one compile per cell's shapes
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    hf = LlamaForCausalLM.from_pretrained(directory, dtype=dtype)
    hf = hf.to(device).eval()  # type: ignore[arg-type]  # transformers types .to without self
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    def generate(batch_prompts: list[list[int]], new: int) -> list[list[int]]:
        ids = torch.tensor(batch_prompts, device=device)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, cache_implementation="static")
        return out[:, ids.shape[1]:].tolist()

    return timed_cells(generate, prompts, new_tokens, reps, platform.synchronize, deadline)


def engine_config(dtype: torch.dtype) -> EngineConfig:
    """The engine as a user gets it: `EngineConfig`'s defaults (a batch-token budget that takes a
    whole long prompt in one step, the platform's compiled layers, full-graph decode, the KV pool
    sized from the free memory), with the checkpoint's dtype."""
    return EngineConfig(dtype=dtype)


def torchhal_side(directory: str, dtype: torch.dtype, prompts: dict[str, list[list[int]]],
                  new_tokens: dict[int, int], reps: int, deadline: float) -> dict[str, Any]:
    """The engine with its defaults (`engine_config`), timed over the cells."""
    config = engine_config(dtype)
    started = time.perf_counter()
    engine = GenerationEngine.from_checkpoint(directory, config)
    setup_s = time.perf_counter() - started
    attention = getattr(engine, "attention", None)

    def generate(batch_prompts: list[list[int]], new: int) -> list[list[int]]:
        return engine_tokens(engine, batch_prompts, new)

    rows = timed_cells(generate, prompts, new_tokens, reps, engine.platform.synchronize, deadline)
    dense_calls = None
    if engine.platform.name == "cuda":  # which whole-prompt kernel actually ran, not only which was meant to
        from torchhal.plugins import cuda_flash

        dense_calls = {"kernel_calls": dict(cuda_flash.KERNEL_CALLS), "after_run": cuda_flash.describe()}
    rows["_engine"] = {"whole_prompt_attention": dense_calls, "setup_s": setup_s,
                       "kv_slots": engine.kv_sizing.num_slots, "max_batch_tokens": engine.max_batch_tokens,
                       "compile_backend": str(engine.compile_backend),
                       "attention": {"name": getattr(attention, "name", None), "why": getattr(attention, "why", None),
                                     # the platform's line: which kernel whole prompts take, and why
                                     "platform_note": getattr(engine.platform.attention_support, "note", None)},
                       "decode_graphs": None if engine.decode_runner is None else {
                           "unsupported": engine.decode_runner.unsupported,
                           "buckets": [engine.decode_runner.batch_buckets, engine.decode_runner.context_buckets],
                           "capture_s": engine.decode_runner.report.seconds if engine.decode_runner.report else None}}
    return rows


def against(ours: dict[str, Any], earlier: dict[str, Any], name: str) -> dict[str, Any]:
    """This run's torchhal figures per cell as ratios of an earlier run's, and whether each cell is
    within 3% (tokens/s, prefill seconds)."""
    theirs = earlier.get("torchhal", {})
    cells = {}
    for cell, row in ours.items():
        old = theirs.get(cell)
        if cell.startswith("_") or not isinstance(row, dict) or "tok_s" not in row or not old or "tok_s" not in old:
            continue
        tok, prefill = row["tok_s"] / old["tok_s"], row["prefill_s"] / old["prefill_s"]
        cells[cell] = {"tok_s_ratio": tok, "prefill_s_ratio": prefill, "within_3_percent": abs(tok - 1) <= 0.03}
    return {"file": name, "cells": cells, "all_within_3_percent": bool(cells) and all(
        c["within_3_percent"] for c in cells.values())}


def child(job_path: str, answer_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    dtype = getattr(torch, job["dtype"])
    new_tokens = {int(k): v for k, v in job["new_tokens"].items()}
    deadline = time.perf_counter() + job["budget_s"]
    if job["side"] == "peer":
        rows = transformers_side(job["directory"], dtype, job["prompts"], new_tokens, job["reps"], deadline)
    else:
        rows = torchhal_side(job["directory"], dtype, job["prompts"], new_tokens, job["reps"], deadline)
    Path(answer_path).write_text(json.dumps(rows))


def run_side(side: str, job: dict[str, Any], directory: str) -> dict[str, Any]:
    """One side in its own process: compiled graphs and allocators of the two never meet."""
    job_path, answer = Path(directory) / f"{side}_job.json", Path(directory) / f"{side}_answer.json"
    job_path.write_text(json.dumps({**job, "side": side}))
    done = subprocess.run([sys.executable, __file__, "--child-job", str(job_path), "--child-answer", str(answer)],
                          check=False)
    if done.returncode != 0:
        return {"failed": f"the {side} process exited with {done.returncode} (its output is above)"}
    rows: dict[str, Any] = json.loads(answer.read_text())
    return rows


# -- judging --------------------------------------------------------------------------------------------
def judge(results: dict[str, Any]) -> dict[str, Any]:
    """Ratios per cell, bytes per decode step and the issue's goals, each met / missed / not measured."""
    peer, ours = results["transformers_static"], results["torchhal"]
    weights, per_token = results["weight_bytes_per_step"], results["kv_bytes_per_token"]
    copy_bw = results.get("copy_bandwidth_Bps")
    cells: dict[str, Any] = {}
    goals: dict[str, list[Any]] = {"e2e_1_5x": [], "prefill_0_8x": [], "decode_16k_bytes": [],
                                   "batch1_short_bandwidth": []}
    for cell in results["cells"]:
        p, t = peer.get(cell, {}), ours.get(cell, {})
        if "tok_s" not in p or "tok_s" not in t:
            cells[cell] = {"not_measured": p.get("skipped") or t.get("skipped") or p.get("failed") or t.get("failed")}
            continue
        prompt, batch = (int(x) for x in cell.split("x"))
        new = t["new_tokens"]
        mean_context = prompt + new / 2
        step_bytes = weights + batch * mean_context * per_token
        row = {
            "tok_s": {"transformers": p["tok_s"], "torchhal": t["tok_s"], "ratio": t["tok_s"] / p["tok_s"]},
            "prefill_s": {"transformers": p["prefill_s"], "torchhal": t["prefill_s"],
                          "ratio": t["prefill_s"] / p["prefill_s"]},
            "decode_step_ms": {"transformers": p["decode_step_ms"], "torchhal": t["decode_step_ms"]},
            "bytes_per_step": step_bytes,
            "hbm_fraction": {side: step_bytes / (ms / 1e3) / HBM_BYTES_PER_S
                             for side, ms in (("transformers", p["decode_step_ms"]),
                                              ("torchhal", t["decode_step_ms"])) if ms > 0},
            # None when the two sides ran in separate calls (the tokens are not kept in the JSON)
            "rows_token_identical_to_transformers": (
                sum(a == b for a, b in zip(t["tokens"], p["tokens"], strict=True))
                if "tokens" in t and "tokens" in p else None),
        }
        if copy_bw:
            row["copy_bandwidth_fraction"] = {k: v * HBM_BYTES_PER_S / copy_bw for k, v in row["hbm_fraction"].items()}
        cells[cell] = row
        goals["e2e_1_5x"].append((cell, row["tok_s"]["ratio"], row["tok_s"]["ratio"] >= 1.5))
        if prompt >= 3968:
            goals["prefill_0_8x"].append((cell, row["prefill_s"]["ratio"], row["prefill_s"]["ratio"] <= 0.8))
        if prompt >= 16000:
            limit_ms = 1.25 * step_bytes / (0.8 * HBM_BYTES_PER_S) * 1e3
            goals["decode_16k_bytes"].append((cell, t["decode_step_ms"] / limit_ms * 1.25,
                                              t["decode_step_ms"] <= limit_ms))
        if prompt == 32 and batch == 1:
            fraction = row["hbm_fraction"].get("torchhal", 0.0)
            goals["batch1_short_bandwidth"].append((cell, fraction, fraction >= 0.75))
    verdicts = {name: {"cells": [{"cell": c, "value": v, "met": m} for c, v, m in entries],
                       "verdict": ("not measured" if not entries else
                                   "met" if all(m for _, _, m in entries) else "missed")}
                for name, entries in goals.items()}
    return {"cells": cells, "goals": verdicts}


def print_table(judged: dict[str, Any]) -> None:
    print(f"{'cell':>9} | {'tok/s hf':>9} {'torchhal':>9} {'ratio':>6} | {'prefill hf':>10} {'torchhal':>9} "
          f"{'ratio':>6} | {'step ms hf':>10} {'torchhal':>9} | {'HBM frac':>8}")
    for cell, row in judged["cells"].items():
        if "tok_s" not in row:
            print(f"{cell:>9} | not measured: {row['not_measured']}")
            continue
        tok, pre, step = row["tok_s"], row["prefill_s"], row["decode_step_ms"]
        print(f"{cell:>9} | {tok['transformers']:9.1f} {tok['torchhal']:9.1f} {tok['ratio']:6.2f} | "
              f"{pre['transformers']:10.3f} {pre['torchhal']:9.3f} {pre['ratio']:6.2f} | "
              f"{step['transformers']:10.2f} {step['torchhal']:9.2f} | {row['hbm_fraction'].get('torchhal', 0):8.2f}")
    for name, goal in judged["goals"].items():
        print(f"goal {name}: {goal['verdict']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", default="results")
    parser.add_argument("--side", choices=("peer", "torchhal", "both"), default="both")
    parser.add_argument("--peer-json", help="a run's JSON whose other side's figures this run merges")
    parser.add_argument("--cells", help="comma-separated PROMPTxBATCH cells (default: every cell)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per figure after one warm-up")
    parser.add_argument("--budget-s", type=float, default=500.0, help="per side: skip the cells left after this")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on whatever device there is")
    parser.add_argument("--against", help="an earlier run's JSON: this run's torchhal figures as ratios of its")
    parser.add_argument("--child-job", help=argparse.SUPPRESS)
    parser.add_argument("--child-answer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_job:
        child(args.child_job, args.child_answer)
        return {}
    platform = torchhal.current_platform()
    device = platform.device(platform.current_device())
    on_gpu = device.type != "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shape = TINY if args.tiny else LLAMA31_8B
    new_tokens = TINY_NEW if args.tiny else PROMPTS
    cells: tuple[tuple[int, int], ...] = TINY_CELLS if args.tiny else CELLS
    if args.cells:
        try:
            cells = tuple((int(p), int(b)) for p, _, b in (cell.partition("x") for cell in args.cells.split(",")))
        except ValueError:
            parser.error(f"--cells {args.cells!r}: give comma-separated PROMPTxBATCH cells, e.g. 3968x8,16000x1")
        unknown = [f"{p}x{b}" for p, b in cells if p not in new_tokens]
        if unknown:
            parser.error(f"--cells {unknown}: the prompt length must be one of {sorted(new_tokens)}")
    prompts = prompts_for(cells, shape["vocab_size"])
    results: dict[str, Any] = {"platform": platform.name, "device": str(device), "dtype": str(dtype),
                               "shape": shape, "cells": list(prompts), "reps": args.reps,
                               "kv_bytes_per_token": kv_bytes_per_token(shape, dtype)}
    if on_gpu:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        seconds, _ = median_run(lambda: src.clone(), 1, 5, platform.synchronize)
        results["copy_bandwidth_Bps"] = 2 * (1 << 30) / seconds
        del src
    with tempfile.TemporaryDirectory() as directory:
        results["weight_bytes_per_step"] = save_model(shape, dtype, device, directory)
        platform.empty_cache(torchhal.ReleasePoint.USER)
        job = {"directory": directory, "dtype": str(dtype).removeprefix("torch."), "prompts": prompts,
               "new_tokens": new_tokens, "reps": args.reps, "budget_s": args.budget_s}
        for side, key in (("peer", "transformers_static"), ("torchhal", "torchhal")):
            if args.side in (side, "both"):
                print(f"== {key}", flush=True)
                results[key] = run_side(side, job, directory)
    if args.peer_json:
        earlier = json.loads(Path(args.peer_json).read_text())["results"]
        for key in ("transformers_static", "torchhal"):
            results.setdefault(key, earlier.get(key, {}))
    if args.against and "torchhal" in results:
        results["against"] = against(results["torchhal"], json.loads(Path(args.against).read_text())["results"],
                                     args.against)
    if "transformers_static" in results and "torchhal" in results:
        results.update(judge(results))
    for key in ("transformers_static", "torchhal"):  # the tokens were for the comparison only
        for row in results.get(key, {}).values():
            if isinstance(row, dict):
                row.pop("tokens", None)
    name = "long_context" + ("_tiny" if args.tiny else "")
    write_json(name, results, args.out)
    if "goals" in results:
        print_table(results)
    return results


if __name__ == "__main__":
    main()
