"""Sleep and wake of an 8B-shaped engine, against torch_memory_saver and the copy floor.

    python benchmarks/sleep_wake.py [--out DIR] [--cycles 2] [--rl-iterations 20] [--tiny]
        [--buckets default|1,8] [--compile | --no-compile] [--idle-before-wake 1.0]

The engine is the Llama-3.1-8B shape in bf16 (seeded random weights drawn on the device),
full-graph decode, compiled layers where the platform compiles by default, the KV pool sized as
the engine sizes it by default. Per sleep level and cycle it reports the sleep time, the device
memory in use asleep (`memory_info`: total - free; `engine_*_bytes` less what is not the
engine's: the context and the trainer's device copy of the weights), the wake time per tag, the time to the first
token after wake, how many graphs were captured on wake, and whether the tokens after wake equal
those before sleep. Between sleep and wake the device idles `--idle-before-wake` seconds, where
an RL loop's trainer steps: the driver clears the physical memory a release gave back on a copy
engine (on an H200 about 2 ms a GB, after the call has returned), and a copy issued meanwhile
shares that engine. One more level-1 cycle wakes at once after the sleep
(`level1_back_to_back`) and shows what that costs. Beside it, in the same process and on the same weights' bytes:

- the floor: a device -> pinned host and a pinned host -> device copy of the weights' bytes;
- the peer: `torch_memory_saver` (pip package, `hook_mode="torch"`) on a tensor of the
  weights' size with CPU backup: `pause` and `resume`.

The RL-shaped loop (`--rl-iterations`): sleep (level 2) -> a trainer-like allocation filling
>= 90% of the free device memory -> free -> wake the weights -> `update_weights_from_tensors`
-> wake the KV cache -> generate; reserved memory, tokens and OOMs per iteration.

`--tiny` runs a tiny model on whatever device there is, so the script is checked end to end
without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _harness import write_json  # noqa: E402

import torchhal  # noqa: E402
from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine  # noqa: E402
from torchhal.core.model import LlamaDecoder, ModelConfig  # noqa: E402
from torchhal.core.model.config import Llama3RopeScaling  # noqa: E402

GiB = 1 << 30
LLAMA31_8B = ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                         intermediate_size=14336, max_position=32768, rope_theta=500000.0, rms_eps=1e-5,
                         rope_scaling=Llama3RopeScaling())
TINY = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
PROMPTS = [[(7 * i + 3 * j) % 200 + 1 for j in range(24)] for i in range(8)]
NEW_TOKENS = 16


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaDecoder:
    """Seeded random weights drawn on the device (no host copy of 15 GiB)."""
    with torch.device("meta"):
        model = LlamaDecoder(config)
    model.to(dtype).materialize(device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            std = 1.0 if "embed" in name else 1.0 / math.sqrt(parameter.shape[-1])
            parameter.normal_(std=std, generator=generator) if parameter.dim() > 1 else parameter.fill_(1.0)
    model.process_weights()
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def in_use(platform: Any, index: int) -> int:
    info = platform.memory_info(index)
    return int(info.total - info.free)


def timed(fn: Any, sync: Any) -> tuple[float, Any]:
    sync()
    started = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - started, out


def tokens(engine: GenerationEngine) -> list[list[int]]:
    return [list(r.output) for r in engine.generate(PROMPTS, NEW_TOKENS)]


def captures(engine: GenerationEngine) -> int:
    runner = engine.decode_runner
    return int(getattr(runner, "captures", 0)) if runner is not None else 0


def copy_floor(nbytes: int, device: torch.device, sync: Any) -> dict[str, float]:
    """Device -> pinned host and pinned host -> device copies of `nbytes`, medians of 3."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    host = host.pin_memory() if device.type != "cpu" else host
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    down = [timed(lambda: host.copy_(dev, non_blocking=True), sync)[0] for _ in range(3)]
    up = [timed(lambda: dev.copy_(host, non_blocking=True), sync)[0] for _ in range(3)]
    return {"device_to_host_s": statistics.median(down), "host_to_device_s": statistics.median(up),
            "device_to_host_GBps": nbytes / statistics.median(down) / 1e9,
            "host_to_device_GBps": nbytes / statistics.median(up) / 1e9}


def peer(nbytes: int, device: torch.device, sync: Any, cycles: int) -> dict[str, Any]:
    """torch_memory_saver on a tensor of `nbytes`, CPU backup on: pause and resume per cycle."""
    try:
        from torch_memory_saver import torch_memory_saver as saver
    except ImportError as exc:
        return {"skipped": f"torch_memory_saver is not installed ({exc})"}
    saver.hook_mode = "torch"
    with saver.region(tag="weights", enable_cpu_backup=True):
        weights = torch.empty(nbytes, dtype=torch.uint8, device=device)
    weights.random_(0, 255)
    check = weights[:: 1 << 20].clone()
    rows = []
    for _ in range(cycles):
        pause_s, _ = timed(lambda: saver.pause("weights"), sync)
        resume_s, _ = timed(lambda: saver.resume("weights"), sync)
        exact = bool(torch.equal(weights[:: 1 << 20], check))
        rows.append({"pause_s": pause_s, "resume_s": resume_s, "bit_exact": exact})
    del weights
    return {"cycles": rows}


def sleep_cycles(engine: GenerationEngine, level: int, cycles: int, reference: list[list[int]],
                 outside: int, idle_s: float) -> list[dict[str, Any]]:
    """`outside`: the device bytes in use that are not the engine's (the context, the trainer's copy);
    `idle_s`: the device's idle time between sleep and wake (the trainer's step)."""
    platform, index = engine.platform, engine.device_index
    sync = lambda: platform.synchronize(index)  # noqa: E731
    rows = []
    for _ in range(cycles):
        awake = in_use(platform, index)
        captured = captures(engine)
        sleep_s, _ = timed(lambda: engine.release_memory_occupation(level=level), sync)
        asleep = in_use(platform, index)
        row: dict[str, Any] = {"level": level, "sleep_s": sleep_s, "in_use_awake_bytes": awake,
                               "in_use_asleep_bytes": asleep,
                               "engine_awake_bytes": awake - outside, "engine_asleep_bytes": asleep - outside,
                               # what stays: the allocator's reserve (graph buffers, workspaces) beside the context
                               "allocator_reserved_asleep_bytes": platform.memory_info(index).reserved,
                               "idle_before_wake_s": idle_s}
        time.sleep(idle_s)
        row["wake_weights_s"], _ = timed(lambda: engine.resume_memory_occupation(tags=("weights",)), sync)
        if level == 2:  # the weights come back through an update (the trainer's), here the same values
            row["update_s"], _ = timed(lambda: engine.update_weights_from_tensors(SAVED_WEIGHTS), sync)
        row["wake_kv_cache_s"], _ = timed(lambda: engine.resume_memory_occupation(tags=("kv_cache",)), sync)
        row["wake_s"] = row["wake_weights_s"] + row["wake_kv_cache_s"]
        row["first_token_s"], _ = timed(lambda: engine.generate([PROMPTS[0]], 1), sync)
        row["graphs_captured_on_wake"] = captures(engine) - captured
        row["tokens_equal"] = tokens(engine) == reference
        rows.append(row)
    return rows


SAVED_WEIGHTS: dict[str, torch.Tensor] = {}


def rl_loop(engine: GenerationEngine, iterations: int, reference: list[list[int]]) -> dict[str, Any]:
    """Sleep (level 2) -> the trainer fills >= 90% of the free memory and gives it back -> wake the
    weights -> the trainer's update -> wake the KV cache -> generate, `iterations` times."""
    platform, index = engine.platform, engine.device_index
    in_use, rows = [], []
    for _ in range(iterations):
        engine.release_memory_occupation(level=2)
        free = platform.memory_info(index).free
        trainer = torch.empty(int(free * 0.9), dtype=torch.uint8, device=engine.device)
        trainer.fill_(1)
        del trainer
        platform.empty_cache(torchhal.ReleasePoint.USER, index)  # the trainer hands its memory back
        wake_s, _ = timed(lambda: engine.resume_memory_occupation(tags=("weights",)), lambda: None)
        update_s, _ = timed(lambda: engine.update_weights_from_tensors(SAVED_WEIGHTS), lambda: None)
        engine.resume_memory_occupation(tags=("kv_cache",))
        ok = tokens(engine) == reference
        info = platform.memory_info(index)
        in_use.append(int(info.total - info.free))
        rows.append({"tokens_equal": ok, "in_use_bytes": in_use[-1], "reserved_bytes": info.reserved,
                     "trainer_bytes": int(free * 0.9), "wake_weights_s": wake_s, "update_s": update_s})
    return {"iterations": rows, "in_use_spread_fraction": (max(in_use) - min(in_use)) / max(in_use),
            "all_tokens_equal": all(r["tokens_equal"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--rl-iterations", type=int, default=20)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--buckets", default="default", help="decode-graph batch buckets: default or e.g. 1,8")
    parser.add_argument("--idle-before-wake", type=float, default=1.0,
                        help="seconds the device idles between sleep and wake, as under a trainer's step")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compiled layers (default: the engine's default)")
    args = parser.parse_args()

    platform = torchhal.current_platform()
    index = platform.current_device()
    device = platform.device(index)
    on_gpu = platform.graph_support is not None and not args.tiny
    torch.empty(1, device=device)  # the context, before anything of the engine
    context = in_use(platform, index)
    config, dtype = (TINY, torch.float32) if args.tiny else (LLAMA31_8B, torch.bfloat16)
    model = build_model(config, dtype, device)
    nbytes = weight_bytes(model)
    # The trainer's weights, on the device (a co-located trainer sends device tensors).
    SAVED_WEIGHTS.update({name: p.detach().clone() for name, p in model.named_parameters()})
    outside = context + sum(t.numel() * t.element_size() for t in SAVED_WEIGHTS.values())  # not the engine's
    graphs = (DecodeGraphConfig(emulate=not on_gpu) if args.buckets == "default" else
              DecodeGraphConfig(batch_buckets=tuple(int(b) for b in args.buckets.split(",")), emulate=not on_gpu))
    extra: dict[str, Any] = {}
    if args.compile is not None:
        extra["compile_layers"] = "inductor" if args.compile else None
    started = time.perf_counter()
    engine = GenerationEngine(EngineConfig(dtype=dtype, decode_graphs=graphs, **extra), platform=platform, model=model)
    build_s = time.perf_counter() - started
    reference = tokens(engine)
    sync = lambda: platform.synchronize(index)  # noqa: E731
    results: dict[str, Any] = {
        "platform": platform.name, "device": str(device), "dtype": str(dtype), "weight_bytes": nbytes,
        "in_use_before_the_engine_bytes": context, "trainer_copy_bytes": outside - context,
        "engine_build_s": build_s, "kv_pool_bytes": engine.kv_sizing.num_blocks * engine.kv_sizing.bytes_per_block,
        "decode_graph_buckets": None if engine.decode_runner is None else
        [list(engine.decode_runner.batch_buckets), list(engine.decode_runner.context_buckets)],
        "sleep_mode": engine.occupation.describe(),
        "compile": engine.config.compile_layers is not None,
    }
    results["level1"] = sleep_cycles(engine, 1, args.cycles, reference, outside, args.idle_before_wake)
    results["level1_back_to_back"] = sleep_cycles(engine, 1, 1, reference, outside, 0.0)
    results["level2"] = sleep_cycles(engine, 2, args.cycles, reference, outside, args.idle_before_wake)
    results["rl_loop"] = rl_loop(engine, args.rl_iterations, reference)
    rl = results["rl_loop"]
    print("rl loop", {"iterations": len(rl["iterations"]), "all_tokens_equal": rl["all_tokens_equal"],
                      "in_use_spread_fraction": round(rl["in_use_spread_fraction"], 5)})
    engine.close()
    del engine, model
    gc.collect()
    platform.empty_cache(torchhal.ReleasePoint.USER, index)
    results["floor"] = copy_floor(nbytes, device, sync)
    if on_gpu:
        results["torch_memory_saver"] = peer(nbytes, device, sync, args.cycles)
    write_json("sleep_wake" + ("_tiny" if args.tiny else ""), results, args.out)
    for level in ("level1", "level1_back_to_back", "level2"):
        for row in results.get(level, []):
            print(level, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    print("floor", results["floor"])
    print("peer", results.get("torch_memory_saver"))


if __name__ == "__main__":
    main()
