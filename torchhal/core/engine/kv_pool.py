"""Token-slot KV pool: sized from memory_info, never by emptying the cache to measure."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchhal.core.model import KVCache, ModelConfig
from torchhal.platforms import Platform


@dataclass(frozen=True)
class KVPoolSizing:
    free_bytes: int
    fraction: float
    bytes_per_slot: int
    num_slots: int


def size_kv_pool(
    platform: Platform, device: int, config: ModelConfig, dtype: torch.dtype, fraction: float, max_slots: int
) -> KVPoolSizing:
    """Slots that fit in `fraction` of the device's free memory (an observation only)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"kv_fraction {fraction!r} must be in (0, 1]; e.g. 0.3 for 30% of free memory")
    free = platform.memory_info(device).free
    per_slot = KVCache.bytes_per_slot(config, dtype)
    slots = min(int(free * fraction) // per_slot, max_slots)
    if slots < 1:
        raise MemoryError(
            f"no KV slot fits: {fraction:.0%} of {free} free bytes is under one slot of {per_slot} bytes; "
            "raise kv_fraction or free device memory"
        )
    return KVPoolSizing(free, fraction, per_slot, slots)


class SlotAllocator:
    """Free list of KV slots. Requests own lists of slots; finished requests return them."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        taken = self._free[-count:] if count else []
        del self._free[len(self._free) - count :]
        return taken[::-1]

    def free(self, slots: list[int]) -> None:
        self._free.extend(reversed(slots))

    def reset(self) -> None:
        self._free = list(range(self.num_slots - 1, -1, -1))
