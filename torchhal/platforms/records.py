"""Typed, frozen records that cross the plugin boundary.

Hook results and SPI return values are records, never loose tuples or dicts, so
the manager can validate them and engine code can rely on their fields.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch


class ReleasePoint(str, enum.Enum):
    """The only reasons the device allocator cache may be emptied (contract 2)."""

    COMPONENT_RELEASE = "component_release"
    OOM = "oom"
    WEIGHT_UPDATE = "weight_update"
    RESUME_GENERATION = "resume_generation"
    IDLE = "idle"
    SLEEP = "sleep"
    USER = "user"


@dataclass(frozen=True)
class Availability:
    """Result of `PlatformPlugin.is_available()`: a yes, or a no with its reason."""

    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available

    @classmethod
    def yes(cls, detail: str = "") -> Availability:
        return cls(True, detail)

    @classmethod
    def no(cls, reason: str) -> Availability:
        return cls(False, reason)


@dataclass(frozen=True)
class MemoryInfo:
    """Memory of one device, observed without changing it (contract 1).

    `reserved` and `allocated` are the caching allocator's bytes; `None` where
    the backend cannot tell (CPU). `estimated` is set when `free` was derived
    (total - reserved) because the backend has no free-memory query.
    """

    device: int
    free: int
    total: int
    reserved: int | None = None
    allocated: int | None = None
    estimated: bool = False

    @property
    def used(self) -> int:
        return self.total - self.free


@dataclass(frozen=True)
class PeakMemory:
    """The caching allocator's high-water marks on one device since the last reset.

    `None` where the backend keeps no such counter (CPU).
    """

    device: int
    reserved: int | None
    allocated: int | None


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    total_memory: int
    capability: tuple[int, int] | None = None
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GraphSupport:
    """How a platform captures and replays device graphs (contract 4).

    graph_class:  the graph type (`torch.cuda.CUDAGraph` …); `graph_class()` makes one.
    new_pool:     returns a memory-pool handle; one pool may back many graphs.
    capture:      `capture(graph, pool, stream)` -> context manager that records the
                  work issued inside it into `graph`. It must NOT empty the cache.
    is_capturing: True while the current stream is capturing.
    """

    graph_class: type
    new_pool: Callable[[], Any]
    capture: Callable[[Any, Any, Any], AbstractContextManager[Any]]
    is_capturing: Callable[[], bool]


@dataclass(frozen=True)
class IpcHandle:
    """A device tensor shared across processes, as plain data (no pickled code).

    `storage` holds the backend's opaque storage handle fields (ints, bytes, str
    only); `storage_nbytes` is the size of that storage. The view fields describe
    the tensor inside it and are validated before any byte is read.
    """

    platform: str
    device: int
    storage: tuple[int | bytes | str | bool, ...]
    storage_nbytes: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset_bytes: int = 0


@dataclass(frozen=True)
class IpcSupport:
    """How a platform shares device tensors across processes (contract 5).

    share: tensor -> IpcHandle (the storage stays alive while the producer holds it).
    open:  (handle, consumer device) -> tensor on the consumer's device; validates
           the handle first. Where `peer_redirect` is True the open maps the memory
           through the consumer's own device, so no context lands on the producer's.
    """

    share: Callable[[torch.Tensor], IpcHandle]
    open: Callable[[IpcHandle, int], torch.Tensor]
    peer_redirect: bool
    note: str = ""


@dataclass(frozen=True)
class PluginFailure:
    """Record of a plugin that failed to import, register, validate or detect (not an exception)."""

    plugin: str
    stage: str  # "import" | "register" | "validate" | "detect" | "conflict"
    error: str
    distribution: str | None = None

    def __str__(self) -> str:
        dist = f" (distribution {self.distribution})" if self.distribution else ""
        return f"plugin {self.plugin!r}{dist} failed to {self.stage}: {self.error}"
