"""Intel XPU: upstream torch.xpu; intel_extension_for_pytorch only for torch builds without it.

XPU has no cross-process tensor sharing up to torch 2.14: IPC is declared unsupported.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from torchhal.platforms import Availability, PlatformPlugin, hookimpl
from torchhal.plugins._accelerator import PROBE_ERRORS, AcceleratorPlatform, module_installed

IPEX = "intel_extension_for_pytorch"


class XpuPlatform(AcceleratorPlatform):
    name = "xpu"
    device_type = "xpu"
    priority = 90
    dist_backend = "xccl"
    visible_devices_env = ("ZE_AFFINITY_MASK",)
    graph_class_name = "XPUGraph"  # present only in torch builds that have XPU graphs

    def device_module(self) -> ModuleType:
        if not hasattr(torch, "xpu"):
            importlib.import_module(IPEX)
        return super().device_module()

    def is_available(self) -> Availability:
        if not hasattr(torch, "xpu") and not module_installed(IPEX):
            return Availability.no(f"torch {torch.__version__} has no torch.xpu and {IPEX} is not installed")
        try:
            module = self.device_module()
            count = module.device_count() if module.is_available() else 0
        except PROBE_ERRORS as exc:
            return Availability.no(f"XPU runtime failed to load: {type(exc).__name__}: {exc}")
        if count == 0:
            return Availability.no("no Intel XPU device is visible (check ZE_AFFINITY_MASK and the Level Zero driver)")
        return Availability.yes(f"{count} XPU device(s)")

    def runtime_version(self) -> str | None:
        return f"torch.xpu (torch {torch.__version__})"


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [XpuPlatform()]
