"""The consumer side: every message is untrusted data from another process.

A consumer opens each producer's control block and pool once per device (redirected
to its own device where peers allow), rebuilds the tensor from the bytes the message
names, and acknowledges. Anything wrong with a message is a `TransportError`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from torchhal.core.transport._shm import POOL_ID, Control, SharedFile, control_name, host_name, pid_alive
from torchhal.core.transport.messages import TensorMessage, TransportError, handle_fingerprint
from torchhal.platforms import IpcHandle, Platform, current_platform
from torchhal.platforms.ipc import DTYPES

#: producers whose control block and pool a consumer keeps open at once (least recently used go).
MAX_OPEN_PRODUCERS = 64


@dataclass
class _OpenProducer:
    control: Control
    handle: IpcHandle | None = None  # the pool handle checked against the control's fingerprint
    pool: torch.Tensor | None = None  # the opened pool as flat bytes


class Consumer:
    def __init__(self, rank: int = 0, platform: Platform | None = None, device_index: int | None = None,
                 max_producers: int = MAX_OPEN_PRODUCERS, copy_stream: bool = False) -> None:
        if max_producers < 1:
            raise ValueError(f"max_producers {max_producers} must be >= 1")
        self.rank = rank
        self.platform = platform or current_platform()
        self.device_index = self.platform.current_device() if device_index is None else device_index
        self.max_producers = max_producers
        self._open: OrderedDict[str, _OpenProducer] = OrderedDict()  # by control-block name
        # copy_stream: copies run on a side stream the caller's stream then waits for (an
        # event, no host synchronisation), so they can overlap work already queued.
        self._side = self.platform.new_stream(self.device_index) if copy_stream else None
        self._copied = self.platform.new_event() if copy_stream else None
        self._lock = threading.Lock()

    def receive(self, message: Any, copy: bool = True) -> torch.Tensor:
        """Rebuild the tensor on this consumer's device and acknowledge it.

        copy=True (default) returns a fresh tensor; copy=False a zero-copy view of the
        producer's slice, valid until it is recycled (acknowledged here already).
        Any problem with the message raises `TransportError` (the cause chained); only an
        out-of-memory error of the copy itself propagates as the platform's OOM error.
        """
        try:
            return self._receive(message, copy)
        except TransportError:
            raise
        except Exception as exc:
            if self.platform.is_out_of_memory(exc):
                raise
            raise TransportError(f"message cannot be received: {type(exc).__name__}: {exc}") from exc

    def _receive(self, message: Any, copy: bool) -> torch.Tensor:
        msg = TensorMessage.from_dict(message)
        entry = self._producer(msg)
        control = entry.control
        if control.generation(msg.slot) != msg.generation:
            raise TransportError(
                f"stale message: slice {msg.slot} was recycled (generation {control.generation(msg.slot)}, "
                f"message has {msg.generation})"
            )
        dtype = DTYPES[msg.dtype]
        if msg.kind == "host":
            tensor = self._from_host(msg, dtype)
        else:
            pool = self._pool(entry, msg)
            if msg.offset + msg.nbytes > pool.numel():
                raise TransportError(f"slice exceeds the opened pool of {pool.numel()} bytes")
            # Bytes [offset, offset + nbytes) and nothing else; the view was checked to fit them.
            tensor = pool[msg.offset : msg.offset + msg.nbytes].view(dtype).as_strided(msg.shape, msg.stride)
            if copy:
                tensor = self._copy(tensor)
        control.ack(msg.slot, self.rank, msg.generation)
        return tensor

    def _copy(self, view: torch.Tensor) -> torch.Tensor:
        home = self.platform.device(self.device_index)
        if self._side is None or self._copied is None or (view.device.type, view.device.index or 0) != (
            home.type, home.index or 0
        ):
            return view.clone()  # not on this consumer's device (no peer redirect): copy where it is
        out = torch.empty(view.shape, dtype=view.dtype, device=view.device)  # owned by the caller's stream
        with self.platform.use_stream(self._side):
            out.copy_(view)
            self._copied.record(self._side)
        self._copied.wait(self.platform.current_stream(self.device_index))
        return out

    # producers ------------------------------------------------------------------------------
    def _producer(self, msg: TensorMessage) -> _OpenProducer:
        if not pid_alive(msg.producer_pid):
            raise TransportError(f"producer pid {msg.producer_pid} has exited; its pool {msg.pool_id} is gone")
        match = POOL_ID.fullmatch(msg.pool_id)
        if match is None or int(match.group(1)) != msg.producer_pid:
            raise TransportError(f"pool id {msg.pool_id!r} is not one of producer pid {msg.producer_pid}")
        if msg.control != control_name(msg.pool_id):
            raise TransportError(f"control block {msg.control!r} is not the one of pool {msg.pool_id!r}")
        with self._lock:
            entry = self._open.get(msg.control)
            if entry is None:
                self._prune()
                entry = _OpenProducer(Control.open(msg.control, msg.producer_pid))
                self._open[msg.control] = entry
            else:
                self._open.move_to_end(msg.control)
        control = entry.control
        if not control.alive:
            self._forget(msg.control)
            raise TransportError(f"producer pool {msg.pool_id} was closed")
        if not 0 <= msg.slot < control.slots or not 0 <= self.rank < control.consumers:
            raise TransportError(
                f"slot {msg.slot} or consumer rank {self.rank} is outside the producer's "
                f"{control.slots} slots x {control.consumers} consumers"
            )
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

    @staticmethod
    def _close_entry(entry: _OpenProducer) -> None:
        entry.pool = None  # views handed out keep their own reference to the storage
        entry.control.close(unlink=False)

    @property
    def open_producers(self) -> int:
        return len(self._open)

    def _pool(self, entry: _OpenProducer, msg: TensorMessage) -> torch.Tensor:
        handle = msg.pool_handle
        if handle is None:
            raise TransportError("pool message lacks its pool_handle")
        with self._lock:
            if entry.pool is not None and entry.handle == handle:
                return entry.pool
            if entry.pool is not None or handle_fingerprint(handle) != entry.control.fingerprint:
                raise TransportError(f"pool_handle is not the one producer {msg.pool_id} shared")
            if handle.shape[0] != entry.control.pool_bytes:
                raise TransportError(
                    f"pool_handle names {handle.shape[0]} bytes; the producer's pool has {entry.control.pool_bytes}"
                )
            ipc = self.platform.ipc_support
            if ipc is None:
                raise TransportError(f"platform {self.platform.name!r} cannot open device pools")
            opened = ipc.open(handle, self.device_index)
            entry.pool, entry.handle = opened.reshape(-1).view(torch.uint8), handle  # index in bytes, always
            return entry.pool

    def _from_host(self, msg: TensorMessage, dtype: torch.dtype) -> torch.Tensor:
        assert msg.host_name is not None
        if msg.host_name != host_name(msg.pool_id, msg.slot, msg.generation):
            raise TransportError(f"host block {msg.host_name!r} is not one of pool {msg.pool_id} slot {msg.slot}")
        block = SharedFile(msg.host_name, writable=False)
        try:
            if block.size < msg.nbytes:
                raise TransportError(f"host block holds {block.size} bytes, message claims {msg.nbytes}")
            raw = torch.empty(msg.nbytes, dtype=torch.uint8)
            if msg.nbytes:
                raw.copy_(torch.frombuffer(bytearray(block.map[: msg.nbytes]), dtype=torch.uint8))
        finally:
            block.close()
        host = raw.view(dtype).as_strided(msg.shape, msg.stride)
        return host.to(self.platform.device(self.device_index)).contiguous()

    def close(self) -> None:
        with self._lock:
            for entry in self._open.values():
                self._close_entry(entry)
            self._open.clear()
