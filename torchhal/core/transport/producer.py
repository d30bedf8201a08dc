"""The producer side: one device pool per worker, best-fit slices, host fallback.

A producer worker owns one device buffer (its pool) whose IPC handle is taken once;
tensors are copied into best-fit slices and sent as flat plain-data messages (see
`messages`); the handle's plain data is written once into the producer's control block. A slice is
recycled when every expected consumer has acknowledged its current generation. A full
pool, or a platform without IPC, falls back to host shared memory with the same API.

Where the platform has interprocess events (`IpcSupport.events`), each slot has one: the
copy into the pool is recorded on it, its handle is stored once in the control block and
the message asks the consumer to wait on it, so `send` returns
without waiting and the consumer's stream waits on the device. Without them, `send` waits
for its own copy (an event synchronize) before the message leaves.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from torchhal.core.devices import check_device_index
from torchhal.core.transport._shm import Control, SharedFile, new_pool_id, reclaim_orphans
from torchhal.core.transport.messages import TensorMessage, check_count, handle_record, host_name
from torchhal.platforms import IpcEvents, IpcHandle, Platform, check_platform_argument, current_platform
from torchhal.platforms.ipc import MAX_BYTES, MAX_DIMS, dtype_name
from torchhal.values import ceil_div, check_bool

MiB = 1 << 20
POOL_FLOOR_BYTES = 128 * MiB
BUDGET_SETTING = "TransportConfig.budget_bytes"
#: sends between reclaim scans while slots and pool space last (a full pool or slot table
#: reclaims at once): the scan reads every used slot's acks, so not on every send.
RECLAIM_EVERY = 32
#: pool slice views kept for reuse (by offset, dtype and shape); past it they start over.
MAX_KEPT_VIEWS = 1024
#: slices start on multiples of this (and of TransportConfig.alignment, a multiple of it): the
#: widest element any sent dtype has, so a slice is a whole number of elements from the pool's start.
SLICE_ALIGNMENT = 16


def pool_size(budget_bytes: int, workers: int, floor: int = POOL_FLOOR_BYTES) -> int:
    """Each producer's share of the total budget, never below the floor."""
    budget, share = check_count("budget_bytes", budget_bytes, 0), check_count("workers", workers, 1)
    return max(budget // share, check_count("floor", floor, 1))


@dataclass(frozen=True)
class TransportConfig:
    budget_bytes: int = 1 << 30  # total for all producer workers
    workers: int = 1
    consumers: int = 1  # acknowledgements needed before a slice is reused
    max_slices: int = 1024
    pool_floor_bytes: int = POOL_FLOOR_BYTES
    alignment: int = 512
    #: use the platform's interprocess events where it has them (False: `send` waits for its
    #: copy on the host, as on platforms without them; for comparison).
    interprocess_events: bool = True

    def __post_init__(self) -> None:
        least = {"budget_bytes": 0, "workers": 1, "consumers": 1, "max_slices": 1, "pool_floor_bytes": 1,
                 "alignment": SLICE_ALIGNMENT}
        for name, minimum in least.items():
            check_count(f"TransportConfig.{name}", getattr(self, name), minimum)
        if self.alignment % SLICE_ALIGNMENT:  # every dtype's slices start on an element boundary
            raise ValueError(f"TransportConfig.alignment = {self.alignment} must be a multiple of {SLICE_ALIGNMENT} "
                             "bytes (the default is 512)")
        if self.max_slices * (2 + self.consumers) >= Control.MAX_CELLS:  # what every consumer's open refuses
            raise ValueError(f"TransportConfig.max_slices = {self.max_slices} with consumers = {self.consumers} "
                             f"needs {self.max_slices * (2 + self.consumers)} control cells, at most "
                             f"{Control.MAX_CELLS - 1}: lower max_slices or consumers")
        check_bool("TransportConfig.interprocess_events", self.interprocess_events)


def _unlink_files(control: Control, host_blocks: dict[int, SharedFile], owner_pid: int) -> None:
    """Unmap and unlink a producer's files (its finalizer: it must not hold the producer). Only
    in the process that made them: a forked child inherits the finalizer with the producer,
    and its exit must not take the parent's files."""
    if os.getpid() != owner_pid:
        return
    for block in host_blocks.values():
        block.discard()
    control.close(unlink=True)


class Producer:
    def __init__(self, config: TransportConfig = TransportConfig(), platform: Platform | None = None,
                 device_index: int | None = None) -> None:
        if not isinstance(config, TransportConfig):
            raise TypeError(f"config = {config!r} must be a TransportConfig, "
                            "e.g. TransportConfig(budget_bytes=1 << 30)")
        check_platform_argument(platform, "Producer")
        self.config = config
        self.platform = platform or current_platform()
        self.device_index = check_device_index(self.platform, device_index, "device_index")
        self.pool_bytes = pool_size(config.budget_bytes, config.workers, config.pool_floor_bytes)
        reclaim_orphans()  # files of producers that died without close()
        self.pool_id = new_pool_id()
        ipc = self.platform.ipc_support
        self.pool: torch.Tensor | None = None
        self.pool_handle: IpcHandle | None = None
        if ipc is not None:
            self.pool = torch.empty(self.pool_bytes, dtype=torch.uint8, device=self.platform.device(self.device_index))
            self.pool_handle = ipc.share(self.pool)  # taken once for the pool's lifetime
        self._events: IpcEvents | None = ipc.events if ipc is not None and config.interprocess_events else None
        self._free: list[tuple[int, int]] = [(0, self.pool_bytes)]  # (offset, size), sorted by offset
        self._used: dict[int, tuple[int, int, str | None]] = {}  # slot -> (offset, size, host block name)
        self._host_blocks: dict[int, SharedFile] = {}
        self._free_slots = list(range(config.max_slices - 1, -1, -1))
        self._warned_full = False
        self._copied = self.platform.new_event()  # marks the end of each send's copy into the pool
        self._slot_events: dict[int, Any] = {}  # slot -> its interprocess event
        self._views: dict[tuple[int, torch.dtype, torch.Size], torch.Tensor] = {}  # see _slice
        self._sends_since_reclaim = 0
        self._lock = threading.Lock()
        self._closed = False
        # Constant per producer, so in the control block (read once per consumer), not in messages.
        # Made last: nothing after it can fail (or be interrupted) and leave its file behind.
        self.control = Control.create(
            self.pool_id, config.max_slices, config.consumers, self.pool_bytes if self.pool is not None else 0,
            handle_record(self.pool_handle) if self.pool_handle is not None else b"",
            self._events.handle_nbytes if self._events is not None else 0,
        )
        # close(), or the producer's collection or the interpreter's exit without it: reclaim
        # skips the files of a live process, so a dropped producer's would stay until it ends.
        self._unlink_files = weakref.finalize(self, _unlink_files, self.control, self._host_blocks, os.getpid())

    # slices -------------------------------------------------------------------------------
    def _rounded(self, nbytes: int) -> int:
        return ceil_div(max(nbytes, 1), self.config.alignment) * self.config.alignment

    def _allocate(self, nbytes: int) -> int | None:
        """The offset of a best-fit slice of the free ranges (sorted by offset), or None."""
        size, best = self._rounded(nbytes), None
        for i, (_, free) in enumerate(self._free):
            if free >= size and (best is None or free < self._free[best][1]):
                best = i
        if best is None:
            return None
        offset, free = self._free[best]
        if free == size:
            del self._free[best]
        else:
            self._free[best] = (offset + size, free - size)
        return offset

    def _release_range(self, offset: int, size: int) -> None:
        self._free.append((offset, self._rounded(size)))
        self._free.sort()
        merged = self._free[:1]
        for start, length in self._free[1:]:
            if merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged

    def reclaim(self) -> int:
        """Free every slice all consumers acknowledged; returns how many (0 once closed)."""
        with self._lock:
            return 0 if self._closed else self._reclaim_locked()

    def _reclaim_locked(self) -> int:
        self._sends_since_reclaim = 0
        freed = [slot for slot in self._used if self.control.all_acked(slot)]
        for slot in freed:
            start, size, host = self._used.pop(slot)
            self._free_slots.append(slot)
            # Its bytes may now go to another slot: a replay of its last message must read as stale.
            self.control.bump(slot)
            if host is None:
                self._release_range(start, size)
            else:
                self._host_blocks.pop(slot).discard()
        return len(freed)

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    # sending -------------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor) -> tuple[Any, ...]:
        """Copy `tensor` into the pool (or host memory) and return the message: the flat
        plain-data record of `TensorMessage.to_wire` (a tuple; JSON-safe).

        With interprocess events the copy may still be running when this returns (it is
        queued on the pool device's current stream); the consumer's stream waits for it.
        A tensor no consumer would accept is refused before a slice is taken for it.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"send() takes a torch.Tensor, got a {type(tensor).__name__}; convert it first "
                            "(torch.as_tensor)")
        if tensor.layout != torch.strided:
            raise TypeError(f"send() takes a strided (dense) tensor, got layout {tensor.layout}; convert it first "
                            "(tensor.to_dense())")
        if tensor.is_meta:
            raise ValueError(f"send() got a tensor on the meta device ({tuple(tensor.shape)} {tensor.dtype}), "
                             "which holds no data to send; send a tensor with data")
        shape = tuple(tensor.shape)
        over = next((i for i, n in enumerate(shape) if n >= MAX_BYTES), None)
        if len(shape) > MAX_DIMS or over is not None:
            problem = (f"{len(shape)} dimensions; a message carries at most {MAX_DIMS}: reshape it first"
                       if len(shape) > MAX_DIMS else f"shape {shape}: dimension {over} is over the "
                       f"2**{MAX_BYTES.bit_length() - 1} - 1 a message carries; reshape it first")
            raise ValueError(f"send() got a tensor of {problem}")
        # Detached: the copy into the pool must join no autograd graph, reverse or forward
        # (a forward-mode tangent would give the pool view a tangent of its own).
        source = tensor.detach().contiguous()
        nbytes = source.numel() * source.element_size()
        dtype = dtype_name(source.dtype)  # an unsupported one: IpcHandleError
        with self._lock:  # close() takes it too: a send in flight finishes before the files go
            if self._closed:
                raise RuntimeError("this Producer is closed; make a new one to send more")
            self._sends_since_reclaim += 1
            if not self._free_slots or self._sends_since_reclaim >= RECLAIM_EVERY:
                self._reclaim_locked()
            if not self._free_slots:
                raise RuntimeError(f"all {self.config.max_slices} slices are awaiting acknowledgement; consumers "
                                   "must ack, or raise TransportConfig.max_slices")
            offset = None if self.pool is None else self._allocate(nbytes)
            if offset is None and self.pool is not None and self._used:  # acknowledged slices may free room
                self._reclaim_locked()
                offset = self._allocate(nbytes)
            slot = self._free_slots.pop()
            generation = self.control.bump(slot)
            try:
                kind, offset, event = self._fill(slot, generation, offset, source, nbytes)
            except BaseException:
                # Nothing of a failed send stays taken (the bumped generation leaves nothing stale).
                self._free_slots.append(slot)
                if offset is not None:
                    self._release_range(offset, nbytes)
                raise
        # `source` is contiguous, but size-1 dimensions may give it a stride other than the one
        # derived from the shape: `to_wire` sends it only then.
        return TensorMessage(kind, self.pool_id, slot, generation, offset, nbytes, dtype, shape,
                             tuple(source.stride()), event).to_wire()

    def _fill(self, slot: int, generation: int, offset: int | None, source: torch.Tensor,
              nbytes: int) -> tuple[str, int, bool]:
        """Copy `source` into slot `slot`'s pool bytes at `offset`, or host memory when None;
        (kind, offset, whether an interprocess event marks the copy)."""
        if offset is None:
            self._used[slot] = (0, nbytes, self._to_host(slot, generation, source, nbytes))
            return "host", 0, False
        self._slice(offset, nbytes, source).copy_(source)
        stream = self.platform.current_stream(self.device_index)
        if self._events is not None:
            # Re-recording a slot's event cannot race a reader of its previous generation: the
            # slot is reused only after every consumer acknowledged that generation, and a
            # consumer acknowledges after queuing its wait, which waits for the record it saw.
            self._record_slot_event(slot, stream, self._events)
        else:
            # Consumers read after the message arrives: wait for this copy (the pool device's
            # current stream), not for everything queued on the device.
            self._copied.record(stream)
            self._copied.synchronize()
        self._used[slot] = (offset, nbytes, None)
        return "pool", offset, self._events is not None

    def _slice(self, offset: int, nbytes: int, source: torch.Tensor) -> torch.Tensor:
        """Pool bytes [offset, offset + nbytes) as a tensor shaped like (contiguous) `source`
        (`offset` is a multiple of SLICE_ALIGNMENT, so of the element size). Kept by (offset,
        dtype, shape): an engine sends the same shapes into the same slices step after step,
        and making the view costs about as much host time as the rest of a send. It never
        leaves the producer: it is only copied into."""
        assert self.pool is not None
        key = (offset, source.dtype, source.shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= MAX_KEPT_VIEWS:
                self._views.clear()
            # Outside inference mode even when a send runs inside it: a view made there would
            # be an inference tensor, which no later send outside it may copy into.
            with torch.inference_mode(False):
                view = self._views[key] = self.pool[offset : offset + nbytes].view(source.dtype).view(source.shape)
        return view

    def _record_slot_event(self, slot: int, stream: Any, events: IpcEvents) -> None:
        """Record the slot's interprocess event on `stream`; made on first use, when its handle
        is stored in the control block (before the message that asks to wait on it leaves)."""
        event = self._slot_events.get(slot)
        if event is None:
            event = events.new(self.device_index)
            event.record(stream)
            self.control.set_event(slot, events.export(event))  # after the first record: the event exists
            self._slot_events[slot] = event
        else:
            event.record(stream)

    def _to_host(self, slot: int, generation: int, source: torch.Tensor, nbytes: int) -> str:
        if self.pool is not None and not self._warned_full:
            self._warned_full = True
            warnings.warn(
                f"IPC pool full: a tensor of {nbytes / MiB:.1f} MiB does not fit the {self.pool_bytes / MiB:.0f} MiB "
                f"pool ({self.free_bytes / MiB:.1f} MiB free); sending through host shared memory. Raise "
                f"{BUDGET_SETTING} (now {self.config.budget_bytes / MiB:.0f} MiB for {self.config.workers} worker(s))",
                stacklevel=3,
            )
        block = SharedFile(host_name(self.pool_id, slot, generation), nbytes)
        try:
            if nbytes:
                window = torch.frombuffer(block.map, dtype=torch.uint8, count=nbytes)
                window.copy_(source.reshape(-1).view(torch.uint8).cpu())
                del window  # the map cannot close while a tensor still exports it
        except BaseException:
            block.discard()
            raise
        self._host_blocks[slot] = block
        return block.name

    def close(self) -> None:
        """Unlink the pool, the control block and the host blocks (messages not yet received
        cannot be received after it); a second close does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for event in self._slot_events.values():
                event.synchronize()  # its last copy done before the event (and the pool) go away
            self._slot_events.clear()
            self._unlink_files()
            self.pool = None
            self._views.clear()
