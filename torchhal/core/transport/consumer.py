"""The consumer side: every message is untrusted data from another process.

A consumer opens each producer's control block once, and its pool once per device
(redirected to its own device where peers allow) from the handle record in that block,
checked against its fingerprint; it rebuilds the tensor from the bytes the message names,
and acknowledges. Anything wrong with a message is a `TransportError`: `receive` is the one
place it is checked, by the decoder (`TensorMessage.from_wire`), against the producer's
control block, and by the platform's open.

A pool message may ask to wait on the producer slot's interprocess event: the consumer
reads its handle from the control block and opens it once per slot (kept with the
producer's entry, dropped with it), and makes its stream wait on it before reading, so the
producer never waits on the host.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from torchhal.core.devices import check_device_index, is_out_of_memory
from torchhal.core.transport._shm import Control, SharedFile, pid_alive
from torchhal.core.transport.messages import TensorMessage, TransportError, check_count, handle_fingerprint
from torchhal.platforms import IpcHandle, IpcHandleError, Platform, check_platform_argument, current_platform
from torchhal.platforms.ipc import DTYPES, handle_from_data
from torchhal.values import check_bool

#: producers whose control block and pool a consumer keeps open at once (least recently used go).
MAX_OPEN_PRODUCERS = 64
#: copies whose acknowledgement waits for the copy to finish on the device; past this the
#: oldest is waited for on the host (a consumer that receives faster than its device copies).
MAX_PENDING_ACKS = 64
#: pool views kept for copies (by producer, offset, dtype, shape, stride); past it they start over.
MAX_KEPT_VIEWS = 1024


@dataclass
class _OpenProducer:
    control: Control
    handle: IpcHandle | None = None  # the pool handle read from the control block
    pool: torch.Tensor | None = None  # the opened pool as flat bytes
    #: slot -> its opened event; at most one per slot of this producer.
    events: dict[int, Any] = field(default_factory=dict)
    views: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict)  # see Consumer._kept_view


class Consumer:
    def __init__(self, rank: int = 0, platform: Platform | None = None, device_index: int | None = None,
                 max_producers: int = MAX_OPEN_PRODUCERS, copy_stream: bool = False) -> None:
        """`rank`: this consumer's index among the producers' `TransportConfig.consumers`.
        `copy_stream`: copies run on a side stream the caller's stream then waits for (an
        event, no host synchronisation), so they can overlap work already queued."""
        self.rank = check_count("rank", rank, 0)
        self.max_producers = check_count("max_producers", max_producers, 1)
        check_bool("copy_stream", copy_stream)
        check_platform_argument(platform, "Consumer")
        self.platform = platform or current_platform()
        self.device_index = check_device_index(self.platform, device_index, "device_index")
        self._open: OrderedDict[str, _OpenProducer] = OrderedDict()  # by pool id
        self._side = self.platform.new_stream(self.device_index) if copy_stream else None
        self._copied = self.platform.new_event() if copy_stream else None
        # copy=True acknowledgements wait until the copy ran (the producer may overwrite the
        # slice as soon as it is acknowledged): (copy-done event, control, slot, generation).
        self._pending: deque[tuple[Any, Control, int, int]] = deque()
        self._kept_views = 0  # views kept over all producers (see _kept_view)
        self._lock = threading.Lock()
        self._closed = False

    def receive(self, message: Any, copy: bool = True) -> torch.Tensor:
        """Rebuild the tensor on this consumer's device and acknowledge it.

        copy=True (default) returns a fresh tensor; its slice is acknowledged once the copy
        has run on the device (checked without waiting here and at every later `receive`,
        or by `flush_acks`). copy=False returns a zero-copy view of the producer's slice, valid
        until it is recycled (acknowledged here already).
        The tensor is ready in stream order on the caller's current stream (where the
        message carries the producer's event, that stream already waits on it): like the
        output of any torch op, use it on that stream, or synchronize it before host reads.
        Any problem with the message raises `TransportError` (the cause chained); only an
        out-of-memory error of the copy itself propagates as the platform's OOM error.
        """
        if self._closed:
            raise RuntimeError("this Consumer is closed; make a new one to receive more")
        check_bool("receive(copy)", copy)  # None is falsy: a view the producer may overwrite
        try:
            return self._receive(message, copy)
        except Exception as exc:
            if isinstance(exc, TransportError) or is_out_of_memory(self.platform, exc):
                raise
            detail = str(exc) if isinstance(exc, IpcHandleError) else f"{type(exc).__name__}: {exc}"
            raise TransportError(f"message cannot be opened: {detail}") from exc

    def _receive(self, message: Any, copy: bool) -> torch.Tensor:
        msg = TensorMessage.from_wire(message)
        entry = self._producer(msg)
        control = entry.control
        if control.generation(msg.slot) != msg.generation:
            raise TransportError(f"stale message: slice {msg.slot} was recycled (generation "
                                 f"{control.generation(msg.slot)}, message has {msg.generation})")
        dtype = DTYPES[msg.dtype]
        if msg.kind == "host":
            tensor = self._from_host(msg, dtype)
        else:
            if not control.pool_bytes or msg.offset + msg.nbytes > control.pool_bytes:  # before opening anything
                raise TransportError(f"slice [{msg.offset}, {msg.offset + msg.nbytes}) exceeds its pool of "
                                     f"{control.pool_bytes} bytes")
            pool = entry.pool if entry.pool is not None else self._pool(entry, msg)
            # Bytes [offset, offset + nbytes) and nothing else: the decoder checked the view fits them.
            # A view only copied from is kept for the next message naming the same bytes.
            tensor = self._kept_view(entry, pool, msg, dtype) if copy else _view(pool, msg, dtype)
            ready = self._slot_event(entry, msg) if msg.event else None
            pool_index = pool.device.index or 0
            side = copy and self._side is not None and pool_index == self.device_index
            # The stream that reads the slice, looked up once (a lookup builds a stream object).
            reader = self._side if side else self.platform.current_stream(pool_index)
            if ready is not None:  # the reader waits for the producer's copy
                ready.wait(reader)
            if copy:
                tensor = self._copy_on_side(tensor) if side else tensor.clone()
                # The producer may overwrite the slice once it is acknowledged: ack when the
                # copy has run (at once where it already has, e.g. in-order host platforms).
                self._ack_when_done(reader, control, msg.slot, msg.generation)
                return tensor
        # Acknowledged after the wait was queued: the producer re-records this slot's event
        # only after every consumer acknowledged, and a queued wait keeps the record it saw.
        control.ack(msg.slot, self.rank, msg.generation)
        self.flush_acks(wait=False)  # copies of earlier messages
        return tensor

    def _ack_when_done(self, stream: Any, control: Control, slot: int, generation: int) -> None:
        done = self.platform.new_event()
        done.record(stream)
        self._pending.append((done, control, slot, generation))
        # Once this copy is queued, so the device runs it meanwhile: acknowledge the copies
        # that have run, earlier ones and this one where it already has (in-order hosts).
        self.flush_acks(wait=False)
        if len(self._pending) > MAX_PENDING_ACKS:
            self._ack_oldest(wait=True)

    def _ack_oldest(self, wait: bool) -> bool:
        done, control, slot, generation = self._pending[0]
        if wait:
            done.synchronize()
        elif not done.query():
            return False
        self._pending.popleft()
        control.ack(slot, self.rank, generation)
        return True

    def flush_acks(self, wait: bool = True) -> int:
        """Acknowledge received copies whose device copy has finished (wait=True: wait for
        all of them); returns how many. A consumer that stops receiving calls this so its
        producers can recycle the last slices it copied."""
        check_bool("flush_acks(wait)", wait)
        acked = 0
        while self._pending and self._ack_oldest(wait):
            acked += 1
        return acked

    def _kept_view(self, entry: _OpenProducer, pool: torch.Tensor, msg: TensorMessage,
                   dtype: torch.dtype) -> torch.Tensor:
        """`_view`, kept by what it views (its shape and stride are exact ints, as decoded): an
        engine receives the same shapes from the same slices step after step, and making the
        view costs about as much host time as the rest of a receive. Never handed out: a
        caller could change a view's metadata in place. At most MAX_KEPT_VIEWS over all
        producers (kept with each producer's entry, dropped with it)."""
        key = (msg.offset, msg.dtype, msg.shape, msg.stride)
        view = entry.views.get(key)
        if view is None:
            if self._kept_views >= MAX_KEPT_VIEWS:
                for known in self._open.values():
                    known.views.clear()
                self._kept_views = 0
            view = entry.views[key] = _view(pool, msg, dtype)
            self._kept_views += 1
        return view

    def _copy_on_side(self, view: torch.Tensor) -> torch.Tensor:
        assert self._side is not None and self._copied is not None
        out = torch.empty(view.shape, dtype=view.dtype, device=view.device)  # owned by the caller's stream
        with self.platform.use_stream(self._side):
            out.copy_(view)
            self._copied.record(self._side)
        self._copied.wait(self.platform.current_stream(self.device_index))
        return out

    def _slot_event(self, entry: _OpenProducer, msg: TensorMessage) -> Any:
        """The producer slot's event, opened once per slot from its handle in the control block
        (a producer writes a slot's handle once, before the first message that waits on it)."""
        known = entry.events.get(msg.slot)
        if known is not None:
            return known
        handle = entry.control.event(msg.slot)
        if handle is None:
            raise TransportError(f"message asks to wait on slot {msg.slot}'s event, but producer {msg.pool_id} "
                                 "stored none")
        ipc = self.platform.ipc_support
        assert ipc is not None and entry.handle is not None  # the pool was opened first, through it
        events = ipc.events
        if events is None:
            raise TransportError(f"message asks to wait on an event but platform {self.platform.name!r} cannot open "
                                 "interprocess events; producer and consumer must run the same platform")
        if len(handle) != events.handle_nbytes:
            raise TransportError(f"event handle of {len(handle)} bytes is not a {self.platform.name} event handle "
                                 f"({events.handle_nbytes} bytes)")
        opened = events.open(handle, entry.handle.device, self.device_index)
        with self._lock:
            entry.events[msg.slot] = opened  # one per slot: bounded by the producer's slots
        return opened

    # producers ------------------------------------------------------------------------------
    def _producer(self, msg: TensorMessage) -> _OpenProducer:
        pid = msg.producer_pid
        if not pid_alive(pid):
            raise TransportError(f"producer pid {pid} has exited; its pool {msg.pool_id} is gone")
        with self._lock:
            entry = self._open.get(msg.pool_id)
            if entry is not None:
                self._open.move_to_end(msg.pool_id)
            else:  # first sight: the control block named by the pool id, and of its pid
                self._prune()
                entry = self._open[msg.pool_id] = _OpenProducer(Control.open(msg.control, pid))
        control = entry.control
        if not control.alive:
            self._forget(msg.pool_id)
            raise TransportError(f"producer pool {msg.pool_id} was closed")
        # Neither is negative: the decoder checked the slot, __init__ the rank.
        if msg.slot >= control.slots or self.rank >= control.consumers:
            raise TransportError(f"slot {msg.slot} or consumer rank {self.rank} is outside the producer's "
                                 f"{control.slots} slots x {control.consumers} consumers")
        return entry

    def _prune(self) -> None:
        """Drop producers that exited or closed, then the least recently used beyond the bound."""
        for name, entry in list(self._open.items()):
            if not entry.control.alive or not pid_alive(entry.control.cells[1]):
                self._close_entry(self._open.pop(name))
        while len(self._open) >= self.max_producers:
            self._close_entry(self._open.popitem(last=False)[1])

    def _forget(self, name: str) -> None:
        with self._lock:
            entry = self._open.pop(name, None)
            if entry is not None:
                self._close_entry(entry)

    def _close_entry(self, entry: _OpenProducer) -> None:
        if any(pending[1] is entry.control for pending in self._pending):
            self.flush_acks(wait=True)  # rare: an evicted or closed producer with copies in flight
        entry.pool = None  # views handed out keep their own reference to the storage
        self._kept_views = max(self._kept_views - len(entry.views), 0)
        entry.views.clear()
        entry.events.clear()  # waits already queued keep what they wait for
        entry.control.close(unlink=False)

    @property
    def open_producers(self) -> int:
        return len(self._open)

    def _pool(self, entry: _OpenProducer, msg: TensorMessage) -> torch.Tensor:
        """Open the producer's pool from the handle record in its control block (first sight)."""
        control = entry.control
        with self._lock:
            if entry.pool is not None:
                return entry.pool
            record = control.handle_record()
            if handle_fingerprint(record) != control.fingerprint:
                raise TransportError(f"the pool handle record of producer {msg.pool_id} does not match its "
                                     "fingerprint (garbled)")
            handle = handle_from_data(json.loads(record))  # the platform's open checks its fields
            # A pool is one flat byte buffer; anything else would index the slice in elements.
            if (handle.dtype, handle.offset_bytes, handle.shape, handle.stride) != (
                    "uint8", 0, (control.pool_bytes,), (1,)):
                raise TransportError(f"pool handle must describe a flat uint8 buffer of the producer's "
                                     f"{control.pool_bytes} bytes, got {handle.dtype} {handle.shape} stride "
                                     f"{handle.stride} at byte {handle.offset_bytes}")
            ipc = self.platform.ipc_support
            if ipc is None:
                raise TransportError(f"platform {self.platform.name!r} cannot open device pools")
            entry.pool, entry.handle = ipc.open(handle, self.device_index).view(torch.uint8), handle
            return entry.pool

    def _from_host(self, msg: TensorMessage, dtype: torch.dtype) -> torch.Tensor:
        block = SharedFile(msg.host_name, writable=False)
        try:
            if block.size < msg.nbytes:
                raise TransportError(f"host block holds {block.size} bytes, message claims {msg.nbytes}")
            raw = torch.frombuffer(bytearray(block.map[: msg.nbytes]), dtype=torch.uint8) if msg.nbytes else \
                torch.empty(0, dtype=torch.uint8)
        finally:
            block.close()
        host = raw.view(dtype).as_strided(msg.shape, msg.stride)
        return host.to(self.platform.device(self.device_index)).contiguous()

    def close(self) -> None:
        self._closed = True
        self.flush_acks(wait=True)  # the copies already returned are done: let producers recycle them
        with self._lock:
            for entry in self._open.values():
                self._close_entry(entry)
            self._open.clear()


def _view(pool: torch.Tensor, msg: TensorMessage, dtype: torch.dtype) -> torch.Tensor:
    """The message's view of its bytes [offset, offset + nbytes) of the pool."""
    return pool[msg.offset : msg.offset + msg.nbytes].view(dtype).as_strided(msg.shape, msg.stride)
