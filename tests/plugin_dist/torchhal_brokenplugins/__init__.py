"""Deliberately broken platform plugins: the conformance suite must catch each one.

All run on the host. `SimCache` models a caching allocator with a reserved-bytes
counter (it cannot see real allocations, so it reports allocated=None). The
`Sim*` mutants break the simulated accelerator of `torchhal_simaccel`, which
does account real allocations (allocated, reserved, a cache emptied only by
`empty_cache`). Each broken variant breaks exactly one contract clause, and
tests/test_conformance_suite.py checks that exactly that clause's test fails.
"""

import time

import torch
from torchhal_simaccel import SimAccelPlatform
from torchhal_simaccel import device as sim_device

from torchhal.platforms import MemoryInfo, hookimpl
from torchhal.plugins.cpu import CpuPlatform

MiB = 1 << 20


class SimCache(CpuPlatform):
    """Well-behaved reference: must be CONFORMANT."""

    name = "simcache"
    priority = -1

    def __init__(self):
        self.reserved = 256 * MiB

    def synchronize(self, index):
        self.reserved = 256 * MiB  # device work happened: the cache filled up again

    def memory_info(self, index):
        base = super().memory_info(index)
        return MemoryInfo(index, base.free, base.total, reserved=self.reserved, allocated=None)

    def empty_cache(self, index):
        released, self.reserved = self.reserved, 0
        return released


class QueryEmpties(SimCache):
    name = "broken_query_empties"

    def memory_info(self, index):
        self.empty_cache(index)  # the bug: a query that cleans
        return super().memory_info(index)


class EmptyNoop(SimCache):
    name = "broken_empty_noop"

    def empty_cache(self, index):
        return 0  # the bug: releases nothing while reserved > allocated


class IpcNoBounds(SimCache):
    name = "broken_ipc_bounds"

    def ipc_support(self):
        support = super().ipc_support()

        def open_unchecked(handle, device):
            manager, name = handle.storage
            storage = torch.UntypedStorage._new_shared_filename_cpu(manager, name, handle.storage_nbytes)
            out = torch.empty(0, dtype=getattr(torch, handle.dtype, torch.float32))
            offset = handle.offset_bytes // max(out.element_size(), 1)
            out.set_(storage, offset, handle.shape, handle.stride)  # the bug: no bounds checks
            return out

        return type(support)(share=support.share, open=open_unchecked, peer_redirect=False)


class DetectRaises(SimCache):
    name = "broken_detect_raises"

    def is_available(self):
        raise RuntimeError("probe crashed")  # the bug: detection raises


class MissingMethod(SimCache):
    name = "broken_missing_method"
    runtime_version = None  # the bug: an SPI method is missing


# -- mutants of the simulated accelerator: one clause each ---------------------------


class SimFloatCounters(SimAccelPlatform):
    name = "broken_float_counters"

    def memory_info(self, index):
        mem = super().memory_info(index)
        # the bug: byte counters as floats (e.g. a value divided and multiplied back)
        return MemoryInfo(mem.device, mem.free, mem.total, float(mem.reserved), float(mem.allocated))


class SimReservedFrozen(SimAccelPlatform):
    name = "broken_reserved_frozen"

    def memory_info(self, index):
        mem = super().memory_info(index)
        return MemoryInfo(mem.device, mem.free, mem.total, reserved=0, allocated=None)  # the bug: reserved never moves

    def empty_cache(self, index):
        return 0


class SimAllocatedStuck(SimAccelPlatform):
    name = "broken_allocated_stuck"
    _first_allocated = None

    def memory_info(self, index):
        mem = super().memory_info(index)
        if self._first_allocated is None:
            self._first_allocated = mem.allocated  # the bug: the allocator's stats read once and kept
        return MemoryInfo(mem.device, mem.free, mem.total, mem.reserved, self._first_allocated)


class SimDetectInitialises(SimAccelPlatform):
    name = "broken_detect_initialises"

    def is_available(self):
        sim_device.init()  # the bug: detection starts the runtime (a device context)
        return super().is_available()


class SimOomUnrecognised(SimAccelPlatform):
    name = "broken_oom_unrecognised"

    def is_out_of_memory(self, error):
        return isinstance(error, torch.OutOfMemoryError)  # the bug: misses what the allocator really raises


class SimSlowMemoryInfo(SimAccelPlatform):
    name = "broken_slow_memory_info"

    def memory_info(self, index):
        time.sleep(0.002)  # the bug: a query that takes milliseconds (a driver round trip per call)
        return super().memory_info(index)


class SimNoDeviceMemory(SimAccelPlatform):
    name = "broken_device_info"

    def device_info(self, index):
        info = super().device_info(index)
        return type(info)(index=index, name=info.name, total_memory=0)  # the bug: total memory unknown, said as 0


class SimEnvList(SimAccelPlatform):
    name = "broken_env_list"
    visible_devices_env = ["SIMACCEL_VISIBLE_DEVICES"]  # the bug: a list, where the SPI says tuple


class SimGraphDict(SimAccelPlatform):
    name = "broken_graph_record"

    def graph_support(self):
        return {"graph_class": object}  # the bug: a dict, not a GraphSupport record


class SimAttentionList(SimAccelPlatform):
    name = "broken_attention_record"

    def attention_support(self):
        return []  # the bug: a list, not an AttentionSupport record (or None)


@hookimpl
def torchhal_register_platforms():
    return [
        SimCache(), QueryEmpties(), EmptyNoop(), IpcNoBounds(), DetectRaises(), MissingMethod(),
        SimFloatCounters(), SimReservedFrozen(), SimAllocatedStuck(), SimDetectInitialises(),
        SimOomUnrecognised(), SimSlowMemoryInfo(), SimNoDeviceMemory(), SimEnvList(), SimGraphDict(),
        SimAttentionList(),
    ]
