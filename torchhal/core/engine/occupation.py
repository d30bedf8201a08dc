"""Sleep and wake: what leaves the device, how it comes back, and what survives.

The platform chooses the way (the caller never does):

- **Regions** (the platform declares virtual memory, `Platform.virtual_memory_support`): the
  weights, the KV cache and the graphs' memory live in tagged regions from the start. Sleep
  gives their physical memory back and wake maps it again under the same addresses, so the
  captured graphs replay as they are: no graph is captured again.
- **Host offload** (no virtual memory): sleep copies the weights to page-locked host memory
  and drops the KV cache and the graphs; wake copies the weights back, allocates a new KV
  cache and captures the graphs again.

Levels, as RL frameworks know them: 1 backs the weights up to host (the host copy is made at
the first sleep and reused by every later one), 2 discards them (an update brings them back:
wake the weights, `update_weights_from_tensors`, then wake the KV cache). The KV cache is
discarded at both levels. While asleep the model's parameters are host tensors: the level-1
backup itself (a weight update made while asleep lands in what wake brings back), or at level 2
placeholders of zeros that nothing may write.

Every sleep and wake is all or nothing: a failure part-way (host or device memory running out, a
capture failing) leaves the engine as it was before the call, so the call can be retried.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from torchhal.core.model import KVCache, Model
from torchhal.platforms import MemoryRegions, Platform, ReleasePoint
from torchhal.values import ceil_div, short_repr

WEIGHTS, KV_CACHE = "weights", "kv_cache"
#: What wakes, in the order a wake of several takes them.
TAGS = (WEIGHTS, KV_CACHE)
#: Regions of the graph runners' memory (discarded at every sleep, restored with the KV cache).
GRAPH_TAGS = ("decode_graphs", "prefill_graphs")
_CHUNK_BYTES = 1 << 30  # weights are packed into region allocations of about this size
_ALIGN = 256  # each storage starts on this many bytes in a chunk (any dtype's view is aligned)
_T = TypeVar("_T")


class Releasable(Protocol):
    """What holds device state built on the weights and KV pool: the runners' graphs."""

    def release(self) -> None: ...

    def resume(self) -> None: ...


@dataclass
class _Storage:
    """One storage of the model's weights and every parameter or buffer viewing it."""

    nbytes: int
    tensors: list[torch.Tensor]
    views: list[tuple[tuple[int, ...], tuple[int, ...], int]]  # each tensor's shape, stride and offset
    weights: bool = False  # a parameter views it: an update writes it (else a buffer the model derives)
    device: torch.Tensor | None = None  # uint8, the storage's bytes on the device (regions)
    host: torch.Tensor | None = None  # uint8, the level-1 backup (made once, reused)


def weight_storages(model: Model) -> list[_Storage]:
    """The model's parameters and buffers grouped by the storage they view (a fused weight and
    the views into it are one), in a fixed order."""
    assert isinstance(model, torch.nn.Module), "sleep moves a model's parameters and buffers"
    groups: dict[int, _Storage] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        storage = tensor.untyped_storage()
        group = groups.setdefault(storage.data_ptr(), _Storage(storage.nbytes(), [], []))
        group.tensors.append(tensor)
        group.views.append((tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset())))
        group.weights |= isinstance(tensor, torch.nn.Parameter)
    return list(groups.values())


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage `tensor` views, as uint8."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def point_at(storage: _Storage, base: torch.Tensor) -> None:
    """Every tensor of `storage` views `base` (uint8, the storage's bytes) as it viewed its own."""
    for tensor, (shape, stride, offset) in zip(storage.tensors, storage.views, strict=True):
        typed = base.view(tensor.dtype)
        tensor.data = typed.as_strided(shape, stride, typed.storage_offset() + offset)


def zeros_placeholder(storage: _Storage) -> None:
    """Level 2 asleep: each tensor reads as zeros of its shape, in no memory worth the name."""
    for tensor in storage.tensors:
        tensor.data = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)


class Occupation(ABC):
    """What is asleep (`asleep`: the tags still to wake, in `TAGS` order) and at which level."""

    def __init__(self, platform: Platform, device: torch.device, model: Model) -> None:
        self.platform, self.device, self.model = platform, device, model
        self.device_index = device.index or 0
        self.storages: list[_Storage] = []
        self.asleep: tuple[str, ...] = ()
        self.level: int | None = None
        self.derived: list[torch.Tensor] = []  # level 2: host copies of the buffers the model derives

    @abstractmethod
    def describe(self) -> str: ...

    def wake_order(self, tags: object) -> list[str]:
        """`resume_memory_occupation`'s tags (None: all) checked, in the order they wake."""
        if not self.asleep:
            raise RuntimeError("the engine is not asleep")
        if tags is None:
            wanted = set(TAGS)
        elif isinstance(tags, str) or not isinstance(tags, Iterable) or not set(tags) or not set(tags) <= set(TAGS):
            raise ValueError(f"resume_memory_occupation(tags={short_repr(tags)}): pass a tuple of "
                             f"{', '.join(map(repr, TAGS))} (the weights first), or None for everything asleep")
        else:
            wanted = set(tags)
        if KV_CACHE in wanted and WEIGHTS in self.asleep and WEIGHTS not in wanted:
            raise ValueError("resume_memory_occupation(tags=('kv_cache',)) while the weights sleep: wake the weights "
                             "first (tags=('weights',)), or both (tags=None)")
        return [tag for tag in TAGS if tag in wanted and tag in self.asleep]

    def graph_pool(self, tag: str) -> Any:
        """The pool handle a runner captures its graphs into (None: the platform's own new pool)."""
        return None

    def place_weights(self) -> dict[int, torch.Tensor]:
        """At construction, after the model's move: where the weights live. Returns the storages
        copied elsewhere: old address -> the copy's bytes."""
        return {}

    def place_kv(self, make_kv: Callable[[torch.device | None], KVCache]) -> KVCache:
        """The KV cache, where it lives (`make_kv(device)`; None: the engine's device)."""
        return make_kv(None)

    @abstractmethod
    def sleep(self, level: int, runners: Sequence[Releasable]) -> int:
        """Level 1 or 2 (see the module's docstring); the bytes given back (0: the cache's to empty)."""

    @abstractmethod
    def wake(self, tags: Sequence[str], runners: Sequence[Releasable],
             make_kv: Callable[[torch.device | None], KVCache]) -> None:
        """Wake `tags`, in `TAGS` order (the weights before the KV cache)."""

    def close(self, runners: Sequence[Releasable]) -> None:
        """The graphs and the KV cache go now; the weights stay the model's."""
        for runner in runners:
            runner.release()
        self.model.kv = None


class RegionSleep(Occupation):
    """Sleep on the platform's virtual-memory regions (see the module's docstring)."""

    def __init__(self, platform: Platform, device: torch.device, model: Model, regions: MemoryRegions) -> None:
        super().__init__(platform, device, model)
        self.regions = regions

    def describe(self) -> str:
        support = self.platform.virtual_memory_support
        note = f" ({support.note})" if support is not None and support.note else ""
        return f"regions released and restored under the same addresses{note}; graphs are kept"

    def graph_pool(self, tag: str) -> Any:
        return self.regions.graph_pool(tag)

    def place_weights(self) -> dict[int, torch.Tensor]:
        """The weights are copied into the weights region, packed in chunks, and each storage is
        pointed at its copy; the old storages go back to the allocator."""
        self.storages = weight_storages(self.model)
        moved: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for chunk in _chunks(self.storages):
                base = self._allocate(WEIGHTS, sum(size for size, _ in chunk))
                start = 0
                for size, storage in chunk:
                    view = base[start : start + storage.nbytes]
                    old = storage_bytes(storage.tensors[0])
                    view.copy_(old)
                    moved[old.data_ptr()] = view
                    point_at(storage, view)
                    storage.device = view
                    start += size
        if self.platform.memory_info(self.device_index).reserved is not None:
            # What the old copies held is cached by the allocator, where a region cannot take it.
            self.platform.empty_cache(ReleasePoint.COMPONENT_RELEASE, self.device_index)
        return moved

    def place_kv(self, make_kv: Callable[[torch.device | None], KVCache]) -> KVCache:
        """The KV cache in its own region: made on the meta device, then given region memory (zeros)."""
        kv = make_kv(torch.device("meta"))
        for name in ("k", "v"):
            meta = getattr(kv, name)
            region = self._allocate(KV_CACHE, meta.numel() * meta.element_size())
            setattr(kv, name, region.view(meta.dtype).view(meta.shape))
        return kv

    def _allocate(self, tag: str, nbytes: int) -> torch.Tensor:
        # The caching allocator may hold what the weights' old storages freed.
        return self._emptying_on_oom(lambda: self.regions.allocate(tag, nbytes))

    def _emptying_on_oom(self, attempt: Callable[[], _T]) -> _T:
        """`attempt()`; out of memory, once more after emptying the cache (what was freed may
        still be cached by the allocator, where a region cannot take it)."""
        try:
            return attempt()
        except Exception as exc:
            if not self.platform.is_out_of_memory(exc):
                raise
            self.platform.empty_cache(ReleasePoint.OOM, self.device_index)
            return attempt()

    def sleep(self, level: int, runners: Sequence[Releasable]) -> int:
        # Level 2: buffers the model derives (the rotary frequencies) are kept, as no update brings them back.
        derived = [s.device for s in self.storages if not s.weights and s.device is not None] if level == 2 else []
        self.derived = [buffer.to("cpu", copy=True) for buffer in derived]
        released = self.regions.release(WEIGHTS, backup=level == 1)
        for storage in self.storages:
            assert storage.device is not None
            if level == 1:  # the parameters view the backup: an update made asleep lands in it
                point_at(storage, self.regions.host_copy(storage.device))
            else:
                zeros_placeholder(storage)
        released += self._release_kv_and_graphs()
        self.asleep, self.level = TAGS, level
        return released

    def wake(self, tags: Sequence[str], runners: Sequence[Releasable],
             make_kv: Callable[[torch.device | None], KVCache]) -> None:
        for tag in tags:
            if tag == WEIGHTS:
                self._restore(WEIGHTS)  # the backup comes back with it; level 2: zeros
                for storage, kept in zip([s for s in self.storages if not s.weights], self.derived, strict=False):
                    assert storage.device is not None
                    storage.device.copy_(kept)
                for storage in self.storages:
                    assert storage.device is not None
                    point_at(storage, storage.device)
            else:
                try:
                    for region in (KV_CACHE, *GRAPH_TAGS):
                        self._restore(region)
                except BaseException:
                    self._release_kv_and_graphs()
                    raise
            self.asleep = tuple(t for t in self.asleep if t != tag)

    def _restore(self, tag: str) -> None:
        # What a trainer freed may still be cached by the allocator.
        self._emptying_on_oom(lambda: self.regions.restore(tag))

    def _release_kv_and_graphs(self) -> int:
        return sum(self.regions.release(tag, backup=False) for tag in (KV_CACHE, *GRAPH_TAGS))

    def close(self, runners: Sequence[Releasable]) -> None:
        super().close(runners)
        self._release_kv_and_graphs()


class HostOffload(Occupation):
    """Sleep without virtual memory (see the module's docstring)."""

    def describe(self) -> str:
        return "weights offloaded to page-locked host memory; KV cache and graphs dropped and captured again on wake"

    def backup(self, storages: list[_Storage]) -> None:
        """Level 1: each storage's bytes into its host copy (made at the first sleep, reused)."""
        pin = self.platform.pin_memory
        for storage in storages:
            assert storage.device is not None
            if storage.host is None or storage.host.numel() != storage.nbytes:
                storage.host = pin(torch.empty(storage.nbytes, dtype=torch.uint8))
            storage.host.copy_(storage.device, non_blocking=True)
        self.platform.synchronize(self.device_index)

    def sleep(self, level: int, runners: Sequence[Releasable]) -> int:
        self.storages = weight_storages(self.model)
        for storage in self.storages:
            storage.device = storage_bytes(storage.tensors[0])
        try:
            self.backup(self.storages if level == 1 else [s for s in self.storages if not s.weights])
        except BaseException:
            self._drop_device_refs()
            raise
        for runner in runners:
            runner.release()
        for storage in self.storages:
            if level == 1 or not storage.weights:
                assert storage.host is not None
                point_at(storage, storage.host)
            else:
                zeros_placeholder(storage)
        self.model.kv = None
        self._drop_device_refs()
        self.asleep, self.level = TAGS, level
        return 0  # the device memory goes back when the engine empties the cache (ReleasePoint.SLEEP)

    def _drop_device_refs(self) -> None:
        for storage in self.storages:
            storage.device = None

    def wake(self, tags: Sequence[str], runners: Sequence[Releasable],
             make_kv: Callable[[torch.device | None], KVCache]) -> None:
        model = self.model
        for tag in tags:
            if tag == WEIGHTS:
                made = [torch.empty(s.nbytes, dtype=torch.uint8, device=self.device) for s in self.storages]
                for storage, base in zip(self.storages, made, strict=True):
                    if self.level == 1 or not storage.weights:
                        assert storage.host is not None
                        base.copy_(storage.host, non_blocking=True)
                self.platform.synchronize(self.device_index)
                for storage, base in zip(self.storages, made, strict=True):
                    point_at(storage, base)
                model.process_weights()
            else:
                try:
                    model.kv = make_kv(None)
                    for runner in runners:
                        runner.resume()
                except BaseException:
                    for runner in runners:
                        runner.release()
                    model.kv = None
                    raise
            self.asleep = tuple(t for t in self.asleep if t != tag)


def _chunks(storages: list[_Storage]) -> list[list[tuple[int, _Storage]]]:
    """Storages packed in order into chunks of about `_CHUNK_BYTES`: (aligned size, storage)."""
    chunks: list[list[tuple[int, _Storage]]] = [[]]
    filled = 0
    for storage in storages:
        size = ceil_div(max(storage.nbytes, 1), _ALIGN) * _ALIGN
        if chunks[-1] and filled + size > _CHUNK_BYTES:
            chunks.append([])
            filled = 0
        chunks[-1].append((size, storage))
        filled += size
    return chunks


def check_level(level: object) -> None:
    if type(level) is not int or level not in (1, 2):
        raise ValueError(f"release_memory_occupation(level={short_repr(level)}): pass 1 (weights backed up to host) "
                         "or 2 (weights discarded)")


def occupation_for(platform: Platform, device: torch.device, model: Model) -> Occupation:
    """The platform's way to sleep (see the module's docstring)."""
    support = platform.virtual_memory_support
    if support is not None:
        return RegionSleep(platform, device, model, support.new_regions(device.index or 0))
    return HostOffload(platform, device, model)

