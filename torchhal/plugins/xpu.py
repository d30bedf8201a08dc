"""Intel XPU: torch.xpu of an XPU build of torch (torch's own XPU wheels).

XPU has no cross-process tensor sharing up to torch 2.14: IPC is declared unsupported.

Attention: torch.xpu has no paged-attention entry point, and intel_extension_for_pytorch's
(`llm.modules.PagedAttention`) is not mapped: IPEX is retired, its last release (2.9.10+xpu)
is built for torch 2.9, and no release pairs with the torch torchhal is tested on (2.13).
XPU declares no backend; engines run the portable reference.
"""

from __future__ import annotations

from types import ModuleType

import torch

from torchhal.platforms import DistributedSupport, PlatformPlugin, hookimpl
from torchhal.plugins.accelerator import AcceleratorPlatform
from torchhal.plugins.vendor_attention import ReferenceAttentionOnly


class XpuPlatform(ReferenceAttentionOnly, AcceleratorPlatform):
    name = "xpu"
    device_type = "xpu"
    priority = 90
    dist_backend = "xccl"
    visible_devices_env = ("ZE_AFFINITY_MASK",)
    runtime_hint = "check the Level Zero driver"
    graph_class_name = "XPUGraph"  # present only in torch builds that have XPU graphs
    reference_attention_because = (
        "torch.xpu has no paged-attention entry point; intel_extension_for_pytorch's PagedAttention is not mapped "
        "(IPEX is retired: its last release, 2.9.10+xpu, is built for torch 2.9)"
    )

    def distributed_support(self) -> DistributedSupport:
        # XCCL collectives join an XPU graph only with oneCCL >= 2021.17.2 and only for
        # all-reduce / all-gather / reduce-scatter (not broadcast or send/recv): not declared.
        return DistributedSupport(note="oneCCL through torch's ProcessGroupXCCL; collectives not graph-captured")

    def runtime_missing(self) -> str | None:
        if not getattr(torch.version, "xpu", None):  # every torch has torch.xpu; only an XPU build runs it
            return f"this torch build ({torch.__version__}) has no XPU support: install torch's XPU build"
        return None

    def probe_device_count(self, module: ModuleType) -> int:
        return int(module.device_count()) if module.is_available() else 0

    def runtime_version(self) -> str | None:
        return f"torch.xpu (torch {torch.__version__}, XPU {torch.version.xpu})"


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [XpuPlatform()]
