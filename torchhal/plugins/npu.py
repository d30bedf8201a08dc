"""Huawei Ascend NPU: torch.npu after importing torch_npu (needs the CANN toolkit).

Known traps, all caught by the probe: torch_npu without CANN fails on import
(RuntimeError/OSError), and torch_npu refuses non-CPU torch builds ("Two
accelerators cannot be used at the same time").
"""

from __future__ import annotations

import torch

from torchhal.platforms import Availability, PlatformPlugin, hookimpl
from torchhal.plugins._accelerator import PROBE_ERRORS, AcceleratorPlatform, module_installed


class NpuPlatform(AcceleratorPlatform):
    name = "npu"
    device_type = "npu"
    priority = 90
    dist_backend = "hccl"
    visible_devices_env = ("ASCEND_RT_VISIBLE_DEVICES",)
    extension_module = "torch_npu"
    graph_class_name = "NPUGraph"
    # torch_npu.multiprocessing.reductions shares storages with these methods.
    ipc_share_method = "_share_npu_"
    ipc_open_method = "_new_shared_npu"
    ipc_peer_redirect = False  # not verified on Ascend: open on the producer's device

    def is_available(self) -> Availability:
        if not module_installed("torch_npu"):
            return Availability.no("torch_npu is not installed (pip install 'torchhal[npu]')")
        try:
            count = self.device_module().device_count()
        except PROBE_ERRORS as exc:
            return Availability.no(f"torch_npu failed to load (is CANN installed?): {type(exc).__name__}: {exc}")
        if count == 0:
            return Availability.no("torch_npu loaded but no NPU is visible (ASCEND_RT_VISIBLE_DEVICES?)")
        return Availability.yes(f"{count} Ascend NPU(s)")

    def oom_error_types(self) -> tuple[type[BaseException], ...]:
        own = getattr(self.device_module(), "OutOfMemoryError", None)
        return tuple(t for t in (own, torch.OutOfMemoryError) if t is not None)

    def runtime_version(self) -> str | None:
        import torch_npu

        return f"torch_npu {getattr(torch_npu, '__version__', '?')}"


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [NpuPlatform()]
