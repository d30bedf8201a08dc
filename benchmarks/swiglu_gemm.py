"""Prefill's gate-up projection with SwiGLU: cuBLAS plus a compiled SwiGLU kernel, against one
Triton GEMM that applies SwiGLU in its epilogue (bf16, the Llama-3.1-8B MLP: K 4096, I 14336).

    python benchmarks/swiglu_gemm.py [--m 3968 16000 31744] [--sweep-rep 60] [--out results]

The question it answers: can a fused kernel beat what the engine runs today? cuBLAS writes the
[M, 2I] gate-up product and inductor's kernel reads it back to write silu(gate) * up [M, I];
the fused kernel keeps both halves in registers and writes only [M, I]. It saves the
intermediate's traffic (at M = 16000, 0.92 GB written and read, ~0.3 ms a layer), but only
wins if its matrix rate stays within that of cuBLAS's. Per M: ms per call of the unfused pair
(each part timed too) and of the best fused launch configuration (swept at `--sweep-rep` ms,
the best re-timed at 200 ms; two kernels: tiles loaded through pointers, and through
the tensor-memory accelerator; `triton.testing.do_bench`, median), TFLOP/s of the products, and
each output's largest difference from a float32 reference (relative to its largest magnitude).
Needs a CUDA GPU and Triton; elsewhere it says so and exits.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _harness import write_json  # noqa: E402

try:
    import triton
    import triton.language as tl
    import triton.testing
except ImportError:  # main() then says what the script needs
    triton = None

HIDDEN, INTERMEDIATE, REP_MS = 4096, 14336, 200
# BLOCK_M, BLOCK_N (outputs: each program reads 2 x BLOCK_N weight rows), BLOCK_K, warps, stages
CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 128, 32, 8, 4),
           (256, 64, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 128, 8, 3), (256, 128, 64, 8, 3)]

if triton is not None:
    @triton.jit
    def swiglu_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr):
        """y[m, n] = silu(x[m] . w[n]) * (x[m] . w[N + n]) for the [gate; up] weight [2N, K]: two
        fp32 accumulators over one pass of K, one bf16 rounding of the product."""
        pid = tl.program_id(0)
        grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * grid_n)  # grouped order: neighbouring programs share weight tiles in L2
        first_m = group * GROUP_M
        size_m = min(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * grid_n)) % size_m
        pid_n = (pid % (GROUP_M * grid_n)) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :]
        g_ptrs = w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None]
        u_ptrs = g_ptrs + N * K  # the up half's rows
        m_ok, n_ok = rm < M, rn < N
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, tl.cdiv(K, BLOCK_K)):
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            gate = tl.dot(x, tl.load(g_ptrs, mask=n_ok[None, :], other=0.0), gate)
            up = tl.dot(x, tl.load(u_ptrs, mask=n_ok[None, :], other=0.0), up)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        y = gate * tl.sigmoid(gate) * up
        y_ptrs = y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


    @triton.jit
    def swiglu_gemm_tma_kernel(x_desc, w_desc, y_desc, M, N, K,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               GROUP_M: tl.constexpr):
        """The same product with the tiles moved by the Hopper tensor-memory accelerator (TMA
        descriptors made on the host): loads and the store without address arithmetic."""
        pid = tl.program_id(0)
        grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * grid_n)
        first_m = group * GROUP_M
        size_m = min(grid_m - first_m, GROUP_M)
        off_m = (first_m + (pid % (GROUP_M * grid_n)) % size_m) * BLOCK_M
        off_n = ((pid % (GROUP_M * grid_n)) // size_m) * BLOCK_N
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = x_desc.load([off_m, k])
            gate = tl.dot(x, w_desc.load([off_n, k]).T, gate)
            up = tl.dot(x, w_desc.load([N + off_n, k]).T, up)
        y_desc.store([off_m, off_n], (gate * tl.sigmoid(gate) * up).to(y_desc.dtype))


def fused_tma(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: tuple[int, ...]) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_m, block_n, block_k, warps, stages = config
    m, n = x.shape[0], w.shape[0] // 2
    assert n % block_n == 0, "a tile must not cross from the gate rows into the up rows"
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    swiglu_gemm_tma_kernel[grid](TensorDescriptor.from_tensor(x, [block_m, block_k]),
                                 TensorDescriptor.from_tensor(w, [block_n, block_k]),
                                 TensorDescriptor.from_tensor(out, [block_m, block_n]), m, n, x.shape[1],
                                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                                 num_warps=warps, num_stages=stages)
    return out


def fused(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: tuple[int, ...]) -> torch.Tensor:
    block_m, block_n, block_k, warps, stages = config
    m, n = x.shape[0], w.shape[0] // 2
    assert x.shape[1] % block_k == 0, "the kernel does not mask K"
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    swiglu_gemm_kernel[grid](x, w, out, m, n, x.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                             GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def error(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float((got.float() - reference).abs().max() / reference.abs().max())


def measure(m: int, sweep_rep: int) -> dict[str, Any]:
    generator = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator)
    w = (torch.randn(2 * INTERMEDIATE, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator)
         / HIDDEN**0.5)
    compiled_swiglu = torch.compile(swiglu, fullgraph=True)
    product = F.linear(x, w)
    reference = swiglu(F.linear(x.float(), w.float()))
    flops = 2 * m * HIDDEN * 2 * INTERMEDIATE

    def bench(fn: Any, rep: int = REP_MS) -> float:
        return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))

    row: dict[str, Any] = {
        "m": m,
        "cublas_ms": bench(lambda: F.linear(x, w)),
        "swiglu_ms": bench(lambda: compiled_swiglu(product)),
        "unfused_ms": bench(lambda: compiled_swiglu(F.linear(x, w))),
        "unfused_error": error(compiled_swiglu(F.linear(x, w)), reference),
    }
    out = torch.empty(m, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
    kernels = {"pointers": fused, "tma": fused_tma}
    sweep: dict[str, float | str] = {}
    for (name, kernel), config in itertools.product(kernels.items(), CONFIGS):
        try:
            sweep[f"{name} {config}"] = bench(lambda k=kernel, c=config: k(x, w, out, c), sweep_rep)
        except Exception as exc:  # a config past the shared memory or registers: say so, try the next
            sweep[f"{name} {config}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    timed = {k: v for k, v in sweep.items() if isinstance(v, float)}
    best = min(timed, key=timed.__getitem__)
    name, _, text = best.partition(" ")
    kernel, best_config = kernels[name], tuple(int(v) for v in text.strip("()").split(","))
    row.update({"fused_sweep_ms": sweep, "fused_config": best,
                "fused_ms": bench(lambda: kernel(x, w, out, best_config)),
                "fused_error": error(kernel(x, w, out, best_config), reference)})
    row["cublas_tflop_s"] = flops / row["cublas_ms"] / 1e9
    row["fused_tflop_s"] = flops / row["fused_ms"] / 1e9
    row["fused_over_unfused"] = row["fused_ms"] / row["unfused_ms"]
    print(f"M {m}: cuBLAS {row['cublas_ms']:.3f} ms ({row['cublas_tflop_s']:.0f} TFLOP/s) + SwiGLU "
          f"{row['swiglu_ms']:.3f} = {row['unfused_ms']:.3f} ms; fused {row['fused_ms']:.3f} ms "
          f"({row['fused_tflop_s']:.0f} TFLOP/s, {best}) = {row['fused_over_unfused']:.3f}x", flush=True)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--m", type=int, nargs="+", default=[3968, 16000, 31744], help="token rows")
    parser.add_argument("--sweep-rep", type=int, default=60, help="ms each launch configuration is timed in the sweep")
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    if triton is None or not torch.cuda.is_available():
        print("swiglu_gemm.py needs a CUDA GPU and Triton")
        return {}
    results = {"device": torch.cuda.get_device_name(), "rows": [measure(m, args.sweep_rep) for m in args.m]}
    write_json("swiglu_gemm", results, args.out)
    return results


if __name__ == "__main__":
    main()
