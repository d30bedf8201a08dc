"""compile (if declared): the platform's inductor options are result-neutral (contract 9).

A decoder layer's arithmetic outside attention (RMS norm, a projection, SwiGLU, a projection,
the residual), compiled by inductor with the platform's options, gives the same bits as the
same function compiled with inductor's defaults, at one row (decode) and more; and replays
from a device graph with those bits where the platform declares graphs. An option inductor
does not know fails here, as does one that changes the numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ._helpers import capture

pytestmark = pytest.mark.conformance("compile")

HIDDEN, INTERMEDIATE = 256, 512
ROWS = (1, 7, 64)
#: Engines compile decoders in 16-bit floats; there an option that changes how intermediates
#: are rounded shows.
DTYPE = torch.bfloat16


def layer(x: torch.Tensor, norm_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """RMS norm, gate-up projection, SwiGLU, down projection, residual: what engines compile."""
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * norm_weight
    gate, up = F.linear(normed, gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down)


def compiled(options: dict[str, Any] | None) -> Callable[..., torch.Tensor]:
    # A fresh function object per compilation, so the two never share a compiled entry.
    def step(x: torch.Tensor, norm_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return layer(x, norm_weight, gate_up, down)

    return torch.compile(step, backend="inductor", fullgraph=True, dynamic=False, options=options)


def operands(rows: int, dtype: torch.dtype, device: torch.device, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(rows, HIDDEN, generator=generator), 1 + 0.1 * torch.randn(HIDDEN, generator=generator),
               torch.randn(2 * INTERMEDIATE, HIDDEN, generator=generator) * HIDDEN**-0.5,
               torch.randn(HIDDEN, INTERMEDIATE, generator=generator) * INTERMEDIATE**-0.5]
    return [t.to(dtype).to(device) for t in tensors]


def compare(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got, want), (
        f"{label}: the platform's inductor options change the numbers ({int((got != want).sum())} of "
        f"{got.numel()} values differ, max {float((got.float() - want.float()).abs().max()):.3g}); "
        "compile options must be result-neutral (leave numeric settings to the user)"
    )


def test_compile_options_are_result_neutral(platform, device_index):
    """Each row count: compiled with the options equals compiled without, bit for bit."""
    support = platform.compile_support  # the group runs only where it is declared
    device, dtype = platform.device(device_index), DTYPE
    plain, tuned = compiled(None), compiled(dict(support.inductor_options))
    for rows in ROWS:
        inputs = operands(rows, dtype, device, seed=rows)
        want = plain(*inputs)
        got = tuned(*inputs)
        platform.synchronize(device_index)
        compare(f"{rows} row(s), {dtype}", got, want)


def test_compile_options_replay_from_a_graph(platform, device_index):
    """Capture the tuned function; write new inputs in place; replay: the plain function's bits."""
    support = platform.compile_support  # the group runs only where it is declared
    if platform.graph_support is None:
        pytest.skip("undeclared: the platform declares no graph support")
    device, dtype = platform.device(device_index), DTYPE
    plain, tuned = compiled(None), compiled(dict(support.inductor_options))
    inputs = operands(1, dtype, device, seed=11)
    graph, out = capture(platform, device_index, lambda: tuned(*inputs))
    for step in range(3):
        for static, fresh in zip(inputs, operands(1, dtype, device, seed=100 + step), strict=True):
            static.copy_(fresh)
        graph.replay()
        platform.synchronize(device_index)
        compare(f"replayed from a graph (step {step})", out, plain(*inputs))
