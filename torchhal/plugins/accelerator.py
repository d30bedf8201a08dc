"""AcceleratorPlatform: the shared body of the CUDA-style vendor plugins.

torch.cuda, torch.xpu, torch.npu and torch.musa expose the same API names
(`device_count`, `mem_get_info`, `memory_reserved`, `empty_cache`,
`graph_pool_handle`, `is_current_stream_capturing` …), so one implementation
serves them all, detection included. A vendor plugin is a declaration: its
name, device type, priority, backend, visible-devices variables, extension
module and graph/IPC names. It overrides a method only where its runtime
really differs (CUDA and ROCm tell their builds apart; XPU may need IPEX).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import os
import stat
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any, ClassVar

import torch

from torchhal.platforms import (
    Availability,
    DeviceInfo,
    GraphSupport,
    IpcEvents,
    IpcHandle,
    IpcHandleError,
    IpcSupport,
    MemoryInfo,
    PlatformPlugin,
    TorchhalPluginWarning,
)
from torchhal.platforms.ipc import (
    MAX_BYTES,
    SHM_DIR,
    TORCH_SHM_NAME,
    describe,
    owned_file,
    tensor_from_storage,
    validate_handle,
)

#: What a probe catches: a vendor runtime that is absent, half-installed
#: (torch_npu without CANN raises RuntimeError/OSError) or refuses this torch.
PROBE_ERRORS: tuple[type[BaseException], ...] = (ImportError, RuntimeError, OSError, AttributeError)


def module_installed(name: str) -> bool:
    """True if `name` could be imported, without importing it (cheap, pure)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class AcceleratorPlatform(PlatformPlugin):
    """Every SPI method through the CUDA-style names of `torch.<device_type>`, detection included."""

    extension_module: ClassVar[str | None] = None
    """The vendor extension imported before `torch.<device_type>` exists (`torch_npu`), or None when
    torch itself has the device module; checked with `find_spec` before it is imported."""
    runtime_hint: ClassVar[str] = ""
    """What to install, said with a "no" when the runtime is absent or fails to load."""
    graph_class_name: ClassVar[str | None] = None
    """The graph class on the device module (`"NPUGraph"`), or None: no graphs. Graphs also need the
    module's `graph_pool_handle`, `is_current_stream_capturing` and `stream`: a class without them
    is warned about (`TorchhalPluginWarning`) and gives no graph support."""
    ipc_share_method: ClassVar[str | None] = None
    """The `UntypedStorage` method exporting a device storage across processes (`"_share_cuda_"`),
    or None: no IPC."""
    ipc_open_method: ClassVar[str | None] = None
    """The `torch.UntypedStorage` static method opening an exported storage (`"_new_shared_cuda"`),
    looked up after the device module is loaded (the extension may add it)."""

    # -- detection -----------------------------------------------------------------
    def is_available(self) -> Availability:
        """Runtime present (`runtime_missing`), loads, and sees at least one device."""
        missing = self.runtime_missing()
        if missing:
            return Availability.no(missing)
        try:
            count = self.probe_device_count(self.device_module())
        except PROBE_ERRORS as exc:
            hint = f" ({self.runtime_hint})" if self.runtime_hint else ""
            return Availability.no(f"the {self.name} runtime failed to load{hint}: {type(exc).__name__}: {exc}")
        if count == 0:
            return Availability.no(f"the {self.name} runtime loaded but no device is visible{self._visibility()}")
        return Availability.yes(f"{count} {self.name} device(s)")

    def runtime_missing(self) -> str | None:
        """Why this torch cannot have the runtime at all (checked without importing it), or None."""
        if self.extension_module and not module_installed(self.extension_module):
            hint = f" ({self.runtime_hint})" if self.runtime_hint else ""
            return f"{self.extension_module} is not installed{hint}"
        return None

    def probe_device_count(self, module: ModuleType) -> int:
        """Visible devices, by a driver query that creates no device context."""
        return int(module.device_count())

    def _visibility(self) -> str:
        set_vars = [f"{name}={os.environ[name]!r}" for name in self.visible_devices_env if name in os.environ]
        if set_vars:
            return f" ({', '.join(set_vars)})"
        return f" (check {' / '.join(self.visible_devices_env)})" if self.visible_devices_env else ""

    # -- device ------------------------------------------------------------------
    def device_module(self) -> ModuleType:
        module = self.__dict__.get("_device_module")  # resolved once: most calls go through here
        if module is not None:
            return module
        if self.extension_module:
            importlib.import_module(self.extension_module)
        module = getattr(torch, self.device_type)  # an AttributeError: a runtime that failed to load (PROBE_ERRORS)
        self.__dict__["_device_module"] = module
        # The argument-free queries are the module's own functions: bind them (unless a
        # subclass overrides them), so a Platform pass-through costs the runtime's call.
        for name in ("device_count", "current_device"):
            if getattr(type(self), name) is getattr(PlatformPlugin, name):
                self.__dict__[name] = getattr(module, name)
        return module

    def runtime_version(self) -> str | None:
        if not self.extension_module:
            return None
        extension = importlib.import_module(self.extension_module)
        return f"{self.extension_module} {getattr(extension, '__version__', '?')}"

    def device_info(self, index: int) -> DeviceInfo:
        props = self.device_module().get_device_properties(index)
        major, minor = getattr(props, "major", None), getattr(props, "minor", None)
        return DeviceInfo(
            index=index,
            name=str(props.name),
            total_memory=int(props.total_memory),
            capability=(int(major), int(minor)) if major is not None and minor is not None else None,
        )

    # -- memory ------------------------------------------------------------------
    def allocator_bytes(self, index: int) -> tuple[int, int]:
        """(reserved, allocated) of the caching allocator on `index`."""
        module = self.device_module()
        return int(module.memory_reserved(index)), int(module.memory_allocated(index))

    def memory_info(self, index: int) -> MemoryInfo:
        module = self.device_module()
        reserved, allocated = self.allocator_bytes(index)
        try:
            free, total = module.mem_get_info(index)
        except (RuntimeError, AttributeError, NotImplementedError):
            # Some devices (several XPUs) cannot report free memory: estimate it.
            total = self.device_info(index).total_memory
            return MemoryInfo(index, max(total - reserved, 0), total, reserved, allocated, estimated=True)
        return MemoryInfo(index, int(free), int(total), reserved, allocated)

    def empty_cache(self, index: int) -> int | None:
        before, _ = self.allocator_bytes(index)
        self.device_module().empty_cache()
        after, _ = self.allocator_bytes(index)
        return max(before - after, 0)

    def oom_error_types(self) -> tuple[type[BaseException], ...]:
        module = self.device_module()
        own = getattr(module, "OutOfMemoryError", torch.OutOfMemoryError)
        return tuple(dict.fromkeys((own, torch.OutOfMemoryError)))

    # -- graphs ------------------------------------------------------------------
    def graph_support(self) -> GraphSupport | None:
        module = self.device_module()
        graph_class = getattr(module, self.graph_class_name or "", None)
        if graph_class is None:  # none declared, or a build without graphs
            return None
        if not _declared_complete(self.name, f"graph_class_name={self.graph_class_name!r}", module,
                                  ("graph_pool_handle", "is_current_stream_capturing", "stream"), "graph"):
            return None

        @contextlib.contextmanager
        def capture(graph: Any, pool: Any, stream: Any) -> Iterator[None]:
            # Unlike torch.<dev>.graph(), no synchronize + empty_cache on entry (contract 4).
            # The cyclic collector stays off while capturing: an unreachable graph of someone
            # else's, destroyed mid-capture, is a device call that invalidates this capture
            # (seen on an H100 as a failed capture_end). No gc.collect() first, as torch's
            # graph() does: in a process with a large heap it cost ~0.35 s a graph (119 layer
            # graphs: 43 s instead of 0.2 s on an H100), and the collector being off is enough.
            was_enabled = gc.isenabled()
            gc.disable()
            try:
                with module.stream(stream):
                    graph.capture_begin(pool=pool)
                    try:
                        yield
                    finally:
                        graph.capture_end()
            finally:
                if was_enabled:
                    gc.enable()

        return GraphSupport(
            graph_class=graph_class,
            new_pool=module.graph_pool_handle,
            capture=capture,
            is_capturing=module.is_current_stream_capturing,
        )

    # -- IPC ---------------------------------------------------------------------
    def ipc_support(self) -> IpcSupport | None:
        if not self.ipc_share_method or not self.ipc_open_method:
            return None
        if not hasattr(torch.UntypedStorage, self.ipc_open_method):
            self.device_module()  # the extension may add the storage methods
            if not hasattr(torch.UntypedStorage, self.ipc_open_method):
                return None  # a build without IPC
        return IpcSupport(
            share=self.ipc_share,
            open=self.ipc_open,
            peer_redirect=self.ipc_peer_redirect,
            note=f"{self.name} IPC memory handles"
            + ("; opened through the consumer's device when peer access exists" if self.ipc_peer_redirect else ""),
            events=self.ipc_events(),
        )

    def ipc_events(self) -> IpcEvents | None:
        """Interprocess events (`IpcSupport.events`), or None: the CUDA plugin has them."""
        return None

    def ipc_share(self, tensor: torch.Tensor) -> IpcHandle:
        storage = tensor.untyped_storage()
        device, handle, size, offset, rc_handle, rc_offset, event_handle, event_sync = getattr(
            storage, self.ipc_share_method or ""
        )()
        dtype, shape, stride, view_offset = describe(tensor)
        return IpcHandle(
            platform=self.name,
            device=int(device),
            storage=(
                int(device), bytes(handle), int(offset), bytes(rc_handle), int(rc_offset),
                bytes(event_handle or b""), bool(event_sync),
            ),
            storage_nbytes=int(size),
            dtype=dtype,
            shape=shape,
            stride=stride,
            offset_bytes=view_offset,
        )

    def ipc_target_device(self, producer: int, consumer: int) -> int:
        """The device to open a producer's handle on: the consumer's, where peers allow."""
        if not self.ipc_peer_redirect or producer == consumer:
            return producer
        module = self.device_module()
        if module.can_device_access_peer(consumer, producer):
            return consumer
        return producer

    def ipc_open(self, handle: IpcHandle, device: int) -> torch.Tensor:
        dtype = validate_handle(handle)  # the view fields
        problem = self._storage_problem(handle, device)
        if problem is not None:
            raise IpcHandleError(problem)
        producer, raw, offset, rc_handle, rc_offset, event_handle, event_sync = handle.storage
        _check_refcount_file(rc_handle, rc_offset)  # type: ignore[arg-type]
        target = self.ipc_target_device(producer, device)  # type: ignore[arg-type]
        module = self.device_module()
        try:
            with module.device(target):
                storage = getattr(torch.UntypedStorage, self.ipc_open_method or "")(
                    target, raw, handle.storage_nbytes, offset, rc_handle, rc_offset,
                    event_handle or None, event_sync,
                )
            return tensor_from_storage(storage, handle, dtype)
        except Exception as exc:  # the driver refused the handle: still the one documented error type
            raise IpcHandleError(f"{self.name} IPC open failed: {type(exc).__name__}: {exc}") from exc

    def _storage_problem(self, handle: IpcHandle, device: object) -> str | None:
        """Why `handle`'s storage fields cannot be opened on `device`, or None. Every field reaches
        native code: each is bounded first."""
        fields = handle.storage
        types = (int, bytes, int, bytes, int, bytes, bool)
        if handle.platform != self.name:
            return f"handle is from platform {handle.platform!r}; this is {self.name!r}"
        if not isinstance(fields, tuple) or len(fields) != len(types) or not all(
            isinstance(v, t) and not (t is int and isinstance(v, bool)) for v, t in zip(fields, types, strict=True)
        ):
            return f"{self.name} IPC storage fields are malformed: {fields!r:.200}"
        producer, raw, offset, rc_handle, rc_offset, event_handle, _ = fields
        assert isinstance(producer, int) and isinstance(offset, int) and isinstance(rc_offset, int)
        assert isinstance(raw, bytes) and isinstance(rc_handle, bytes) and isinstance(event_handle, bytes)
        count = self.device_count()
        visible = isinstance(device, int) and not isinstance(device, bool) and 0 <= device < count
        if not (visible and 0 <= producer < count):
            return (f"IPC device {producer} (producer) or {device!r} (consumer) is not a visible {self.name} device "
                    f"(0..{count - 1})")
        if not 0 < len(raw) <= _IPC_BLOB_MAX or len(event_handle) > _IPC_BLOB_MAX:
            return f"{self.name} IPC memory/event handle of {len(raw)}/{len(event_handle)} bytes is not a handle"
        if not 0 <= offset < MAX_BYTES:
            return f"{self.name} IPC allocation offset {offset} is out of range"
        return None


_IPC_BLOB_MAX = 256  # driver IPC memory/event handles are tens of bytes
_REFCOUNT_CELLS = 10_000  # torch's CUDA IPC ref-counter file holds this many int64 cells


def _check_refcount_file(name: bytes, offset: int) -> None:
    """The ref-counter handle is a shared-memory file name the native open maps and writes:
    only torch's own names, of a regular file of this user (no symlink), with the cell inside."""
    problem = None
    if not TORCH_SHM_NAME.fullmatch(name) or not 0 <= offset < _REFCOUNT_CELLS:
        problem = f"IPC ref-counter {name[:128]!r} at cell {offset} is not a torch ref-counter handle"
    elif owned_file(SHM_DIR + name.decode("ascii"), "ref-counter", stat.S_ISREG).st_size < 8 * (offset + 1):
        problem = f"IPC ref-counter {name.decode('ascii')!r} does not hold cell {offset}"
    if problem is not None:
        raise IpcHandleError(problem)


def _declared_complete(platform: str, declared: str, owner: ModuleType, needed: tuple[str, ...],
                       capability: str) -> bool:
    """Whether `owner` has the rest of what a declared capability needs; if not, the capability is
    unsupported and a warning names what is missing (a build with part of it is a plugin or
    extension mismatch the vendor must hear of, unlike a build without it at all)."""
    missing = [f"{owner.__name__}.{name}" for name in needed if not hasattr(owner, name)]
    if missing:
        warnings.warn(f"platform {platform!r} declares {declared}, which is there, but {', '.join(missing)} is not: "
                      f"no {capability} support; install a device extension that has them all, or declare "
                      f"{declared.split('=')[0]} = None", TorchhalPluginWarning, stacklevel=3)
    return not missing
