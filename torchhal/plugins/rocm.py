"""AMD ROCm: a HIP build of torch. It reuses torch.cuda (HIP maps onto it).

Everything but detection and the version comes from the CUDA plugin: the
device type "cuda", priority, the "nccl" backend name (RCCL answers to it),
`CUDAGraph` (hipGraph behind it) and peer-redirected IPC. CUDA and ROCm never
both claim a machine: each checks `torch.version.hip`.
"""

from __future__ import annotations

import torch

from torchhal.platforms import PlatformPlugin, hookimpl
from torchhal.plugins.cuda import CudaPlatform


class RocmPlatform(CudaPlatform):
    name = "rocm"
    visible_devices_env = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")

    def runtime_missing(self) -> str | None:
        if not getattr(torch.version, "hip", None):
            return "this torch build is not a ROCm (HIP) build"
        return None

    def runtime_version(self) -> str | None:
        return f"HIP {torch.version.hip}"


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [RocmPlatform()]
