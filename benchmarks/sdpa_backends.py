"""Which SDPA kernel serves whole-prompt prefill, and what each costs: torch's default choice
against each backend forced, at the 8B attention shape (32 query / 8 KV heads, head dim 128,
bf16, causal, grouped-query heads native), for the prompt batches of `long_context.py`.

    python benchmarks/sdpa_backends.py [--out results]

Per shape: milliseconds per call (`triton.testing.do_bench`, median) of the default, FLASH,
CUDNN, EFFICIENT (where it runs) and CUDNN-then-FLASH by priority, and each output's largest
difference from the default's; `cudnn_expanded` runs cuDNN on K/V heads repeated to the query
heads, in case grouped-query heads are not native there. Needs a CUDA GPU and triton.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _harness import write_json  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

SHAPES = ((8, 3968), (1, 16000), (8, 16000), (32, 32))  # (prompts, tokens each)
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BACKENDS: dict[str, list[SDPBackend] | None] = {
    "default": None, "flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn_then_flash": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION],
}


def measure(count: int, length: int) -> dict[str, Any]:
    import triton.testing

    def heads(n: int) -> torch.Tensor:  # the engine's layout: [count, L, H, D] viewed as [count, H, L, D]
        return torch.randn(count, length, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    q, k, v = heads(Q_HEADS), heads(KV_HEADS), heads(KV_HEADS)
    default = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    row: dict[str, Any] = {}
    for name, backends in BACKENDS.items():
        def call(backends: list[SDPBackend] | None = backends) -> torch.Tensor:
            if backends is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            with sdpa_kernel(backends, set_priority=True):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        try:
            diff = (call().float() - default.float()).abs().max().item()
            row[name] = {"ms": triton.testing.do_bench(call, warmup=25, rep=200), "max_abs_diff_vs_default": diff}
        except RuntimeError as exc:
            row[name] = {"error": str(exc)[:160]}
    ke, ve = k.repeat_interleave(Q_HEADS // KV_HEADS, 1), v.repeat_interleave(Q_HEADS // KV_HEADS, 1)

    def expanded() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)

    row["cudnn_expanded"] = {"ms": triton.testing.do_bench(expanded, warmup=25, rep=200)}
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.manual_seed(0)
    results = {"gpu": torch.cuda.get_device_name(0), "cudnn": torch.backends.cudnn.version(),
               "shapes": {f"{count}x{length}": measure(count, length) for count, length in SHAPES}}
    write_json("sdpa_backends", results, args.out)
    return results


if __name__ == "__main__":
    main()
