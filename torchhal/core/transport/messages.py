"""Transport messages: a flat record of plain data (JSON-safe, never pickle), decoded as untrusted input.

The wire form is a 10-field tuple (a list after a JSON round trip is accepted too):

    (kind, pool_id, slot, generation, offset, nbytes, dtype, shape, stride, event)

Everything constant per producer (the pool's IPC handle, its fingerprint, the slots' event
handles) is in the producer's control block, read once per consumer; `pool_id` names the
producer, and its control block and host blocks are derived from it, never sent.
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import lru_cache
from typing import Any, NamedTuple

from torchhal.platforms import IpcHandle, IpcHandleError
from torchhal.platforms.ipc import DTYPES, MAX_BYTES, MAX_DIMS, check_view, handle_to_data, itemsize


class TransportError(ValueError):
    """A message that cannot be honoured: malformed, out of bounds, stale, or from a gone producer."""


#: the wire record's fields, in order.
WIRE_FIELDS = ("kind", "pool_id", "slot", "generation", "offset", "nbytes", "dtype", "shape", "stride", "event")
_COUNTS = ("slot", "generation", "offset", "nbytes")
#: pool ids are `<producer pid>-<12 hex digits>`; the names of the producer's files embed them.
POOL_ID = re.compile(r"(\d{1,10})-([0-9a-f]{12})")
EVENT_HANDLE_MAX = 256  # bytes; driver event handles are tens of bytes


def control_name(pool_id: str) -> str:
    return f"torchhal-{pool_id}-ctl"


def host_name(pool_id: str, slot: int, generation: int) -> str:
    return f"torchhal-{pool_id}-h{slot}-g{generation}"


def handle_record(handle: IpcHandle) -> bytes:
    """The pool handle's canonical plain data as bytes (what the control block stores)."""
    return json.dumps(handle_to_data(handle), sort_keys=True, separators=(",", ":")).encode()


def handle_fingerprint(record: bytes) -> bytes:
    """sha256 of a handle record (recorded in the producer's control block beside it)."""
    return hashlib.sha256(record).digest()


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


#: `contiguous_stride` for shapes already checked to be ints (per message on both sides, for
#: the few shapes an engine sends). Never for unchecked shapes: (2.0, 3.0) == (2, 3) as a key.
checked_contiguous_stride = lru_cache(maxsize=1024)(contiguous_stride)


class TensorMessage(NamedTuple):
    """A decoded message (a named tuple: built per message on the receive path, ~0.4 us
    against ~2 us for a frozen dataclass)."""

    kind: str  # "pool" (device pool slice) or "host" (shared-memory fallback)
    pool_id: str  # the producer: `<pid>-<12 hex>`
    slot: int
    generation: int
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    #: pool messages of a producer with interprocess events: the consumer's stream waits on
    #: the slot's event (its handle is in the producer's control block) before reading.
    event: bool = False

    @property
    def producer_pid(self) -> int:
        return int(self.pool_id.split("-", 1)[0])

    @property
    def control(self) -> str:
        """Name of the producer's control block."""
        return control_name(self.pool_id)

    @property
    def host_name(self) -> str:
        """Name of the host block of a host message."""
        return host_name(self.pool_id, self.slot, self.generation)

    def to_wire(self) -> tuple[Any, ...]:
        """The flat record sent between processes; `stride` is None where it is contiguous."""
        stride = None if self.stride == contiguous_stride(self.shape) else self.stride
        return (self.kind, self.pool_id, self.slot, self.generation, self.offset, self.nbytes, self.dtype,
                self.shape, stride, self.event)

    @classmethod
    def from_wire(cls, data: Any) -> TensorMessage:
        """Decode and validate. Anything wrong raises TransportError, never anything else."""
        try:
            return cls._decode(data)
        except TransportError:
            raise
        except Exception as exc:  # a malformed message must never escape as another error type
            raise TransportError(f"malformed message: {type(exc).__name__}: {exc}") from exc

    @classmethod
    def _decode(cls, data: Any) -> TensorMessage:
        if type(data) is not tuple and type(data) is not list:
            raise TransportError(
                f"message must be the tuple ({', '.join(WIRE_FIELDS)}), got {type(data).__name__}"
            )
        if len(data) != len(WIRE_FIELDS):
            raise TransportError(
                f"message has {len(data)} fields, not the {len(WIRE_FIELDS)} of ({', '.join(WIRE_FIELDS)})"
            )
        kind, pool_id, slot, generation, offset, nbytes, dtype, shape, stride, event = data
        if kind != "pool" and kind != "host":
            raise TransportError(f"message kind {kind!r:.80} is neither 'pool' nor 'host'")
        if type(pool_id) is not str or POOL_ID.fullmatch(pool_id) is None:
            raise TransportError(f"message pool_id {pool_id!r:.80} is not a producer id '<pid>-<12 hex digits>'")
        for key, value in zip(_COUNTS, (slot, generation, offset, nbytes), strict=True):
            if type(value) is not int:  # exactly int: bool is no int
                raise TransportError(f"message field {key!r} = {value!r:.80} is not an int")
            if not 0 <= value < MAX_BYTES:
                raise TransportError(f"message field {key!r} = {value} is out of range")
        if type(dtype) is not str or dtype not in DTYPES:
            raise TransportError(
                f"message view is invalid: unknown dtype {dtype!r:.80}; supported: {', '.join(DTYPES)}"
            )
        if type(event) is not bool:
            raise TransportError(f"message field 'event' = {event!r:.80} is not a bool")
        if event and kind != "pool":
            raise TransportError("only pool messages carry an event")
        if kind == "host" and offset:  # a host block holds one tensor, from its first byte
            raise TransportError(f"message field 'offset' = {offset} must be 0 in a host message")
        if type(shape) is not tuple:
            if type(shape) is not list:
                raise TransportError(f"message field 'shape' = {shape!r:.80} is not a sequence of ints")
            shape = tuple(shape)
        if stride is None:
            # Contiguous (what producers send): its extent is numel x itemsize, so the checks
            # of `check_view` reduce to these and the size check below.
            if len(shape) > MAX_DIMS:
                raise TransportError(f"message view is invalid: shape has more than {MAX_DIMS} dimensions")
            numel = 1
            for i, n in enumerate(shape):
                if type(n) is not int or not 0 <= n < MAX_BYTES:
                    raise TransportError(f"message view is invalid: shape[{i}] = {n!r:.80} is not a size")
                numel *= n
            size = DTYPES[dtype].itemsize
            stride = checked_contiguous_stride(shape)
        else:
            if type(stride) is not tuple:
                if type(stride) is not list:
                    raise TransportError(f"message field 'stride' = {stride!r:.80} is neither None nor ints")
                stride = tuple(stride)
            try:
                # The slice [offset, offset + nbytes) is the storage the view must fit: the
                # same validator every platform's IPC open applies to its handles.
                size = itemsize(check_view(dtype, shape, stride, 0, nbytes))
            except IpcHandleError as exc:
                raise TransportError(f"message view is invalid: {exc}") from exc
            numel = 1
            for n in shape:
                numel *= n
        if numel * size > nbytes:  # e.g. stride 0: a copy would allocate more than was sent
            raise TransportError(
                f"view of {numel} x {size} bytes (shape {list(shape)}, stride {list(stride)}) is larger "
                f"than the {nbytes} bytes the message names"
            )
        if offset % size or nbytes % size:
            raise TransportError(
                f"offset {offset} and nbytes {nbytes} must be multiples of the {dtype} size {size}"
            )
        return cls(kind, pool_id, slot, generation, offset, nbytes, dtype, shape, stride, event)
