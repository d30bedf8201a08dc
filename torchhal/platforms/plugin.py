"""PlatformPlugin: the SPI a vendor implements.

This class is the single written form of the SPI: `SPI_METHODS` and
`SPI_ATTRIBUTES` are read from it, and `Platform` exposes its methods without
restating them. A vendor subclasses `PlatformPlugin`, fills in the class
attributes and the abstract methods, and returns an instance from the
`torchhal_register_platforms` hook. Everything else has a default written against the device module's
CUDA-style API (`Stream`, `current_stream`, `synchronize` …), which torch.cuda,
torch.xpu, torch.npu and torch.musa all mirror.

Rules (checked by the conformance suite):
- Import the vendor runtime lazily, inside methods: `import torchhal` must
  never import it.
- `is_available()` is cheap, idempotent, creates no device context and never
  raises; it returns `Availability.no(reason)` instead.
- `memory_info()` observes only: no empty_cache, no synchronize, and no context
  on any device other than the one asked.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, ClassVar

import torch

from torchhal.platforms.records import (
    Availability,
    DeviceInfo,
    GraphSupport,
    IpcSupport,
    MemoryInfo,
    PeakMemory,
)


class PlatformPlugin(abc.ABC):
    #: Unique platform name, e.g. "cuda". Selected with TORCHHAL_PLATFORM=name.
    name: ClassVar[str]
    #: torch device type string, e.g. "cuda" (ROCm also uses "cuda").
    device_type: ClassVar[str]
    #: Higher wins when several platforms are available; CPU is 0.
    priority: ClassVar[int] = 50
    #: Name of a platform (registered by another distribution) this one replaces.
    replaces: ClassVar[str | None] = None
    #: torch.distributed backend for this platform's devices.
    dist_backend: ClassVar[str]
    #: Environment variables that restrict which devices the runtime sees.
    visible_devices_env: ClassVar[tuple[str, ...]] = ()
    #: The IPC open maps a handle through the consumer's own device where peer access
    #: exists (see `IpcSupport.peer_redirect`). `Platform.set_ipc_peer_redirect(False)`
    #: turns it off for one process, to compare with torch's default open.
    ipc_peer_redirect: ClassVar[bool] = False

    # -- detection ----------------------------------------------------------
    @abc.abstractmethod
    def is_available(self) -> Availability:
        """Cheap, pure probe. Never raises; says why not."""

    # -- device -------------------------------------------------------------
    @abc.abstractmethod
    def device_module(self) -> ModuleType:
        """The torch device module (`torch.cuda`, `torch.xpu` …), imported lazily."""

    def device_count(self) -> int:
        return int(self.device_module().device_count())

    def current_device(self) -> int:
        return int(self.device_module().current_device())

    def set_device(self, index: int) -> None:
        self.device_module().set_device(index)

    def synchronize(self, index: int) -> None:
        self.device_module().synchronize(index)

    @abc.abstractmethod
    def device_info(self, index: int) -> DeviceInfo: ...

    def runtime_version(self) -> str | None:
        """Driver / runtime version string for reports; None if unknown."""
        return None

    # -- memory -------------------------------------------------------------
    @abc.abstractmethod
    def memory_info(self, index: int) -> MemoryInfo:
        """Observe free/total/reserved/allocated of one device. Never cleans."""

    @abc.abstractmethod
    def empty_cache(self, index: int) -> int | None:
        """Return cached blocks to the device; bytes released, or None if unknown."""

    @abc.abstractmethod
    def oom_error_types(self) -> tuple[type[BaseException], ...]:
        """Exception types an out-of-memory allocation raises on this platform."""

    def is_out_of_memory(self, error: BaseException) -> bool:
        """True if `error` is this platform's out-of-memory failure."""
        return isinstance(error, self.oom_error_types())

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Host tensor in page-locked memory, for async host<->device copies."""
        return tensor.pin_memory()

    def peak_memory(self, index: int) -> PeakMemory:
        """The allocator's peak reserved/allocated bytes since the last reset."""
        module = self.device_module()
        return PeakMemory(index, int(module.max_memory_reserved(index)), int(module.max_memory_allocated(index)))

    def reset_peak_memory(self, index: int) -> None:
        """Start a new peak measurement on `index`."""
        self.device_module().reset_peak_memory_stats(index)

    def can_access_peer(self, index: int, peer: int) -> bool:
        """True if device `index` can map memory of device `peer` directly."""
        return bool(self.device_module().can_device_access_peer(index, peer))

    # -- streams and events ---------------------------------------------------
    def new_stream(self, index: int) -> Any:
        return self.device_module().Stream(device=index)

    def current_stream(self, index: int) -> Any:
        return self.device_module().current_stream(index)

    @contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        with self.device_module().stream(stream):
            yield

    def new_event(self) -> Any:
        return self.device_module().Event()

    # -- capabilities (None = unsupported) ------------------------------------
    def graph_support(self) -> GraphSupport | None:
        return None

    def ipc_support(self) -> IpcSupport | None:
        return None


def _spi_methods(cls: type) -> tuple[str, ...]:
    return tuple(name for name, value in vars(cls).items() if not name.startswith("_") and callable(value))


def _spi_attributes(cls: type) -> tuple[str, ...]:
    return tuple(name for name in vars(cls).get("__annotations__", {}) if not name.startswith("_"))


#: The SPI methods, in documentation order: read from `PlatformPlugin` itself, never listed by hand.
SPI_METHODS: tuple[str, ...] = _spi_methods(PlatformPlugin)
#: The SPI class attributes, in documentation order, read from `PlatformPlugin`'s annotations.
SPI_ATTRIBUTES: tuple[str, ...] = _spi_attributes(PlatformPlugin)
