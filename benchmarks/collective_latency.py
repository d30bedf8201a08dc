"""What a tensor-parallel decode step pays for its collectives, alone: per TP size, the platform
communicator's all_reduce of one decode step's activations ([batch, hidden], the model dtype),
and the whole step's set of collectives (two all-reduces a layer, the vocabulary-parallel
embedding's all-reduce, the logits' all-gather along the vocabulary) recorded in one device
graph as full-graph decode records them, replayed back to back.

    python benchmarks/collective_latency.py --tp 2 4                  # the 8B shape, batches 1/8/32
    python benchmarks/collective_latency.py --tp 2 4 --shape 70b
    python benchmarks/collective_latency.py --tp 2 --shape tiny       # CPU: gloo, eager only

Each TP size is one `torchhal.distributed.launch` (a process and device per rank). Eager:
the median of `--reps` timings of `--calls` all-reduces back to back, between device syncs.
Graph (where the platform captures its collectives): the median of `--reps` timings of
`--replays` replays of the step's collectives. The JSON has µs per collective and ms per
step, per TP size and batch; compare the step's figure with the step time a TP run leaves
over once its weights are read (benchmarks/README.md, tensor parallel).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _harness import median_run, write_json  # noqa: E402

#: hidden size, layers, vocabulary: what a decode step's collectives move.
SHAPES = {"8b": (4096, 32, 128256), "70b": (8192, 80, 128256), "tiny": (64, 2, 256)}


def step_collectives(comm: Any, hidden: torch.Tensor, logits: torch.Tensor, layers: int) -> torch.Tensor:
    """One decode step's collectives on a rank, in the model's order."""
    comm.all_reduce(hidden)  # the vocabulary-parallel embedding
    for _ in range(layers):
        comm.all_reduce(hidden)  # attention's o_proj
        comm.all_reduce(hidden)  # the MLP's down_proj
    return comm.all_gather(logits, dim=-1)


def timed(platform: Any, index: int, work: Any, count: int, reps: int) -> float:
    """Median seconds of `count` calls of `work`, between device syncs, after one untimed round."""
    seconds, _ = median_run(lambda: [work() for _ in range(count)], warmups=1, reps=reps,
                            sync=lambda: platform.synchronize(index))
    return seconds


def rank_run(shape: str, batches: list[int], dtype_name: str, calls: int, replays: int, reps: int) -> dict[str, Any]:
    from torchhal.distributed import init_group

    group = init_group()
    platform, comm, device = group.platform, group.comm, group.device
    index = device.index or 0
    dtype = getattr(torch, dtype_name)
    hidden_size, layers, vocab = SHAPES[shape]
    capturable = comm.graph_capturable and platform.graph_support is not None
    cells = []
    for batch in batches:
        hidden = torch.ones(batch, hidden_size, dtype=dtype, device=device)
        logits = torch.ones(batch, vocab // group.world_size, dtype=torch.float32, device=device)
        eager_s = timed(platform, index, lambda hidden=hidden: comm.all_reduce(hidden), calls, reps)
        cell: dict[str, Any] = {"batch": batch, "all_reduce_bytes": hidden.numel() * hidden.element_size(),
                                "eager_us_per_all_reduce": eager_s / calls * 1e6,
                                "collectives_per_step": 2 * layers + 2}
        if capturable:
            support = platform.graph_support
            assert support is not None  # capturable says the platform has graphs
            stream = platform.new_stream(index)
            stream.wait_stream(platform.current_stream(index))
            with platform.use_stream(stream):
                step_collectives(comm, hidden, logits, layers)  # warm up outside the graph
            platform.current_stream(index).wait_stream(stream)
            graph = support.graph_class()
            with support.capture(graph, support.new_pool(), stream):
                step_collectives(comm, hidden, logits, layers)
            platform.current_stream(index).wait_stream(stream)
            step_s = timed(platform, index, graph.replay, replays, reps) / replays
            cell.update(graph_ms_per_step=step_s * 1e3, graph_us_per_collective=step_s / (2 * layers + 2) * 1e6)
            del graph
        cells.append(cell)
    group.close()
    return {"rank": group.rank, "device": str(device), "communicator": type(comm).__name__,
            "graph_captured": capturable, "cells": cells}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[2])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--calls", type=int, default=200, help="eager all-reduces a timing")
    parser.add_argument("--replays", type=int, default=50, help="graph replays a timing")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds for each TP size's launch")
    parser.add_argument("--out", default=None, help="results folder (default results/)")
    args = parser.parse_args(argv)
    if min(args.tp) < 2:
        parser.error("--tp: collectives need at least 2 ranks")
    if min(args.batches) < 1:
        parser.error("--batches: each batch must be 1 or more")
    import torchhal
    from torchhal.distributed import launch

    platform = torchhal.current_platform()
    dtype_name = "float32" if platform.device_type == "cpu" else "bfloat16"
    by_tp = {}
    for tp in args.tp:
        ranks = launch(rank_run, tp, (args.shape, args.batches, dtype_name, args.calls, args.replays, args.reps),
                       timeout=args.timeout)
        by_tp[str(tp)] = ranks
        for cell in ranks[0]["cells"]:
            graph = (f"  graph {cell['graph_us_per_collective']:7.1f} us a collective, "
                     f"{cell['graph_ms_per_step']:6.3f} ms a step" if "graph_ms_per_step" in cell else "")
            print(f"TP={tp} batch {cell['batch']:>3}: eager {cell['eager_us_per_all_reduce']:7.1f} us an "
                  f"all-reduce{graph}", flush=True)
    results = {"shape": args.shape, "hidden_layers_vocab": SHAPES[args.shape], "dtype": dtype_name,
               "platform": platform.name, "runs": by_tp}
    write_json(f"collective_latency_{args.shape}", results, args.out)
    return results


if __name__ == "__main__":
    main()
