"""Huawei Ascend NPU: torch.npu after importing torch_npu (needs the CANN toolkit).

Known traps, all caught by the shared probe: torch_npu without CANN fails on
import (RuntimeError/OSError), and torch_npu refuses non-CPU torch builds ("Two
accelerators cannot be used at the same time"). IPC opens stay on the
producer's device (`ipc_peer_redirect` is left False): the redirect is not
verified on Ascend.
"""

from __future__ import annotations

import importlib

from torchhal.platforms import AttentionSupport, DistributedSupport, PlatformPlugin, hookimpl
from torchhal.plugins.accelerator import PROBE_ERRORS, AcceleratorPlatform, module_installed
from torchhal.plugins.vendor_attention import log_reference_only

#: torch_npu's fused paged attention (torchhal.plugins.npu_attention maps onto it).
FUSED_ATTENTION = "npu_fused_infer_attention_score"


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


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [NpuPlatform()]
