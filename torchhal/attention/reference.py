"""The portable reference backend: plain torch, every platform's fallback and the oracle.

It computes in float32 and casts at the end. Decode gathers each row's blocks through
the (static-shape) block table and masks by length, so it has no host syncs and can be
captured in a graph; prefill walks the requests on the host, in query chunks, so its
memory stays bounded at long contexts.
"""

from __future__ import annotations

import torch

from torchhal.attention.backend import AttentionCapability
from torchhal.attention.layout import PagedMetadata, PagedWriter
from torchhal.values import ceil_div

#: Query rows the reference prefill scores at once (bounds its float32 score tensor).
PREFILL_CHUNK = 512


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_pos: torch.Tensor,
           key_len: torch.Tensor, scale: float, sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """Grouped-query attention of query [B, Q, Hq, D] at positions query_pos [B, Q] over
    keys/values [B, L, Hk, D] whose first key_len [B] positions are written; float32 out.

    Query head h reads KV head h // (Hq // Hk) by a reshape, never a copy of KV heads.
    A query with no key to attend (a padded row) gets zeros.
    """
    batch, queries, q_heads, dim = query.shape
    length, kv_heads = keys.shape[1], keys.shape[2]
    positions = torch.arange(length, device=query.device)
    written = positions[None, :] < key_len[:, None]  # [B, L]; unwritten slots may hold anything
    keys = torch.where(written[:, :, None, None], keys.float(), 0.0)
    values = torch.where(written[:, :, None, None], values.float(), 0.0)
    grouped = query.float().view(batch, queries, kv_heads, q_heads // kv_heads, dim)
    scores = torch.einsum("bqhgd,blhd->bhgql", grouped, keys) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    allowed = written[:, None, :] & (positions[None, None, :] <= query_pos[:, :, None])  # [B, Q, L]
    if sliding_window is not None:
        allowed &= positions[None, None, :] > query_pos[:, :, None] - sliding_window
    allowed = allowed[:, None, None]  # broadcast over heads
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    weights = torch.where(allowed.any(dim=-1, keepdim=True), weights, 0.0)  # no key: zeros, not NaN
    out = torch.einsum("bhgql,blhd->bqhgd", weights, values)
    return out.reshape(batch, queries, q_heads, dim)


class ReferenceBackend(PagedWriter):
    """Paged attention in plain torch; correct everywhere, fast nowhere."""

    capability = AttentionCapability(
        name="reference",
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        prefill=True,
        sliding_window=True,
        soft_cap=True,
        graph_capture=True,
        note="plain torch; gathers each row's blocks (portable fallback)",
    )

    def decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata, *,
               scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        assert meta.block_size == k_cache.shape[1], "metadata built for the cache's block size"
        batch, block_size = meta.batch, k_cache.shape[1]
        shape = (batch, meta.max_blocks * block_size, k_cache.shape[2], k_cache.shape[3])
        keys = k_cache[meta.block_tables.long()].view(shape)
        values = v_cache[meta.block_tables.long()].view(shape)
        query_pos = (meta.seq_lens.long() - 1)[:, None]  # -1 for a padded row: attends nothing
        result = attend(query[:, None], keys, values, query_pos, meta.seq_lens.long(), scale, sliding_window,
                        soft_cap)[:, 0]
        return result.to(query.dtype) if out is None else out.copy_(result)

    def prefill(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata, *,
                scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                out: torch.Tensor | None = None, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        # Not declaring `step_kv`, it reads every K/V out of the cache.
        assert meta.block_size == k_cache.shape[1], "metadata built for the cache's block size"
        block_size = k_cache.shape[1]
        result = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        starts = meta.host_query_start or meta.query_start.tolist()  # a host walk: not capturable
        seq_lens = meta.host_seq_lens or meta.seq_lens.tolist()
        for row, seq_len in enumerate(seq_lens):
            first, last = starts[row], starts[row + 1]
            if seq_len == 0 or first == last:
                continue
            blocks = meta.block_tables[row, : ceil_div(seq_len, block_size)].long()
            keys = k_cache[blocks].flatten(0, 1)[None, :seq_len]
            values = v_cache[blocks].flatten(0, 1)[None, :seq_len]
            length = torch.tensor([seq_len], device=query.device)
            for chunk in range(first, last, PREFILL_CHUNK):
                end = min(chunk + PREFILL_CHUNK, last)
                query_pos = torch.arange(chunk, end, device=query.device)[None] + (seq_len - last)
                result[chunk:end] = attend(query[None, chunk:end], keys, values, query_pos, length, scale,
                                           sliding_window, soft_cap)[0]
        return result.to(query.dtype) if out is None else out.copy_(result)
