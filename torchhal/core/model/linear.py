"""The one place a model's projections choose between the platform's linear kernel and F.linear.

A platform may supply a kernel for decode-shaped linears (`LinearSupport`, contract 8): a
matrix-vector product that beats the general matrix multiply when the input has one row or
a few. `routed_linear(support)` is the function `LayerMath` calls for every projection: the
kernel for a 2-D input of at most `support.max_rows` rows in a dtype it declares, F.linear
for everything else. The branch is on shapes and dtypes only, so inside `torch.compile` it is
decided while tracing (the one-token graph is its own compiled graph) and costs nothing per call.
`takes_kernel` is that branch alone: `LayerMath.into_residual` asks it whether a projection
runs as F.linear, which can add itself to the residual inside the product.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from torchhal.platforms import LinearSupport

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def takes_kernel(support: LinearSupport | None, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `routed_linear(support)` sends `x @ weight.T` to the platform's kernel."""
    return (support is not None and x.dim() == 2 and x.shape[0] <= support.max_rows and x.dtype in support.dtypes
            and weight.is_contiguous())


def routed_linear(support: LinearSupport | None) -> LinearFn:
    """`linear(x, weight, bias)`: `support.kernel` where it applies, else F.linear (always, for None)."""
    if support is None:
        return F.linear
    assert isinstance(support, LinearSupport), f"linear support {support!r} is not platform.linear_support"
    kernel = support.kernel

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if takes_kernel(support, x, weight):
            return kernel(x, weight, bias)
        return F.linear(x, weight, bias)

    return linear


def use_platform_linear(model: Any, support: LinearSupport | None, dtype: torch.dtype) -> tuple[str | None, str]:
    """Give `model` the platform's linear kernel where it can take it (`model.use_linear`) and
    runs in `dtype`; returns the kernel's name (None: F.linear everywhere) and one line saying why."""
    if support is None:
        return None, "the platform supplies no linear kernel: F.linear everywhere"
    use_linear = getattr(model, "use_linear", None)
    if use_linear is None:
        return None, f"model {type(model).__name__} has no use_linear(support): F.linear everywhere"
    if dtype not in support.dtypes:
        declared = ", ".join(str(d).removeprefix("torch.") for d in support.dtypes)
        return None, (f"{support.name} takes {declared}, not {str(dtype).removeprefix('torch.')}: "
                      "F.linear everywhere")
    use_linear(support)
    return support.name, f"{support.name} for inputs of at most {support.max_rows} row(s), F.linear above"
