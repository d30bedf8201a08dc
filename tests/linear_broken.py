"""Linear kernels with one classic bug each, on CPU platforms, for the linear clause's own tests
(tests/test_linear_conformance.py registers this module as a plugin).

Each computes F.linear's numbers (float32 sums, one rounding) and breaks exactly one thing, the
way GEMV kernels get it wrong:
- drops the K tail: sums only the full 64-wide blocks of K (a loop without a mask for the rest);
- ignores the bias;
- swaps rows: with several rows, row m's output lands in row M - 1 - m (a wrong row index);
- wrong weight row stride: reads row n at n * K rounded down to a multiple of 8 (a kernel taking
  16-byte aligned rows for granted);
- racing split-K: sums K in two parts split at a random point each call (partial sums combined
  in whatever order they finish), right within rounding but never the same bits twice.
`linear_correct` declares the reference-like kernel itself: the clause must pass it.
All declare float32 and bfloat16 and up to 4 rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from torchhal.platforms import LinearSupport, hookimpl
from torchhal.plugins.cpu import CpuPlatform

MAX_ROWS = 4
BLOCK_K = 64
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def correct(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), weight.float(), bias.float() if bias is not None else None).to(x.dtype)


def drops_k_tail(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    full = x.shape[1] // BLOCK_K * BLOCK_K
    return correct(x[:, :full], weight[:, :full], bias)


def ignores_bias(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return correct(x, weight, None)


def swaps_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return correct(x, weight, bias).flip(0)


def wrong_row_stride(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = weight.shape
    aligned = k - k % 8
    return correct(x, weight.as_strided((n, k), (aligned, 1)), bias)


def racing_split_k(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[1]
    if k < 2:
        return correct(x, weight, bias)
    split = int(torch.randint(1, k, ()))
    low = F.linear(x[:, :split].float(), weight[:, :split].float())
    high = F.linear(x[:, split:].float(), weight[:, split:].float())
    total = high + low if bias is None else high + low + bias.float()
    return total.to(x.dtype)


def platform_with(name: str, kernel: Kernel) -> CpuPlatform:
    support = LinearSupport(name=name.replace("_", "-"), kernel=kernel, max_rows=MAX_ROWS,
                            dtypes=(torch.float32, torch.bfloat16))

    def linear_support(self: CpuPlatform) -> LinearSupport:
        return support

    cls = type(f"Lin{name.title().replace('_', '')}", (CpuPlatform,),
               {"name": name, "priority": -1, "linear_support": linear_support})
    return cls()


@hookimpl
def torchhal_register_platforms() -> list[CpuPlatform]:
    return [
        platform_with("linear_correct", correct),
        platform_with("linear_drops_k_tail", drops_k_tail),
        platform_with("linear_ignores_bias", ignores_bias),
        platform_with("linear_swaps_rows", swaps_rows),
        platform_with("linear_wrong_row_stride", wrong_row_stride),
        platform_with("linear_racing_split_k", racing_split_k),
    ]
