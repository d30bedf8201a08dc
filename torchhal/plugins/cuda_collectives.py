"""Small all-reduces through peer memory for the CUDA plugin's groups (symmetric memory loads per group).

A tensor-parallel decode step all-reduces a [batch, hidden] activation twice a layer: tens to
hundreds of KiB, where NCCL's all-reduce is mostly latency (15-18 us each on two H200s linked by
NVLink, replayed from a CUDA graph). torch's symmetric memory maps one buffer of every rank into
every other rank's address space. Its one-shot kernel copies this rank's tensor into its own
buffer, meets every peer at a barrier on the device, sums all ranks' buffers and writes the sum
over the tensor, then meets them again, so that the next call cannot overwrite a buffer a peer is
still reading (6-10 us at those sizes, replayed from a graph; benchmarks/collective_latency.py).

`PeerMemoryCommunicator` wraps the NCCL communicator and takes the all-reduces that kernel serves:
a sum, float32 or bfloat16, a multiple of 16 bytes, at most `PEER_MEMORY_BYTES`, whatever its
layout (a view or an unaligned tensor goes through an aligned copy). Every other call goes to
NCCL. Both queue on the current stream in call order, so ranks that make the same calls in the
same order meet at the same collective either way.

Like a collective replayed from a graph, the kernel's barrier has no timeout: a dead peer leaves
it spinning, and a bounded wait (`DeviceGroup.wait_for`) is what raises. The ranks agree before
any of them uses it (one host, every peer's device reachable); `TORCHHAL_CUDA_PEER_ALL_REDUCE=0`
on every rank turns it off.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from torchhal.platforms import TorchhalPluginWarning
from torchhal.platforms.communicator import Communicator, ReduceOpName, TorchCommunicator, WrappedCommunicator

#: The largest all-reduce sent through peer memory (a [32, 8192] bfloat16 activation): above it
#: NCCL's bandwidth-bound algorithms win. Each rank keeps one buffer of this size.
PEER_MEMORY_BYTES = 512 * 1024
#: Group sizes the one-shot kernel is built for.
WORLD_SIZES = (2, 4, 8)
DTYPES = (torch.float32, torch.bfloat16)
ALIGNMENT = 16
OFF_SWITCH = "TORCHHAL_CUDA_PEER_ALL_REDUCE"


def peer_memory_communicator(default: Communicator) -> Communicator:
    """The CUDA plugin's `DistributedSupport.communicator`: `default` wrapped in a
    `PeerMemoryCommunicator` when every rank can use peer memory, else `default` itself.
    A collective over the group's store: every rank of a new group calls it."""
    if not isinstance(default, TorchCommunicator) or default.store is None or default.world_size == 1:
        return default
    store, rank, world = default.store, default.rank, default.world_size

    def everyone(key: str, mine: str) -> list[str]:
        """Every rank's value for `key`, in rank order: each rank sets its own, then reads all."""
        store.set(f"peer_memory/{key}/{rank}", mine)
        return [store.get(f"peer_memory/{key}/{other}").decode() for other in range(world)]

    # Where each rank runs first, then whether it can reach every peer's device from there.
    hosts = everyone("host", socket.gethostname())
    devices = everyone("device", device_uuid(default.device.index or 0))
    if any(everyone("unable", why_not(rank, hosts, devices))):
        return default
    # Mapping the buffers can still fail (a container that forbids sharing memory handles,
    # say): then every rank keeps NCCL, as they agree again.
    try:
        peer: Communicator = PeerMemoryCommunicator(default)
        failure = ""
    except Exception as exc:  # noqa: BLE001 - any failure to build it means NCCL for this group
        peer, failure = default, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    failures = everyone("built", failure)
    if any(failures):
        reason = next(f"rank {other}: {text}" for other, text in enumerate(failures) if text)
        warnings.warn(f"group {default.name!r}: all-reduces stay on NCCL; peer memory could not be set up "
                      f"({reason})", TorchhalPluginWarning, stacklevel=2)
        return default
    return peer


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def why_not(rank: int, hosts: Sequence[str], devices: Sequence[str]) -> str:
    """Why `rank` cannot all-reduce through peer memory with ranks on `hosts` and `devices`
    (device UUIDs), in rank order; '' when it can."""
    if os.environ.get(OFF_SWITCH, "1") == "0":
        return f"{OFF_SWITCH}=0"
    if len(hosts) not in WORLD_SIZES:
        return f"the one-shot kernel takes groups of {WORLD_SIZES}, not {len(hosts)}"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return f"torch {torch.__version__} has no symmetric-memory one-shot all-reduce"
    if len(set(hosts)) > 1:
        return f"the ranks run on more than one host ({sorted(set(hosts))})"
    local = {device_uuid(index): index for index in range(torch.cuda.device_count())}
    mine = local[devices[rank]]
    for peer_uuid in devices:
        peer = local.get(peer_uuid)
        if peer is None:
            return f"a peer's device ({peer_uuid}) is not visible to rank {rank}"
        if peer != mine and not torch.cuda.can_device_access_peer(mine, peer):
            return f"device {mine} cannot reach device {peer}'s memory"
    return ""


def one_shot_sum(staged: torch.Tensor, tensor: torch.Tensor, group_name: str) -> None:
    """Sum `tensor` over the group in place, through `staged` (this rank's peer-memory buffer,
    `tensor`'s dtype and size). Each thread copies its elements in before the first barrier and
    writes their sums after it, so the output may be the input."""
    torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, tensor, "sum", group_name, tensor)


class PeerMemoryCommunicator(WrappedCommunicator):
    """NCCL's communicator with small sum all-reduces through peer memory (see the module doc)."""

    inner: TorchCommunicator

    def __init__(self, inner: TorchCommunicator, capacity: int = PEER_MEMORY_BYTES) -> None:
        import torch.distributed._symmetric_memory as symmetric_memory
        from torch._C._distributed_c10d import _SymmetricMemory

        assert inner.store is not None  # peer_memory_communicator checked
        super().__init__(inner)
        self.capacity = capacity
        # Symmetric memory finds the group by the name init_group registered it under with torch.
        self.group_name: str = inner.backend.group_name
        _SymmetricMemory.set_group_info(self.group_name, inner.rank, inner.world_size,
                                        dist.PrefixStore("peer_memory/exchange", inner.store))
        self.buffer = symmetric_memory.empty(capacity, dtype=torch.uint8, device=inner.device)
        _SymmetricMemory.rendezvous(self.buffer, self.group_name)

    def __repr__(self) -> str:
        return (f"<PeerMemoryCommunicator sum all-reduces of <= {self.capacity} bytes through peer memory, "
                f"the rest {self.inner!r}>")

    def takes(self, tensor: torch.Tensor, op: str) -> bool:
        """Whether `all_reduce(tensor, op)` runs the one-shot kernel (else NCCL). By what every
        rank's call shares (reduction, dtype, size), never by layout: ranks whose tensors are
        laid out differently must still meet in the same collective."""
        nbytes = tensor.numel() * tensor.element_size()
        return (op == "sum" and tensor.dtype in DTYPES and tensor.device == self.device
                and 0 < nbytes <= self.capacity and nbytes % ALIGNMENT == 0)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> torch.Tensor:
        if not self.takes(tensor, op):
            return self.inner.all_reduce(tensor, op)
        self.inner.check(tensor, f"all_reduce(op={op!r})", written=True)  # the refusals NCCL's path makes
        # The kernel reads and writes a dense, 16-byte aligned run: a view or an unaligned
        # offset goes through a fresh copy (the allocator aligns it), written back after.
        aligned = tensor.is_contiguous() and tensor.data_ptr() % ALIGNMENT == 0  # the address, storage's start included
        work = tensor if aligned else tensor.clone(memory_format=torch.contiguous_format)
        flat = work.view(-1)
        one_shot_sum(self.buffer[: flat.numel() * flat.element_size()].view(tensor.dtype), flat, self.group_name)
        if work is not tensor:
            tensor.copy_(work)
        return tensor
