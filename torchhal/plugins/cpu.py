"""CPU: the embedded default platform. Always available, lowest priority.

Memory comes from the OS, capped by the process's memory cgroup (a container's
limit, see `host_memory`); there is no caching allocator, so `empty_cache` is
a no-op that reports nothing released. Device, stream and event calls go to
`torch.cpu` through the SPI's defaults. IPC uses torch's shared-memory CPU
storages (file-descriptor-free 'filename' handles, which are plain data).
"""

from __future__ import annotations

import functools
import os
import re
import stat
import sys
from types import ModuleType
from typing import Any, TypeGuard

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
    VirtualMemorySupport,
    hookimpl,
)
from torchhal.platforms.ipc import SHM_DIR, TORCH_SHM_NAME, describe, owned_file, tensor_from_storage, validate_handle
from torchhal.plugins.host_memory import HostMemory


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

    def device_for_rank(self, local_rank: int, local_world_size: int) -> int:
        return 0  # every rank's tensors live in host memory: the one CPU device

    def device_info(self, index: int) -> DeviceInfo:
        import platform as host

        return DeviceInfo(index=index, name=host.processor() or host.machine(), total_memory=self._host_memory.total,
                          extra={"cores": str(os.cpu_count() or 0)})

    def runtime_version(self) -> str | None:
        return f"torch {torch.__version__}"

    @functools.cached_property
    def _host_memory(self) -> HostMemory:
        return HostMemory()  # the cgroup levels found at the first query; each query reads only their usage

    def memory_info(self, index: int) -> MemoryInfo:
        free, total = self._host_memory()
        return MemoryInfo(device=index, free=free, total=total)

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
        return torch.cpu.Stream()  # torch.cpu.Stream takes no device

    def virtual_memory_support(self) -> VirtualMemorySupport | None:
        """The reference: anonymous host pages given back with madvise(MADV_DONTNEED) (Linux)."""
        if not sys.platform.startswith("linux"):
            return None
        from torchhal.plugins.virtual_memory import HostDriver, Regions

        return VirtualMemorySupport(lambda index: Regions(HostDriver(), _host_bytes), graph_memory=False,
                                    note="host pages: mmap, madvise(MADV_DONTNEED)")

    def ipc_support(self) -> IpcSupport | None:
        # handles name this platform, which may be a vendor's subclass of this one
        return IpcSupport(
            share=functools.partial(_share, self.name),
            open=functools.partial(_open, self.name),
            peer_redirect=False,
            note="host shared memory (torch file_system strategy handles)",
        )


def _share(platform: str, tensor: torch.Tensor) -> IpcHandle:
    manager, name, size = tensor.untyped_storage()._share_filename_cpu_()
    dtype, shape, stride, offset = describe(tensor)
    return IpcHandle(platform=platform, device=0, storage=(bytes(manager), bytes(name)), storage_nbytes=int(size),
                     dtype=dtype, shape=shape, stride=stride, offset_bytes=offset)


#: torch's shared-memory manager's socket.
_MANAGER_SOCKET = re.compile(rb"(/[A-Za-z0-9._-]{1,64}){0,8}/torch-shm-dir-[A-Za-z0-9]{6}/manager\.sock")
_UNIX_PATH_MAX = 107  # sockaddr_un.sun_path, less the terminating NUL
_REFCOUNT_BYTES = 64  # torch's shared storages carry a refcount header after the data


def _is_torch_storage(storage: object) -> TypeGuard[tuple[bytes, bytes]]:
    """(manager socket path, shared-memory name) as torch's own file_system strategy names them."""
    if not (isinstance(storage, tuple) and len(storage) == 2 and all(isinstance(x, bytes) for x in storage)):
        return False
    manager, name = storage
    return len(manager) <= _UNIX_PATH_MAX and bool(_MANAGER_SOCKET.fullmatch(manager)
                                                   and TORCH_SHM_NAME.fullmatch(name))


def _open(platform: str, handle: IpcHandle, device: int) -> torch.Tensor:
    if handle.platform != platform or handle.device != 0 or device != 0:
        raise IpcHandleError(
            f"{platform} IPC opens {platform} handles of device 0 on device 0; got {handle.platform!r} device "
            f"{handle.device!r} onto {device!r}"
        )
    if not _is_torch_storage(handle.storage):
        raise IpcHandleError(f"CPU IPC handle storage {handle.storage!r:.200} is not torch's (manager socket path, "
                             "/torch_<pid>_<n>_<n> shared-memory name) pair of bytes")
    manager, name = handle.storage
    # Sizes come from the OS, not from the handle: only this user's own torch objects qualify.
    shm = owned_file(SHM_DIR + name.decode("ascii"), "memory", stat.S_ISREG)
    dtype = validate_handle(handle, storage_nbytes=max(shm.st_size - _REFCOUNT_BYTES, 0))
    owned_file(manager.decode("ascii"), "manager socket", stat.S_ISSOCK)
    try:
        # Maps at most the file's real size (checked above), so nothing grows /dev/shm.
        storage = torch.UntypedStorage._new_shared_filename_cpu(manager, name, handle.storage_nbytes)
        return tensor_from_storage(storage, handle, dtype)
    except Exception as exc:  # e.g. the object vanished between the check and the open
        raise IpcHandleError(f"CPU IPC open of {name!r} failed: {type(exc).__name__}: {exc}") from exc


def _host_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [CpuPlatform()]
