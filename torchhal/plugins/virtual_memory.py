"""Tagged memory regions over a virtual-memory driver (the platform SPI's `MemoryRegions`).

Every allocation reserves its own range of addresses and maps physical memory there. A
release copies the contents to a host backup when asked (made once per allocation, reused by
every later release), then unmaps the physical memory and gives it back; the addresses stay
reserved. A restore maps new physical memory at the same addresses and copies the backup
back. Tensors viewing a region are never reallocated, so kernels and captured graphs that hold
their addresses stay valid across a release and a restore. An allocation's memory and
addresses go back for good when no tensor views it any more.

Drivers: `VmmDriver` over the CUDA driver's `cuMem*` calls (and HIP's `hipMem*`, the same
calls under another prefix) through ctypes; `AclDriver` over Ascend's `aclrt*` calls;
`HostDriver` over anonymous host pages, which `madvise(MADV_DONTNEED)` gives back (the CPU
platform's reference). Where torch can view a driver's addresses as a tensor (CUDA, the host),
a region's tensors are those views; elsewhere (ACL) they come from the region's torch
`MemPool`, whose segments are the region's allocations.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from torchhal.values import ceil_div


class Driver(Protocol):
    """What regions need from a runtime: addresses, physical memory, and copies to and from
    the host. A driver whose addresses torch can view as tensors derives from `ViewedMemory`."""

    granularity: int
    zero_filled: bool  # new physical memory reads as zeros
    device: torch.device

    def reserve(self, size: int) -> int: ...

    def create(self, size: int) -> int: ...

    def map(self, va: int, size: int, handle: int) -> None: ...

    def unmap(self, va: int, size: int, handle: int) -> None:
        """Unmap the range and give its physical memory (`handle`) back."""

    def free(self, va: int, size: int) -> None: ...

    def to_host(self, va: int, host: torch.Tensor) -> None:
        """Copy `host.numel()` bytes at `va` into `host` (done by the next `synchronize`)."""

    def from_host(self, va: int, host: torch.Tensor) -> None: ...

    def zero(self, va: int, size: int) -> None: ...

    def synchronize(self) -> None: ...


class ViewedMemory(ABC):
    """A driver base for runtimes whose addresses torch views as tensors: copies and zeroing
    run on those views, and a region's tensors are views of its allocations."""

    @abstractmethod
    def tensor(self, va: int, size: int, owner: object) -> torch.Tensor:
        """A uint8 tensor over [va, va + size) that keeps `owner` alive."""

    def to_host(self, va: int, host: torch.Tensor) -> None:
        host.copy_(self.tensor(va, host.numel(), None), non_blocking=True)

    def from_host(self, va: int, host: torch.Tensor) -> None:
        self.tensor(va, host.numel(), None).copy_(host, non_blocking=True)

    def zero(self, va: int, size: int) -> None:
        self.tensor(va, size, None).zero_()


@dataclass(frozen=True)
class TorchPools:
    """torch's pluggable allocator and `MemPool` on one backend, whose segments are a region's
    allocations: a graph captured into such a pool keeps its memory in the region, and a driver
    without views makes every tensor of a region there."""

    custom_allocator: Callable[[int, int], Any]  # (alloc, free) function addresses -> an allocator
    mem_pool: Callable[[Any], Any]  # that allocator -> a MemPool
    use_mem_pool: Callable[[Any, torch.device], AbstractContextManager[Any]]

    def new_pool(self, regions: Regions, tag: str) -> Any:
        """A pool whose segments are allocations of `tag`'s region. The allocator's two functions
        are ctypes callbacks: torch calls them only to grow or shrink the pool, never per tensor."""

        def alloc(size: int, device: int, stream: int) -> int | None:
            try:
                return regions.allocate_segment(tag, size)
            except Exception:  # noqa: BLE001 - a null pointer is how torch's allocator hears "out of memory"
                return None

        def free(va: int, size: int, device: int, stream: int) -> None:
            regions.free_segment(tag, va)

        callbacks = (_ALLOC(alloc), _FREE(free))
        alloc_fn, free_fn = (ctypes.cast(c, ctypes.c_void_p).value for c in callbacks)
        assert alloc_fn is not None and free_fn is not None
        allocator = self.custom_allocator(alloc_fn, free_fn)
        pool = self.mem_pool(allocator)
        # The pool outlives the process's Python state (torch may free it at exit, calling `free`):
        # its callbacks and the pool are never collected.
        _FOREVER.append((pool, callbacks, allocator))
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_FOREVER[-1]))
        return pool

    def tensor(self, pool: Any, nbytes: int, device: torch.device) -> torch.Tensor:
        with self.use_mem_pool(pool, device):
            return torch.empty(nbytes, dtype=torch.uint8, device=device)


_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FOREVER: list[Any] = []


@dataclass(eq=False)
class _Mapping:
    va: int
    size: int
    handle: int | None  # None while released


@dataclass(eq=False)
class _Allocation:
    mapping: _Mapping
    backup: torch.Tensor | None = None
    backed_up: bool = False  # the backup holds what the last release copied


@dataclass
class _Region:
    refs: list[weakref.ref[_Allocation]] = field(default_factory=list)
    held: dict[int, _Allocation] = field(default_factory=dict)  # a graph pool's segments, by address
    released: bool = False

    def live(self) -> list[_Allocation]:
        alive = [a for a in (ref() for ref in self.refs) if a is not None]
        self.refs = [weakref.ref(a) for a in alive]
        return alive


class Regions:
    """`MemoryRegions` of one device. `host_buffer(nbytes)` makes a backup's host memory
    (page-locked, for copies at the link's speed). `pools` makes each region's torch pool:
    graphs capture there when `graphs_in_pools` (else graph memory cannot live in a region),
    and a driver without views makes every tensor there."""

    def __init__(self, driver: Driver, host_buffer: Callable[[int], torch.Tensor],
                 pools: TorchPools | None = None, *, graphs_in_pools: bool = True) -> None:
        assert pools is not None or isinstance(driver, ViewedMemory), "a driver without views needs pools"
        self.driver, self.host_buffer, self.pools, self.graphs_in_pools = driver, host_buffer, pools, graphs_in_pools
        self._regions: dict[str, _Region] = {}
        self._pools: dict[str, Any] = {}

    def allocate(self, tag: str, nbytes: int) -> torch.Tensor:
        region = self._region(tag)
        assert not region.released, f"allocation asked of released region {tag!r}"  # engines allocate when made
        if not isinstance(self.driver, ViewedMemory):
            assert self.pools is not None
            return self.pools.tensor(self._pool(tag), nbytes, self.driver.device)
        allocation = self._new_allocation(nbytes)
        region.refs.append(weakref.ref(allocation))
        return self._view(allocation)[:nbytes]

    def allocate_segment(self, tag: str, nbytes: int) -> int:
        """A graph pool's segment, held by the region until `free_segment`; returns its address."""
        region = self._region(tag)
        assert not region.released, f"graph memory asked of released region {tag!r}"
        allocation = self._new_allocation(nbytes)
        region.held[allocation.mapping.va] = allocation
        region.refs.append(weakref.ref(allocation))
        return allocation.mapping.va

    def free_segment(self, tag: str, va: int) -> None:
        self._region(tag).held.pop(va, None)

    def graph_pool(self, tag: str) -> Any | None:
        if self.pools is None or not self.graphs_in_pools:
            return None
        return self._pool(tag).id

    def region_bytes(self, tag: str) -> int:
        return sum(a.mapping.size for a in self._region(tag).live())

    def released(self, tag: str) -> bool:
        return self._region(tag).released

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """The backup's bytes of `tensor` (a uint8 view into a region released with a backup)."""
        address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for region in self._regions.values():
            for allocation in region.live():
                start = address - allocation.mapping.va
                if 0 <= start < allocation.mapping.size:
                    assert region.released and allocation.backed_up and allocation.backup is not None
                    return allocation.backup[start : start + nbytes]
        raise ValueError(f"no region holds the tensor at {address:#x}")

    def release(self, tag: str, *, backup: bool) -> int:
        region = self._region(tag)
        if region.released:
            return 0
        allocations = region.live()
        self.driver.synchronize()  # work still queued on the region runs before it goes
        if backup:
            for allocation in allocations:
                if allocation.backup is None:
                    allocation.backup = self.host_buffer(allocation.mapping.size)
                self.driver.to_host(allocation.mapping.va, allocation.backup)
            self.driver.synchronize()
        released = 0
        for allocation in allocations:
            mapping = allocation.mapping
            assert mapping.handle is not None
            self.driver.unmap(mapping.va, mapping.size, mapping.handle)
            mapping.handle, allocation.backed_up = None, backup
            released += mapping.size
        region.released = True
        return released

    def restore(self, tag: str) -> int:
        region = self._region(tag)
        if not region.released:
            return 0
        allocations = region.live()
        try:
            # Every map before the first copy: a map while a copy is in flight stalls the copy
            # (on an H200, 16 GB restored 10% slower interleaved; the maps take 3 ms in all).
            for allocation in allocations:
                self._map(allocation.mapping)
            for allocation in allocations:
                if allocation.backed_up:
                    assert allocation.backup is not None
                    self.driver.from_host(allocation.mapping.va, allocation.backup)
                elif not self.driver.zero_filled:
                    self.driver.zero(allocation.mapping.va, allocation.mapping.size)
            self.driver.synchronize()
        except BaseException:  # out of memory part-way: the region stays released, whole
            self.driver.synchronize()  # no copy may still write what is unmapped
            for allocation in allocations:
                mapping = allocation.mapping
                if mapping.handle is not None:
                    self.driver.unmap(mapping.va, mapping.size, mapping.handle)
                    mapping.handle = None
            raise
        region.released = False
        return sum(a.mapping.size for a in allocations)

    def _new_allocation(self, nbytes: int) -> _Allocation:
        granularity = self.driver.granularity
        size = ceil_div(max(nbytes, 1), granularity) * granularity
        mapping = _Mapping(self.driver.reserve(size), size, None)
        try:
            self._map(mapping)
        except BaseException:
            self.driver.free(mapping.va, size)
            raise
        allocation = _Allocation(mapping)
        weakref.finalize(allocation, _give_back, self.driver, mapping)
        if not self.driver.zero_filled:
            self.driver.zero(mapping.va, size)
        return allocation

    def _map(self, mapping: _Mapping) -> None:
        handle = self.driver.create(mapping.size)
        try:
            self.driver.map(mapping.va, mapping.size, handle)
        except BaseException:
            self.driver.unmap(mapping.va, 0, handle)
            raise
        mapping.handle = handle

    def _view(self, allocation: _Allocation) -> torch.Tensor:
        assert isinstance(self.driver, ViewedMemory)
        return self.driver.tensor(allocation.mapping.va, allocation.mapping.size, allocation)

    def _pool(self, tag: str) -> Any:
        assert self.pools is not None
        if tag not in self._pools:
            self._pools[tag] = self.pools.new_pool(self, tag)
        return self._pools[tag]

    def _region(self, tag: str) -> _Region:
        return self._regions.setdefault(tag, _Region())


def _give_back(driver: Driver, mapping: _Mapping) -> None:
    """No tensor views the allocation any more: its memory and its addresses go back."""
    if mapping.handle is not None:
        driver.unmap(mapping.va, mapping.size, mapping.handle)
    driver.free(mapping.va, mapping.size)


# -- the host's pages (the CPU platform's reference) ------------------------------------------------
_PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS_NORESERVE = 0x1 | 0x2, 0x02 | 0x20 | 0x4000
_MADV_DONTNEED = 4


class _HostPages:
    """A ctypes view of host pages, for `torch.frombuffer`; holds its owner for the tensor's life."""

    @staticmethod
    def over(va: int, size: int, owner: object) -> Any:
        pages: Any = type("_Pages", (ctypes.c_uint8 * size,), {}).from_address(va)  # type: ignore[attr-defined]
        pages.owner = owner
        return pages


class HostDriver(ViewedMemory):
    """Anonymous host pages (Linux): reserved with `mmap`, given back with `madvise(MADV_DONTNEED)`
    (the range then reads as zeros until it is written), freed with `munmap`."""

    granularity = 4096
    zero_filled = True
    device = torch.device("cpu")

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._mmap, self._munmap, self._madvise = libc.mmap, libc.munmap, libc.madvise
        self._mmap.restype = ctypes.c_void_p
        self._mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_long]
        self._munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def reserve(self, size: int) -> int:
        va = self._mmap(None, size, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS_NORESERVE, -1, 0)
        if va in (None, ctypes.c_void_p(-1).value):
            raise MemoryError(f"mmap of {size} bytes failed (errno {ctypes.get_errno()})")
        return int(va)

    def create(self, size: int) -> int:
        return 0  # the pages are the mapping's own: they fault in when touched

    def map(self, va: int, size: int, handle: int) -> None:
        return None

    def unmap(self, va: int, size: int, handle: int) -> None:
        if size and self._madvise(va, size, _MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")

    def free(self, va: int, size: int) -> None:
        self._munmap(va, size)

    def tensor(self, va: int, size: int, owner: object) -> torch.Tensor:
        return torch.frombuffer(_HostPages.over(va, size, owner), dtype=torch.uint8)

    def synchronize(self) -> None:
        return None


# -- CUDA's and HIP's virtual-memory calls ----------------------------------------------------------
class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp / hipMemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc / hipMemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_PINNED, _ON_DEVICE, _READ_WRITE, _GRANULARITY_RECOMMENDED = 1, 1, 3, 1


class _DeviceSpan:
    """Device memory as `__cuda_array_interface__` describes it, so `torch.as_tensor` views it."""

    def __init__(self, va: int, size: int, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (va, False), "version": 3}


def check_status(call: str, status: int, out_of_memory: tuple[int, ...], device: torch.device) -> None:
    """A runtime call's status as torch's errors: out of memory is `torch.OutOfMemoryError`."""
    if status != 0:
        message = f"{call} failed with error {status}"
        if status in out_of_memory:
            raise torch.OutOfMemoryError(f"{message} (out of memory on {device})")
        raise RuntimeError(message)


class VmmDriver(ViewedMemory):
    """The runtime's virtual-memory calls through ctypes: `library` is the driver library
    (libcuda.so.1, or libamdhip64.so for ROCm) and `prefix` its names' ("cu", "hip")."""

    zero_filled = False  # the driver does not promise zeroed physical memory

    def __init__(self, library: str, prefix: str, device: torch.device, synchronize: Callable[[], None]) -> None:
        lib = ctypes.CDLL(library)
        self._call = {name: getattr(lib, f"{prefix}{name}") for name in (
            "MemAddressReserve", "MemCreate", "MemMap", "MemSetAccess", "MemUnmap", "MemRelease",
            "MemAddressFree", "MemGetAllocationGranularity")}
        self._prefix, self.device, self.synchronize = prefix, device, synchronize
        index = device.index or 0
        self._prop = _AllocationProp(type=_PINNED, location=_Location(_ON_DEVICE, index))
        self._access = _AccessDesc(location=_Location(_ON_DEVICE, index), flags=_READ_WRITE)
        granularity = ctypes.c_size_t()
        self._check("MemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self._prop),
                    _GRANULARITY_RECOMMENDED)
        self.granularity = int(granularity.value)

    def _check(self, name: str, *args: Any) -> None:
        # CUDA_ERROR_OUT_OF_MEMORY / hipErrorOutOfMemory
        check_status(f"{self._prefix}{name}", self._call[name](*args), (2,), self.device)

    def reserve(self, size: int) -> int:
        va = ctypes.c_uint64()
        self._check("MemAddressReserve", ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0),
                    ctypes.c_uint64(0), ctypes.c_uint64(0))
        return int(va.value)

    def create(self, size: int) -> int:
        handle = ctypes.c_uint64()
        self._check("MemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self._prop),
                    ctypes.c_uint64(0))
        return int(handle.value)

    def map(self, va: int, size: int, handle: int) -> None:
        self._check("MemMap", ctypes.c_uint64(va), ctypes.c_size_t(size), ctypes.c_size_t(0),
                    ctypes.c_uint64(handle), ctypes.c_uint64(0))
        self._check("MemSetAccess", ctypes.c_uint64(va), ctypes.c_size_t(size), ctypes.byref(self._access),
                    ctypes.c_size_t(1))

    def unmap(self, va: int, size: int, handle: int) -> None:
        if size:
            self._check("MemUnmap", ctypes.c_uint64(va), ctypes.c_size_t(size))
        self._check("MemRelease", ctypes.c_uint64(handle))

    def free(self, va: int, size: int) -> None:
        self._check("MemAddressFree", ctypes.c_uint64(va), ctypes.c_size_t(size))

    def tensor(self, va: int, size: int, owner: object) -> torch.Tensor:
        return torch.as_tensor(_DeviceSpan(va, size, owner), device=self.device)


def registered_host_buffer(nbytes: int) -> torch.Tensor:
    """A backup's page-locked host memory: torch's threads fault the pages in (`fill_`), then
    `cudaHostRegister` locks them in place, as torch's `pinned_use_cuda_host_register` setting
    does for its own pinned memory. `torch.empty(pin_memory=True)` faults and locks them on one
    thread, and rounds the size up to a power of two."""
    buffer = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0))
    # Unregistered when no tensor views it (a view holds its base), before its storage is freed.
    weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer


def cuda_pools() -> TorchPools:
    """torch.cuda's pluggable allocator and MemPool (graph memory in a CUDA region)."""
    return TorchPools(torch._C._cuda_customAllocator, torch.cuda.MemPool, torch.cuda.use_mem_pool)


# -- Ascend's virtual-memory calls (ACL) -------------------------------------------------------------
class _AclLocation(ctypes.Structure):  # aclrtMemLocation
    _fields_ = [("id", ctypes.c_uint32), ("type", ctypes.c_int)]


class _AclPhysicalMemProp(ctypes.Structure):  # aclrtPhysicalMemProp
    _fields_ = [("handleType", ctypes.c_int), ("allocationType", ctypes.c_int), ("memAttr", ctypes.c_int),
                ("location", _AclLocation), ("reserve", ctypes.c_uint64)]


# acl_rt.h: ACL_HBM_MEM_HUGE, ACL_MEM_LOCATION_TYPE_DEVICE, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM,
# ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST; ACL_ERROR_BAD_ALLOC, ACL_ERROR_RT_MEMORY_ALLOCATION.
_ACL_HBM_HUGE, _ACL_ON_DEVICE, _ACL_GRANULARITY_MINIMUM, _ACL_TO_DEVICE, _ACL_TO_HOST = 4, 1, 0, 1, 2
_ACL_OUT_OF_MEMORY = (200000, 207001)


class AclDriver:
    """Ascend's virtual-memory calls (`aclrtReserveMemAddress`, `aclrtMallocPhysical`,
    `aclrtMapMem`, ...) in libascendcl through ctypes. torch_npu cannot view an address as a
    tensor: a region's tensors come from its torch_npu `MemPool`, copies go through `aclrtMemcpy`."""

    zero_filled = False

    def __init__(self, device: torch.device, synchronize: Callable[[], None]) -> None:
        lib = ctypes.CDLL(ACL_LIBRARY)
        self._call = {name: getattr(lib, f"aclrt{name}") for name in ACL_CALLS}
        self.device, self.synchronize = device, synchronize
        index = device.index or 0
        self._check("SetDevice", ctypes.c_int32(index))  # the calling thread's context is the device's
        self._prop = _AclPhysicalMemProp(memAttr=_ACL_HBM_HUGE, location=_AclLocation(index, _ACL_ON_DEVICE))
        granularity = ctypes.c_size_t()
        self._check("MemGetAllocationGranularity", ctypes.byref(self._prop), _ACL_GRANULARITY_MINIMUM,
                    ctypes.byref(granularity))
        self.granularity = int(granularity.value)

    def _check(self, name: str, *args: Any) -> None:
        check_status(f"aclrt{name}", self._call[name](*args), _ACL_OUT_OF_MEMORY, self.device)

    def reserve(self, size: int) -> int:
        va = ctypes.c_void_p()
        self._check("ReserveMemAddress", ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0), None,
                    ctypes.c_uint64(0))
        return int(va.value or 0)

    def create(self, size: int) -> int:
        handle = ctypes.c_void_p()
        self._check("MallocPhysical", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self._prop),
                    ctypes.c_uint64(0))
        return int(handle.value or 0)

    def map(self, va: int, size: int, handle: int) -> None:
        self._check("MapMem", ctypes.c_void_p(va), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_void_p(handle),
                    ctypes.c_uint64(0))

    def unmap(self, va: int, size: int, handle: int) -> None:
        if size:
            self._check("UnmapMem", ctypes.c_void_p(va))
        self._check("FreePhysical", ctypes.c_void_p(handle))

    def free(self, va: int, size: int) -> None:
        self._check("ReleaseMemAddress", ctypes.c_void_p(va))

    def to_host(self, va: int, host: torch.Tensor) -> None:
        self._copy(host.data_ptr(), va, host.numel(), _ACL_TO_HOST)

    def from_host(self, va: int, host: torch.Tensor) -> None:
        self._copy(va, host.data_ptr(), host.numel(), _ACL_TO_DEVICE)

    def _copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        self._check("Memcpy", ctypes.c_void_p(dst), ctypes.c_size_t(nbytes), ctypes.c_void_p(src),
                    ctypes.c_size_t(nbytes), kind)

    def zero(self, va: int, size: int) -> None:
        self._check("Memset", ctypes.c_void_p(va), ctypes.c_size_t(size), ctypes.c_int32(0), ctypes.c_size_t(size))


#: The CANN runtime library `AclDriver` calls, and the calls it makes (without their `aclrt` prefix).
ACL_LIBRARY = "libascendcl.so"
ACL_CALLS = ("SetDevice", "MemGetAllocationGranularity", "ReserveMemAddress", "ReleaseMemAddress", "MallocPhysical",
             "FreePhysical", "MapMem", "UnmapMem", "Memcpy", "Memset")
