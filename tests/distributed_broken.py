"""CPU platforms whose distributed layer has one classic bug each, for the distributed
clause's own tests (tests/test_distributed_conformance.py registers this module as a plugin).

- `dist_wrong_reduction`: its communicator answers all_reduce(op="max") with the sum;
- `dist_ignores_sizes`: its communicator pads uneven all_gather pieces and never trims them;
- `dist_swapped_devices`: two (simulated) devices, and device_for_rank maps rank r to device
  n-1-r, so each rank runs on the device listed for its peer.
`dist_two_devices` is the same two-device platform mapped correctly: the clauses must pass it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torchhal.distributed import Communicator
from torchhal.platforms import DistributedSupport, hookimpl
from torchhal.plugins.cpu import CpuPlatform


class Wrapped:
    """A communicator forwarding everything to torchhal's default one."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.rank, self.world_size, self.device = inner.rank, inner.world_size, inner.device
        self.graph_capturable = inner.graph_capturable

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        return self.inner.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None) -> torch.Tensor:
        return self.inner.all_gather(tensor, dim, sizes)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.inner.broadcast(tensor, src)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.inner.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.inner.recv(tensor, src)


class WrongReduction(Wrapped):
    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        return self.inner.all_reduce(tensor, "sum" if op == "max" else op)  # the bug


class IgnoresSizes(Wrapped):
    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None) -> torch.Tensor:
        if sizes is None:
            return self.inner.all_gather(tensor, dim)
        dim = dim % tensor.dim()
        pad = list(tensor.shape)
        pad[dim] = max(sizes) - tensor.shape[dim]
        # The bug: every piece padded to the widest, the padding never trimmed.
        return self.inner.all_gather(torch.cat((tensor, tensor.new_zeros(pad)), dim), dim)


class TwoDevices(CpuPlatform):
    """Two simulated devices over host memory (cpu:0, cpu:1)."""

    def device_count(self) -> int:
        return 2

    def set_device(self, index: int) -> None:
        if index not in (0, 1):
            raise ValueError(f"device {index}: this platform has devices 0 and 1")
        self._current = index

    def current_device(self) -> int:
        return getattr(self, "_current", 0)

    def device_for_rank(self, local_rank: int, local_world_size: int) -> int:
        return local_rank


class SwappedDevices(TwoDevices):
    def device_for_rank(self, local_rank: int, local_world_size: int) -> int:
        return local_world_size - 1 - local_rank  # the bug


def with_communicator(name: str, wrapper: type[Wrapped]) -> CpuPlatform:
    def distributed_support(self: CpuPlatform) -> DistributedSupport:
        return DistributedSupport(communicator=wrapper, note=f"{name}: a wrapped default communicator")

    cls = type(f"Dist{name.title()}", (CpuPlatform,), {"name": name, "priority": -1,
                                                       "distributed_support": distributed_support})
    return cls()


def named(cls: type[CpuPlatform], name: str) -> CpuPlatform:
    return type(cls.__name__, (cls,), {"name": name, "priority": -1})()


@hookimpl
def torchhal_register_platforms() -> list[CpuPlatform]:
    return [
        with_communicator("dist_wrapped_correctly", Wrapped),
        with_communicator("dist_wrong_reduction", WrongReduction),
        with_communicator("dist_ignores_sizes", IgnoresSizes),
        named(TwoDevices, "dist_two_devices"),
        named(SwappedDevices, "dist_swapped_devices"),
    ]
