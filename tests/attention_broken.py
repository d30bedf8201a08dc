"""Attention backends with one classic bug each, on CPU platforms, for the attention clause's
own tests (tests/test_attention_conformance.py registers this module as a plugin).

Each wraps the reference backend and breaks exactly one thing, the way kernels get it wrong:
- off-by-one block: reads block-table column j + 1 where it should read column j;
- wrong GQA head mapping: query head h reads KV head h % num_kv_heads, not h // group;
- ignores the window: declares sliding windows, then attends the whole context;
- writes from packed rows: `write_kv` reads K/V as if each token's row were contiguous
  (a kernel taking the row stride for granted), which views into a fused projection are not;
- writes V through K's strides: one row stride taken for both (the engine's K and V are
  views into two different outputs);
- the step's K/V taken for the whole context: declares `step_kv`, then attends a request
  whose earlier tokens are cached over the step's rows alone;
- the step's K/V read as packed rows, as `write_kv` above;
- the step's V read through K's strides, as above.
`attn_step_kv` declares `step_kv` and uses the step's K/V correctly (whole prompts only).
`attn_declared_reference` declares the reference itself, and `attn_blocks_128` the reference
taking 128-token blocks only (as Ascend's fused attention does): the clause must pass both.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from torchhal.attention import SCRATCH_BLOCK, PagedMetadata, ReferenceBackend, attend
from torchhal.platforms import AttentionSupport, hookimpl
from torchhal.plugins.cpu import CpuPlatform


class Renamed(ReferenceBackend):
    def __init__(self, name: str) -> None:
        self.capability = replace(ReferenceBackend.capability, name=name)


class OffByOneBlock(Renamed):
    def _shifted(self, meta: PagedMetadata) -> PagedMetadata:
        tables = torch.full_like(meta.block_tables, SCRATCH_BLOCK)
        tables[:, :-1] = meta.block_tables[:, 1:]  # the bug: column j + 1 for column j
        return replace(meta, block_tables=tables)

    def decode(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata,
               **kwargs: Any) -> torch.Tensor:
        return super().decode(query, k, v, self._shifted(meta), **kwargs)

    def prefill(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata,
                **kwargs: Any) -> torch.Tensor:
        return super().prefill(query, k, v, self._shifted(meta), **kwargs)


class WrongGqaMapping(Renamed):
    def _mapped(self, method: Any, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata,
                out: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        q_heads, kv_heads = query.shape[1], k.shape[2]
        group = q_heads // kv_heads
        # Place head g * kv_heads + kv where the reference reads KV head kv: then head h
        # reads KV head h % kv_heads (the bug).
        order = torch.tensor([(p % group) * kv_heads + p // group for p in range(q_heads)], device=query.device)
        result = torch.empty_like(query)
        result[:, order] = method(query[:, order], k, v, meta, **kwargs)
        if out is None:
            return result
        out.copy_(result)
        return out

    def decode(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata,
               **kwargs: Any) -> torch.Tensor:
        return self._mapped(super().decode, query, k, v, meta, **kwargs)

    def prefill(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata,
                **kwargs: Any) -> torch.Tensor:
        return self._mapped(super().prefill, query, k, v, meta, **kwargs)


class IgnoresWindow(Renamed):
    def decode(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata,
               **kwargs: Any) -> torch.Tensor:
        return super().decode(query, k, v, meta, **{**kwargs, "sliding_window": None})

    def prefill(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata,
                **kwargs: Any) -> torch.Tensor:
        return super().prefill(query, k, v, meta, **{**kwargs, "sliding_window": None})


class Only128TokenBlocks(Renamed):
    """Correct, but refuses every block size but the one it declares."""

    def __init__(self, name: str) -> None:
        self.capability = replace(ReferenceBackend.capability, name=name, block_sizes=(128,))

    def decode(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata,
               **kwargs: Any) -> torch.Tensor:
        self._check(k)
        return super().decode(query, k, v, meta, **kwargs)

    def prefill(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata,
                **kwargs: Any) -> torch.Tensor:
        self._check(k)
        return super().prefill(query, k, v, meta, **kwargs)

    @staticmethod
    def _check(k_cache: torch.Tensor) -> None:
        if k_cache.shape[1] != 128:
            raise ValueError(f"blocks of {k_cache.shape[1]} tokens; this backend takes 128")


class WritesPackedRows(Renamed):
    @staticmethod
    def packed(t: torch.Tensor) -> torch.Tensor:
        """The storage read as [tokens, heads, dim] from its start (the row stride taken for granted)."""
        heads, dim = t.shape[1], t.shape[2]
        return t.as_strided(t.shape, (heads * dim, dim, 1), t.storage_offset())

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        super().write_kv(k_cache, v_cache, self.packed(key), self.packed(value), slot_mapping)


def with_keys_strides(value: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """V's storage read through K's strides (one KV row stride taken for granted)."""
    return value.as_strided(value.shape, key.stride(), value.storage_offset())


class WritesValuesWithKeysStrides(Renamed):
    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        super().write_kv(k_cache, v_cache, key, with_keys_strides(value, key), slot_mapping)


class ComputesOnlyIntoOut(Renamed):
    """Writes its result only into an `out` it is given; without one it returns a buffer it never filled."""

    def prefill(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata,
                **kwargs: Any) -> torch.Tensor:
        out = kwargs.pop("out", None)
        if out is None:
            return torch.zeros_like(query)
        return super().prefill(query, k, v, meta, out=out, **kwargs)


class StepKvPrompts(Renamed):
    """Declares `step_kv`: whole prompts attend over the step's own K/V rows, the rest through
    the cache (as the CUDA backend's dense path does). The flags break it."""

    def __init__(self, name: str, whole_context: bool = False, packed_rows: bool = False,
                 keys_strides: bool = False) -> None:
        self.capability = replace(ReferenceBackend.capability, name=name, step_kv=True)
        self.whole_context, self.packed_rows, self.keys_strides = whole_context, packed_rows, keys_strides

    def prefill(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata, *,
                key: torch.Tensor | None = None, value: torch.Tensor | None = None, out: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        result = super().prefill(query, k, v, meta, **kwargs)
        if key is not None and value is not None:
            if self.packed_rows:
                key, value = (WritesPackedRows.packed(t) for t in (key, value))
            if self.keys_strides:
                value = with_keys_strides(value, key)
            window, soft_cap = kwargs.get("sliding_window"), kwargs.get("soft_cap")
            starts, seq_lens = meta.query_start.tolist(), meta.seq_lens.tolist()
            for row, seq_len in enumerate(seq_lens):
                first, last = starts[row], starts[row + 1]
                whole = seq_len == last - first and (window or seq_len) >= seq_len
                if last == first or not (whole or self.whole_context):
                    continue
                positions = torch.arange(last - first, device=query.device)[None]
                result[first:last] = attend(query[None, first:last], key[None, first:last], value[None, first:last],
                                            positions, torch.tensor([last - first], device=query.device),
                                            kwargs["scale"], window, soft_cap)[0]
        if out is None:
            return result
        out.copy_(result)
        return out


def platform_with(name: str, backend: ReferenceBackend) -> CpuPlatform:
    def attention_support(self: CpuPlatform) -> AttentionSupport:
        return AttentionSupport(backends=(backend,))

    cls = type(f"Attn{name.title()}", (CpuPlatform,), {"name": name, "priority": -1,
                                                       "attention_support": attention_support})
    return cls()


@hookimpl
def torchhal_register_platforms() -> list[CpuPlatform]:
    return [
        platform_with("attn_declared_reference", Renamed("declared-reference")),
        platform_with("attn_blocks_128", Only128TokenBlocks("blocks-128")),
        platform_with("attn_off_by_one_block", OffByOneBlock("off-by-one-block")),
        platform_with("attn_wrong_gqa", WrongGqaMapping("wrong-gqa")),
        platform_with("attn_ignores_window", IgnoresWindow("ignores-window")),
        platform_with("attn_writes_packed_rows", WritesPackedRows("writes-packed-rows")),
        platform_with("attn_only_into_out", ComputesOnlyIntoOut("only-into-out")),
        platform_with("attn_step_kv", StepKvPrompts("step-kv")),
        platform_with("attn_step_kv_whole_context", StepKvPrompts("step-kv-whole-context", whole_context=True)),
        platform_with("attn_step_kv_packed_rows", StepKvPrompts("step-kv-packed-rows", packed_rows=True)),
        platform_with("attn_step_kv_keys_strides", StepKvPrompts("step-kv-keys-strides", keys_strides=True)),
        platform_with("attn_writes_with_keys_strides", WritesValuesWithKeysStrides("writes-with-keys-strides")),
    ]
