"""CPU: the embedded default platform. Always available, lowest priority.

Memory comes from the OS; there is no caching allocator, so `empty_cache` is
a no-op that reports nothing released. IPC uses torch's shared-memory CPU
storages (file-descriptor-free 'filename' handles, which are plain data).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import psutil
import torch

from torchhal.platforms import (
    Availability,
    DeviceInfo,
    IpcHandle,
    IpcHandleError,
    IpcSupport,
    MemoryInfo,
    PeakMemory,
    PlatformPlugin,
    hookimpl,
)
from torchhal.platforms.ipc import describe, tensor_from_storage, validate_handle

_SHM_DIR = "/dev/shm"


class CpuPlatform(PlatformPlugin):
    name = "cpu"
    device_type = "cpu"
    priority = 0
    dist_backend = "gloo"
    visible_devices_env = ()

    def is_available(self) -> Availability:
        return Availability.yes("the CPU is always available")

    def device_module(self) -> ModuleType:
        return torch.cpu

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        if index != 0:
            raise ValueError(f"the CPU platform has one device, 0; got {index}")

    def synchronize(self, index: int) -> None:
        return None

    def device_info(self, index: int) -> DeviceInfo:
        import platform as host

        return DeviceInfo(
            index=index,
            name=host.processor() or host.machine(),
            total_memory=psutil.virtual_memory().total,
            capability=None,
            extra={"cores": str(os.cpu_count() or 0)},
        )

    def runtime_version(self) -> str | None:
        return f"torch {torch.__version__}"

    def memory_info(self, index: int) -> MemoryInfo:
        vm = psutil.virtual_memory()
        return MemoryInfo(device=index, free=int(vm.available), total=int(vm.total))

    def empty_cache(self, index: int) -> int | None:
        return None  # no caching allocator on the host: nothing to release

    def oom_error_types(self) -> tuple[type[BaseException], ...]:
        return (MemoryError, torch.OutOfMemoryError)

    def is_out_of_memory(self, error: BaseException) -> bool:
        # torch's CPU allocator raises a plain RuntimeError when malloc fails.
        return isinstance(error, self.oom_error_types()) or (
            isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
        )

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # host and device are the same memory

    def peak_memory(self, index: int) -> PeakMemory:
        return PeakMemory(index, None, None)  # no caching allocator: no counters

    def reset_peak_memory(self, index: int) -> None:
        return None

    def can_access_peer(self, index: int, peer: int) -> bool:
        return False  # one device: there is no peer

    def new_stream(self, index: int) -> Any:
        return torch.cpu.Stream()

    def current_stream(self, index: int) -> Any:
        return torch.cpu.current_stream()

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        yield  # the CPU runs everything in order

    def new_event(self) -> Any:
        return _CpuEvent()

    def ipc_support(self) -> IpcSupport | None:
        return IpcSupport(
            share=_share,
            open=_open,
            peer_redirect=False,
            note="host shared memory (torch file_system strategy handles)",
        )


class _CpuEvent:
    """Event for in-order host execution: recording and waiting are no-ops."""

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def _share(tensor: torch.Tensor) -> IpcHandle:
    if tensor.device.type != "cpu":
        raise ValueError(f"the CPU platform shares CPU tensors; got one on {tensor.device}")
    storage = tensor.untyped_storage()
    manager, name, size = storage._share_filename_cpu_()
    dtype, shape, stride, offset = describe(tensor)
    return IpcHandle(
        platform="cpu",
        device=0,
        storage=(bytes(manager), bytes(name)),
        storage_nbytes=int(size),
        dtype=dtype,
        shape=shape,
        stride=stride,
        offset_bytes=offset,
    )


def _shm_size(name: bytes) -> int:
    """Size of the shared-memory object, read from the OS, not from the handle."""
    text = name.decode("utf-8", "strict")
    if not text.startswith("/") or "/" in text[1:] or ".." in text:
        raise IpcHandleError(f"shared-memory name {text!r} is not a plain /name")
    try:
        return os.stat(_SHM_DIR + text).st_size
    except FileNotFoundError:
        raise IpcHandleError(
            f"shared memory {text!r} no longer exists: its producer freed it or exited"
        ) from None


def _open(handle: IpcHandle, device: int) -> torch.Tensor:
    if len(handle.storage) != 2 or not all(isinstance(x, bytes) for x in handle.storage):
        raise IpcHandleError(f"CPU IPC handle storage must be (manager, name) bytes; got {handle.storage!r}")
    manager, name = handle.storage
    assert isinstance(manager, bytes) and isinstance(name, bytes)
    dtype = validate_handle(handle, storage_nbytes=_shm_size(name))
    storage = torch.UntypedStorage._new_shared_filename_cpu(manager, name, handle.storage_nbytes)
    return tensor_from_storage(storage, handle, dtype)


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [CpuPlatform()]
