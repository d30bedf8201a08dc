"""Programmatic dependent launch (PDL) for the CUDA plugin's Triton kernels (Hopper and later;
imported lazily: Triton may be absent).

A kernel launched with PDL may be scheduled while the kernel before it on the stream is still
finishing. Its first act is `gdc_wait`, which returns once every earlier kernel has completed
and its writes are visible, so nothing it reads can be stale; it then lets the kernel after it
launch the same way (`gdc_launch_dependents`). What it saves is the launch and ramp-up between
two kernels: a batch-1 decode step runs hundreds of kernels of a few microseconds each.
`TORCHHAL_CUDA_PDL=0` turns it off (to measure it, or to rule it out).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

#: The first compute capability with programmatic dependent launch (sm_90, Hopper).
PDL_CAPABILITY = 9


@functools.cache
def programmatic_launch(device_index: int) -> bool:
    """Launch the plugin's kernels with PDL on this device."""
    if os.environ.get("TORCHHAL_CUDA_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= PDL_CAPABILITY


@triton.jit
def wait_for_previous_kernels(USE_PDL: tl.constexpr):
    """Call before a kernel's first load: with PDL, wait for the kernels before it, then let
    the next one launch; without, nothing (the stream already ordered them)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
