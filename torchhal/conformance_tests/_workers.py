"""Code the conformance tests run in spawned processes (importable, top level).

Workers talk to the test through multiprocessing queues and return plain data
only, so a worker may exit before its results are read.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

import torchhal
from torchhal.platforms.testing import patched_plugin


def _platform(name: str) -> torchhal.Platform:
    return torchhal.get_platform(name)


def open_handles(name: str, device: int, handles: list[Any], queue: Any) -> None:
    """Open each handle on `device`; report values, device and a checksum of each."""
    try:
        platform = _platform(name)
        platform.set_device(device)
        out = []
        for handle in handles:
            tensor = platform.ipc_support.open(handle, device)  # type: ignore[union-attr]
            out.append(
                {
                    "device_type": tensor.device.type,
                    "device_index": tensor.device.index or 0,
                    "values": tensor.detach().to("cpu", torch.float64).flatten().tolist(),
                }
            )
        queue.put(("ok", out))
    except BaseException as exc:  # report, never hang the parent
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def _report_and_hold(name: str, device: int, queue: Any, release: Any, work: Any) -> None:
    """Run `work(platform)` on `device`, report its value, and stay alive until released.

    `work` returns (value to report, objects to keep alive while holding).
    """
    try:
        platform = _platform(name)
        platform.set_device(device)
        value, keep_alive = work(platform)
        queue.put(("ok", value))
        release.wait(120)
        del keep_alive
    except BaseException as exc:
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def wait_event_then_read(
    name: str, producer: int, device: int, handle: Any, event_handle: bytes, queue: Any
) -> None:
    """Open the producer's memory and event on `device`; the current stream waits on the
    event, then sums the memory; report the sum."""
    try:
        platform = _platform(name)
        platform.set_device(device)
        ipc = platform.ipc_support
        assert ipc is not None and ipc.events is not None
        tensor = ipc.open(handle, device)
        event = ipc.events.open(event_handle, producer, device)
        event.wait(platform.current_stream(tensor.device.index or 0))
        queue.put(("ok", float(tensor.sum().to("cpu"))))
    except BaseException as exc:  # report, never hang the parent
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def open_and_hold(name: str, device: int, handle: Any, queue: Any, release: Any) -> None:
    """Open a handle on `device`, do a little work there, and hold it until told to exit."""

    def work(platform: torchhal.Platform) -> tuple[float, Any]:
        tensor = platform.ipc_support.open(handle, device)  # type: ignore[union-attr]
        return float(tensor.sum().item()), tensor

    _report_and_hold(name, device, queue, release, work)


def query_memory_and_hold(name: str, device: int, queue: Any, release: Any) -> None:
    """Use one device: allocate, query memory_info(device) repeatedly, then hold."""

    def work(platform: torchhal.Platform) -> tuple[float, Any]:
        block = torch.ones(1 << 20, device=platform.device(device))
        for _ in range(10):
            platform.memory_info(device)
        platform.synchronize(device)
        return float(block[0].item()), block

    _report_and_hold(name, device, queue, release, work)


def share_then_exit(name: str, device: int, queue: Any, release: Any) -> None:
    """Producer that shares a tensor, waits until the consumer has it, then exits."""

    def work(platform: torchhal.Platform) -> tuple[Any, Any]:
        tensor = torch.arange(1024, dtype=torch.float32, device=platform.device(device))
        platform.synchronize(device)
        return platform.ipc_support.share(tensor), tensor  # type: ignore[union-attr]

    _report_and_hold(name, device, queue, release, work)


def distributed_rank(name: str, rank: int, world: int, store_path: str, queue: Any) -> None:
    """One rank of a 2-process group on the platform's dist backend."""
    import torch.distributed as dist

    try:
        platform = _platform(name)
        device = rank % platform.device_count()
        platform.set_device(device)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(platform.dist_backend, store=store, rank=rank, world_size=world)
        value = torch.full((4,), float(rank + 1), device=platform.device(device))
        dist.all_reduce(value)
        cpu_group = dist.new_group(backend="gloo")
        real_free = platform.memory_info(device).free
        # Free memory drifts between ranks' reads; pin each rank's answer so the
        # reduction itself is checked exactly: rank r reports 1 GiB + r MiB.
        pinned = dataclasses.replace(platform.memory_info(device), free=(1 << 30) + rank * (1 << 20))
        with patched_plugin(platform, memory_info=lambda index: pinned):
            minimum = platform.available_memory(cpu_group)
        dist.barrier(cpu_group)
        dist.destroy_process_group()
        report = {"rank": rank, "sum": value.cpu().tolist(), "min": minimum, "free": real_free, "pid": os.getpid()}
        queue.put(("ok", report))
    except BaseException as exc:
        queue.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
