"""CPU platforms whose distributed layer has one classic bug each, for the distributed
clause's own tests (tests/test_distributed_conformance.py registers this module as a plugin).

- `dist_wrong_reduction`: its communicator answers all_reduce(op="max") with the sum;
- `dist_ignores_sizes`: its communicator pads uneven all_gather pieces and never trims them;
- `dist_swapped_devices`: two (simulated) devices, and device_for_rank maps rank r to device
  n-1-r, so each rank runs on the device listed for its peer.
`dist_two_devices` is the same two-device platform mapped correctly: the clauses must pass it.

Graph capture, on a device graph simulated on the host (`SimGraph`: a capturing communicator
records its collectives, a replay runs them again); each declares graph-capturable collectives:
- `dist_captures_correctly`: all_reduce and all_gather both join the graph: every clause passes;
- `dist_gather_not_capturable`: all_gather raises under capture, as a backend that cannot record it does;
- `dist_gather_stale_in_replay`: all_gather runs once at capture and records nothing, so a replay
  leaves the capture-time result (the engine's logits then never change).
`dist_unknown_backend` declares dist_backend "acmeccl", which torch.distributed does not have.
`dist_four_devices`: four simulated devices mapped correctly, so the clauses run four ranks.

When a peer has died, a collective of:
- `dist_peer_loss_ends_process` ends its process, as NCCL's watchdog does: the clause must pass it;
- `dist_peer_loss_silent` returns its input as the sum (a wrong result, silently);
- `dist_peer_loss_hangs` never returns;
- `dist_peer_loss_exits_cleanly` exits with code 0, as if the work were done;
- `dist_small_sums_miss_peer_loss` sends sums of 16 bytes or more another way (as a peer-memory
  all-reduce does), and that way returns the input as the sum: only a probe that takes it fails.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from torchhal.distributed import CollectiveError, WrappedCommunicator
from torchhal.platforms import DistributedSupport, GraphSupport, hookimpl
from torchhal.plugins.cpu import CpuPlatform


class Wrapped(WrappedCommunicator):
    """A communicator forwarding everything to torchhal's default one."""


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


class PeerLoss(Wrapped):
    """all_reduce that meets a dead peer (the default communicator's CollectiveError) in one way."""

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        try:
            return self.inner.all_reduce(tensor, op)
        except CollectiveError:
            return self.lost_peer(tensor)

    def lost_peer(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PeerLossEndsProcess(PeerLoss):
    def lost_peer(self, tensor: torch.Tensor) -> torch.Tensor:
        os._exit(6)  # a watchdog aborting the process


class PeerLossSilent(PeerLoss):
    def lost_peer(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # the bug: this rank's own values as the sum


class PeerLossHangs(PeerLoss):
    def lost_peer(self, tensor: torch.Tensor) -> torch.Tensor:
        while True:  # the bug
            time.sleep(60)


class PeerLossExitsCleanly(PeerLoss):
    def lost_peer(self, tensor: torch.Tensor) -> torch.Tensor:
        os._exit(0)  # the bug: a failure that looks like success


class SmallSumsMissPeerLoss(PeerLoss):
    """A small-message path that never learns of a dead peer; the bulk path is correct."""

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        if tensor.numel() * tensor.element_size() < 16:
            return self.inner.all_reduce(tensor, op)
        return super().all_reduce(tensor, op)

    def lost_peer(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # the bug, on the small path only


class SimGraph:
    """A device graph simulated on the host: the collectives recorded while capturing, run again by replay."""

    def __init__(self) -> None:
        self.recorded: list[Callable[[], object]] = []

    def replay(self) -> None:
        for call in self.recorded:
            call()


_capturing: SimGraph | None = None  # one rank per process, one thread: a module global is the capture state


@contextlib.contextmanager
def sim_capture(graph: SimGraph, pool: object, stream: object) -> Iterator[None]:
    global _capturing
    if _capturing is not None:
        raise RuntimeError("already capturing")
    _capturing = graph
    try:
        yield
    finally:
        _capturing = None


def sim_graph_support() -> GraphSupport:
    return GraphSupport(graph_class=SimGraph, new_pool=object, capture=sim_capture,
                        is_capturing=lambda: _capturing is not None)


class Captures(Wrapped):
    """Collectives that join a capture: recorded, not run; the replay runs them on the same tensors."""

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        if _capturing is None:
            return self.inner.all_reduce(tensor, op)
        _capturing.recorded.append(lambda: self.inner.all_reduce(tensor, op))  # in place
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None) -> torch.Tensor:
        if _capturing is None:
            return self.inner.all_gather(tensor, dim, sizes)
        shape = list(tensor.shape)
        shape[dim] = sum(sizes) if sizes is not None else tensor.shape[dim] * self.world_size
        # The graph's output: no values until a replay writes them, as in a real capture.
        out = torch.full(shape, float("nan"), dtype=tensor.dtype, device=tensor.device)
        _capturing.recorded.append(lambda: out.copy_(self.inner.all_gather(tensor, dim, sizes)))
        return out


class GatherNotCapturable(Captures):
    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None) -> torch.Tensor:
        if _capturing is not None:  # the bug
            raise RuntimeError("all_gather: operation not permitted when stream is capturing")
        return self.inner.all_gather(tensor, dim, sizes)


class GatherStaleInReplay(Captures):
    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None) -> torch.Tensor:
        return self.inner.all_gather(tensor, dim, sizes)  # the bug: run at capture, never recorded


class TwoDevices(CpuPlatform):
    """Two simulated devices over host memory (cpu:0, cpu:1)."""

    devices = 2

    def device_count(self) -> int:
        return self.devices

    def set_device(self, index: int) -> None:
        if not 0 <= index < self.devices:
            raise ValueError(f"device {index}: this platform has devices 0 to {self.devices - 1}")
        self._current = index

    def current_device(self) -> int:
        return getattr(self, "_current", 0)

    def device_for_rank(self, local_rank: int, local_world_size: int) -> int:
        return local_rank


class FourDevices(TwoDevices):
    devices = 4


class SwappedDevices(TwoDevices):
    def device_for_rank(self, local_rank: int, local_world_size: int) -> int:
        return local_world_size - 1 - local_rank  # the bug


def with_communicator(name: str, wrapper: type[Wrapped], captured: bool = False) -> CpuPlatform:
    """A CPU platform whose communicator is `wrapper`; `captured`: with simulated graphs, and its
    collectives declared graph-capturable."""
    def distributed_support(self: CpuPlatform) -> DistributedSupport:
        return DistributedSupport(communicator=wrapper, graph_capturable=captured,
                                  note=f"{name}: a wrapped default communicator")

    members: dict[str, Any] = {"name": name, "priority": -1, "distributed_support": distributed_support}
    if captured:
        members["graph_support"] = lambda self: sim_graph_support()
    cls = type(f"Dist{name.title()}", (CpuPlatform,), members)
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
        named(FourDevices, "dist_four_devices"),
        with_communicator("dist_peer_loss_ends_process", PeerLossEndsProcess),
        with_communicator("dist_peer_loss_silent", PeerLossSilent),
        with_communicator("dist_peer_loss_hangs", PeerLossHangs),
        with_communicator("dist_peer_loss_exits_cleanly", PeerLossExitsCleanly),
        with_communicator("dist_small_sums_miss_peer_loss", SmallSumsMissPeerLoss),
        with_communicator("dist_captures_correctly", Captures, captured=True),
        with_communicator("dist_gather_not_capturable", GatherNotCapturable, captured=True),
        with_communicator("dist_gather_stale_in_replay", GatherStaleInReplay, captured=True),
        type("UnknownBackend", (CpuPlatform,), {"name": "dist_unknown_backend", "priority": -1,
                                                 "dist_backend": "acmeccl"})(),  # a typo of a vendor's backend
    ]
