"""NVIDIA CUDA: torch.cuda on a CUDA build of torch with a visible GPU."""

from __future__ import annotations

from typing import ClassVar

import torch

from torchhal.platforms import MemoryInfo, PlatformPlugin, hookimpl
from torchhal.plugins._accelerator import AcceleratorPlatform


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
    ipc_event_handle_nbytes = 64  # cudaIpcEventHandle_t (hipIpcEventHandle_t is 64 bytes too)

    def runtime_missing(self) -> str | None:
        if getattr(torch.version, "hip", None):
            return f"this torch is a ROCm build (HIP {torch.version.hip}); use the rocm platform"
        if not torch.version.cuda:
            return f"this torch build ({torch.__version__}) has no CUDA support"
        return None

    def memory_info(self, index: int) -> MemoryInfo:
        # The floor: one mem_get_info and one read of the allocator's stats dict.
        # memory_reserved() would flatten the whole dict (~140 us on an H100).
        # mem_get_info initialises CUDA first, so the stats read needs no guard.
        free, total = torch.cuda.mem_get_info(index)
        stats = torch._C._cuda_memoryStats(index)
        return MemoryInfo(
            index, free, total, stats["reserved_bytes"]["all"]["current"], stats["allocated_bytes"]["all"]["current"]
        )

    def allocator_bytes(self, index: int) -> tuple[int, int]:
        # As in memory_info: the two counters from the nested dict, not memory_reserved().
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
