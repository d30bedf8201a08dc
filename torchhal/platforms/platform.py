"""Platform: the API engine code calls.

A `Platform` wraps one `PlatformPlugin`. Calls are plain method calls (no
pluggy on the hot path); observer hooks fire only where the engine changes
memory (`empty_cache`, `report_out_of_memory`) or asks to trace.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pluggy
import torch

from torchhal.platforms.manager import notify
from torchhal.platforms.records import (
    DeviceInfo,
    GraphSupport,
    IpcSupport,
    MemoryInfo,
    ReleasePoint,
)

if TYPE_CHECKING:
    import torch.distributed as dist

    from torchhal.platforms.plugin import PlatformPlugin


class Platform:
    """One platform, as engine code sees it. Obtain with `torchhal.current_platform()`."""

    def __init__(
        self, plugin: PlatformPlugin, pm: pluggy.PluginManager, distribution: str, version: str
    ) -> None:
        self.plugin = plugin
        self.name: str = plugin.name
        self.device_type: str = plugin.device_type
        self.priority: int = plugin.priority
        self.dist_backend: str = plugin.dist_backend
        self.visible_devices_env: tuple[str, ...] = tuple(plugin.visible_devices_env)
        self.distribution = distribution
        self.version = version
        self._pm = pm
        self._has_event_observers = bool(pm.hook.torchhal_engine_event.get_hookimpls())

    def __repr__(self) -> str:
        return f"<Platform {self.name} ({self.distribution} {self.version})>"

    # -- devices -----------------------------------------------------------------
    @property
    def device_module(self) -> ModuleType:
        return self.plugin.device_module()

    def device_count(self) -> int:
        return self.plugin.device_count()

    def current_device(self) -> int:
        return self.plugin.current_device()

    def set_device(self, index: int) -> None:
        self._check_index(index)
        self.plugin.set_device(index)

    def device(self, index: int | None = None) -> torch.device:
        """`torch.device` for `index` (default: the current device)."""
        return torch.device(self.device_type, self.current_device() if index is None else index)

    def synchronize(self, index: int | None = None) -> None:
        self.plugin.synchronize(self.current_device() if index is None else index)

    def device_info(self, index: int | None = None) -> DeviceInfo:
        return self.plugin.device_info(self._index(index))

    def runtime_version(self) -> str | None:
        return self.plugin.runtime_version()

    # -- memory ----------------------------------------------------------------------
    def memory_info(self, index: int | None = None) -> MemoryInfo:
        """Observe one device's memory. Never empties the cache, never synchronizes."""
        return self.plugin.memory_info(self.current_device() if index is None else index)

    def empty_cache(self, reason: ReleasePoint, index: int | None = None) -> int | None:
        """Empty the allocator cache at a named release point; fires `torchhal_cache_emptied`."""
        if not isinstance(reason, ReleasePoint):
            choices = ", ".join(f"ReleasePoint.{r.name}" for r in ReleasePoint)
            raise TypeError(
                f"empty_cache(reason={reason!r}): the reason must be a ReleasePoint "
                f"({choices}); emptying the cache is only allowed at a named release point"
            )
        device = self._index(index)
        released = self.plugin.empty_cache(device)
        notify(
            self._pm,
            "torchhal_cache_emptied",
            platform=self,
            device=device,
            reason=reason,
            bytes_released=released,
        )
        return released

    def available_memory(self, group: dist.ProcessGroup | None = None) -> int:
        """Free bytes on the current device; with `group`, the minimum across its ranks.

        The group must be able to reduce CPU tensors (gloo), so it works on any platform.
        """
        free = self.memory_info().free
        if group is None:
            return free
        import torch.distributed as dist

        value = torch.tensor([free], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
        return int(value.item())

    @functools.cached_property
    def oom_error_types(self) -> tuple[type[BaseException], ...]:
        return tuple(self.plugin.oom_error_types())

    def is_out_of_memory(self, error: BaseException) -> bool:
        return self.plugin.is_out_of_memory(error)

    def report_out_of_memory(self, error: BaseException, context: str, index: int | None = None) -> None:
        """Tell observers an OOM was caught (call before emptying with ReleasePoint.OOM)."""
        notify(
            self._pm,
            "torchhal_out_of_memory",
            platform=self,
            device=self._index(index),
            error=error,
            context=context,
        )

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.plugin.pin_memory(tensor)

    # -- streams ---------------------------------------------------------------------
    def new_stream(self, index: int | None = None) -> Any:
        return self.plugin.new_stream(self._index(index))

    def current_stream(self, index: int | None = None) -> Any:
        return self.plugin.current_stream(self._index(index))

    @contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        with self.plugin.use_stream(stream):
            yield

    def new_event(self) -> Any:
        return self.plugin.new_event()

    # -- capabilities ----------------------------------------------------------------
    @functools.cached_property
    def graph_support(self) -> GraphSupport | None:
        return self.plugin.graph_support()

    @functools.cached_property
    def ipc_support(self) -> IpcSupport | None:
        return self.plugin.ipc_support()

    # -- observers -------------------------------------------------------------------
    def notify_component_moved(self, component: str, source: str, destination: str, nbytes: int) -> None:
        notify(
            self._pm,
            "torchhal_component_moved",
            component=component,
            source=source,
            destination=destination,
            nbytes=nbytes,
        )

    @property
    def traces_events(self) -> bool:
        """True when some plugin observes engine events (skip building them otherwise)."""
        return self._has_event_observers

    def emit_event(self, event: dict[str, Any]) -> None:
        if self._has_event_observers:
            notify(self._pm, "torchhal_engine_event", event=event)

    # -- helpers -----------------------------------------------------------------------
    def _index(self, index: int | None) -> int:
        return self.current_device() if index is None else index

    def _check_index(self, index: int) -> None:
        count = self.device_count()
        if not isinstance(index, int) or not 0 <= index < max(count, 1):
            raise ValueError(
                f"device index {index!r} is out of range for platform {self.name!r} "
                f"with {count} device(s); use 0..{max(count - 1, 0)}"
            )
