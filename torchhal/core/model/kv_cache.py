"""The decoder's paged KV cache and the per-step metadata its attention reads.

The cache is the paged layout of `torchhal.attention` for every layer at once:
`k[layer]` and `v[layer]` are `[num_blocks, block_size, num_kv_heads, head_dim]` (KV heads
only, so GQA shrinks it). Block `SCRATCH_BLOCK` is part of the cache and never handed to a
request: padded rows write there.

`AttentionMetadata` is what every layer's attention of one step reads: the paged
metadata (block tables, context lengths, query offsets, the slots this step writes),
the tokens' positions, and the attention backend the engine chose.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torchhal.attention import (
    SCRATCH_BLOCK,
    AttentionBackend,
    PagedMetadata,
    ReferenceBackend,
    build_metadata_and_positions,
)
from torchhal.core.model.config import ModelConfig

__all__ = ["SCRATCH_BLOCK", "AttentionMetadata", "KVCache"]


class KVCache:
    """Paged KV storage for every layer, preallocated once; block SCRATCH_BLOCK is scratch."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        # The engine's pool sizes it (EngineConfig's checked kv_block_size, dtype and slots).
        assert num_blocks >= 2 and block_size >= 1, f"block {SCRATCH_BLOCK} is scratch: {num_blocks} block(s)"
        assert dtype.is_floating_point, f"KVCache: dtype {dtype} (an integer cache truncates K and V)"
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        """K and V of one token in every layer."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element

    @staticmethod
    def bytes_per_block(config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
        return block_size * KVCache.bytes_per_token(config, dtype)


_REFERENCE = ReferenceBackend()
_POSITION_DTYPES = (torch.int64, torch.int32)


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's attention facts, shared by every layer.

    paged:     block tables, context lengths, query offsets and write slots (device tensors).
    positions: [T] int64 absolute positions of the step's tokens (also the rotary positions).
    backend:   the attention backend the engine chose (`Platform.choose_attention`).
    decode:    every row has exactly one query: `backend.decode` (graph-capturable) runs,
               else `backend.prefill`.
    """

    paged: PagedMetadata
    positions: torch.Tensor
    backend: AttentionBackend
    decode: bool

    def __post_init__(self) -> None:
        # Host facts only (no device sync), once per step for every layer: one position for
        # several tokens would broadcast over them (each rotated as that one: wrong hidden states
        # and KV, no error), and a truthy non-bool decode would pick the decode kernel.
        assert self.positions.dim() == 1 and self.positions.shape[0] == self.paged.slot_mapping.shape[0], \
            "one position per token"
        assert self.positions.dtype in _POSITION_DTYPES and type(self.decode) is bool

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        block_size: int,
        device: torch.device,
        backend: AttentionBackend | None = None,
    ) -> AttentionMetadata:
        """From host lists: request i's last `query_lens[i]` of `seq_lens[i]` tokens are this
        step's queries, its KV in `block_tables[i]`. Host work grows with the requests and
        their blocks; slots and positions are worked out on the device, once
        (`build_metadata_and_positions`).
        `backend` None: the portable reference."""
        paged, positions = build_metadata_and_positions(block_tables, seq_lens, query_lens, block_size, device)
        return cls(
            paged=paged,
            positions=positions,
            backend=backend or _REFERENCE,
            decode=bool(query_lens) and all(q == 1 for q in query_lens),
        )
