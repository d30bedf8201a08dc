"""simaccel: a simulated accelerator whose device memory is host memory, with a real cache.

The worked example of a CPU-backed platform (docs/spi-reference.md). Tensors live
on the CPU (`device_type = "cpu"`), but memory is accounted the way a device
caching allocator accounts it:

- `allocated` is the bytes live on the "device": the process heap's in-use bytes
  (glibc `mallinfo2`), rounded down to the allocator's 16 MiB segments. torch's
  host allocator takes large tensors from that heap and gives them back on free.
- `reserved` is what the cache holds: every allocation the simulator sees (at a
  memory query or a synchronize) reserves its segments, and a free keeps them
  reserved, cached, until `empty_cache` hands them back.

So an allocation raises allocated and reserved, a free lowers allocated only,
and `empty_cache` brings reserved down to allocated and says how much it
released: the counters a real caching allocator reports, on any Linux host.

The device module is its own (`torchhal_simaccel.device`): it knows whether the
simulated runtime was initialised, so the suite can check that detection does
not initialise it (the `device_module().is_initialized()` convention).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import psutil
import torch

from torchhal.platforms import Availability, DeviceInfo, MemoryInfo, PeakMemory, PlatformPlugin, hookimpl

from . import device as sim_device

MiB = 1 << 20
SEGMENT = 16 * MiB


class SimAccelPlatform(PlatformPlugin):
    name = "simaccel"
    device_type = "cpu"  # tensors are host tensors; only the accounting is simulated
    priority = -1  # never chosen over the real CPU platform unless asked for by name
    dist_backend = "gloo"
    visible_devices_env = ("SIMACCEL_VISIBLE_DEVICES",)

    def __init__(self) -> None:
        self._reserved = 0  # bytes held by the cache (live + cached segments)
        self._peak_reserved = 0
        self._peak_allocated = 0

    # -- detection: cheap, never raises, initialises nothing ------------------------
    def is_available(self) -> Availability:
        if not sim_device.heap_counter_available():
            return Availability.no("simaccel needs glibc's mallinfo2 to see allocations (Linux, glibc >= 2.33)")
        return Availability.yes("1 simulated device backed by host memory")

    def device_module(self) -> ModuleType:
        return sim_device

    # -- device ------------------------------------------------------------------------
    def device_count(self) -> int:
        return sim_device.device_count()

    def current_device(self) -> int:
        return sim_device.current_device()

    def set_device(self, index: int) -> None:
        sim_device.set_device(index)

    def synchronize(self, index: int) -> None:
        sim_device.synchronize(index)
        self._observe()  # work finished: what it allocated is now reserved

    def device_info(self, index: int) -> DeviceInfo:
        return DeviceInfo(index=index, name="simaccel (host-backed)", total_memory=self._total())

    def runtime_version(self) -> str | None:
        return f"simaccel 1.0 on torch {torch.__version__}"

    # -- memory --------------------------------------------------------------------------
    def _total(self) -> int:
        return int(psutil.virtual_memory().total)

    def _allocated(self) -> int:
        return sim_device.heap_in_use() // SEGMENT * SEGMENT

    def _observe(self) -> int:
        """Account what is live now: allocations reserve their segments; frees keep them."""
        allocated = self._allocated()
        self._reserved = max(self._reserved, allocated)
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        self._peak_allocated = max(self._peak_allocated, allocated)
        return allocated

    def memory_info(self, index: int) -> MemoryInfo:
        sim_device.init()
        allocated = self._observe()
        total = self._total()
        free = max(0, min(int(psutil.virtual_memory().available), total - self._reserved))
        return MemoryInfo(device=index, free=free, total=total, reserved=self._reserved, allocated=allocated)

    def empty_cache(self, index: int) -> int | None:
        before = self._reserved
        self._reserved = self._allocated()  # cached segments go back; live ones stay
        return before - self._reserved

    def oom_error_types(self) -> tuple[type[BaseException], ...]:
        return (MemoryError, torch.OutOfMemoryError)

    def is_out_of_memory(self, error: BaseException) -> bool:
        # the host allocator under the simulation raises a plain RuntimeError when malloc fails
        return isinstance(error, self.oom_error_types()) or (
            isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
        )

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # device memory is host memory

    def peak_memory(self, index: int) -> PeakMemory:
        self._observe()
        return PeakMemory(index, self._peak_reserved, self._peak_allocated)

    def reset_peak_memory(self, index: int) -> None:
        self._peak_reserved = self._reserved
        self._peak_allocated = self._allocated()

    def can_access_peer(self, index: int, peer: int) -> bool:
        return False  # one device

    # -- streams and events: host execution is in order -----------------------------------
    def new_stream(self, index: int) -> Any:
        return sim_device.Stream()

    def current_stream(self, index: int) -> Any:
        return sim_device.current_stream(index)

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        yield

    def new_event(self) -> Any:
        return sim_device.Event()


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [SimAccelPlatform()]
