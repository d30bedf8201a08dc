"""The paged KV pool: sized from memory_info (never by emptying the cache to measure), and
the blocks requests own.

A request owns whole blocks of `block_size` token slots and a count of the tokens it has
reserved in them (`Request.kv_tokens`). Growing by n tokens takes the blocks the new
tokens start; shrinking frees every block no reserved token of the request remains in,
so rollback, give-back, retraction and abort free exactly what was taken. The scratch
block (SCRATCH_BLOCK) is in the cache but never in the free list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torchhal.core.engine.records import EngineConfig, Request
from torchhal.core.model import SCRATCH_BLOCK, KVCache, ModelConfig
from torchhal.values import ceil_div


@dataclass(frozen=True)
class KVPoolSizing:
    free_bytes: int
    fraction: float
    block_size: int
    bytes_per_block: int
    num_blocks: int  # blocks requests can own; the cache holds one more (the scratch block)
    capped_by: str | None = None  # the setting that capped the pool below what memory holds

    @property
    def how_to_grow(self) -> str:
        """The setting that would give the pool more blocks."""
        if self.capped_by is not None:
            return f"raise EngineConfig.{self.capped_by} (it caps the pool at {self.num_slots} tokens)"
        return "raise EngineConfig.kv_fraction"

    @property
    def num_slots(self) -> int:
        """Token slots requests can own."""
        return self.num_blocks * self.block_size


def blocks_for(tokens: int, block_size: int) -> int:
    return ceil_div(tokens, block_size)


def size_kv_pool(model: ModelConfig, config: EngineConfig, free: int) -> KVPoolSizing:
    """Blocks that fit in `kv_fraction` of `free` bytes (an observation only; tensor parallel:
    the least free of any rank's), at most `max_kv_slots` tokens' worth (None: `max_running`
    requests of the model's longest); the scratch block comes out of the same budget."""
    fraction, block_size, dtype = config.kv_fraction, config.kv_block_size, config.dtype
    max_slots, cap = (config.max_kv_slots, "max_kv_slots") if config.max_kv_slots is not None else (
        config.max_running * model.max_position, "max_running")
    per_block = KVCache.bytes_per_block(model, dtype, block_size)
    fitting = int(free * fraction) // per_block - 1
    blocks = min(fitting, max_slots // block_size)
    if blocks < 1:
        raise MemoryError(
            f"no KV block fits: {fraction:.0%} of {free} free bytes and max_kv_slots {max_slots} leave no block of "
            f"{block_size} tokens ({per_block} bytes) beside the scratch block; raise kv_fraction or max_kv_slots, "
            "or lower kv_block_size"
        )
    return KVPoolSizing(free, fraction, block_size, per_block, blocks, capped_by=cap if blocks < fitting else None)


class BlockAllocator:
    """Free list of KV blocks 1..num_blocks (SCRATCH_BLOCK is never handed out) and the
    requests' share of them."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.reset()

    @property
    def available(self) -> int:
        """Free blocks."""
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        taken = self._free[-count:] if count else []
        del self._free[len(self._free) - count :]
        return taken[::-1]

    def free(self, blocks: Sequence[int]) -> None:
        self._free.extend(reversed(blocks))

    def reset(self) -> None:
        self._free = self.all_blocks()[::-1]

    def all_blocks(self) -> list[int]:
        """Every block that may be handed out, ascending."""
        return [b for b in range(1, self.num_blocks + 1) if b != SCRATCH_BLOCK]

    def free_blocks(self) -> list[int]:
        return list(self._free)

    # -- a request's share --------------------------------------------------------------
    def blocks_needed(self, request: Request, tokens: int) -> int:
        """New blocks `request` takes to reserve `tokens` more tokens."""
        return blocks_for(request.kv_tokens + tokens, self.block_size) - len(request.blocks)

    def grow(self, requests: Sequence[Request], tokens: Sequence[int]) -> bool:
        """Reserve `tokens[i]` more tokens for request i, all or none (False: too few blocks)."""
        needs = [self.blocks_needed(request, count) for request, count in zip(requests, tokens, strict=True)]
        taken = self.allocate(sum(needs))
        if taken is None:
            return False
        start = 0
        for request, count, need in zip(requests, tokens, needs, strict=True):
            request.blocks.extend(taken[start : start + need])
            request.kv_tokens += count
            start += need
        return True

    def shrink(self, request: Request, tokens: int) -> None:
        """Give back the request's last `tokens` reserved tokens and every block left empty."""
        request.kv_tokens -= tokens
        keep = blocks_for(request.kv_tokens, self.block_size)
        self.free(request.blocks[keep:])
        del request.blocks[keep:]

    def release(self, request: Request) -> None:
        """Everything the request holds."""
        self.shrink(request, request.kv_tokens)
