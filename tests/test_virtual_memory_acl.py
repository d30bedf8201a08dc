"""The NPU plugin's regions: Ascend's ACL virtual-memory calls and torch_npu's pluggable allocator,
against fakes. The fake ACL keeps its "device memory" in host pages (a reserve is an mmap'd
range, an unmap gives the pages back with madvise, so what was there is gone), and refuses a
copy or memset outside a mapped range; the fake pool hands torch's allocator calls to the
region through the real ctypes callbacks. A mapping test: it proves the calls, their arguments
and the regions' bookkeeping over them, not that CANN behaves as documented (no Ascend
hardware here). The names and layouts are CANN's `acl_rt.h`; torch_npu's `torch.npu.MemPool`
and `torch.npu.use_mem_pool` are checked against the torch_npu 2.13.0 wheel by
tests/test_vendor_api_surface.py."""

from __future__ import annotations

import ctypes
import sys
import types
from typing import Any

import pytest
import torch

from torchhal.platforms import Availability
from torchhal.plugins import virtual_memory
from torchhal.plugins.npu import NpuPlatform
from torchhal.plugins.virtual_memory import ACL_CALLS, AclDriver, HostDriver, Regions, TorchPools

GRANULARITY = 2 << 20
#: torch_npu's device type is torch's privateuse1 backend, renamed "npu" when torch_npu loads.
NPU = "privateuseone"
OUT_OF_MEMORY = 207001  # ACL_ERROR_RT_MEMORY_ALLOCATION


class FakeAcl:
    """libascendcl's calls that AclDriver makes, recording what they were given."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.pages, self.reserved, self.mapped = HostDriver(), {}, {}
        self.next_handle, self.out_of_memory = 100, False
        for name in ACL_CALLS:
            setattr(self, f"aclrt{name}", getattr(self, f"_{name}"))

    def _mapped(self, address: int, nbytes: int) -> None:
        assert any(va <= address and address + nbytes <= va + size for va, (size, _) in self.mapped.items()), (
            f"{nbytes} bytes at {address:#x} are not mapped")

    def _SetDevice(self, index):  # noqa: N802 - the runtime's names
        self.calls.append(("set_device", index.value))
        return 0

    def _MemGetAllocationGranularity(self, prop, option, granularity):  # noqa: N802
        p = prop._obj
        self.calls.append(("granularity", p.handleType, p.allocationType, p.memAttr, p.location.type, p.location.id,
                           option))
        granularity._obj.value = GRANULARITY
        return 0

    def _ReserveMemAddress(self, va, size, alignment, expected, flags):  # noqa: N802
        va._obj.value = self.pages.reserve(size.value)
        self.reserved[va._obj.value] = size.value
        self.calls.append(("reserve", size.value, alignment.value, expected, flags.value))
        return 0

    def _MallocPhysical(self, handle, size, prop, flags):  # noqa: N802
        if self.out_of_memory:
            return OUT_OF_MEMORY
        handle._obj.value, self.next_handle = self.next_handle, self.next_handle + 1
        self.calls.append(("malloc_physical", size.value, prop._obj.location.id, flags.value))
        return 0

    def _MapMem(self, va, size, offset, handle, flags):  # noqa: N802
        self.mapped[va.value] = (size.value, handle.value)
        self.calls.append(("map", va.value, size.value, offset.value, handle.value, flags.value))
        return 0

    def _UnmapMem(self, va):  # noqa: N802
        size, _ = self.mapped.pop(va.value)
        self.pages.unmap(va.value, size, 0)  # the contents go with the physical memory
        self.calls.append(("unmap", va.value))
        return 0

    def _FreePhysical(self, handle):  # noqa: N802
        self.calls.append(("free_physical", handle.value))
        return 0

    def _ReleaseMemAddress(self, va):  # noqa: N802
        assert va.value not in self.mapped, "addresses released while mapped"
        self.pages.free(va.value, self.reserved.pop(va.value))
        self.calls.append(("release_address", va.value))
        return 0

    def _Memcpy(self, dst, dst_max, src, count, kind):  # noqa: N802
        assert dst_max.value >= count.value
        self._mapped(src.value if kind == 2 else dst.value, count.value)  # ACL_MEMCPY_DEVICE_TO_HOST = 2
        ctypes.memmove(dst.value, src.value, count.value)
        self.calls.append(("memcpy", "to_host" if kind == 2 else "to_device", count.value))
        return 0

    def _Memset(self, va, max_count, value, count):  # noqa: N802
        self._mapped(va.value, count.value)
        ctypes.memset(va.value, value.value, count.value)
        self.calls.append(("memset", va.value, value.value, count.value))
        return 0


class HostPools(TorchPools):
    """torch's caching allocator as the fake sees it: a tensor asks its pool's alloc callback
    (through the function pointer torch would call) for a segment, and views it."""

    def tensor(self, pool: Any, nbytes: int, device: torch.device) -> torch.Tensor:
        va = pool.alloc(nbytes, 0, None)
        if va is None:
            raise torch.OutOfMemoryError("the pool's allocator answered a null pointer")
        return torch.frombuffer(virtual_memory._HostPages.over(va, nbytes, pool), dtype=torch.uint8)


def fake_pools() -> HostPools:
    def custom_allocator(alloc: int, free: int) -> tuple[Any, Any]:
        return virtual_memory._ALLOC(alloc), virtual_memory._FREE(free)

    def mem_pool(allocator: tuple[Any, Any]) -> types.SimpleNamespace:
        return types.SimpleNamespace(id=(0, 7), alloc=allocator[0], free=allocator[1])

    return HostPools(custom_allocator, mem_pool, lambda pool, device: pytest.fail("HostPools.tensor is overridden"))


@pytest.fixture
def acl(monkeypatch: pytest.MonkeyPatch) -> FakeAcl:
    fake = FakeAcl()
    monkeypatch.setattr(virtual_memory.ctypes, "CDLL", lambda library: fake)
    return fake


def npu_regions(device: int = 0) -> Regions:
    driver = AclDriver(torch.device(NPU, device), lambda: None)
    return Regions(driver, lambda n: torch.empty(n, dtype=torch.uint8), fake_pools(), graphs_in_pools=False)


def test_an_allocation_reserves_mallocs_maps_and_clears_on_its_device(acl: FakeAcl) -> None:
    regions = npu_regions(device=3)
    # The thread's context is device 3's; pinned (0) huge-page HBM (ACL_HBM_MEM_HUGE = 4) on device (1) 3,
    # the minimum granularity (0).
    assert acl.calls == [("set_device", 3), ("granularity", 0, 0, 4, 1, 3, 0)]
    tensor = regions.allocate("weights", 3 << 20)  # rounded up to whole granules
    va = tensor.data_ptr()
    assert tensor.numel() == 3 << 20 and regions.region_bytes("weights") == 4 << 20
    assert acl.calls[2:] == [("reserve", 4 << 20, 0, None, 0), ("malloc_physical", 4 << 20, 3, 0),
                             ("map", va, 4 << 20, 0, 100, 0), ("memset", va, 0, 4 << 20)]
    assert regions.graph_pool("weights") is None  # graph memory stays out of NPU regions


def test_a_backed_up_release_comes_back_bit_exact_at_the_same_address(acl: FakeAcl) -> None:
    regions = npu_regions()
    tensor = regions.allocate("weights", GRANULARITY)
    tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8))
    expected, va = tensor.clone(), tensor.data_ptr()
    acl.calls.clear()
    assert regions.release("weights", backup=True) == GRANULARITY
    assert acl.calls == [("memcpy", "to_host", GRANULARITY), ("unmap", va), ("free_physical", 100)]
    assert not bool(tensor.any())  # the physical memory (and what it held) went back
    assert torch.equal(regions.host_copy(tensor), expected)
    acl.calls.clear()
    assert regions.restore("weights") == GRANULARITY
    assert acl.calls == [("malloc_physical", GRANULARITY, 0, 0), ("map", va, GRANULARITY, 0, 101, 0),
                         ("memcpy", "to_device", GRANULARITY)]
    assert tensor.data_ptr() == va and torch.equal(tensor, expected)


def test_a_discarded_release_comes_back_cleared(acl: FakeAcl) -> None:
    regions = npu_regions()
    kv = regions.allocate("kv_cache", GRANULARITY)
    kv.fill_(7)
    regions.release("kv_cache", backup=False)
    acl.calls.clear()
    regions.restore("kv_cache")
    assert [call[0] for call in acl.calls] == ["malloc_physical", "map", "memset"]  # not read as old data
    assert not bool(kv.any())


def test_out_of_memory_is_torchs_error_and_a_failed_restore_stays_released(acl: FakeAcl) -> None:
    regions = npu_regions()
    regions.allocate("weights", GRANULARITY)
    regions.release("weights", backup=True)
    acl.out_of_memory = True
    with pytest.raises(torch.OutOfMemoryError, match=rf"aclrtMallocPhysical failed with error {OUT_OF_MEMORY}"):
        regions.restore("weights")
    assert regions.released("weights")
    acl.out_of_memory = False
    regions.restore("weights")
    assert not regions.released("weights")


def test_a_segment_freed_by_torchs_allocator_gives_its_memory_and_addresses_back(acl: FakeAcl) -> None:
    import gc

    regions = npu_regions()
    pool = regions._pool("weights")
    va = pool.alloc(GRANULARITY, 0, None)
    assert regions.region_bytes("weights") == GRANULARITY
    pool.free(va, GRANULARITY, 0, None)  # what torch does when it empties the pool
    gc.collect()
    assert regions.region_bytes("weights") == 0
    assert [call[0] for call in acl.calls[-3:]] == ["unmap", "free_physical", "release_address"]


def test_the_physical_memory_property_has_acls_layout() -> None:
    """aclrtPhysicalMemProp: handleType, allocationType, memAttr, location {uint32 id, type}, then a
    uint64 reserve (acl_rt.h), 32 bytes with its padding."""
    prop = virtual_memory._AclPhysicalMemProp
    assert [name for name, _ in prop._fields_] == ["handleType", "allocationType", "memAttr", "location", "reserve"]
    assert [name for name, _ in virtual_memory._AclLocation._fields_] == ["id", "type"]
    assert ctypes.sizeof(virtual_memory._AclLocation) == 8 and ctypes.sizeof(prop) == 32
    assert prop.reserve.offset == 24


def fake_torch_npu(monkeypatch: pytest.MonkeyPatch, *, mem_pool: bool = True) -> types.ModuleType:
    module = types.ModuleType("torch.npu")
    module.synchronize = lambda device=None: None  # type: ignore[attr-defined]
    if mem_pool:
        module.MemPool = lambda allocator=None, use_on_oom=False, no_split=False: types.SimpleNamespace(  # type: ignore[attr-defined]
            id=(0, 1), allocator=allocator)
        module.use_mem_pool = lambda pool, device=None: pytest.fail("not used here")  # type: ignore[attr-defined]
    ext = types.ModuleType("torch_npu")
    ext.__version__ = "2.13.0"  # type: ignore[attr-defined]
    ext._C = types.SimpleNamespace(__name__="torch_npu._C", _npu_customAllocator=lambda alloc, free: (alloc, free))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_npu", ext)
    monkeypatch.setattr(NpuPlatform, "is_available", lambda self: Availability.yes("2 npu device(s)"))
    monkeypatch.setattr(NpuPlatform, "device_module", lambda self: module)
    monkeypatch.setattr(NpuPlatform, "device_type", NPU)
    return module


def test_the_npu_plugin_declares_acl_regions_without_graph_memory(acl: FakeAcl,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from torchhal.plugins import npu

    fake_torch_npu(monkeypatch)
    monkeypatch.setattr(npu.ctypes, "CDLL", lambda library: acl)
    support = NpuPlatform().virtual_memory_support()
    assert support is not None and not support.graph_memory and "aclrtMapMem" in support.note
    regions = support.new_regions(1)
    assert isinstance(regions, Regions) and isinstance(regions.driver, AclDriver)
    assert regions.driver.device == torch.device(NPU, 1) and regions.graph_pool("weights") is None
    assert acl.calls[0] == ("set_device", 1)


def test_the_npu_plugin_without_mem_pools_or_the_calls_sleeps_by_host_offload(acl: FakeAcl,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from torchhal.plugins import npu

    fake_torch_npu(monkeypatch, mem_pool=False)
    monkeypatch.setattr(npu.ctypes, "CDLL", lambda library: acl)
    assert NpuPlatform().virtual_memory_missing() == "torch_npu 2.13.0 has no torch.npu.MemPool"
    assert NpuPlatform().virtual_memory_support() is None
    fake_torch_npu(monkeypatch)
    del acl.aclrtMapMem
    assert NpuPlatform().virtual_memory_missing() == "libascendcl.so has no aclrtMapMem (CANN too old)"
