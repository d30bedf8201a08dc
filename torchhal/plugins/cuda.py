"""NVIDIA CUDA: torch.cuda on a CUDA build of torch with a visible GPU."""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from torchhal.platforms import Availability, PlatformPlugin, hookimpl
from torchhal.plugins._accelerator import PROBE_ERRORS, AcceleratorPlatform


class CudaPlatform(AcceleratorPlatform):
    name = "cuda"
    device_type = "cuda"
    priority = 100
    dist_backend = "nccl"
    visible_devices_env: ClassVar[tuple[str, ...]] = ("CUDA_VISIBLE_DEVICES",)
    graph_class_name = "CUDAGraph"
    ipc_share_method = "_share_cuda_"
    ipc_open_method = "_new_shared_cuda"
    ipc_peer_redirect = True

    def is_available(self) -> Availability:
        if getattr(torch.version, "hip", None):
            return Availability.no(f"this torch is a ROCm build (HIP {torch.version.hip}); use the rocm platform")
        if not torch.version.cuda:
            return Availability.no(f"this torch build ({torch.__version__}) has no CUDA support")
        try:
            count = torch.cuda.device_count()  # NVML/driver query: no context is created
        except PROBE_ERRORS as exc:
            return Availability.no(f"CUDA device query failed: {type(exc).__name__}: {exc}")
        if count == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return Availability.no(f"CUDA build {torch.version.cuda} but no GPU is visible{hint}")
        return Availability.yes(f"{count} CUDA device(s)")

    def allocator_bytes(self, index: int) -> tuple[int, int]:
        # memory_reserved() flattens the whole memory_stats dict (~140 us on an H100);
        # read the two counters from the nested dict instead.
        if not torch.cuda.is_initialized():
            return 0, 0
        stats = torch._C._cuda_memoryStats(index)
        return int(stats["reserved_bytes"]["all"]["current"]), int(stats["allocated_bytes"]["all"]["current"])

    def runtime_version(self) -> str | None:
        text = f"CUDA runtime {torch.version.cuda}"
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            text += f", driver {driver.decode() if isinstance(driver, bytes) else driver}"
        except Exception:  # nvidia-ml-py is optional (the `cuda` extra)
            pass
        return text


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [CudaPlatform()]
