"""Deliberately broken platform plugins: the conformance suite must catch each one.

All run on the host. `SimCache` models a caching allocator with a reserved-bytes
counter (it cannot see real allocations, so it reports allocated=None); each
broken variant breaks exactly one contract.
"""

import torch

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




@hookimpl
def torchhal_register_platforms():
    return [SimCache(), QueryEmpties(), EmptyNoop(), IpcNoBounds(), DetectRaises(), MissingMethod()]
