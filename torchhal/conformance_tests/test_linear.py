"""linear (if declared): the platform's kernel for decode-shaped linears computes F.linear's
numbers within its dtype's rounding, bit for bit the same on every call, and replays from a
device graph where it says it can (contract 8).

Shapes have N and K that are multiples of no usual block (a kernel that drops the K tail, or
takes a row stride for granted, shows), the Llama-3.1-8B projections scaled down, and widths
where kernels commonly switch tiles; every row count up to `max_rows`, with and without a bias,
in every declared dtype. The reference is float64 on the host, so it needs nothing of the device.
"""

from __future__ import annotations

import functools

import pytest
import torch

from ._helpers import capture

pytestmark = pytest.mark.conformance("linear")

#: name: (N outputs, K inputs).
SHAPES = {
    "n100_k300": (100, 300),
    "n1_k1": (1, 1),
    "n24_k4101": (24, 4101),  # a long K with a ragged tail
    "qkv_like": (768, 512),  # Llama-3.1-8B's 6144 x 4096, scaled by 1/8
    "o_proj_like": (512, 512),
    "gate_up_like": (3584, 512),
    "down_like": (512, 1792),
    "n16411_k96": (16411, 96),  # past 16384 outputs
    "n65543_k48": (65543, 48),  # past 65536 outputs (an 8B vocabulary is 128256)
}
#: Error allowed on top of the output's own rounding (one unit of the dtype, relative to the
#: reference), relative to sum_k |x_k w_nk| + |b_n|: summing in float32 in any order stays far
#: inside it; summing in the 16-bit dtype, or leaving terms out, does not.
ACCUMULATION = 2.0**-14


def row_counts(max_rows: int) -> list[int]:
    """Every count up to 8; beyond, the ends and the middle."""
    if max_rows <= 8:
        return list(range(1, max_rows + 1))
    return sorted({1, 2, 3, max_rows // 2, max_rows - 1, max_rows})


def operands(n: int, k: int, rows: int, dtype: torch.dtype, bias: bool, device: torch.device,
             seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    w = (torch.randn(n, k, generator=generator) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=generator).to(dtype) if bias else None
    return x.to(device), w.to(device), b.to(device) if b is not None else None


def check_numbers(label: str, got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """`got` is F.linear(x, w, b) within one unit of the dtype plus the accumulation allowance."""
    assert got.dtype == x.dtype and tuple(got.shape) == (x.shape[0], w.shape[0]), (
        f"{label}: returned {got.dtype} {tuple(got.shape)}; F.linear gives {x.dtype} {(x.shape[0], w.shape[0])}"
    )
    x64, w64 = x.cpu().double(), w.cpu().double()
    b64 = b.cpu().double() if b is not None else None
    expected = torch.nn.functional.linear(x64, w64, b64)
    magnitude = x64.abs() @ w64.abs().T + (b64.abs() if b64 is not None else 0.0)
    allowed = torch.finfo(x.dtype).eps * expected.abs() + ACCUMULATION * magnitude
    error = (got.cpu().double() - expected).abs()
    bad = ~(error <= allowed)  # NaN is bad
    assert not bad.any(), (
        f"{label} differs from F.linear: {int(bad.sum())} of {bad.numel()} values, e.g. [row, output] "
        f"{bad.nonzero()[0].tolist()}, max error {float(error.nan_to_num(1e9).max()):.3g} "
        f"(allowed there {float(allowed[bad].min()):.3g})"
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_matches_f_linear(platform, device_index, shape):
    """Every row count, both with and without a bias, in every declared dtype; the inputs untouched."""
    support = platform.linear_support  # the group runs only where it is declared
    device = platform.device(device_index)
    n, k = SHAPES[shape]
    for dtype in support.dtypes:
        for bias in (False, True):
            for rows in row_counts(support.max_rows):
                x, w, b = operands(n, k, rows, dtype, bias, device, seed=rows * 7919 + n + k)
                before = [t.clone() for t in (x, w, b) if t is not None]
                got = support.kernel(x, w, b)
                platform.synchronize(device_index)
                label = f"{support.name} on {shape}, {rows} row(s), {dtype}, {'with' if bias else 'no'} bias"
                check_numbers(label, got, x, w, b)
                after = [t for t in (x, w, b) if t is not None]
                assert all(torch.equal(a, c) for a, c in zip(after, before, strict=True)), (
                    f"{label}: the kernel changed its inputs"
                )


def test_linear_is_deterministic(platform, device_index):
    """The same call three times gives the same bits (no split-K with racing partial sums)."""
    support = platform.linear_support  # the group runs only where it is declared
    device = platform.device(device_index)
    for shape in ("down_like", "n24_k4101"):
        n, k = SHAPES[shape]
        for dtype in support.dtypes:
            for rows in sorted({1, support.max_rows}):
                x, w, b = operands(n, k, rows, dtype, True, device, seed=5)
                first = support.kernel(x, w, b).clone()
                for _ in range(2):
                    again = support.kernel(x, w, b)
                    platform.synchronize(device_index)
                    assert torch.equal(again, first), (
                        f"{support.name} on {shape}, {rows} row(s), {dtype}: the same call gave other bits"
                    )


def test_linear_replays_from_a_graph(platform, device_index):
    """Capture one call; write new inputs in place; replay; the output follows them."""
    support = platform.linear_support  # the group runs only where it is declared
    if not support.graph_capture:
        pytest.skip(f"undeclared: {support.name} does not declare graph_capture")
    if platform.graph_support is None:
        pytest.skip("undeclared: the platform declares no graph support")
    device = platform.device(device_index)
    n, k = SHAPES["n100_k300"]
    for dtype in support.dtypes:
        x, w, b = operands(n, k, support.max_rows, dtype, True, device, seed=3)
        graph, out = capture(platform, device_index, functools.partial(support.kernel, x, w, b))
        for step in range(3):
            fresh_x, fresh_w, fresh_b = operands(n, k, support.max_rows, dtype, True, device, seed=100 + step)
            x.copy_(fresh_x)
            w.copy_(fresh_w)
            b.copy_(fresh_b)
            graph.replay()
            platform.synchronize(device_index)
            check_numbers(f"{support.name} replayed from a graph ({dtype}, step {step})", out, x, w, b)
