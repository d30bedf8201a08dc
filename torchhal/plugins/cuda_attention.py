"""Triton paged attention for the CUDA plugin (imported lazily: Triton may be absent).

One kernel serves decode and chunked prefill. A program takes BLOCK_M rows that are
(query token, query head) pairs of ONE KV head, so grouped-query heads share each K/V
tile they load (no copies of KV heads), and walks the row's context in BLOCK_N-token
tiles, looking each token's block up in the block table (any block size). Decode splits
the context across programs (flash-decoding: a fixed number of splits per launch, each
split's share worked out on the device from the row's length) and a second kernel
merges the splits by their log-sum-exp. Launch shapes depend only on the batch, the
block-table width and the head counts, never on lengths: decode is graph-capturable.
A third kernel writes a step's K and V into their slots in one launch, reading them where
the projection left them (strided views, no copies first).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from torchhal.attention import AttentionCapability, PagedMetadata
from torchhal.plugins import cuda_flash
from torchhal.plugins.cuda_pdl import programmatic_launch, wait_for_previous_kernels

LOG2E = 1.4426950408889634
#: Split the context only while each split keeps at least this many tokens.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
#: Launch configurations (tuned on an H200, bf16, head_dim 128; benchmarks/attention_kernels.py --sweep).
DECODE = {"block_n": 64, "num_warps": 4, "num_stages": 2, "waves": 2}
#: Prefill by element size: 256-row tiles of 4-byte elements need more shared memory than an
#: H200 has (263168 > 232448 bytes at head_dim 128), so float32 keeps 128-row tiles.
PREFILL = {
    2: {"block_m": 256, "block_n": 64, "num_warps": 16, "num_stages": 2},
    4: {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
}


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, K, V, Table, start, hi, pos, dims, dim_ok, kv_head,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale, soft_cap, window,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
):
    """One BLOCK_N-token tile of keys into the running softmax (online, exp2 domain)."""
    kpos = start + tl.arange(0, BLOCK_N)
    offset = kpos % PAGE
    if MASKED:
        k_ok = kpos < hi
        block = tl.load(Table + kpos // PAGE, mask=k_ok, other=0).to(tl.int64)
        kv_mask = k_ok[:, None] & dim_ok[None, :]
    else:
        block = tl.load(Table + kpos // PAGE).to(tl.int64)
        kv_mask = dim_ok[None, :]
    k = tl.load(K + block[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
                mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if HAS_SOFTCAP:
        s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0)  # cap * tanh(s / cap)
    s = s * 1.4426950408889634  # log2(e): exp2 below
    if MASKED:
        allowed = k_ok[None, :] & (kpos[None, :] <= pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (kpos[None, :] > pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet: no NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    v = tl.load(V + block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
                mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _paged_attention_kernel(
    Q, K, V, Out, PartOut, PartLse, BlockTables, SeqLens, QueryStart,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_bt, kv_heads, scale, soft_cap, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernels(USE_PDL)
    tile = tl.program_id(0)
    seq = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    split = tl.program_id(2)
    q_begin = tl.load(QueryStart + seq)
    q_len = tl.load(QueryStart + seq + 1) - q_begin
    seq_len = tl.load(SeqLens + seq)
    if tile * BLOCK_M >= q_len * GROUP:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    token = rows // GROUP
    q_head = kv_head * GROUP + rows % GROUP
    row_ok = token < q_len
    pos = seq_len - q_len + token  # each row's absolute position (-1 for a padded decode row)
    # This tile's key range: causal end of its last row, window start of its first.
    hi = tl.minimum(seq_len - q_len + (tile * BLOCK_M + BLOCK_M - 1) // GROUP, seq_len - 1) + 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - q_len + (tile * BLOCK_M) // GROUP - window + 1, 0)
    if NUM_SPLITS > 1:
        share = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * share
        hi = tl.minimum(lo + share, hi)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(Q + (q_begin + token)[:, None] * stride_qt + q_head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Tiles wholly before the tile's first query position need no causal mask (nor bounds
    # checks); with a window every tile may need one.
    mid = lo
    if not HAS_WINDOW:
        first_pos = seq_len - q_len + (tile * BLOCK_M) // GROUP
        mid = lo + tl.maximum(tl.minimum(first_pos + 1, hi) - lo, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, mid, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, K, V, BlockTables + seq * stride_bt, start, hi, pos, dims,
                                     dim_ok, kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                     stride_vh, scale, soft_cap, window, PAGE, BLOCK_N, False, HAS_WINDOW,
                                     HAS_SOFTCAP, PRECISION)
    for start in range(mid, hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, K, V, BlockTables + seq * stride_bt, start, hi, pos, dims,
                                     dim_ok, kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                     stride_vh, scale, soft_cap, window, PAGE, BLOCK_N, True, HAS_WINDOW,
                                     HAS_SOFTCAP, PRECISION)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row with no key outputs zeros
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(Out + (q_begin + token)[:, None] * stride_ot + q_head[:, None] * stride_oh + dims[None, :],
                 (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=out_mask)
    else:
        part = ((q_begin + token) * (kv_heads * GROUP) + q_head) * NUM_SPLITS + split
        tl.store(PartOut + part[:, None] * HEAD_DIM + dims[None, :], acc / l_safe[:, None], mask=out_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(PartLse + part, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    PartOut, PartLse, Out, stride_ot, stride_oh, q_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernels(USE_PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    base = (token * q_heads + head) * NUM_SPLITS
    lse = tl.load(PartLse + base + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    parts = tl.load(PartOut + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
                    mask=(splits < NUM_SPLITS)[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    total = tl.sum(weight, 0)
    merged = tl.sum(weight[:, None] * parts, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + token * stride_ot + head * stride_oh + dims, merged.to(Out.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit
def _write_kv_kernel(
    Key, Value, KCache, VCache, Slots, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One token's K and V, every KV head, into its slot of both caches."""
    wait_for_previous_kernels(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(Slots + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < HEADS) & (dims < HEAD_DIM)
    cache = slot * stride_cs + heads * stride_ch + dims
    key = tl.load(Key + token.to(tl.int64) * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(KCache + cache, key.to(KCache.dtype.element_ty), mask=mask)
    value = tl.load(Value + token.to(tl.int64) * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(VCache + cache, value.to(VCache.dtype.element_ty), mask=mask)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def decode_splits(batch: int, kv_heads: int, context_capacity: int, multiprocessors: int) -> int:
    """Splits per row: enough programs for about two waves, each split >= MIN_TOKENS_PER_SPLIT.

    A function of launch shapes only (the table's capacity, not the lengths): graph-safe.
    """
    wanted = math.ceil(DECODE["waves"] * multiprocessors / max(batch * kv_heads, 1))
    useful = max(1, context_capacity // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, MAX_SPLITS))


class TritonPagedAttention:
    """The CUDA plugin's attention backend: Triton kernels over the paged layout."""

    capability = AttentionCapability(
        name="triton-paged",
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        head_dims=(64, 128),  # 128 checked compiled on an H200; 64 only under the interpreter
        block_sizes=None,
        prefill=True,
        sliding_window=True,
        soft_cap=True,
        graph_capture=True,
        step_kv=True,
        note="Triton: split-K paged decode, paged chunked prefill; whole prompts through a dense kernel "
        "(FlashAttention-4 for long bf16 prompts at head dim 128 on sm_90, else SDPA: cuda_flash.py) on the "
        "step's own K/V; GQA without KV copies",
    )

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """One launch for K and V, read through their strides: the engine passes views into
        the fused QKV projection, which an indexed copy would first copy to contiguous."""
        assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the kernel puts slot s at s * a slot's stride"
        tokens, heads, dim = key.shape
        if tokens == 0:
            return
        if key.stride(-1) != 1:
            key = key.contiguous()
        if value.stride(-1) != 1:
            value = value.contiguous()
        pdl = programmatic_launch(key.device.index or 0)
        _write_kv_kernel[(tokens,)](
            key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0),
            value.stride(1), k_cache.stride(1), k_cache.stride(2),
            HEADS=heads, HEAD_DIM=dim, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim),
            USE_PDL=pdl, launch_pdl=pdl,
        )

    def decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata, *,
               scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        splits = decode_splits(meta.batch, k_cache.shape[2], meta.max_blocks * k_cache.shape[1],
                               _multiprocessors(query.device.index or 0))
        return self._launch(query, k_cache, v_cache, meta, 1, splits, scale, sliding_window, soft_cap, out)

    def prefill(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata, *,
                scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                out: torch.Tensor | None = None, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        split = cuda_flash.split_whole_prompts(meta, sliding_window) if soft_cap is None else None
        if split is None or not split.runs:
            return self._launch(query, k_cache, v_cache, meta, meta.max_query_len, 1, scale, sliding_window,
                                soft_cap, out)

        def dense(run: tuple[int, int, int]) -> torch.Tensor:
            first, count, length = run
            k, v = cuda_flash.prompt_kv(k_cache, v_cache, meta.slot_mapping, first, first + count * length, key,
                                        value)
            return self._flash_prefill(query, k, v, run, scale)

        if out is None and split.rest is None and len(split.runs) == 1:  # one dense call covers the step
            return dense(split.runs[0])
        if out is None:
            out = torch.empty_like(query)
        if split.rest is not None and split.rest_tokens is not None:  # chunks after cached tokens, decode rows
            part = self._launch(query.index_select(0, split.rest_tokens), k_cache, v_cache, split.rest,
                                split.rest.max_query_len, 1, scale, sliding_window, soft_cap, None)
            out.index_copy_(0, split.rest_tokens, part)
        for run in split.runs:
            first, count, length = run
            out[first : first + count * length] = dense(run)
        return out

    @staticmethod
    def _flash_prefill(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, run: tuple[int, int, int],
                       scale: float) -> torch.Tensor:
        """One run of adjacent equally long whole prompts (nothing cached before them; `run`
        is (first row, prompts, length)), as one batch through `cuda_flash.dense_causal`:
        FlashAttention-4 where installed, for the cases it was measured in (sm_90, bf16, head
        dim 128, prompts of >= 3968 tokens), else SDPA (cuDNN's kernel on an H200,
        1.7-1.8x faster there than SDPA's flash kernel: benchmarks/sdpa_backends.py). Both are
        faster than the paged kernel there (H200, 8B shape: 0.27 vs 0.45 ms at 4k). `keys`/
        `values` are the run's rows [count * length, Hk, D]: the step's own when the engine
        passed them (read as strided views in place), else copied out of the cache. Returns
        the run's rows [count * length, Hq, D], the kernel's own output (a view when its
        layout allows)."""
        first, count, length = run
        rows = query[first : first + count * length]
        q, k, v = (t.view(count, length, *t.shape[1:]) for t in (rows, keys, values))
        return cuda_flash.dense_causal(q, k, v, scale).reshape(rows.shape)

    def _launch(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata,
                max_query_len: int, splits: int, scale: float, sliding_window: int | None, soft_cap: float | None,
                out: torch.Tensor | None) -> torch.Tensor:
        assert meta.block_size == k_cache.shape[1], "metadata built for the cache's block size"
        if query.stride(-1) != 1:
            query = query.contiguous()
        if out is None:
            out = torch.empty_like(query)
        tokens, q_heads, head_dim = query.shape
        kv_heads = k_cache.shape[2]
        group = q_heads // kv_heads
        if tokens == 0 or max_query_len == 0:
            return out
        decode = splits > 1 or max_query_len == 1
        config = DECODE if decode else PREFILL[query.element_size()]
        block_m = max(16, triton.next_power_of_2(group)) if decode else config["block_m"]
        block_d = max(16, triton.next_power_of_2(head_dim))
        if splits > 1:
            part_out = torch.empty((tokens, q_heads, splits, head_dim), dtype=torch.float32, device=query.device)
            part_lse = torch.empty((tokens, q_heads, splits), dtype=torch.float32, device=query.device)
        else:
            part_out = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
        grid = (triton.cdiv(max_query_len * group, block_m), meta.batch * kv_heads, splits)
        pdl = programmatic_launch(query.device.index or 0)
        _paged_attention_kernel[grid](
            query, k_cache, v_cache, out, part_out, part_lse, meta.block_tables, meta.seq_lens, meta.query_start,
            query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
            meta.block_tables.stride(0), kv_heads, float(scale), float(soft_cap or 1.0), int(sliding_window or 0),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=k_cache.shape[1], BLOCK_M=block_m,
            BLOCK_N=config["block_n"], NUM_SPLITS=splits, HAS_WINDOW=sliding_window is not None,
            HAS_SOFTCAP=soft_cap is not None, PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            USE_PDL=pdl, num_warps=config["num_warps"], num_stages=config["num_stages"], launch_pdl=pdl,
        )
        if splits > 1:
            _merge_splits_kernel[(tokens, q_heads)](
                part_out, part_lse, out, out.stride(0), out.stride(1), q_heads,
                HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
                USE_PDL=pdl, launch_pdl=pdl,
            )
        return out
