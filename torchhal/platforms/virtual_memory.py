"""The virtual-memory capability: device memory released and restored under the same addresses.

A platform that declares it (`PlatformPlugin.virtual_memory_support()`) lets an engine place
allocations in tagged regions ("weights", "kv_cache", "graphs") and later give a region's
physical memory back to the device while its virtual addresses stay reserved. A restore maps
new physical memory at the same addresses, so every tensor, kernel argument and captured graph
that points into the region is valid again: sleep and wake cost what their copies cost, and no
graph is captured twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class MemoryRegions(Protocol):
    """One device's tagged regions, owned by one engine (two engines never share a tag).

    Contract (the conformance clause `virtual_memory` checks each point on the device):
    - `allocate` returns a uint8 device tensor of `nbytes` in the tag's region; its memory
      lives as long as a tensor views it.
    - `release(tag, backup=...)` gives the tag's physical memory back to the device: the
      device's free memory (`Platform.memory_info`) rises by the bytes returned. With
      `backup`, the contents are copied to host memory first (allocated once per tag and
      reused by later releases). Nothing may touch the region until `restore`.
    - `restore(tag)` maps physical memory again under the same addresses: a backed-up
      region holds its old contents bit for bit, another holds undefined bytes.
    - `host_copy(tensor)` is the backup of a tensor in a region released with a backup.
    - `graph_pool(tag)` is a pool handle for `GraphSupport.capture` whose memory lives in
      the tag's region, or None when graph memory cannot live in a region.
    """

    def allocate(self, tag: str, nbytes: int) -> torch.Tensor: ...

    def release(self, tag: str, *, backup: bool) -> int: ...

    def restore(self, tag: str) -> int: ...

    def graph_pool(self, tag: str) -> Any | None: ...

    def region_bytes(self, tag: str) -> int: ...

    def released(self, tag: str) -> bool: ...

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """The backup's bytes of `tensor` (a uint8 view into a region released with a backup):
        host memory that `restore` copies back, so what is written there while released
        comes back."""


@dataclass(frozen=True)
class VirtualMemorySupport:
    """How a platform releases and restores device memory under the same addresses.

    new_regions:    `new_regions(device_index)` -> a `MemoryRegions` for one device, owned
                    by its caller.
    graph_memory:   graph memory can live in a region (`MemoryRegions.graph_pool` answers a
                    pool): captured graphs keep their addresses and give their memory back
                    while asleep. False: graphs survive a release but their memory stays.
    not_released:   what a release leaves on the device or breaks, in words for reports
                    (the device context, a communicator's buffers, ...).
    note:           one line for reports (which API maps the memory).
    """

    new_regions: Callable[[int], MemoryRegions]
    graph_memory: bool
    not_released: tuple[str, ...] = ()
    note: str = ""

    def __post_init__(self) -> None:
        if not callable(self.new_regions):
            raise TypeError(f"VirtualMemorySupport.new_regions is {self.new_regions!r}; it must be a function "
                            "new_regions(device_index) returning the device's MemoryRegions")
        if type(self.graph_memory) is not bool:
            raise TypeError(f"VirtualMemorySupport.graph_memory is {self.graph_memory!r}; it must be True or False")
        if not isinstance(self.not_released, tuple) or not all(isinstance(s, str) for s in self.not_released):
            raise TypeError(f"VirtualMemorySupport.not_released is {self.not_released!r}; it must be a tuple of str")
        if not isinstance(self.note, str):
            raise TypeError(f"VirtualMemorySupport.note is {self.note!r}; it must be a str (one line for reports)")
