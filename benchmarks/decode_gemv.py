"""Decode-shaped matrix-vector products (M = 1 and 8 rows, bf16) at the Llama-3.1-8B linear shapes.

cuBLAS through F.linear against torch.mv (M = 1) and a Triton GEMV with no split-K.

    python benchmarks/decode_gemv.py [--m 1 8] [--sweep-rep 50] [--out results]

Per shape and M: microseconds per call (`triton.testing.do_bench_cudagraph`, rep 200 ms, median:
graph-replayed, so host launch costs are excluded as in a captured decode step), the bytes a call
must move (weights + input + output), TB/s and its fraction of 4.8 TB/s, and the largest absolute
error against a float32 reference (`"wrong": true` past 2e-2 of the reference's largest magnitude).
Each timed call reads a different copy of the weights, enough copies to span 4x the L2, so weights
come from HBM as they do in a decode step. The Triton kernel gives each output to one program
(fp32 sums, one bf16 rounding: deterministic) and reads each weight tile once for all M rows; its
launch configurations are swept (timed at `--sweep-rep` ms) and the best is re-timed at 200 ms.
`summary`: per M, the five shapes' total for cuBLAS and for the best alternative per shape, and the
8B decode step's (qkv, o_proj, gate_up, down 32 times each, lm_head once) with the saving in ms.
Needs a CUDA GPU and Triton; elsewhere it says so and exits.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from collections.abc import Callable
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

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # name: (N out, K in)
CALLS_PER_STEP = {"qkv": 32, "o_proj": 32, "gate_up": 32, "down": 32, "lm_head": 1}  # 8B: 32 layers
CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
PEAK_BYTES_PER_S, WRONG_FRACTION, REP_MS = 4.8e12, 2e-2, 200

if triton is not None:
    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[m, n] = sum_k x[m, k] * w[n, k] for BLOCK_N outputs of every row: one pass over K, each
        weight tile loaded once. M = 1 multiplies on CUDA cores (fp32 partials [BLOCK_N, BLOCK_K]:
        at most 64 registers a thread with the configs below); M > 1 pads the rows to BLOCK_M >= 16
        for tl.dot (zero rows, never stored)."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rm = tl.arange(0, BLOCK_M)
        n_ok = rn < N
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
        if BLOCK_M == 1:  # products summed elementwise, reduced over K once after the loop
            acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + rk < K
            w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if BLOCK_M == 1:
                x = tl.load(x_ptr + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
                acc += w.to(tl.float32) * x[None, :]
            else:
                x = tl.load(x_ptr + rm[:, None] * K + k0 + rk[None, :], mask=(rm[:, None] < M) & k_ok[None, :],
                            other=0.0)
                acc = tl.dot(x, tl.trans(w), acc)
        if BLOCK_M == 1:
            tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(tl.bfloat16), mask=n_ok)
        else:
            tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16),
                     mask=(rm[:, None] < M) & n_ok[None, :])


def configs(m: int) -> list[tuple[int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages), ~20 of the full grid: tiles of 4k-16k weights (smaller
    keep too few bytes in flight, larger spill registers), 4 warps for 4k, 8 for 16k, both for 8k;
    2-3 stages for 16k tiles (32 KiB each), 3-4 below; tl.dot (M > 1) needs BLOCK_N >= 16."""
    grid = []
    for block_n, block_k in itertools.product((8, 16, 32, 64), (128, 256, 512)):
        tile = block_n * block_k
        if not 4096 <= tile <= 16384 or (m > 1 and block_n < 16):
            continue
        for warps in (w for w in (4, 8) if not (w == 8 and tile < 8192 or w == 4 and tile > 8192)):
            grid += [(block_n, block_k, warps, stages) for stages in ((2, 3) if tile == 16384 else (3, 4))]
    return grid


def triton_gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, config: tuple[int, int, int, int]) -> None:
    block_n, block_k, warps, stages = config
    m, (n, k) = x.shape[0], w.shape
    block_m = 1 if m == 1 else max(16, triton.next_power_of_2(m))  # tl.dot takes 16 rows at least
    gemv_kernel[(triton.cdiv(n, block_n),)](x, w, y, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                            num_warps=warps, num_stages=stages)


def time_us(call: Callable[[torch.Tensor], Any], weights: list[torch.Tensor], rep: int) -> float:
    """Graph-replayed median of `call` on each weight copy in turn (each captured call reads the next)."""
    turn = itertools.cycle(weights)
    return 1e3 * float(triton.testing.do_bench_cudagraph(lambda: call(next(turn)), rep=rep, return_mode="median"))


def measure(name: str, m: int, sweep_rep: int) -> list[dict[str, Any]]:
    n, k = SHAPES[name]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ w.float().T
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    weights = [w] + [w.clone() for _ in range(-(-4 * l2 // w.nbytes) - 1)]
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    candidates: dict[str, Callable[[torch.Tensor], Any]] = {"cublas_linear": lambda wt: F.linear(x, wt)}
    if m == 1:
        candidates["torch_mv"] = lambda wt: torch.mv(wt, x[0])
    rows = []

    def row(candidate: str, out: torch.Tensor, us: float, **extra: Any) -> dict[str, Any]:
        error = (out.float().reshape(m, n) - ref).abs().max().item()
        nbytes = n * k * 2 + m * k * 2 + m * n * 2
        return {"shape": name, "n": n, "k": k, "m": m, "candidate": candidate, "us": us, "bytes": nbytes,
                "tb_s": nbytes / us / 1e6, "fraction_of_4p8": nbytes / us / 1e-6 / PEAK_BYTES_PER_S,
                "max_abs_error": error, "wrong": error > WRONG_FRACTION * ref.abs().max().item(), **extra}

    for candidate, call in candidates.items():
        rows.append(row(candidate, call(w), time_us(call, weights, REP_MS)))
    swept, skipped = [], []
    for config in configs(m):
        try:
            y.zero_()
            triton_gemv(x, w, y, config)
            torch.cuda.synchronize()
        except Exception as exc:  # a config that fails to compile or launch is skipped
            skipped.append(f"{config}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        trial = row("triton_gemv", y, time_us(functools.partial(triton_gemv, x, y=y, config=config), weights,
                                                 sweep_rep))
        swept.append((trial["wrong"], trial["us"], config))
    if swept:
        _, _, best = min(swept)  # correct ones first, then fastest
        us = time_us(lambda wt: triton_gemv(x, wt, y, best), weights, REP_MS)
        triton_gemv(x, w, y, best)
        rows.append(row("triton_gemv", y, us, config=dict(zip(CONFIG_KEYS, best, strict=True)),
                        configs_tried=len(swept), configs_skipped=skipped))
    return rows


def summarize(rows: list[dict[str, Any]], m: int) -> dict[str, Any]:
    cublas = {r["shape"]: r["us"] for r in rows if r["m"] == m and r["candidate"] == "cublas_linear"}
    best: dict[str, tuple[float, str]] = {}
    for r in rows:
        if r["m"] == m and r["candidate"] != "cublas_linear" and not r["wrong"]:
            best[r["shape"]] = min(best.get(r["shape"], (float("inf"), "")), (r["us"], r["candidate"]))
    if set(best) != set(cublas):
        return {"note": f"no correct alternative for {sorted(set(cublas) - set(best))}"}
    step = {"cublas": sum(CALLS_PER_STEP[s] * us for s, us in cublas.items()),
            "alternative": sum(CALLS_PER_STEP[s] * us for s, (us, _) in best.items()),
            "faster_of_the_two": sum(CALLS_PER_STEP[s] * min(us, best[s][0]) for s, us in cublas.items())}
    return {"best_alternative": {s: c for s, (_, c) in best.items()},
            "five_shapes_us": {"cublas": sum(cublas.values()), "alternative": sum(us for us, _ in best.values())},
            "decode_step_us": step, "saving_ms_per_step": (step["cublas"] - step["alternative"]) / 1e3,
            "saving_ms_per_step_routing_where_faster": (step["cublas"] - step["faster_of_the_two"]) / 1e3}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8], help="rows (tokens), 1..8")
    parser.add_argument("--sweep-rep", type=int, default=50, help="ms per Triton config in the sweep")
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    bad = [m for m in args.m if not 1 <= m <= 8]
    if bad:
        parser.error(f"--m {bad[0]}: the Triton GEMV handles 1 to 8 rows; pass values in 1..8")
    if not torch.cuda.is_available() or triton is None:
        print("decode_gemv needs a CUDA device and Triton; none here, nothing measured")
        return None
    torch.manual_seed(0)
    rows = [r for m in args.m for name in SHAPES for r in measure(name, m, args.sweep_rep)]
    results = {"gpu": torch.cuda.get_device_name(0), "triton": triton.__version__, "rows": rows,
               "summary": {f"m{m}": summarize(rows, m) for m in args.m}}
    print(f"{'shape':8} {'M':>2} {'candidate':14} {'us':>8} {'TB/s':>6} {'of 4.8':>6} {'max err':>8}  config")
    for r in rows:
        print(f"{r['shape']:8} {r['m']:2} {r['candidate']:14} {r['us']:8.1f} {r['tb_s']:6.2f} "
              f"{r['fraction_of_4p8']:6.1%} {r['max_abs_error']:8.4f}{'  WRONG' if r['wrong'] else ''}  "
              f"{r.get('config', '')}")
    write_json("decode_gemv", results, args.out)
    return results


if __name__ == "__main__":
    main()
