"""Platforms whose virtual memory breaks one contract each, on the CPU, for the virtual_memory
clause's own tests (tests/test_virtual_memory_conformance.py registers this module as a plugin).

- `vm_moves`: a restore moves the region's tensors to new memory (their addresses change);
- `vm_backup_lost`: a release with a backup keeps none (the restore reads as new memory);
- `vm_not_released`: a release gives no memory back (the pages stay).
"""

from __future__ import annotations

import weakref

import torch

from torchhal.platforms import VirtualMemorySupport, hookimpl
from torchhal.plugins.cpu import CpuPlatform
from torchhal.plugins.virtual_memory import HostDriver, Regions


class Moving(Regions):
    def allocate(self, tag: str, nbytes: int) -> torch.Tensor:
        tensor = super().allocate(tag, nbytes)
        self.handed: list[weakref.ref[torch.Tensor]] = [*getattr(self, "handed", []), weakref.ref(tensor)]
        return tensor

    def restore(self, tag: str) -> int:
        restored = super().restore(tag)
        for ref in getattr(self, "handed", []):
            tensor = ref()
            if tensor is not None:
                tensor.data = tensor.clone()  # new memory: the old address is not where it lives now
        return restored


class LosingBackups(Regions):
    def release(self, tag: str, *, backup: bool) -> int:
        return super().release(tag, backup=False)

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.numel(), dtype=torch.uint8)


class KeepingPages(HostDriver):
    def unmap(self, va: int, size: int, handle: int) -> None:
        return None


def host_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def platform_with(name: str, make: type[Regions], driver: type[HostDriver] = HostDriver) -> CpuPlatform:
    def virtual_memory_support(self: CpuPlatform) -> VirtualMemorySupport:
        return VirtualMemorySupport(lambda index: make(driver(), host_bytes), graph_memory=False, note=name)

    cls = type(f"Vm{name.title().replace('_', '')}", (CpuPlatform,),
               {"name": name, "priority": -1, "virtual_memory_support": virtual_memory_support})
    return cls()


class VmNone(CpuPlatform):
    """Declares no virtual memory: an engine on it sleeps by host offload."""

    name = "vm_none"
    priority = -1

    def virtual_memory_support(self) -> VirtualMemorySupport | None:
        return None


@hookimpl
def torchhal_register_platforms() -> list[CpuPlatform]:
    return [
        VmNone(),
        platform_with("vm_moves", Moving),
        platform_with("vm_backup_lost", LosingBackups),
        platform_with("vm_not_released", Regions, KeepingPages),
    ]
