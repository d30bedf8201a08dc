"""The CUDA plugin's peer-memory all-reduce on two real GPUs (marker multi_gpu; skipped without them).

Each rank holds small integers times (rank + 1), so every sum is exact in bfloat16 too and a rank can
check its result alone: the all-reduces the kernel takes (float32 and bfloat16 sums up to the
buffer's size) and the ones it leaves to NCCL (max, float16, odd sizes, larger than the buffer),
interleaved with NCCL all-gathers; one captured in a CUDA graph and replayed on new inputs; and the
off switch. tests/test_tensor_parallel_gpu.py runs the TP engine over it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import torchhal

platform = torchhal.current_platform()
two_gpus = platform.device_type == "cuda" and platform.device_count() >= 2
# (elements, dtype, op): 16 bytes; 12 bytes (NCCL); a [32, 4096] bf16 activation; the whole buffer;
# just past it (NCCL); float16 (NCCL); max (NCCL).
CASES = [(4, "float32", "sum"), (3, "float32", "sum"), (32 * 4096, "bfloat16", "sum"), (131072, "float32", "sum"),
         (131076, "float32", "sum"), (4096, "float16", "sum"), (4096, "bfloat16", "max")]


def rank_checks(off: bool) -> dict[str, Any]:
    from torchhal.distributed import init_group
    from torchhal.plugins.cuda_collectives import OFF_SWITCH, PeerMemoryCommunicator

    if off:
        os.environ[OFF_SWITCH] = "0"
    group = init_group()
    comm, index, ranks = group.comm, group.device.index or 0, range(group.world_size)
    try:
        peer = isinstance(comm, PeerMemoryCommunicator)
        outcomes = []
        for _ in range(10):  # interleaved with NCCL's collectives, in the same order on every rank
            for numel, dtype_name, op in CASES:
                base = (torch.arange(numel, device=group.device) % 7).to(getattr(torch, dtype_name))
                tensor = base * (group.rank + 1)
                routed = peer and comm.takes(tensor, op)
                comm.all_reduce(tensor, op)
                expected = base * (sum(r + 1 for r in ranks) if op == "sum" else group.world_size)
                gathered = comm.all_gather(tensor[:4].contiguous())
                outcomes.append((numel, dtype_name, op, routed, torch.equal(tensor, expected),
                                 torch.equal(gathered, expected[:4].repeat(group.world_size))))
        # Ranks whose tensors are laid out otherwise (a transposed view, 4 bytes into a storage)
        # meet in the same collective: routed by size alone, a view through an aligned copy.
        layouts = []
        for odd_rank in ranks:
            dense = (torch.arange(32, device=group.device) % 7).float().view(8, 4)
            for layout in ("transposed", "offset"):
                tensor = dense * (group.rank + 1)
                if group.rank == odd_rank and layout == "transposed":
                    tensor = tensor.t().contiguous().t()
                elif group.rank == odd_rank:
                    tensor = torch.zeros(33, device=group.device)[1:].view(8, 4).copy_(tensor)
                comm.all_reduce(tensor)
                layouts.append(torch.equal(tensor, dense * sum(r + 1 for r in ranks)))
        # A tensor whose elements share memory (expand()) is refused before any rank waits, on the
        # kernel's path as on NCCL's: written back, it failed on one rank after the sum.
        overlapping = torch.ones(1, 4, device=group.device).expand(4, 4)
        assert not peer or comm.takes(overlapping, "sum")  # the kernel's path, where there is one
        try:
            comm.all_reduce(overlapping)
            overlap_refused = False
        except ValueError as exc:
            overlap_refused = "share memory" in str(exc)
        # Captured: the same static tensor replayed on three new inputs.
        static = torch.zeros(8, 4096, dtype=torch.bfloat16, device=group.device)
        stream = platform.new_stream(index)
        stream.wait_stream(platform.current_stream(index))
        with platform.use_stream(stream):
            comm.all_reduce(static)
        platform.current_stream(index).wait_stream(stream)
        support = platform.graph_support
        assert support is not None
        graph = support.graph_class()
        with support.capture(graph, support.new_pool(), stream):
            comm.all_reduce(static)
        replays = []
        for step in range(3):
            base = ((torch.arange(static.numel(), device=group.device) + step) % 5).to(static.dtype).view_as(static)
            static.copy_(base * (group.rank + 1))
            graph.replay()
            replays.append(torch.equal(static, base * sum(r + 1 for r in ranks)))
        platform.synchronize(index)
        del graph  # before close: NCCL's shutdown waits while a graph holds its captured work
        return {"peer": peer, "outcomes": outcomes, "replays": replays, "layouts": layouts,
                "overlap_refused": overlap_refused}
    finally:
        group.close()


@pytest.mark.multi_gpu
@pytest.mark.skipif(not two_gpus, reason="needs two CUDA devices")
def test_peer_memory_sums_equal_nccls_eager_and_replayed() -> None:
    from torchhal.distributed import launch

    for rank, result in enumerate(launch(rank_checks, 2, (False,), timeout=90)):
        assert result["peer"], f"rank {rank} did not get the peer-memory communicator"
        routed = {(n, d, op) for n, d, op, r, _, _ in result["outcomes"] if r}
        assert routed == {(4, "float32", "sum"), (32 * 4096, "bfloat16", "sum"), (131072, "float32", "sum")}
        wrong = [o for o in result["outcomes"] if not (o[4] and o[5])]
        assert not wrong, f"rank {rank}: wrong sums or gathers {wrong[:5]}"
        assert result["replays"] == [True, True, True]
        assert result["layouts"] == [True] * 4, f"rank {rank}: wrong sums of tensors laid out otherwise"
        assert result["overlap_refused"], f"rank {rank}: an expand()ed tensor was summed into"


@pytest.mark.multi_gpu
@pytest.mark.skipif(not two_gpus, reason="needs two CUDA devices")
def test_the_off_switch_keeps_nccl() -> None:
    from torchhal.distributed import launch

    for result in launch(rank_checks, 2, (True,), timeout=90):
        assert not result["peer"] and all(o[4] and o[5] for o in result["outcomes"])
        assert result["overlap_refused"]
        assert result["replays"] == [True, True, True]
