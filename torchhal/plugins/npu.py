"""Huawei Ascend NPU: torch.npu after importing torch_npu (needs the CANN toolkit).

Known traps, all caught by the shared probe: torch_npu without CANN fails on
import (RuntimeError/OSError), and torch_npu refuses non-CPU torch builds ("Two
accelerators cannot be used at the same time"). IPC opens stay on the
producer's device (`ipc_peer_redirect` is left False): the redirect is not
verified on Ascend.

Virtual memory: ACL's `aclrtReserveMemAddress` / `aclrtMallocPhysical` / `aclrtMapMem`
(`torchhal.plugins.virtual_memory.AclDriver`), tensors through torch_npu's pluggable
allocator and `MemPool`. Graph memory stays out of the regions: NPUGraph capture into a
pluggable allocator's pool is not verified, so graphs survive a sleep and keep their memory.
"""

from __future__ import annotations

import ctypes
import importlib
import logging

import torch

from torchhal.platforms import AttentionSupport, DistributedSupport, PlatformPlugin, VirtualMemorySupport, hookimpl
from torchhal.plugins.accelerator import PROBE_ERRORS, AcceleratorPlatform, module_installed
from torchhal.plugins.vendor_attention import log_reference_only

#: torch_npu's fused paged attention (torchhal.plugins.npu_attention maps onto it).
FUSED_ATTENTION = "npu_fused_infer_attention_score"

log = logging.getLogger(__name__)


class NpuPlatform(AcceleratorPlatform):
    name = "npu"
    device_type = "npu"
    priority = 90
    dist_backend = "hccl"
    visible_devices_env = ("ASCEND_RT_VISIBLE_DEVICES",)
    extension_module = "torch_npu"
    runtime_hint = "needs torch_npu and the CANN toolkit: pip install 'torchhal[npu]'"
    graph_class_name = "NPUGraph"
    # torch_npu.multiprocessing.reductions shares storages with these methods.
    ipc_share_method = "_share_npu_"
    ipc_open_method = "_new_shared_npu"

    def distributed_support(self) -> DistributedSupport:
        # torch_npu registers "hccl" with torch.distributed; HCCL inside NPUGraph capture is
        # reported failing on multi-die parts (an HCCL stream not joined to the capture).
        return DistributedSupport(note="HCCL, registered by torch_npu; collectives not graph-captured")

    def virtual_memory_missing(self) -> str | None:
        """Why ACL regions cannot be declared, or None."""
        from torchhal.plugins.virtual_memory import ACL_CALLS, ACL_LIBRARY

        if not self.is_available():
            return "no NPU is available"
        module = self.device_module()
        torch_npu = importlib.import_module("torch_npu")
        for owner, name in ((module, "MemPool"), (module, "use_mem_pool"), (torch_npu._C, "_npu_customAllocator")):
            if not hasattr(owner, name):
                return f"torch_npu {getattr(torch_npu, '__version__', '?')} has no {owner.__name__}.{name}"
        try:
            acl = ctypes.CDLL(ACL_LIBRARY)
        except OSError as exc:
            return f"{ACL_LIBRARY} does not load ({exc}): source CANN's set_env.sh"
        absent = [f"aclrt{name}" for name in ACL_CALLS if not hasattr(acl, f"aclrt{name}")]
        return f"{ACL_LIBRARY} has no {', '.join(absent)} (CANN too old)" if absent else None

    def virtual_memory_support(self) -> VirtualMemorySupport | None:
        missing = self.virtual_memory_missing()
        if missing:
            log.info("npu: no virtual memory (sleep by host offload): %s", missing)
            return None
        from torchhal.plugins.virtual_memory import AclDriver, Regions, TorchPools

        module = self.device_module()
        torch_npu = importlib.import_module("torch_npu")
        pools = TorchPools(torch_npu._C._npu_customAllocator, module.MemPool, module.use_mem_pool)

        def new_regions(index: int) -> Regions:
            driver = AclDriver(torch.device(self.device_type, index), lambda: module.synchronize(index))
            return Regions(driver, _pinned_host_bytes, pools, graphs_in_pools=False)

        return VirtualMemorySupport(
            new_regions, graph_memory=False,
            not_released=("the ACL context", "graph memory (NPUGraph's own pool)", "HCCL communicators' buffers"),
            note="ACL virtual memory: aclrtMallocPhysical / aclrtMapMem under addresses kept by aclrtReserveMemAddress")

    def attention_missing(self) -> str | None:
        """Why torch_npu's fused paged attention cannot be declared, or None."""
        if not module_installed("torch_npu"):
            return "torch_npu is not installed"
        try:
            torch_npu = importlib.import_module("torch_npu")
        except PROBE_ERRORS as exc:
            return f"torch_npu failed to import: {type(exc).__name__}: {exc}"
        if not hasattr(torch_npu, FUSED_ATTENTION):
            version = getattr(torch_npu, "__version__", "?")
            return f"torch_npu {version} has no {FUSED_ATTENTION} (torch_npu 2.13.0 has it)"
        return None

    def attention_support(self) -> AttentionSupport | None:
        missing = self.attention_missing()
        if missing:
            log_reference_only(self.name, missing)
            return None
        from torchhal.plugins.npu_attention import NpuFusedAttention

        return AttentionSupport(backends=(NpuFusedAttention(),), note=f"torch_npu.{FUSED_ATTENTION} (paged)")


def _pinned_host_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [NpuPlatform()]
