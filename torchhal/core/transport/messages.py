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
import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from torchhal.platforms import IpcHandle, IpcHandleError
from torchhal.platforms.ipc import MAX_BYTES, check_view, contiguous_stride, handle_to_data
from torchhal.values import as_index, short_repr


class TransportError(ValueError):
    """A message that cannot be honoured: malformed, out of bounds, stale, or from a gone producer."""


#: the wire record's fields, in order.
WIRE_FIELDS = ("kind", "pool_id", "slot", "generation", "offset", "nbytes", "dtype", "shape", "stride", "event")
#: pool ids are `<producer pid>-<12 hex digits>`; the names of the producer's files embed them.
POOL_ID = re.compile(r"(\d{1,10})-([0-9a-f]{12})")
EVENT_HANDLE_MAX = 256  # bytes; driver event handles are tens of bytes


def check_count(label: str, value: object, minimum: int) -> int:
    """A count given to the transport's public calls: an int (not a bool) of at least `minimum`."""
    number = as_index(value)
    if number is None or number < minimum:
        raise ValueError(f"{label} = {short_repr(value)} must be an int >= {minimum}")
    return number


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


def _count(value: object) -> str | None:
    if type(value) is not int:  # exactly int: a bool is no count
        return "is not an int"
    return None if 0 <= value < MAX_BYTES else "is out of range"


#: What each wire field must be, in wire order: a rule gives the problem with a value, or
#: None. The view (dtype, shape, stride) is then checked as a whole by `check_view`.
_FIELD_RULES: tuple[Callable[[Any], str | None], ...] = (
    lambda v: None if v in ("pool", "host") else "is neither 'pool' nor 'host'",
    lambda v: None if type(v) is str and POOL_ID.fullmatch(v) else "is not a producer id '<pid>-<12 hex digits>'",
    _count, _count, _count, _count,
    lambda v: None,  # dtype
    lambda v: None if type(v) in (tuple, list) else "is not a sequence of ints",
    lambda v: None if v is None or type(v) in (tuple, list) else "is neither None nor ints",
    lambda v: None if type(v) is bool else "is not a bool",
)


class TensorMessage(NamedTuple):
    """A decoded message (a named tuple: one is built per message received)."""

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
        """Decode and validate a record another process sent: anything wrong is a TransportError."""
        if type(data) is not tuple and type(data) is not list:
            raise TransportError(f"message must be the tuple ({', '.join(WIRE_FIELDS)}), got {type(data).__name__}")
        if len(data) != len(WIRE_FIELDS):
            raise TransportError(f"message has {len(data)} fields, not the {len(WIRE_FIELDS)} of "
                                 f"({', '.join(WIRE_FIELDS)})")
        for name, rule, value in zip(WIRE_FIELDS, _FIELD_RULES, data, strict=True):
            problem = rule(value)
            if problem is not None:
                raise TransportError(f"message field {name!r} = {short_repr(value)} {problem}")
        kind, pool_id, slot, generation, offset, nbytes, dtype, shape, stride, event = data
        if event and kind != "pool":
            raise TransportError("only pool messages carry an event")
        if kind == "host" and offset:  # a host block holds one tensor, from its first byte
            raise TransportError(f"message field 'offset' = {offset} must be 0 in a host message")
        try:
            # The slice [offset, offset + nbytes) is the storage an explicit stride's view must
            # fit (a contiguous view's extent is its size, checked below).
            view = check_view(dtype, shape, stride, 0, nbytes if stride is not None else MAX_BYTES - 1)
        except IpcHandleError as exc:
            raise TransportError(f"message view is invalid: {exc}") from exc
        numel, size = math.prod(view.shape), view.dtype.itemsize
        if numel * size > nbytes:  # e.g. stride 0: a copy would allocate more than was sent
            raise TransportError(f"view of {numel} x {size} bytes (shape {list(view.shape)}, stride "
                                 f"{list(view.stride)}) is larger than the {nbytes} bytes the message names")
        if offset % size or nbytes % size:
            raise TransportError(f"offset {offset} and nbytes {nbytes} must be multiples of the {dtype} size {size}")
        return cls(kind, pool_id, slot, generation, offset, nbytes, dtype, view.shape, view.stride, event)
