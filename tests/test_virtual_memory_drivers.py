"""The virtual-memory driver's calls, against a fake runtime library: the CUDA driver's `cuMem*`
and HIP's `hipMem*` take the same arguments in the same order (CUmemAllocationProp and
hipMemAllocationProp share their layout), so one driver maps both. A mapping test: it proves
the calls and their arguments, not that a runtime behaves as documented (that needs the device:
the CUDA plugin's regions pass the virtual_memory clauses on an H200)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from torchhal.plugins import virtual_memory
from torchhal.plugins.virtual_memory import Regions, VmmDriver

GRANULARITY = 2 << 20


class FakeRuntime:
    """The eight calls, recording what they were given; `out_of_memory` makes create fail as the
    runtime does (error 2)."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.calls, self.out_of_memory = prefix, [], False
        self.next_va, self.next_handle = 0x7F00_0000_0000, 100
        for name in ("MemGetAllocationGranularity", "MemAddressReserve", "MemCreate", "MemMap", "MemSetAccess",
                     "MemUnmap", "MemRelease", "MemAddressFree"):
            setattr(self, prefix + name, getattr(self, "_" + name))

    def _MemGetAllocationGranularity(self, granularity, prop, option):  # noqa: N802 - the runtime's names
        granularity._obj.value = GRANULARITY
        self.calls.append(("granularity", prop._obj.type, prop._obj.location.type, prop._obj.location.id, option))
        return 0

    def _MemAddressReserve(self, va, size, alignment, addr, flags):  # noqa: N802
        va._obj.value, self.next_va = self.next_va, self.next_va + size.value
        self.calls.append(("reserve", size.value))
        return 0

    def _MemCreate(self, handle, size, prop, flags):  # noqa: N802
        if self.out_of_memory:
            return 2
        handle._obj.value, self.next_handle = self.next_handle, self.next_handle + 1
        self.calls.append(("create", size.value, prop._obj.location.id))
        return 0

    def _MemMap(self, va, size, offset, handle, flags):  # noqa: N802
        self.calls.append(("map", va.value, size.value, handle.value))
        return 0

    def _MemSetAccess(self, va, size, desc, count):  # noqa: N802
        self.calls.append(("access", va.value, desc._obj.location.id, desc._obj.flags, count.value))
        return 0

    def _MemUnmap(self, va, size):  # noqa: N802
        self.calls.append(("unmap", va.value, size.value))
        return 0

    def _MemRelease(self, handle):  # noqa: N802
        self.calls.append(("release", handle.value))
        return 0

    def _MemAddressFree(self, va, size):  # noqa: N802
        self.calls.append(("free", va.value, size.value))
        return 0


class HostViewDriver(VmmDriver):
    """The driver under test, with host memory standing in for the device's mapped pages."""

    def tensor(self, va: int, size: int, owner: object) -> torch.Tensor:
        self.__dict__.setdefault("owners", []).append(owner)  # as a device tensor would, for the test's life
        return self.__dict__.setdefault("pages", {}).setdefault(va, torch.zeros(size, dtype=torch.uint8))


@pytest.fixture(params=["cu", "hip"])
def runtime(request, monkeypatch):
    fake = FakeRuntime(request.param)
    monkeypatch.setattr(virtual_memory.ctypes, "CDLL", lambda library: fake)
    return fake


def test_an_allocation_reserves_creates_maps_and_opens_on_its_device(runtime):
    driver = HostViewDriver("libruntime.so", runtime.prefix, torch.device("cuda", 3), lambda: None)
    assert driver.granularity == GRANULARITY
    # Pinned memory on device 3, the recommended granularity (CU/HIP_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1).
    assert runtime.calls[0] == ("granularity", 1, 1, 3, 1)
    regions = Regions(driver, lambda n: torch.empty(n, dtype=torch.uint8))
    regions.allocate("weights", 3 << 20)  # rounded up to whole granules
    va = runtime.next_va - (4 << 20)
    assert runtime.calls[1:] == [("reserve", 4 << 20), ("create", 4 << 20, 3), ("map", va, 4 << 20, 100),
                                 ("access", va, 3, 3, 1)]  # read-write (3) for device 3, one descriptor


def test_a_release_unmaps_and_gives_the_memory_back_and_a_restore_maps_new_memory_at_the_same_address(runtime):
    driver = HostViewDriver("libruntime.so", runtime.prefix, torch.device("cuda", 0), lambda: None)
    regions = Regions(driver, lambda n: torch.empty(n, dtype=torch.uint8))
    tensor = regions.allocate("kv_cache", GRANULARITY)
    va = runtime.next_va - GRANULARITY
    runtime.calls.clear()
    assert regions.release("kv_cache", backup=False) == GRANULARITY
    assert runtime.calls == [("unmap", va, GRANULARITY), ("release", 100)]  # the address stays reserved
    runtime.calls.clear()
    regions.restore("kv_cache")
    assert runtime.calls == [("create", GRANULARITY, 0), ("map", va, GRANULARITY, 101), ("access", va, 0, 3, 1)]
    del tensor


def test_out_of_memory_is_torchs_error_and_a_failed_restore_stays_released(runtime):
    driver = HostViewDriver("libruntime.so", runtime.prefix, torch.device("cuda", 0), lambda: None)
    regions = Regions(driver, lambda n: torch.empty(n, dtype=torch.uint8))
    regions.allocate("weights", GRANULARITY)
    regions.allocate("weights", GRANULARITY)
    regions.release("weights", backup=False)
    runtime.out_of_memory = True
    with pytest.raises(torch.OutOfMemoryError, match=rf"{runtime.prefix}MemCreate failed with error 2"):
        regions.restore("weights")
    assert regions.released("weights")
    runtime.out_of_memory = False
    regions.restore("weights")
    assert not regions.released("weights")


def test_the_allocation_property_has_the_runtimes_layout():
    """CUmemAllocationProp / hipMemAllocationProp: type, handle types, location {type, id}, a
    pointer, then 8 bytes of flags (the CUDA 12/13 headers' layout, 32 bytes)."""
    prop = virtual_memory._AllocationProp
    assert ctypes.sizeof(prop) == 32
    assert [name for name, _ in prop._fields_] == ["type", "requestedHandleTypes", "location", "win32HandleMetaData",
                                                   "allocFlags"]
    assert ctypes.sizeof(virtual_memory._AccessDesc) == 12


def test_rocm_declares_no_regions_though_it_runs_torch_cuda(monkeypatch):
    """A ROCm build answers torch.cuda, but CUDA's regions open libcuda: on AMD hardware the engine
    would fail at construction. ROCm sleeps by host offload until HIP's calls run on AMD hardware."""
    from torchhal.plugins.cuda import CudaPlatform
    from torchhal.plugins.rocm import RocmPlatform

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert CudaPlatform().virtual_memory_support() is not None
    assert RocmPlatform().virtual_memory_support() is None


class FakeCudart:
    """cudaHostRegister / cudaHostUnregister, recording what they were given; `status` is what register answers."""

    def __init__(self, status: int = 0) -> None:
        self.calls: list[tuple] = []
        self.status = status

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - the runtime's names
        self.calls.append(("register", ptr, nbytes, flags))
        return self.status

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


def failing_check(status: int) -> None:
    if status != 0:
        raise RuntimeError(f"CUDA error {status}")


def test_a_backup_is_host_memory_registered_in_place_and_unregistered_when_it_goes(monkeypatch):
    """The CUDA plugin's backups: torch's host memory, page-locked where it lies with cudaHostRegister
    (its whole size, default flags), unregistered once no tensor views it and not before."""
    import gc

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "check_error", failing_check)
    backup = virtual_memory.registered_host_buffer(3 << 20)
    assert backup.device.type == "cpu" and backup.dtype == torch.uint8 and backup.numel() == 3 << 20
    assert fake.calls == [("register", backup.data_ptr(), 3 << 20, 0)]
    assert not torch.any(backup)  # every page written (faulted in) before it is locked
    address, view = backup.data_ptr(), backup[1:]  # as a parameter views it while asleep
    del backup
    gc.collect()
    assert len(fake.calls) == 1  # a view keeps it locked
    del view
    gc.collect()
    assert fake.calls[1:] == [("unregister", address)]


def test_a_backup_the_runtime_cannot_lock_is_its_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(status=2))
    monkeypatch.setattr(torch.cuda, "check_error", failing_check)
    with pytest.raises(RuntimeError, match="CUDA error 2"):
        virtual_memory.registered_host_buffer(1 << 20)
