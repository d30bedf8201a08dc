"""Paged attention kernels of the CUDA plugin against the bandwidth floor and torch SDPA.

    python benchmarks/attention_kernels.py [--out results/] [--quick]

Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head_dim 128, bf16), block
size 16, blocks shuffled over the cache. Decode: batch 1/8/32 at contexts 4k and 16k,
every row at the full context; the Triton kernel (launched eagerly, and replayed from a
CUDA graph), the reference backend, and torch SDPA on the same K/V already gathered into
contiguous [batch, heads, context, dim] tensors (and gather + SDPA, the gather-per-step
path). Floor: K and V bytes read / 4.8 TB/s (H200 HBM3e). Prefill: one 4k and one 16k
prompt (causal), and a 2k chunk at offset 14k; Triton vs SDPA (is_causal) on contiguous
K/V. Each case first checks the kernel's output against SDPA's (max abs error). Times are
`triton.testing.do_bench` medians (ms). Writes attention_kernels.json; prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton.testing

from torchhal.attention import ReferenceBackend, build_metadata
from torchhal.plugins.cuda_attention import TritonPagedAttention, decode_splits

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
HBM_BYTES_PER_S = 4.8e12
DTYPE = torch.bfloat16


def paged(batch: int, context: int, query_len: int, device: torch.device, seed: int = 0):
    """Caches with shuffled blocks, their metadata, the query, and contiguous K/V copies."""
    torch.manual_seed(seed)
    per_row = -(-context // BLOCK)
    blocks = torch.randperm(batch * per_row, device=device) + 1  # block 0 is scratch
    tables = blocks.view(batch, per_row).tolist()
    shape = (batch * per_row + 1, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device=device)
    v_cache = torch.randn(shape, dtype=DTYPE, device=device)
    meta = build_metadata(tables, [context] * batch, [query_len] * batch, BLOCK, device)
    query = torch.randn(batch * query_len, Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    return k_cache, v_cache, meta, query


def contiguous(cache: torch.Tensor, meta, context: int) -> torch.Tensor:
    """[batch, kv_heads, context, dim]: what SDPA reads."""
    batch = meta.batch
    return cache[meta.block_tables.long()].view(batch, -1, KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2)


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def bench_graph(fn) -> float:
    return float(triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median"))


def decode_case(batch: int, context: int, device: torch.device, with_reference: bool) -> dict:
    k_cache, v_cache, meta, query = paged(batch, context, 1, device)
    scale = HEAD_DIM**-0.5
    triton_backend = TritonPagedAttention()
    out = torch.empty_like(query)

    def run_triton() -> None:
        triton_backend.decode(query, k_cache, v_cache, meta, scale=scale, out=out)

    keys, values = contiguous(k_cache, meta, context).contiguous(), contiguous(v_cache, meta, context).contiguous()
    q4 = query[:, :, None]  # [batch, heads, 1, dim]

    def run_sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, keys, values, scale=scale, enable_gqa=True)

    def run_gather_sdpa() -> torch.Tensor:
        gathered_k = contiguous(k_cache, meta, context)
        gathered_v = contiguous(v_cache, meta, context)
        return F.scaled_dot_product_attention(q4, gathered_k, gathered_v, scale=scale, enable_gqa=True)

    run_triton()
    expected = run_sdpa()[:, :, 0]
    error = float((out.float() - expected.float()).abs().max())
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    row: dict[str, Any] = {
        "kind": "decode", "batch": batch, "context": context, "max_abs_err_vs_sdpa": error,
        "splits": decode_splits(batch, KV_HEADS, meta.max_blocks * BLOCK,
                                torch.cuda.get_device_properties(device).multi_processor_count),
        "kv_bytes": kv_bytes, "floor_ms": kv_bytes / HBM_BYTES_PER_S * 1e3,
        "triton_ms": bench(run_triton), "triton_graph_ms": bench_graph(run_triton),
        "sdpa_contiguous_ms": bench(run_sdpa), "gather_sdpa_ms": bench(run_gather_sdpa),
    }
    if with_reference:
        reference = ReferenceBackend()
        row["reference_ms"] = bench(lambda: reference.decode(query, k_cache, v_cache, meta, scale=scale))
    row["triton_fraction_of_floor"] = row["floor_ms"] / row["triton_ms"]
    return row


def prefill_case(context: int, query_len: int, device: torch.device) -> dict:
    k_cache, v_cache, meta, query = paged(1, context, query_len, device)
    scale = HEAD_DIM**-0.5
    triton_backend = TritonPagedAttention()
    out = torch.empty_like(query)

    def run_triton() -> None:
        triton_backend.prefill(query, k_cache, v_cache, meta, scale=scale, out=out)

    keys, values = contiguous(k_cache, meta, context).contiguous(), contiguous(v_cache, meta, context).contiguous()
    q4 = query.transpose(0, 1)[None]  # [1, heads, query_len, dim]
    if query_len == context:
        def run_sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q4, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:  # queries at an offset: SDPA needs the bottom-right causal mask spelt out
        positions = torch.arange(context, device=device)
        mask = positions[None, :] <= (positions[context - query_len:, None])

        def run_sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q4, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)

    run_triton()
    expected = run_sdpa()[0].transpose(0, 1)
    error = float((out.float() - expected.float()).abs().max())
    # Causal work: each query attends its own prefix.
    pairs = sum(range(context - query_len + 1, context + 1))
    flops = 4 * Q_HEADS * HEAD_DIM * pairs
    row: dict[str, Any] = {"kind": "prefill", "batch": 1, "context": context, "query_len": query_len,
                           "max_abs_err_vs_sdpa": error, "triton_ms": bench(run_triton),
                           "sdpa_contiguous_ms": bench(run_sdpa)}
    row["triton_tflops"] = flops / row["triton_ms"] / 1e9
    row["sdpa_tflops"] = flops / row["sdpa_contiguous_ms"] / 1e9
    return row


DECODE_SWEEP = [
    {"block_n": 64, "num_warps": 4, "num_stages": 2, "waves": 2},
    {"block_n": 64, "num_warps": 4, "num_stages": 3, "waves": 4},
    {"block_n": 128, "num_warps": 4, "num_stages": 3, "waves": 4},
    {"block_n": 64, "num_warps": 8, "num_stages": 3, "waves": 4},
    {"block_n": 32, "num_warps": 4, "num_stages": 4, "waves": 4},
    {"block_n": 128, "num_warps": 8, "num_stages": 2, "waves": 2},
    {"block_n": 64, "num_warps": 4, "num_stages": 4, "waves": 8},
]
PREFILL_SWEEP = [
    {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2},
    {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
    {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
    {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 4},
    {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 3},
    {"block_m": 256, "block_n": 64, "num_warps": 8, "num_stages": 2},
    {"block_m": 256, "block_n": 64, "num_warps": 16, "num_stages": 2},
    {"block_m": 256, "block_n": 32, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
]


def kernel_call(mode: str, batch: int, context: int, query_len: int, device: torch.device) -> Callable[[], None]:
    """The Triton backend's `mode` ("decode" or "prefill") on a fresh layout, as a closure."""
    k_cache, v_cache, meta, query = paged(batch, context, query_len, device)
    method = getattr(TritonPagedAttention(), mode)
    return functools.partial(method, query, k_cache, v_cache, meta, scale=HEAD_DIM**-0.5, out=torch.empty_like(query))


def sweep(device: torch.device, kinds: str) -> list[dict]:
    """Time each launch configuration (graph-replayed decode, eager prefill)."""
    from torchhal.plugins import cuda_attention

    rows: list[dict] = []
    prefill = cuda_attention.PREFILL[DTYPE.itemsize]
    saved = dict(cuda_attention.DECODE), dict(prefill)
    for config in DECODE_SWEEP if kinds in ("decode", "both") else []:
        cuda_attention.DECODE.update(config)
        for batch, context in ((1, 16384), (8, 16384), (32, 16384), (8, 4096)):
            run = kernel_call("decode", batch, context, 1, device)
            rows.append({"kind": "decode", "config": config, "batch": batch, "context": context,
                         "graph_ms": bench_graph(run)})
    cuda_attention.DECODE.update(saved[0])
    for config in PREFILL_SWEEP if kinds in ("prefill", "both") else []:
        prefill.update(config)
        for context in (4096, 16384):
            run = kernel_call("prefill", 1, context, context, device)
            rows.append({"kind": "prefill", "config": config, "context": context, "ms": bench(run)})
    prefill.update(saved[1])
    for row in rows:
        shape = f"b{row['batch']} ctx{row['context']}" if row["kind"] == "decode" else f"ctx{row['context']}"
        figure = row.get("graph_ms", row.get("ms"))
        print(f"{row['kind']:<8}{shape:<14}{figure:>8.3f}  {row['config']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    parser.add_argument("--quick", action="store_true", help="one small decode and prefill case")
    parser.add_argument("--sweep", choices=("decode", "prefill", "both"), help="time launch configurations first")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    swept = sweep(device, args.sweep) if args.sweep else None
    decode_shapes = [(1, 4096)] if args.quick else [(b, c) for c in (4096, 16384) for b in (1, 8, 32)]
    prefill_shapes = [(4096, 4096)] if args.quick else [(4096, 4096), (16384, 16384), (16384, 2048)]
    from torchhal.plugins import cuda_attention

    env_configs = {"decode": dict(cuda_attention.DECODE), "prefill": dict(cuda_attention.PREFILL[DTYPE.itemsize])}
    rows = [decode_case(b, c, device, with_reference=b * c <= 8 * 4096) for b, c in decode_shapes]
    rows += [prefill_case(c, q, device) for c, q in prefill_shapes]
    env = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(device),
           "timer": "triton.testing.do_bench median (ms)", "launch_configs": env_configs,
           "hbm_bytes_per_s": HBM_BYTES_PER_S,
           "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": str(DTYPE),
                     "block_size": BLOCK}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"environment": env, "rows": rows, "sweep": swept}
    (out / "attention_kernels.json").write_text(json.dumps(result, indent=1))
    print(f"{'case':<26}{'err':>8}{'floor':>8}{'triton':>8}{'graph':>8}{'sdpa':>8}{'gath+sdpa':>10}"
          f"{'ref':>8}  note")
    for r in rows:
        name = f"{r['kind']} b{r['batch']} ctx{r['context']}" + (f" q{r['query_len']}" if "query_len" in r else "")
        note = (f"{r['triton_fraction_of_floor']:.2f} of floor, {r['splits']} splits" if r["kind"] == "decode"
                else f"{r['triton_tflops']:.0f} vs {r['sdpa_tflops']:.0f} TFLOP/s")
        cells = [r.get(k) for k in ("floor_ms", "triton_ms", "triton_graph_ms", "sdpa_contiguous_ms",
                                    "gather_sdpa_ms", "reference_ms")]
        text = "".join(f"{c:>8.3f}" if c is not None else f"{'-':>8}" for c in cells[:4])
        text += f"{cells[4]:>10.3f}" if cells[4] is not None else f"{'-':>10}"
        text += f"{cells[5]:>8.3f}" if cells[5] is not None else f"{'-':>8}"
        print(f"{name:<26}{r['max_abs_err_vs_sdpa']:>8.1e}{text}  {note}", file=sys.stdout)


if __name__ == "__main__":
    main()
