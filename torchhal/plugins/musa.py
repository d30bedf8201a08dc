"""Moore Threads MUSA: torch.musa after importing torch_musa.

torch_musa mirrors torch.cuda name for name, including IPC (`_share_musa_` /
`_new_shared_musa`, the CUDA path with the device index redirected).
"""

from __future__ import annotations

from torchhal.platforms import Availability, PlatformPlugin, hookimpl
from torchhal.plugins._accelerator import PROBE_ERRORS, AcceleratorPlatform, module_installed


class MusaPlatform(AcceleratorPlatform):
    name = "musa"
    device_type = "musa"
    priority = 90
    dist_backend = "mccl"
    visible_devices_env = ("MUSA_VISIBLE_DEVICES",)
    extension_module = "torch_musa"
    graph_class_name = "MUSAGraph"
    ipc_share_method = "_share_musa_"
    ipc_open_method = "_new_shared_musa"
    ipc_peer_redirect = True

    def is_available(self) -> Availability:
        if not module_installed("torch_musa"):
            return Availability.no("torch_musa is not installed")
        try:
            count = self.device_module().device_count()
        except PROBE_ERRORS as exc:
            return Availability.no(f"torch_musa failed to load: {type(exc).__name__}: {exc}")
        if count == 0:
            return Availability.no("torch_musa loaded but no MUSA GPU is visible (MUSA_VISIBLE_DEVICES?)")
        return Availability.yes(f"{count} MUSA GPU(s)")

    def runtime_version(self) -> str | None:
        import torch_musa

        return f"torch_musa {getattr(torch_musa, '__version__', '?')}"


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [MusaPlatform()]
