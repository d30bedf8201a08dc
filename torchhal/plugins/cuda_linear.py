"""Triton matrix-vector product for decode-shaped linears (imported lazily: Triton may be absent).

`y[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n])`. A program owns BLOCK_N outputs of one row
and walks K once in BLOCK_K steps, multiplying on CUDA cores into fp32 partials [BLOCK_N,
BLOCK_K] that are reduced over K once after the loop; the bias is added in fp32 and the result
rounded once to x's dtype. No split-K and a fixed reduction order: the same inputs give the same
bits. Masks cover any N and K. One program per (BLOCK_N outputs, row): more rows re-read the
weights, which is why the platform routes only one-row inputs here (`max_rows=1`).

The weights are loaded evict-first: a decode step reads each weight once, so caching it in L2
only pushes out what the step reads again (H200, the 8B shape's captured batch-1 decode step:
4.21 ms with plain loads, 4.12 ms evict-first, same tokens; benchmarks/profile_long_context.py).

The kernel is the torch custom op `torchhal::cuda_gemv` (with a fake for tracing), so
`torch.compile(fullgraph=True)` keeps it as one opaque call, and a CUDA graph records its launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchhal.platforms import LinearSupport
from torchhal.plugins.cuda_pdl import programmatic_launch, wait_for_previous_kernels

#: Launch configurations (BLOCK_N, BLOCK_K, num_warps, num_stages), measured on an H200 at the
#: Llama-3.1-8B decode shapes (bf16, one row): outputs under 16384 (QKV 6144, o_proj and down
#: 4096) take 8 x 512 tiles; wider ones (gate-up 28672, lm_head 128256) 16 x 256 tiles, with a
#: fourth stage in flight from 65536 outputs on.
NARROW = (8, 512, 4, 4)
WIDE = (16, 256, 4, 3)
WIDEST = (16, 256, 4, 4)
WIDE_FROM, WIDEST_FROM = 16384, 65536
DTYPES = (torch.float16, torch.bfloat16)


def launch_config(n: int) -> tuple[int, int, int, int]:
    """The (BLOCK_N, BLOCK_K, num_warps, num_stages) for `n` outputs (see NARROW, WIDE, WIDEST)."""
    if n >= WIDEST_FROM:
        return WIDEST
    return WIDE if n >= WIDE_FROM else NARROW


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernels(USE_PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
    x_ptrs = x_ptr + row * stride_xm + rk
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + rk < K
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@torch.library.custom_op("torchhal::cuda_gemv", mutates_args=())
def cuda_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for few rows: one Triton launch, fp32 sums, one rounding.
    `routed_linear` sends only 2-D inputs in a declared dtype with a contiguous weight; the
    model's weights, bias and rows share that dtype and run along their last dim."""
    assert x.stride(1) == 1 and weight.dtype == x.dtype and (bias is None or bias.stride(0) == 1)
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_n, block_k, warps, stages = launch_config(n)
    pdl = programmatic_launch(x.device.index or 0)
    _gemv_kernel[(triton.cdiv(n, block_n), m)](
        x, weight, bias if bias is not None else x, y, n, k, x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, USE_PDL=pdl, num_warps=warps,
        num_stages=stages, launch_pdl=pdl,
    )
    return y


@cuda_gemv.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.torchhal.cuda_gemv(x, weight, bias)  # type: ignore[no-any-return]


def triton_gemv() -> LinearSupport:
    """The CUDA plugin's `LinearSupport`: one-row inputs, float16/bfloat16, capturable."""
    return LinearSupport(
        name="triton-gemv", kernel=gemv, max_rows=1, dtypes=DTYPES, graph_capture=True,
        note="Triton GEMV (torchhal): no split-K, fp32 sums, one rounding",
    )
