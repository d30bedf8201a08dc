"""AMD ROCm: a HIP build of torch. It reuses torch.cuda (HIP maps onto it).

Everything but detection and the version comes from the CUDA plugin: the
device type "cuda", priority, the "nccl" backend name (RCCL answers to it),
`CUDAGraph` (hipGraph behind it) and peer-redirected IPC. CUDA and ROCm never
both claim a machine: each checks `torch.version.hip`.

Attention is the exception: the CUDA plugin's Triton backend is plain Triton, which
targets AMD GPUs too, but its launch configurations are tuned for an H200 (its 256-row
bf16 prefill tiles need about 128 KiB of shared memory by the kernel's own count; an
MI300 CU has 64 KiB of LDS) and it has never run on AMD hardware. ROCm declares no
backend, so engines run the portable reference, until the kernels are verified (and
tuned) on an AMD GPU. The CUDA plugin's Triton GEMV (`linear_support`) is withheld for the
same reason: its launch configurations were measured on an H200 only, and so are the
virtual-memory regions (sleep falls back to host offload).
"""

from __future__ import annotations

import torch

from torchhal.platforms import (
    CompileSupport,
    DistributedSupport,
    LinearSupport,
    PlatformPlugin,
    VirtualMemorySupport,
    hookimpl,
)
from torchhal.plugins.cuda import CudaPlatform
from torchhal.plugins.vendor_attention import ReferenceAttentionOnly


class RocmPlatform(ReferenceAttentionOnly, CudaPlatform):
    name = "rocm"
    visible_devices_env = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    reference_attention_because = (
        "the CUDA plugin's Triton kernels are tuned for NVIDIA GPUs and not verified on AMD hardware; "
        "ROCm has no vendor paged-attention entry point in torch"
    )

    def virtual_memory_support(self) -> VirtualMemorySupport | None:
        # Not CUDA's (it opens libcuda): the driver maps HIP's hipMem* calls too, but they have not
        # run on AMD hardware, and a declared capability is what the engine sleeps on by default.
        return None

    def linear_support(self) -> LinearSupport | None:
        return None  # the CUDA plugin's Triton GEMV is not verified on AMD hardware: F.linear

    def compile_support(self) -> CompileSupport | None:
        return None  # programmatic dependent launch is an NVIDIA (sm_90+) feature: inductor's defaults

    def runtime_missing(self) -> str | None:
        if not getattr(torch.version, "hip", None):
            return "this torch build is not a ROCm (HIP) build"
        return None

    def runtime_version(self) -> str | None:
        return f"HIP {torch.version.hip}"

    def distributed_support(self) -> DistributedSupport:
        # RCCL answers to torch's "nccl"; capturing torch.distributed collectives in a HIP
        # graph is reported refused ("operation not permitted when stream is capturing").
        return DistributedSupport(note="RCCL behind torch's nccl backend; collectives not graph-captured")


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [RocmPlatform()]
