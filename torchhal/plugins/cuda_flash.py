"""Whole-prompt causal attention for the CUDA plugin: FlashAttention-4 where it is installed
and was measured faster, else torch's SDPA (cuDNN's kernel on an H200 with torch 2.11).

FlashAttention-4 (the `flash-attn-4` package: CuTe DSL kernels) is an optional extra,
`pip install 'torchhal[fa4]'`. On an H200 at the Llama-3.1-8B shape (32/8 heads, dim 128,
bf16) its causal kernel took a 16000-token prompt's attention in 3.43 ms a layer against
cuDNN's 4.13, in a layer stack running at the power limit (benchmarks/README.md). It is used
only where all of these hold, so every other case keeps the SDPA path it had:

- compute capability 9.x and head dim 128 (where it was measured and checked against the
  reference on hardware; FA4 itself takes more head dims);
- float16 or bfloat16;
- not while a graph is being captured (its first call per configuration compiles);
- `TORCHHAL_CUDA_FA4` is not `0` (to measure against SDPA, or to rule it out).

Importing it takes seconds (it loads the CuTe compiler), so that happens at the first call
that would use it, not at plugin load. An import that fails warns once, naming the error,
and SDPA serves from then on.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

DISTRIBUTION = "flash-attn-4"
#: Compute capability majors and head dims where FA4 was measured faster than SDPA's pick
#: and checked against the reference (9: H200; 128: Llama, Mistral, Qwen).
MEASURED_CAPABILITIES = (9,)
MEASURED_HEAD_DIMS = (128,)
DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def fa4_version() -> tuple[str | None, str]:
    """(version, why): the installed flash-attn-4's version, or None and why it is not used."""
    if os.environ.get("TORCHHAL_CUDA_FA4", "1") == "0":
        return None, "TORCHHAL_CUDA_FA4=0"
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None, "flash-attn-4 is not installed: pip install 'torchhal[fa4]'"
    return version, f"flash-attn-4 {version}"


def describe() -> str:
    """One line for `torchhal info`: which kernel whole prompts take, and why."""
    version, why = fa4_version()
    if version is None:
        return f"whole prompts through SDPA ({why})"
    return f"whole prompts through FlashAttention-4 ({why}) on sm_90 at head dim 128, SDPA elsewhere"


@functools.cache
def _fa4_function() -> Callable[..., Any] | None:
    try:
        return importlib.import_module("flash_attn.cute").flash_attn_func  # type: ignore[no-any-return]
    except Exception as exc:  # a broken install: say so once, keep serving through SDPA
        warnings.warn(f"flash-attn-4 is installed but `import flash_attn.cute` failed ({type(exc).__name__}: "
                      f"{exc}); whole prompts use SDPA. Reinstall it (pip install 'torchhal[fa4]') or set "
                      "TORCHHAL_CUDA_FA4=0 to silence this.", RuntimeWarning, stacklevel=3)
        return None


@functools.cache
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def fa4_takes(query: torch.Tensor) -> bool:
    """FA4 runs this call (the conditions in the module's docstring)."""
    return (fa4_version()[0] is not None and query.dtype in DTYPES and query.shape[-1] in MEASURED_HEAD_DIMS
            and _capability_major(query.device.index or 0) in MEASURED_CAPABILITIES
            and not torch.cuda.is_current_stream_capturing() and _fa4_function() is not None)


def dense_causal(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention over `count` equally long prompts, nothing cached before them.

    query [count, L, Hq, D]; keys, values [count, L, Hk, D] with Hq a multiple of Hk (grouped
    heads read in place, no copies); any strides with the last dim contiguous, so views into
    the projections' outputs need no copy. Returns [count, L, Hq, D] (FA4's output is
    contiguous; SDPA's a transposed view of its own).
    """
    if fa4_takes(query):
        function = _fa4_function()
        assert function is not None  # fa4_takes checked it
        out = function(query, keys, values, softmax_scale=scale, causal=True)
        return out[0] if isinstance(out, tuple) else out
    attended = F.scaled_dot_product_attention(query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                              is_causal=True, scale=scale, enable_gqa=True)
    return attended.transpose(1, 2)
