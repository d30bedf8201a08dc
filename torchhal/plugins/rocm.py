"""AMD ROCm: a HIP build of torch. It reuses torch.cuda (HIP maps onto it).

CUDA and ROCm never both claim a machine: each checks `torch.version.hip`.
"""

from __future__ import annotations

import torch

from torchhal.platforms import Availability, PlatformPlugin, hookimpl
from torchhal.plugins._accelerator import PROBE_ERRORS
from torchhal.plugins.cuda import CudaPlatform


class RocmPlatform(CudaPlatform):
    name = "rocm"
    device_type = "cuda"
    priority = 100
    dist_backend = "nccl"  # RCCL answers to the nccl backend name
    visible_devices_env = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    graph_class_name = "CUDAGraph"  # hipGraph behind torch.cuda.CUDAGraph
    ipc_peer_redirect = True

    def is_available(self) -> Availability:
        hip = getattr(torch.version, "hip", None)
        if not hip:
            return Availability.no("this torch build is not a ROCm (HIP) build")
        try:
            count = torch.cuda.device_count()
        except PROBE_ERRORS as exc:
            return Availability.no(f"ROCm device query failed: {type(exc).__name__}: {exc}")
        if count == 0:
            return Availability.no(f"ROCm build (HIP {hip}) but no GPU is visible")
        return Availability.yes(f"{count} ROCm device(s)")

    def runtime_version(self) -> str | None:
        return f"HIP {torch.version.hip}"


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [RocmPlatform()]
