"""Ascend paged attention for the NPU plugin: torch_npu's fused infer attention (FIA).

One op serves decode and prefill: `torch_npu.npu_fused_infer_attention_score` (torch_npu
2.13.0; its query length 1 takes the incremental branch, longer queries the prompt one),
in its page-attention mode. How torchhal's paged layout maps onto it:

- KV cache: FIA's page-attention layout `(num_blocks, block_size, H)` with
  H = num_kv_heads * head_dim is a view of ours `[num_blocks, block_size, num_kv_heads,
  head_dim]` (contiguous rows: no copy). FIA reads `num_key_value_heads` to split H.
- block_table: our int32 `[batch, max_blocks]` as it is (FIA wants int32, 2-D, one row per
  request, at least as many columns as the longest request has blocks).
- lengths: `actual_seq_lengths_kv` is a host int list (SymInt[]): the metadata's host copy
  of `seq_lens`, else one read from the device.
- query: `input_layout="BSND"`. Decode is `[batch, 1, q_heads, head_dim]` (a view). Prefill
  pads each request's rows to the longest query run (`[batch, max_query_len, ...]`) with
  `actual_seq_lengths` the per-request query lengths, and gathers the rows back after.
- causal: `sparse_mode=3` (right-down causal: query i of q attends key j <= kv_len - q + i,
  our "queries are the last tokens" rule) with the 2048 x 2048 upper-triangle mask FIA
  requires for it; decode (query length 1) takes no mask.
- padded rows (seq_len 0) are zeroed after the call on the device: FIA defines zeros only
  for an empty key tensor, not for a zero length inside a batch.

K/V are written by torchhal's `write_kv` (one indexed copy per cache, as on every device).
Nothing here is verified on Ascend hardware: tests/test_vendor_attention.py maps it onto a
fake of the op that implements the documented semantics on the CPU.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from torchhal.attention import AttentionCapability, PagedMetadata, PagedWriter

#: FIA's right-down causal mode, and the side of the square mask it takes for it.
RIGHT_DOWN_CAUSAL = 3
CAUSAL_MASK_SIDE = 2048


def _torch_npu() -> ModuleType:
    # Imported per call, never at module import: torch_npu needs CANN (absent here; faked in tests).
    return importlib.import_module("torch_npu")


class NpuFusedAttention(PagedWriter):
    """torchhal's paged attention through `torch_npu.npu_fused_infer_attention_score`."""

    capability = AttentionCapability(
        name="npu-fused-infer-attention",
        dtypes=(torch.float16, torch.bfloat16),  # FIA's query dtypes (besides int8): no float32
        head_dims=tuple(range(16, 513, 16)),  # 16-aligned for float16/bfloat16, at most 512
        block_sizes=(128, 256, 384, 512),  # page attention with queries > 1: multiples of 128 up to 512
        prefill=True,
        sliding_window=False,  # FIA ignores pre_tokens for a query of length 1 (decode)
        soft_cap=False,  # FIA has no logit soft-capping parameter
        graph_capture=False,  # actual_seq_lengths_kv is a host list: decode reads lengths on the host
        note="torch_npu.npu_fused_infer_attention_score (page attention, BSND); mapping-tested only, "
        "not verified on Ascend hardware",
    )

    def __init__(self) -> None:
        self._masks: dict[torch.device, torch.Tensor] = {}

    def decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata, *,
               scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        result = self._attend(query[:, None], k_cache, v_cache, meta, None, scale)[:, 0]
        return result if out is None else out.copy_(result)

    def prefill(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata, *,
                scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                out: torch.Tensor | None = None, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        # Not declaring `step_kv`, it reads every K/V out of the cache.
        starts = list(meta.host_query_start) if meta.host_query_start is not None else meta.query_start.tolist()
        seq_lens = _host_seq_lens(meta)
        # A padded row (seq_len 0) gets no queries in FIA: its rows are zeroed below anyway.
        query_lens = [last - first if seq_len else 0
                      for first, last, seq_len in zip(starts[:-1], starts[1:], seq_lens, strict=True)]
        rows = [(request, position) for request, length in enumerate(query_lens) for position in range(length)]
        result = query.new_zeros(query.shape)
        if not rows:
            return result if out is None else out.copy_(result)
        # Row t of the step's queries is position t - starts[request] of its request.
        tokens = torch.tensor([starts[request] + position for request, position in rows], device=query.device)
        where = torch.tensor(rows, device=query.device).T
        padded = query.new_zeros((meta.batch, max(query_lens), *query.shape[1:]))
        padded[where[0], where[1]] = query[tokens]
        attended = self._attend(padded, k_cache, v_cache, meta, query_lens, scale)
        result[tokens] = attended[where[0], where[1]]
        return result if out is None else out.copy_(result)

    def _attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata,
                query_lens: list[int] | None, scale: float) -> torch.Tensor:
        """FIA on a BSND query [batch, q_len, q_heads, head_dim]; padded rows come back zero.
        Selection gave it only models whose dtype, head dim, block size and features FIA takes
        (its capability), so no window or soft cap is passed."""
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        prompt = query.shape[1] > 1  # FIA's prompt branch: causal mask and per-request query lengths
        torch_npu = _torch_npu()
        attention, _ = torch_npu.npu_fused_infer_attention_score(
            query.contiguous(),
            k_cache.view(num_blocks, block_size, kv_heads * head_dim),
            v_cache.view(num_blocks, block_size, kv_heads * head_dim),
            atten_mask=self._causal_mask(query.device) if prompt else None,
            actual_seq_lengths=query_lens if prompt else None,
            actual_seq_lengths_kv=_host_seq_lens(meta),
            block_table=meta.block_tables,
            num_heads=query.shape[2],
            scale=scale,
            input_layout="BSND",
            num_key_value_heads=kv_heads,
            sparse_mode=RIGHT_DOWN_CAUSAL if prompt else 0,
            block_size=block_size,
        )
        live = (meta.seq_lens > 0)[:, None, None, None]
        return torch.where(live, attention, 0.0).to(query.dtype)

    def _causal_mask(self, device: torch.device) -> torch.Tensor:
        """The square upper-triangle mask (True = masked) FIA's right-down causal mode requires."""
        mask = self._masks.get(device)
        if mask is None:
            side = CAUSAL_MASK_SIDE
            mask = torch.ones(side, side, dtype=torch.bool, device=device).triu_(diagonal=1)
            self._masks[device] = mask
        return mask


def _host_seq_lens(meta: PagedMetadata) -> list[int]:
    return list(meta.host_seq_lens) if meta.host_seq_lens is not None else meta.seq_lens.tolist()
