"""Cross-process device tensor transport on the platform's IPC capability.

A producer worker owns one device buffer (its pool) whose IPC handle is taken
once; tensors are copied into best-fit slices and sent as plain-data messages
(JSON-safe dicts, never pickle). Consumers open each pool once per device
through the platform's open (redirected to the consumer's own device where
peers allow, so no context lands on the producer's GPU), rebuild the tensor
and acknowledge. A slice is recycled when every expected consumer has
acknowledged its current generation. A full pool, or a platform without IPC,
falls back to host shared memory with the same API.
"""

from __future__ import annotations

import base64
import mmap
import os
import tempfile
import threading
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from torchhal.platforms import IpcHandle, Platform, current_platform
from torchhal.platforms.ipc import DTYPES, MAX_BYTES, dtype_name, view_extent_bytes

MiB = 1 << 20
POOL_FLOOR_BYTES = 128 * MiB
BUDGET_SETTING = "TransportConfig.budget_bytes"


class TransportError(ValueError):
    """A message that cannot be honoured: malformed, out of bounds, stale, or from a gone producer."""


def pool_size(budget_bytes: int, workers: int, floor: int = POOL_FLOOR_BYTES) -> int:
    """Each producer's share of the total budget, never below the floor."""
    if workers < 1 or budget_bytes < 0:
        raise ValueError(f"workers {workers} must be >= 1 and budget_bytes {budget_bytes} >= 0")
    return max(budget_bytes // workers, floor)


# -- messages --------------------------------------------------------------------------

_FIELDS = {
    "kind": str, "pool_id": str, "slot": int, "generation": int, "offset": int, "nbytes": int,
    "dtype": str, "shape": list, "stride": list, "control": str, "producer_pid": int,
}


@dataclass(frozen=True)
class TensorMessage:
    kind: str  # "pool" (device pool slice) or "host" (shared-memory fallback)
    pool_id: str
    slot: int
    generation: int
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    control: str  # name of the producer's control block
    producer_pid: int
    pool_handle: IpcHandle | None = None  # pool messages: the pool's handle (same in every message)
    host_name: str | None = None  # host messages: the shared-memory block

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in _FIELDS}
        out["shape"], out["stride"] = list(self.shape), list(self.stride)
        if self.pool_handle is not None:
            h = self.pool_handle
            out["pool_handle"] = {
                "platform": h.platform, "device": h.device, "storage_nbytes": h.storage_nbytes, "dtype": h.dtype,
                "shape": list(h.shape), "stride": list(h.stride), "offset_bytes": h.offset_bytes,
                "storage": [_encode_field(v) for v in h.storage],
            }
        if self.host_name is not None:
            out["host_name"] = self.host_name
        return out

    @classmethod
    def from_dict(cls, data: Any) -> TensorMessage:
        """Decode and validate. Anything wrong raises TransportError, never anything else."""
        try:
            return cls._decode(data)
        except TransportError:
            raise
        except Exception as exc:  # a malformed message must never escape as another error type
            raise TransportError(f"malformed message: {type(exc).__name__}: {exc}") from None

    @classmethod
    def _decode(cls, data: Any) -> TensorMessage:
        if not isinstance(data, dict):
            raise TransportError(f"message must be a dict, got {type(data).__name__}")
        values: dict[str, Any] = {}
        for key, kind in _FIELDS.items():
            if key not in data:
                raise TransportError(f"message lacks {key!r}")
            value = data[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise TransportError(f"message field {key!r} = {value!r} is not a {kind.__name__}")
            values[key] = value
        if values["kind"] not in ("pool", "host"):
            raise TransportError(f"message kind {values['kind']!r} is neither 'pool' nor 'host'")
        for key in ("slot", "generation", "offset", "nbytes", "producer_pid"):
            if not 0 <= values[key] < MAX_BYTES:
                raise TransportError(f"message field {key!r} = {values[key]} is out of range")
        if values["dtype"] not in DTYPES:
            raise TransportError(f"unknown dtype {values['dtype']!r}; supported: {', '.join(DTYPES)}")
        shape, stride = tuple(values["shape"]), tuple(values["stride"])
        if len(shape) != len(stride) or len(shape) > 32:
            raise TransportError(f"shape {shape} and stride {stride} do not describe a tensor")
        for v in shape + stride:
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < MAX_BYTES:
                raise TransportError(f"shape {shape} / stride {stride} has an invalid entry {v!r}")
        itemsize = torch.empty((), dtype=DTYPES[values["dtype"]]).element_size()
        if values["offset"] % itemsize or values["nbytes"] % itemsize:
            raise TransportError(
                f"offset {values['offset']} and nbytes {values['nbytes']} must be multiples of the "
                f"{values['dtype']} size {itemsize}"
            )
        extent = view_extent_bytes(shape, stride, itemsize)
        if extent > values["nbytes"]:
            raise TransportError(f"view of {extent} bytes exceeds the message's nbytes {values['nbytes']}")
        values["shape"], values["stride"] = shape, stride
        handle = None
        if values["kind"] == "pool":
            raw = data.get("pool_handle")
            if not isinstance(raw, dict):
                raise TransportError("pool message lacks its pool_handle")
            handle = IpcHandle(
                platform=str(raw["platform"]), device=int(raw["device"]),
                storage=tuple(_decode_field(v) for v in raw["storage"]),
                storage_nbytes=int(raw["storage_nbytes"]), dtype=str(raw["dtype"]),
                shape=tuple(int(v) for v in raw["shape"]), stride=tuple(int(v) for v in raw["stride"]),
                offset_bytes=int(raw["offset_bytes"]),
            )
            if values["offset"] + values["nbytes"] > handle.storage_nbytes:
                raise TransportError(
                    f"slice [{values['offset']}, {values['offset'] + values['nbytes']}) exceeds its pool of "
                    f"{handle.storage_nbytes} bytes"
                )
        host_name = data.get("host_name")
        if values["kind"] == "host" and not isinstance(host_name, str):
            raise TransportError("host message lacks its host_name")
        return cls(**values, pool_handle=handle, host_name=host_name)


def _encode_field(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode()}
    if isinstance(value, (int, str, bool)):
        return value
    raise TransportError(f"IPC handle field {value!r} is not plain data")


def _decode_field(value: Any) -> Any:
    if isinstance(value, dict):
        return base64.b64decode(value["b64"], validate=True)
    if isinstance(value, (int, str, bool)):
        return value
    raise TransportError(f"IPC handle field {value!r} is not plain data")


# -- shared memory: plain mmap'd files (no resource tracker to unlink a producer's block) ------

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class _SharedFile:
    """A named block of shared memory: a file in /dev/shm, mapped. Plain-data name."""

    def __init__(self, name: str | None = None, size: int = 0) -> None:
        if name is None:
            name = f"torchhal-{os.getpid()}-{uuid.uuid4().hex[:16]}"
            fd = os.open(os.path.join(_SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, max(size, 1))
        else:
            if not name.startswith("torchhal-") or "/" in name or ".." in name:
                raise TransportError(f"shared-memory name {name!r} is not a torchhal block name")
            try:
                fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
            except FileNotFoundError:
                raise TransportError(f"shared memory {name!r} is gone (recycled, or its producer exited)") from None
        try:
            self.size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.name = name

    def close(self) -> None:
        self.map.close()

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(_SHM_DIR, self.name))
        except FileNotFoundError:
            pass


# -- the control block: liveness, slice generations, per-consumer acknowledgements ------------

class _Control:
    """int64 cells in shared memory: [alive, pid, slots, consumers, gen[slots], ack[slots x consumers]].

    Each consumer writes only its own ack cells, so no cross-process atomics are needed.
    """

    HEADER = 4

    def __init__(self, name: str | None, slots: int = 0, consumers: int = 0) -> None:
        if name is None:
            self.shm = _SharedFile(None, 8 * (self.HEADER + slots + slots * consumers))
            self._raw = memoryview(self.shm.map)
            self.cells = self._raw.cast("q")
            self.cells[0], self.cells[1], self.cells[2], self.cells[3] = 1, os.getpid(), slots, consumers
            for i in range(self.HEADER, len(self.cells)):
                self.cells[i] = -1
            for slot in range(slots):
                self.cells[self.HEADER + slot] = 0
        else:
            self.shm = _SharedFile(name)
            if self.shm.size < 8 * self.HEADER:
                raise TransportError(f"control block {name!r} is too small to be one")
            self._raw = memoryview(self.shm.map)
            self.cells = self._raw.cast("q")
        self.slots, self.consumers = self.cells[2], self.cells[3]

    @property
    def name(self) -> str:
        return self.shm.name

    def generation(self, slot: int) -> int:
        return self.cells[self.HEADER + slot]

    def bump(self, slot: int) -> int:
        self.cells[self.HEADER + slot] += 1
        return self.cells[self.HEADER + slot]

    def ack(self, slot: int, consumer: int, generation: int) -> None:
        self.cells[self.HEADER + self.slots + slot * self.consumers + consumer] = generation

    def all_acked(self, slot: int) -> bool:
        gen = self.generation(slot)
        base = self.HEADER + self.slots + slot * self.consumers
        return all(self.cells[base + c] == gen for c in range(self.consumers))

    @property
    def alive(self) -> bool:
        return self.cells[0] == 1

    def close(self, unlink: bool) -> None:
        if unlink:
            self.cells[0] = 0
        self.cells.release()
        self._raw.release()
        self.shm.close()
        if unlink:
            self.shm.unlink()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- producer -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class TransportConfig:
    budget_bytes: int = 1 << 30  # total for all producer workers
    workers: int = 1
    consumers: int = 1  # acknowledgements needed before a slice is reused
    max_slices: int = 1024
    pool_floor_bytes: int = POOL_FLOOR_BYTES
    alignment: int = 512


class Producer:
    def __init__(self, config: TransportConfig = TransportConfig(), platform: Platform | None = None,
                 device_index: int | None = None) -> None:
        self.config = config
        self.platform = platform or current_platform()
        self.device_index = self.platform.current_device() if device_index is None else device_index
        self.pool_bytes = pool_size(config.budget_bytes, config.workers, config.pool_floor_bytes)
        self.pool_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.control = _Control(None, config.max_slices, config.consumers)
        ipc = self.platform.ipc_support
        self.pool: torch.Tensor | None = None
        self.pool_handle: IpcHandle | None = None
        if ipc is not None:
            self.pool = torch.empty(self.pool_bytes, dtype=torch.uint8, device=self.platform.device(self.device_index))
            self.pool_handle = ipc.share(self.pool)  # taken once for the pool's lifetime
        self._free: list[tuple[int, int]] = [(0, self.pool_bytes)]  # (offset, size), sorted by offset
        self._used: dict[int, tuple[int, int, str | None]] = {}  # slot -> (offset, size, host block name)
        self._host_blocks: dict[int, _SharedFile] = {}
        self._free_slots = list(range(config.max_slices - 1, -1, -1))
        self._warned_full = False
        self._lock = threading.Lock()

    # slices -------------------------------------------------------------------------------
    def _allocate(self, nbytes: int) -> int | None:
        size = -(-max(nbytes, 1) // self.config.alignment) * self.config.alignment
        best = None
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
        size = -(-max(size, 1) // self.config.alignment) * self.config.alignment
        self._free.append((offset, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for off, sz in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + sz)
            else:
                merged.append((off, sz))
        self._free = merged

    def reclaim(self) -> int:
        """Free every slice all consumers acknowledged; returns how many."""
        freed = 0
        with self._lock:
            for slot, (start, size, host) in list(self._used.items()):
                if not self.control.all_acked(slot):
                    continue
                del self._used[slot]
                self._free_slots.append(slot)
                if host is None:
                    self._release_range(start, size)
                else:
                    block = self._host_blocks.pop(slot)
                    block.close()
                    block.unlink()
                freed += 1
        return freed

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    # sending -------------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor) -> dict[str, Any]:
        """Copy `tensor` into the pool (or host memory) and return the plain-data message."""
        self.reclaim()
        source = tensor.detach().contiguous()
        nbytes = source.numel() * source.element_size()
        with self._lock:
            if not self._free_slots:
                raise RuntimeError(
                    f"all {self.config.max_slices} slices are awaiting acknowledgement; consumers must ack, "
                    "or raise TransportConfig.max_slices"
                )
            slot = self._free_slots.pop()
            offset = self._allocate(nbytes) if self.pool is not None else None
            generation = self.control.bump(slot)
            if offset is not None and self.pool is not None:
                self.pool[offset : offset + nbytes].view(source.dtype).view(source.shape).copy_(source)
                self.platform.synchronize(self.device_index)  # consumers read after the message arrives
                self._used[slot] = (offset, nbytes, None)
                kind, host_name = "pool", None
            else:
                host_name = self._to_host(slot, source, nbytes)
                self._used[slot] = (0, nbytes, host_name)
                offset, kind = 0, "host"
        message = TensorMessage(
            kind=kind, pool_id=self.pool_id, slot=slot, generation=generation, offset=offset, nbytes=nbytes,
            dtype=dtype_name(source.dtype), shape=tuple(source.shape), stride=tuple(source.stride()),
            control=self.control.name, producer_pid=os.getpid(),
            pool_handle=self.pool_handle if kind == "pool" else None, host_name=host_name,
        )
        return message.to_dict()

    def _to_host(self, slot: int, source: torch.Tensor, nbytes: int) -> str:
        if self.pool is not None and not self._warned_full:
            self._warned_full = True
            warnings.warn(
                f"IPC pool full: a tensor of {nbytes / MiB:.1f} MiB does not fit the {self.pool_bytes / MiB:.0f} MiB "
                f"pool ({self.free_bytes / MiB:.1f} MiB free); sending through host shared memory. Raise "
                f"{BUDGET_SETTING} (now {self.config.budget_bytes / MiB:.0f} MiB for {self.config.workers} worker(s))",
                stacklevel=3,
            )
        block = _SharedFile(None, nbytes)
        if nbytes:
            window = torch.frombuffer(block.map, dtype=torch.uint8, count=nbytes)
            window.copy_(source.reshape(-1).view(torch.uint8).cpu())
            del window  # the map cannot close while a tensor still exports it
        self._host_blocks[slot] = block
        return block.name

    def close(self) -> None:
        for block in self._host_blocks.values():
            block.close()
            block.unlink()
        self._host_blocks.clear()
        self.control.close(unlink=True)
        self.pool = None


# -- consumer -----------------------------------------------------------------------------------

class Consumer:
    def __init__(self, rank: int = 0, platform: Platform | None = None, device_index: int | None = None) -> None:
        self.rank = rank
        self.platform = platform or current_platform()
        self.device_index = self.platform.current_device() if device_index is None else device_index
        self._pools: dict[tuple[str, int], torch.Tensor] = {}
        self._controls: dict[str, _Control] = {}
        self._lock = threading.Lock()

    def receive(self, message: Any, copy: bool = True) -> torch.Tensor:
        """Rebuild the tensor on this consumer's device and acknowledge it.

        copy=True (default) returns a fresh tensor; copy=False a zero-copy view of the
        producer's slice, valid until it is recycled (acknowledged here already).
        """
        msg = TensorMessage.from_dict(message)
        control = self._control(msg)
        if control.generation(msg.slot) != msg.generation:
            raise TransportError(
                f"stale message: slice {msg.slot} was recycled (generation {control.generation(msg.slot)}, "
                f"message has {msg.generation})"
            )
        dtype = DTYPES[msg.dtype]
        if msg.kind == "host":
            tensor = self._from_host(msg, dtype)
        else:
            pool = self._pool(msg)
            if msg.offset + msg.nbytes > pool.numel():
                raise TransportError(f"slice exceeds the opened pool of {pool.numel()} bytes")
            flat = pool[msg.offset : msg.offset + msg.nbytes]
            count = msg.nbytes // torch.empty((), dtype=dtype).element_size()
            tensor = flat.view(dtype)[:count].as_strided(msg.shape, msg.stride)
            if copy:
                tensor = tensor.clone()
        control.ack(msg.slot, self.rank, msg.generation)
        return tensor

    def _control(self, msg: TensorMessage) -> _Control:
        if not _pid_alive(msg.producer_pid):
            raise TransportError(f"producer pid {msg.producer_pid} has exited; its pool {msg.pool_id} is gone")
        with self._lock:
            control = self._controls.get(msg.control)
            if control is None:
                control = _Control(msg.control)
                self._controls[msg.control] = control
        if not control.alive:
            raise TransportError(f"producer pool {msg.pool_id} was closed")
        if not 0 <= msg.slot < control.slots or not 0 <= self.rank < control.consumers:
            raise TransportError(
                f"slot {msg.slot} or consumer rank {self.rank} is outside the producer's "
                f"{control.slots} slots x {control.consumers} consumers"
            )
        return control

    def _pool(self, msg: TensorMessage) -> torch.Tensor:
        key = (msg.pool_id, self.device_index)
        with self._lock:  # open each pool once per consumer device
            pool = self._pools.get(key)
            if pool is None:
                ipc = self.platform.ipc_support
                if ipc is None or msg.pool_handle is None:
                    raise TransportError(f"platform {self.platform.name!r} cannot open device pools")
                pool = ipc.open(msg.pool_handle, self.device_index).view(-1)
                self._pools[key] = pool
        return pool

    def _from_host(self, msg: TensorMessage, dtype: torch.dtype) -> torch.Tensor:
        assert msg.host_name is not None
        block = _SharedFile(msg.host_name)
        try:
            if block.size < msg.nbytes:
                raise TransportError(f"host block holds {block.size} bytes, message claims {msg.nbytes}")
            raw = torch.empty(msg.nbytes, dtype=torch.uint8)
            if msg.nbytes:
                raw.copy_(torch.frombuffer(bytearray(block.map[: msg.nbytes]), dtype=torch.uint8))
        finally:
            block.close()
        count = msg.nbytes // torch.empty((), dtype=dtype).element_size()
        host = raw.view(dtype)[:count].as_strided(msg.shape, msg.stride)
        return host.to(self.platform.device(self.device_index)).contiguous()

    def close(self) -> None:
        with self._lock:
            self._pools.clear()
            for control in self._controls.values():
                control.close(unlink=False)
            self._controls.clear()
