"""Eager vs breakable graph replay of the reference model's layer stack, and decode tokens/s.

    python benchmarks/graph_runner.py [--out results] [--quick]

For bs in {1, 8, 16} and 8..512 total tokens (bs <= tokens), at two model sizes:
median forward time of the layer stack (embedding + stack, metadata prebuilt),
eager vs GraphRunner; and the scheduler's decode tokens/s at batch 8.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _harness import write_json  # noqa: E402

import torchhal  # noqa: E402
from torchhal.core.engine import EagerRunner, EngineConfig, GenerationEngine  # noqa: E402
from torchhal.core.graphs import GraphRunner  # noqa: E402
from torchhal.core.model import AttentionMetadata, ModelConfig  # noqa: E402

SIZES = {
    "h1024_l8": ModelConfig(vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=16, intermediate_size=2816),
    "h2048_l24": ModelConfig(vocab_size=32000, hidden_size=2048, num_layers=24, num_heads=16, intermediate_size=5632),
}
BUCKETS = (8, 16, 32, 64, 128, 256, 512)
CONTEXT = 128  # tokens already in each sequence's KV


def paired(eager_fn, graph_fn, platform, iters: int) -> tuple[float, float, float]:
    """Median eager ms, median graph ms, and the median of per-pair ratios.

    Samples alternate eager/graph so clock or host drift hits both sides alike.
    """
    for _ in range(3):
        eager_fn()
        graph_fn()
    platform.synchronize()
    eager: list[float] = []
    graph: list[float] = []
    for _ in range(iters):
        for fn, samples in ((eager_fn, eager), (graph_fn, graph)):
            start = time.perf_counter()
            fn()
            platform.synchronize()
            samples.append(time.perf_counter() - start)
    ratios = [e / g for e, g in zip(eager, graph, strict=True)]
    return statistics.median(eager) * 1e3, statistics.median(graph) * 1e3, statistics.median(ratios)


def make_factory(buckets):
    def make(engine):
        return GraphRunner(engine.model, engine.platform, engine.device_index,
                           hidden_size=engine.model_config.hidden_size, dtype=engine.config.dtype, buckets=buckets)

    return make


def stack_times(name: str, config: ModelConfig, iters: int) -> dict:
    engine = GenerationEngine(EngineConfig(model=config, dtype=torch.bfloat16, max_kv_slots=64 * 1024,
                                           kv_fraction=0.2), runner_factory=make_factory(BUCKETS))
    runner, eager, platform = engine.runner, EagerRunner(engine.model), engine.platform
    assert isinstance(runner, GraphRunner)  # make_factory's
    rows = []
    for bs in (1, 8, 16):
        for tokens in (8, 16, 32, 64, 128, 256, 512):
            if tokens < bs:
                continue
            counts = [tokens // bs + (1 if i < tokens % bs else 0) for i in range(bs)]
            block = engine.config.kv_block_size
            tables, lengths, base = [], [], 1  # block 0 is the scratch block
            for c in counts:
                need = -(-(CONTEXT + c) // block)
                tables.append(list(range(base, base + need)))
                lengths.append(CONTEXT + c)
                base += need
            meta = AttentionMetadata.build(tables, lengths, counts, block, engine.device, engine.attention.backend)
            ids = torch.randint(0, config.vocab_size, (tokens,), device=engine.device)
            with torch.no_grad():
                eager_ms, graph_ms, speedup = paired(
                    lambda ids=ids, meta=meta: eager.forward(ids, meta),
                    lambda ids=ids, meta=meta: runner.forward(ids, meta),
                    platform, iters,
                )
            rows.append({"bs": bs, "tokens": tokens, "eager_ms": eager_ms, "graph_ms": graph_ms, "speedup": speedup})
            print(f"{name} bs={bs:>2} tokens={tokens:>3}: eager {eager_ms:.3f} ms, graphs {graph_ms:.3f} ms, "
                  f"{speedup:.2f}x (median of paired ratios)", flush=True)
    report = runner.report
    assert report is not None, runner.eager_reason  # captured at construction unless it runs eager
    return {"rows": rows, "graphs": report.graphs, "buckets": list(report.buckets),
            "capture_s": report.seconds, "pool_bytes": report.pool_bytes}


def decode_tokens_per_s(config: ModelConfig, batch: int, graphs: bool, new_tokens: int = 64) -> float:
    factory = make_factory(BUCKETS) if graphs else None
    engine = GenerationEngine(EngineConfig(model=config, dtype=torch.bfloat16, max_kv_slots=64 * 1024,
                                           kv_fraction=0.2), runner_factory=factory)
    prompts = [[(7 * i + j) % config.vocab_size for j in range(16)] for i in range(batch)]
    engine.generate(prompts, 4)  # warm up
    for p in prompts:
        engine.add_request(p, new_tokens)
    engine.step()  # prefill
    engine.platform.synchronize()
    start = time.perf_counter()
    produced = 0
    while engine.running:
        produced += len(engine.running)
        engine.step()
    engine.platform.synchronize()
    return produced / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    platform = torchhal.current_platform()
    results: dict = {"platform": platform.name, "context_tokens": CONTEXT, "dtype": "bfloat16", "sizes": {}}
    for name, config in SIZES.items():
        results["sizes"][name] = stack_times(name, config, args.iters)
    small = SIZES["h1024_l8"]
    decode = {}
    for batch in (1, 8, 32):
        eager = decode_tokens_per_s(small, batch, graphs=False)
        graphs = decode_tokens_per_s(small, batch, graphs=True)
        decode[f"batch{batch}"] = {"eager_tok_s": eager, "graph_tok_s": graphs, "speedup": graphs / eager}
        print(f"decode batch {batch}: eager {eager:.0f} tok/s, graphs {graphs:.0f} tok/s ({graphs / eager:.2f}x)")
    results["decode_h1024_l8"] = decode
    write_json("graph_runner", results, args.out)


if __name__ == "__main__":
    main()
