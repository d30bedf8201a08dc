"""Which device kernels a windowed full-graph decode step spends its time in.

    python benchmarks/decode_kernels.py [--batches 8 32] [--shapes llama32_1b_shape] [--compile inductor]

Profiles 4 engine steps (windows of 8 decode steps, graphs replayed) per model and batch and
prints the kernels sorted by device time, with the kernel count per decode step. For the
two shapes of decode_vs_transformers.py (random reference weights: the kernels do not
depend on the values). Prints tables only; the figures it explains are in
step_breakdown.json and decode_vs_transformers.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine  # noqa: E402
from torchhal.core.model import ModelConfig  # noqa: E402

SHAPES = {
    "llama_h1024_l8": ModelConfig(vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=16,
                                  intermediate_size=2816),
    "llama32_1b_shape": ModelConfig(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
                                    num_kv_heads=8, intermediate_size=8192, rope_theta=500000.0),
}
WINDOW, ENGINE_STEPS = 8, 4


def profile(config: ModelConfig, batch: int, compile_layers: str | None) -> str:
    graphs = DecodeGraphConfig(batch_buckets=(batch,), context_buckets=(128,), steps_per_sync=WINDOW)
    engine = GenerationEngine(EngineConfig(model=config, dtype=torch.bfloat16, max_kv_slots=16 * 1024,
                                           kv_fraction=0.2, decode_graphs=graphs, compile_layers=compile_layers))
    for i in range(batch):
        engine.add_request([(7 * i + j) % 1000 for j in range(16)], 1 + WINDOW * (ENGINE_STEPS + 2))
    engine.step()  # prefill
    engine.step()  # one window of warm-up
    engine.platform.synchronize()
    with torch.profiler.profile(activities=list(torch.profiler.supported_activities())) as prof:
        for _ in range(ENGINE_STEPS):
            engine.step()
        engine.platform.synchronize()
    cpu = torch.autograd.DeviceType.CPU
    kernels = [e for e in prof.key_averages() if getattr(e, "device_type", cpu) != cpu]  # device-side events
    total = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    steps = WINDOW * ENGINE_STEPS
    lines = [f"device time per decode step {total / steps / 1e3:.3f} ms, kernels per decode step "
             f"{launches / steps:.0f}"]
    lines.append(prof.key_averages().table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="*", default=[8, 32])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--compile", metavar="BACKEND", help="compiled layers (EngineConfig.compile_layers)")
    args = parser.parse_args()
    for name in args.shapes:
        for batch in args.batches:
            label = f", layers compiled ({args.compile})" if args.compile else ""
            print(f"== {name}, batch {batch}, windows of {WINDOW}{label}", flush=True)
            print(profile(SHAPES[name], batch, args.compile), flush=True)
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
