"""torchhal decode vs transformers' `generate`, side by side in one run, on the same weights.

    python benchmarks/decode_vs_transformers.py [--out results] [--quick] [--tiny] [--budget-s 450]
        [--compile inductor]

For each model shape (8-layer hidden-1024 Llama; Llama-3.2-1B-shaped with GQA), a random-weight
`LlamaForCausalLM` is saved and loaded into torchhal, then greedy generation of 64 new tokens
from 16-token prompts at batch 1, 8, 32 is timed (median of >= 3 runs after warm-up) for:
transformers eager `generate`; transformers `generate(cache_implementation="static")` (compiled
decode on a GPU; its compile is timed apart); torchhal engine eager, breakable graphs, full-graph
decode reading tokens back every step, and full-graph decode in windows of `--window` (8)
steps per read-back (`DecodeGraphConfig.steps_per_sync`, same runner and graphs). Also: HBM
copy bandwidth and the batch-1 fraction of it that decode reaches (weight bytes read per step / step time), graph
capture time and pool memory, and per-row token checks (torchhal paths against each other and
against transformers' greedy output). `--compile BACKEND` then compiles torchhal's layers
(`LlamaDecoder.compile_layers`), recaptures the decode graphs and runs eager and windows
again in the same run (the breakable prefill graphs and the decode graphs captured again).

transformers runs in a child process on the saved checkpoint: its compiled decode captures
CUDA graphs through inductor's graph trees, which corrupted graphs captured beforehand by
torch.cuda.graph in the same process (seen on the H100: an illegal address at the next
replay of torchhal's graphs). Separate processes keep both sides' allocators apart.

`--tiny` runs tiny shapes on whatever device there is (CPU: float32, no compile, graph rows
skipped with their reason and full-graph decode emulated), so the script is checked end to end
before it meets a GPU. `--budget-s` skips the remaining rows (with that reason) once spent.
"""

from __future__ import annotations

import argparse
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
from _harness import median_run, random_llama, write_json  # noqa: E402

import torchhal  # noqa: E402
from torchhal.core.engine import DecodeGraphConfig, EagerRunner, EngineConfig, GenerationEngine  # noqa: E402
from torchhal.core.graphs import GraphRunner  # noqa: E402
from torchhal.core.graphs.decode import DecodeGraphRunner  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 16, 64
BATCHES = (1, 8, 32)
SHAPES: dict[str, dict[str, int]] = {
    "llama_h1024_l8": dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                           num_key_value_heads=16, intermediate_size=2816),
    "llama32_1b_shape": dict(vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                             num_key_value_heads=8, intermediate_size=8192),
}
TINY_SHAPES: dict[str, dict[str, int]] = {
    "tiny_mha": dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, intermediate_size=128),
    "tiny_gqa": dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128),
}
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
CONTEXT_BUCKETS = (128, 256)
PREFILL_BUCKETS = (8, 16, 32, 64, 128, 256, 512)


def run_engine(engine: GenerationEngine, prompts: list[list[int]], new_tokens: int) -> tuple[
        list[list[int]], float, float]:
    """Outputs, total seconds, and seconds after the first (prefill) step."""
    rids = [engine.add_request(p, new_tokens) for p in prompts]
    engine.platform.synchronize()
    start = time.perf_counter()
    engine.step()
    engine.platform.synchronize()
    after_prefill = time.perf_counter()
    while any(rid not in engine.results for rid in rids):
        engine.step()
    engine.platform.synchronize()
    end = time.perf_counter()
    return [list(engine.results.pop(rid).output) for rid in rids], end - start, end - after_prefill


# -- model construction ----------------------------------------------------------------------------
def hf_model(shape: dict[str, int], dtype: torch.dtype, device: torch.device, seed: int = 0) -> Any:
    """A random-weight LlamaForCausalLM whose greedy choices are decisive (weights with spread)."""
    return random_llama(shape, dtype, device, seed)


def torchhal_engine(directory: str, dtype: torch.dtype, max_kv_slots: int,
                    decode_graphs: DecodeGraphConfig) -> GenerationEngine:
    """A torchhal engine serving the checkpoint in `directory` (written by save_pretrained)."""
    return GenerationEngine.from_checkpoint(
        directory, EngineConfig(dtype=dtype, max_kv_slots=max_kv_slots, decode_graphs=decode_graphs)
    )


# -- the peer, in its own process ----------------------------------------------------------------------
def run_peers(directory: str, dtype: torch.dtype, prompts: dict[int, list[list[int]]], warmups: int, reps: int,
              budget_s: float) -> dict[str, Any]:
    """transformers eager and static-cache `generate` on the checkpoint, in a child process."""
    job = Path(directory) / "peer_job.json"
    answer = Path(directory) / "peer_answer.json"
    job.write_text(json.dumps({"directory": directory, "dtype": str(dtype).removeprefix("torch."),
                               "prompts": {str(b): p for b, p in prompts.items()}, "warmups": warmups,
                               "reps": reps, "budget_s": budget_s}))
    done = subprocess.run([sys.executable, __file__, "--peer-job", str(job), "--peer-answer", str(answer)],
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the transformers child process failed (exit {done.returncode})")
    answer_data: dict[str, Any] = json.loads(answer.read_text())
    return answer_data


def peer_child(job_path: str, answer_path: str) -> None:
    """Child: load the checkpoint in transformers and time eager and static-cache generate per batch."""
    from transformers import LlamaForCausalLM

    job = json.loads(Path(job_path).read_text())
    platform = torchhal.current_platform()
    device = platform.device(platform.current_device())
    sync = platform.synchronize
    on_gpu = device.type != "cpu"
    for limit in ("recompile_limit", "cache_size_limit"):  # one compile per batch size
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    hf = LlamaForCausalLM.from_pretrained(job["directory"], dtype=getattr(torch, job["dtype"]))
    hf = hf.to(device).eval()  # type: ignore[arg-type]  # transformers types .to without self
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    started, rows = time.perf_counter(), dict[int, Any]()
    for batch, batch_prompts in job["prompts"].items():
        if time.perf_counter() - started > job["budget_s"]:
            rows[batch] = {"skipped": "time budget spent (--budget-s)"}
            continue
        ids = torch.tensor(batch_prompts, device=device)
        mask = torch.ones_like(ids)

        def hf_generate(new: int = NEW_TOKENS, ids: torch.Tensor = ids, mask: torch.Tensor = mask,
                        **kw: Any) -> list[list[int]]:
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kw)
            return out[:, PROMPT_LEN:].tolist()

        b = len(batch_prompts)
        eager_s, eager_out = median_run(hf_generate, job["warmups"], job["reps"], sync)
        compile_start = time.perf_counter()
        hf_generate(cache_implementation="static")
        sync()
        compile_s = time.perf_counter() - compile_start
        static_s, static_out = median_run(lambda: hf_generate(cache_implementation="static"),
                                          job["warmups"], job["reps"], sync)
        one_token_s, _ = median_run(lambda: hf_generate(1, cache_implementation="static"), 1, job["reps"], sync)
        rows[batch] = {
            "transformers_eager": {"tok_s": b * NEW_TOKENS / eager_s, "s": eager_s},
            "transformers_static": {"tok_s": b * NEW_TOKENS / static_s, "s": static_s, "first_call_s": compile_s,
                                    "compiled": on_gpu,
                                    "decode_step_ms": (static_s - one_token_s) / (NEW_TOKENS - 1) * 1e3},
            "outputs": {"transformers_eager": eager_out, "transformers_static": static_out},
        }
    Path(answer_path).write_text(json.dumps(rows))


# -- timing ------------------------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, sync: Callable[[], None]) -> float | None:
    """Device memory bandwidth in bytes/s from a 1 GiB copy (read + write); None on the host."""
    if device.type == "cpu":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds, _ = median_run(lambda: dst.copy_(src), 3, 10, sync)
    return 2 * (1 << 30) / seconds


def first_mismatch(a: list[int], b: list[int]) -> int:
    """Index of the first differing token; -1 when identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def compare(rows: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    firsts = [first_mismatch(r, e) for r, e in zip(rows, reference, strict=True)]
    return {"identical": all(f == -1 for f in firsts), "rows_identical": sum(f == -1 for f in firsts),
            "first_mismatch_per_row": firsts}


# -- one shape -----------------------------------------------------------------------------------------
class Budget:
    """A deadline; a shape may spend its share of what is left (what one shape leaves, the next gets)."""

    def __init__(self, seconds: float) -> None:
        self.start = time.perf_counter()
        self.deadline = self.start + seconds

    def share(self, parts: int) -> Budget:
        return Budget((self.deadline - time.perf_counter()) / max(parts, 1))

    def left(self) -> bool:
        return time.perf_counter() < self.deadline

    def remaining(self) -> float:
        return max(self.deadline - time.perf_counter(), 0.0)


def bench_shape(name: str, shape: dict[str, int], args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    platform = torchhal.current_platform()
    device = platform.device(platform.current_device())
    sync = platform.synchronize
    on_gpu = device.type != "cpu"
    dtype = torch.bfloat16 if on_gpu and not args.float32 else torch.float32
    warmups, reps = (1, 3) if args.quick or args.tiny else (2, 5)
    result: dict[str, Any] = {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "rows": {}}
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(0, shape["vocab_size"], (b, PROMPT_LEN), generator=generator).tolist()
               for b in BATCHES}
    with tempfile.TemporaryDirectory() as directory:
        hf = hf_model(shape, dtype, device)
        params = sum(p.numel() * p.element_size() for p in hf.parameters())
        embed = hf.model.embed_tokens.weight
        result["weight_bytes_read_per_step"] = params - embed.numel() * embed.element_size()  # all but embeddings
        hf.save_pretrained(directory)
        del hf, embed
        gc.collect()
        platform.empty_cache(torchhal.ReleasePoint.USER)
        peers = run_peers(directory, dtype, prompts, warmups, reps, budget.remaining() * 0.5)
        max_slots = max(BATCHES) * (PROMPT_LEN + NEW_TOKENS) * 2 + 64
        decode_graphs = DecodeGraphConfig(batch_buckets=BATCH_BUCKETS, context_buckets=CONTEXT_BUCKETS,
                                          steps_per_sync=args.window, emulate=not on_gpu)
        engine = torchhal_engine(directory, dtype, max_slots, decode_graphs)
    result["weights"] = "save_pretrained; transformers from_pretrained (child process), torchhal load_checkpoint"
    result["setup_s"] = time.perf_counter() - started

    # torchhal runners: eager, breakable graphs (prefill + decode), and full-graph decode.
    eager_runner = EagerRunner(engine.model)
    graph_runner = GraphRunner(engine.model, engine.platform, engine.device_index,
                               hidden_size=engine.model.config.hidden_size, dtype=dtype, buckets=PREFILL_BUCKETS)
    decode_runner = engine.decode_runner  # the engine's; modes without it detach it for their runs
    assert decode_runner is not None
    result["breakable_graphs"] = (
        {"reason_eager": graph_runner.eager_reason} if graph_runner.report is None else
        {"graphs": graph_runner.report.graphs, "capture_s": graph_runner.report.seconds,
         "pool_bytes": graph_runner.report.pool_bytes})
    result["full_graph_decode"] = (
        {"unsupported": decode_runner.unsupported, "emulated": decode_runner.emulate}
        if decode_runner.report is None else
        {"graphs": decode_runner.report.graphs, "batch_buckets": list(decode_runner.report.batch_buckets),
         "context_buckets": list(decode_runner.report.context_buckets), "capture_s": decode_runner.report.seconds,
         "pool_bytes": decode_runner.report.pool_bytes})
    modes: dict[str, tuple[Any, DecodeGraphRunner | None, int]] = {  # runner, decode runner, steps per sync
        "torchhal_eager": (eager_runner, None, 1),
        "torchhal_breakable_graphs": (graph_runner, None, 1),
        "torchhal_full_graph_decode": (graph_runner, decode_runner, 1),
        "torchhal_full_graph_window": (graph_runner, decode_runner, args.window),
    }
    full_graph_real = decode_runner.graphs_enabled
    phases: list[tuple[str | None, dict[str, tuple[Any, DecodeGraphRunner | None, int]]]] = [(None, modes)]
    if args.compile:
        # Compiled layers: the breakable prefill graphs and the decode graphs are captured again,
        # so both hold the compiled kernels (tokens must match the compiled eager path).
        phases.append((args.compile, {"torchhal_compiled_eager": (eager_runner, None, 1),
                                      "torchhal_compiled_window": (graph_runner, decode_runner, args.window)}))
    outputs_by_batch: dict[int, dict[str, list[list[int]]]] = {}
    for backend, phase_modes in phases:
        if backend is not None:
            engine.executor.runner, engine.executor.decode = eager_runner, decode_runner
            compile_started = time.perf_counter()
            engine.model.compile_layers(backend)  # type: ignore[attr-defined]  # LlamaDecoder's, not the protocol's
            report = decode_runner.capture() if full_graph_real else None  # compiles in the warm-ups
            prefill = graph_runner.capture() if graph_runner.report is not None else None
            result["compiled_layers"] = {
                "backend": backend, "compile_and_capture_s": time.perf_counter() - compile_started,
                "graphs": report.graphs if report else None, "pool_bytes": report.pool_bytes if report else None,
                "prefill_graphs": prefill.graphs if prefill else None}
        for batch in BATCHES:
            row = result["rows"].setdefault(f"batch{batch}", {})
            if "skipped" in row:
                continue
            if not budget.left():
                row.setdefault("skipped_modes", []).extend(phase_modes)
                if backend is None:
                    row["skipped"] = "time budget spent (--budget-s)"
                continue
            peer_row = peers.get(str(batch), {"skipped": "no transformers figures"})
            if "skipped" in peer_row:
                row["skipped"] = peer_row["skipped"]
                continue
            outputs = outputs_by_batch.setdefault(batch, dict(peer_row["outputs"]))
            row["transformers_eager"] = peer_row["transformers_eager"]
            row["transformers_static"] = peer_row["transformers_static"]
            for mode, (runner, decode, steps_per_sync) in phase_modes.items():
                if mode == "torchhal_breakable_graphs" and graph_runner.report is None:
                    row[mode] = {"skipped": graph_runner.eager_reason}
                if decode is not None and not full_graph_real:
                    row[mode] = {"skipped": decode_runner.unsupported or "graphs emulated on this device (tokens only)"}
                engine.executor.runner, engine.executor.decode = runner, decode
                decode_runner.steps_per_sync = steps_per_sync

                def run(prompts: list[list[int]] = prompts[batch]) -> tuple[list[list[int]], float, float]:
                    return run_engine(engine, prompts, NEW_TOKENS)

                seconds, (outputs[mode], total, decode_s) = median_run(run, warmups, reps, sync)
                if mode in row:  # skipped rows still produce tokens (eager or emulated) for the checks
                    continue
                row[mode] = {"tok_s": batch * NEW_TOKENS / seconds, "s": seconds,
                             "decode_step_ms": decode_s / (NEW_TOKENS - 1) * 1e3}
    for batch, outputs in outputs_by_batch.items():
        row = result["rows"][f"batch{batch}"]
        peer = row["transformers_static"]["tok_s"]
        for mode in outputs:
            if isinstance(row.get(mode), dict) and "tok_s" in row[mode] and mode.startswith("torchhal"):
                row[mode]["x_transformers_static"] = row[mode]["tok_s"] / peer
        reference = outputs["transformers_eager"]
        row["tokens"] = {mode: compare(outputs[mode], reference) for mode in outputs if mode != "transformers_eager"}
        for graph_mode, eager_mode, label in (
            ("torchhal_full_graph_decode", "torchhal_eager", "torchhal_full_graph_vs_eager"),
            ("torchhal_full_graph_window", "torchhal_eager", "torchhal_window_vs_eager"),
            ("torchhal_breakable_graphs", "torchhal_eager", "torchhal_breakable_vs_eager"),
            ("torchhal_compiled_window", "torchhal_compiled_eager", "torchhal_compiled_window_vs_compiled_eager"),
        ):
            if graph_mode in outputs and eager_mode in outputs:
                row["tokens"][label] = compare(outputs[graph_mode], outputs[eager_mode])
        print(f"{name} batch {batch}: " + ", ".join(
            f"{mode} {row[mode]['tok_s']:.0f}" for mode in row if isinstance(row[mode], dict) and "tok_s" in row[mode]
        ) + " tok/s", flush=True)
    result["seconds"] = time.perf_counter() - started
    return result  # the models go with this frame; main collects before the next shape


def bandwidth_summary(result: dict[str, Any], copy_bw: float | None) -> None:
    """Batch-1 decode: weight bytes per step / step time, as a fraction of copy bandwidth."""
    row = result.get("rows", {}).get("batch1", {})
    weight_bytes = result.get("weight_bytes_read_per_step")
    if copy_bw is None or weight_bytes is None:
        result["bandwidth"] = {"skipped": "no device copy bandwidth (host run)"}
        return
    floor_ms = weight_bytes / copy_bw * 1e3
    summary: dict[str, Any] = {"copy_bandwidth_GBps": copy_bw / 1e9, "floor_step_ms": floor_ms}
    for mode in ("transformers_static", "torchhal_breakable_graphs", "torchhal_full_graph_decode",
                 "torchhal_full_graph_window", "torchhal_compiled_window"):
        step_ms = row.get(mode, {}).get("decode_step_ms")
        if step_ms:
            summary[mode] = {"step_ms": step_ms, "fraction_of_copy_bandwidth": floor_ms / step_ms}
    peer = summary.get("transformers_static")
    if peer:
        # 1.5x the peer's step rate needs a step of peer/1.5; below the floor that cannot happen.
        summary["goal_1_5x_feasible_at_batch1"] = peer["step_ms"] / 1.5 >= floor_ms
    result["bandwidth"] = summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", default="results")
    parser.add_argument("--quick", action="store_true", help="1 warm-up and 3 timed runs per row")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes; runs on the host (graph rows skipped)")
    parser.add_argument("--float32", action="store_true", help="float32 instead of bfloat16 on a GPU")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="skip remaining rows after this many seconds (split between shapes)")
    parser.add_argument("--shapes", nargs="*", help="subset of shape names")
    parser.add_argument("--window", type=int, default=8, help="steps_per_sync of the windowed mode")
    parser.add_argument("--compile", metavar="BACKEND",
                        help="also run torchhal eager and windows with compiled layers (e.g. inductor), "
                             "after the uncompiled rows, in the same run")
    parser.add_argument("--peer-job", help=argparse.SUPPRESS)  # internal: the transformers child process
    parser.add_argument("--peer-answer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer_job:
        peer_child(args.peer_job, args.peer_answer)
        return {}
    budget = Budget(args.budget_s)
    for limit in ("recompile_limit", "cache_size_limit"):  # one compile per model and batch size
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    platform = torchhal.current_platform()
    device = platform.device(platform.current_device())
    copy_bw = copy_bandwidth(device, platform.synchronize)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    chosen = {k: v for k, v in shapes.items() if not args.shapes or k in args.shapes}
    results: dict[str, Any] = {"platform": platform.name, "window": args.window, "compile": args.compile,
                               "prompt_tokens": PROMPT_LEN, "new_tokens": NEW_TOKENS,
                               "batches": list(BATCHES), "quick": args.quick, "tiny": args.tiny,
                               "copy_bandwidth_GBps": copy_bw / 1e9 if copy_bw else None, "shapes": {}}
    for index, (name, shape) in enumerate(chosen.items()):
        result = bench_shape(name, shape, args, budget.share(len(chosen) - index))
        bandwidth_summary(result, copy_bw)
        results["shapes"][name] = result
        gc.collect()
        if hasattr(torch, "_dynamo"):
            torch._dynamo.reset()  # compiled code of a freed model must not count against the next one
    results["total_s"] = time.perf_counter() - budget.start
    write_json("decode_vs_transformers" + ("_tiny" if args.tiny else ""), results, args.out)
    return results


if __name__ == "__main__":
    main()
