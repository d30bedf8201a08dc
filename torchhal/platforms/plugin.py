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
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch

from torchhal.platforms.errors import TorchhalPluginWarning
from torchhal.platforms.records import (
    AttentionSupport,
    Availability,
    CompileSupport,
    DeviceInfo,
    DistributedSupport,
    GraphSupport,
    IpcSupport,
    LinearSupport,
    MemoryInfo,
    PeakMemory,
)
from torchhal.platforms.virtual_memory import VirtualMemorySupport

#: The SPI version this torchhal implements: (major, minor). A minor release only adds
#: members, each with a default; a major release may remove or change members.
#: docs/vendor-guide.md ("Compatibility") states the policy.
SPI_VERSION: tuple[int, int] = (1, 9)  # 1.1: IpcSupport.events; 1.2: attention_support();
# 1.3: device_for_rank(), distributed_support(); 1.4: linear_support(); 1.5: compile_support();
# 1.6: PagedMetadata.block_size, check_call(scale=, out=); 1.7: AttentionCapability.step_kv,
# prefill(key=, value=) and check_call(key=, value=); 1.8: TorchCommunicator.store (and the
# WrappedCommunicator base)


@dataclass(frozen=True)
class Deprecation:
    """One deprecated SPI member: since which SPI version, its replacement, and its removal."""

    member: str
    since: tuple[int, int]
    removed_in: tuple[int, int]
    replacement: str

    def message(self, plugin_class: str, how: str) -> str:
        since, removed = ".".join(map(str, self.since)), ".".join(map(str, self.removed_in))
        return (
            f"{plugin_class} {how} {self.member!r}, deprecated since SPI {since} and removed in "
            f"SPI {removed}; use {self.replacement} instead"
        )


#: Deprecated SPI members by name. The registry warns (TorchhalPluginWarning) when a
#: plugin class defines one of them; a default the host still provides warns when
#: called (`deprecated_member`). An entry stays for at least one minor release
#: before its member is removed in the next major. Empty in SPI 1.0.
DEPRECATED_MEMBERS: dict[str, Deprecation] = {}


def deprecated_member(method: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a `PlatformPlugin` default as deprecated: a call warns with its table entry."""

    @functools.wraps(method)
    def warn_then_call(self: PlatformPlugin, *args: Any, **kwargs: Any) -> Any:
        entry = DEPRECATED_MEMBERS.get(method.__name__)
        if entry is not None:
            warnings.warn(entry.message(type(self).__name__, "calls"), TorchhalPluginWarning, stacklevel=2)
        return method(self, *args, **kwargs)

    return warn_then_call


def deprecated_overrides(plugin: PlatformPlugin) -> list[Deprecation]:
    """The deprecated members `plugin`'s own classes (not PlatformPlugin) define."""
    own = [cls for cls in type(plugin).__mro__ if cls not in (PlatformPlugin, abc.ABC, object)]
    return [
        entry
        for member, entry in DEPRECATED_MEMBERS.items()
        if any(member in vars(cls) for cls in own) or member in vars(plugin)
    ]


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
    #: The SPI version (major, minor) this plugin was written against. The host refuses a
    #: major other than its own and accepts any minor (see SPI_VERSION). Undeclared, a
    #: plugin targets (current major, 0): it uses only members every 1.x host provides.
    spi_version: ClassVar[tuple[int, int]] = (SPI_VERSION[0], 0)

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

    def attention_support(self) -> AttentionSupport | None:
        """The platform's own attention backends; None: torchhal's reference backend only."""
        return None

    def linear_support(self) -> LinearSupport | None:
        """The platform's kernel for linears of few rows (decode); None: F.linear everywhere."""
        return None

    def compile_support(self) -> CompileSupport | None:
        """Inductor options for the layers engines compile; None: inductor's defaults."""
        return None

    def virtual_memory_support(self) -> VirtualMemorySupport | None:
        """Tagged device-memory regions released and restored under the same addresses (an
        engine's sleep keeps its graphs); None: engines sleep by host offload."""
        return None

    # -- distributed ------------------------------------------------------------------
    def device_for_rank(self, local_rank: int, local_world_size: int) -> int:
        """The device index local rank `local_rank` (of `local_world_size` on this host) uses.

        Indices count the devices this process sees: the visible-devices variables
        (`visible_devices_env`) have already renumbered them, so with
        `CUDA_VISIBLE_DEVICES=3,5` local rank 1 uses index 1 (physical GPU 5). A launcher
        that gives each rank a single visible device leaves index 0 for every rank."""
        count = self.device_count()
        if local_world_size <= count:
            return local_rank
        if count == 1 and any(os.environ.get(var) for var in self.visible_devices_env):
            return 0  # one device made visible per rank
        shown = ", ".join(f"{var}={os.environ[var]!r}" for var in self.visible_devices_env if var in os.environ)
        raise ValueError(
            f"{local_world_size} local ranks need {local_world_size} {self.name} devices, but {count} "
            f"{'is' if count == 1 else 'are'} visible{f' ({shown})' if shown else ''}: start at most {count} "
            f"rank(s) on this host, or make more devices visible"
        )

    def distributed_support(self) -> DistributedSupport:
        """The communicator engines use and whether its collectives can be graph-captured;
        the default: torch.distributed on `dist_backend`, not captured."""
        return DistributedSupport()


def _spi_methods(cls: type) -> tuple[str, ...]:
    return tuple(name for name, value in vars(cls).items() if not name.startswith("_") and callable(value))


def _spi_attributes(cls: type) -> tuple[str, ...]:
    return tuple(name for name in vars(cls).get("__annotations__", {}) if not name.startswith("_"))


#: The SPI methods, in documentation order: read from `PlatformPlugin` itself, never listed by hand.
SPI_METHODS: tuple[str, ...] = _spi_methods(PlatformPlugin)
#: The SPI class attributes, in documentation order, read from `PlatformPlugin`'s annotations.
SPI_ATTRIBUTES: tuple[str, ...] = _spi_attributes(PlatformPlugin)
