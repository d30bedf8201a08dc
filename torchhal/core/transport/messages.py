"""Transport messages: plain-data dicts (JSON-safe, never pickle), decoded as untrusted input."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from torchhal.platforms import IpcHandle, IpcHandleError
from torchhal.platforms.ipc import MAX_BYTES, check_view, handle_from_data, handle_to_data, itemsize


class TransportError(ValueError):
    """A message that cannot be honoured: malformed, out of bounds, stale, or from a gone producer."""


_FIELDS = {
    "kind": str, "pool_id": str, "slot": int, "generation": int, "offset": int, "nbytes": int,
    "dtype": str, "shape": list, "stride": list, "control": str, "producer_pid": int,
}
_MAX_NAME = 128  # every name the transport makes is far shorter
EVENT_HANDLE_MAX = 256  # bytes; driver event handles are tens of bytes
_EVENT_TEXT_MAX = 4 * -(-EVENT_HANDLE_MAX // 3)  # its base64 text


def handle_fingerprint(handle: IpcHandle) -> bytes:
    """sha256 of the handle's canonical plain data (recorded in the producer's control block)."""
    return hashlib.sha256(json.dumps(handle_to_data(handle), sort_keys=True).encode()).digest()


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
    #: pool messages of a producer with interprocess events: the handle of the event its
    #: slot's copy was recorded on (the consumer's stream waits on it before reading).
    event: bytes | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in _FIELDS}
        out["shape"], out["stride"] = list(self.shape), list(self.stride)
        if self.pool_handle is not None:
            out["pool_handle"] = handle_to_data(self.pool_handle)
        if self.host_name is not None:
            out["host_name"] = self.host_name
        if self.event is not None:
            out["event"] = encode_event(self.event)
        return out

    @classmethod
    def from_dict(cls, data: Any, known_pool: tuple[object, IpcHandle] | None = None) -> TensorMessage:
        """Decode and validate. Anything wrong raises TransportError, never anything else.

        `known_pool` is (plain data, handle) of a pool handle already decoded and checked
        (the consumer's open pool): a message whose `pool_handle` equals that data gets
        that handle without decoding it again; its slice is still checked against it.
        """
        try:
            return cls._decode(data, known_pool)
        except TransportError:
            raise
        except Exception as exc:  # a malformed message must never escape as another error type
            raise TransportError(f"malformed message: {type(exc).__name__}: {exc}") from exc

    @classmethod
    def _decode(cls, data: Any, known_pool: tuple[object, IpcHandle] | None = None) -> TensorMessage:
        if not isinstance(data, dict):
            raise TransportError(f"message must be a dict, got {type(data).__name__}")
        values: dict[str, Any] = {}
        for key, kind in _FIELDS.items():
            value = data.get(key, _MISSING)
            if type(value) is not kind:  # the common case: exactly the type (bool is no int)
                if value is _MISSING:
                    raise TransportError(f"message lacks {key!r}")
                if not isinstance(value, kind) or isinstance(value, bool):
                    raise TransportError(f"message field {key!r} = {value!r} is not a {kind.__name__}")
            values[key] = value
        if values["kind"] not in ("pool", "host"):
            raise TransportError(f"message kind {values['kind']!r} is neither 'pool' nor 'host'")
        for key in ("slot", "generation", "offset", "nbytes", "producer_pid"):
            if not 0 <= values[key] < MAX_BYTES:
                raise TransportError(f"message field {key!r} = {values[key]} is out of range")
        for key in ("pool_id", "control"):
            if len(values[key]) > _MAX_NAME:
                raise TransportError(f"message field {key!r} of {len(values[key])} characters is too long")
        try:
            # The slice [offset, offset + nbytes) is the storage the view must fit: the
            # same validator every platform's IPC open applies to its handles.
            size = itemsize(check_view(values["dtype"], values["shape"], values["stride"], 0, values["nbytes"]))
        except IpcHandleError as exc:
            raise TransportError(f"message view is invalid: {exc}") from exc
        numel = 1
        for n in values["shape"]:
            numel *= n
        if numel * size > values["nbytes"]:  # e.g. stride 0: a copy would allocate more than was sent
            raise TransportError(
                f"view of {numel} x {size} bytes (shape {values['shape']}, stride {values['stride']}) is larger "
                f"than the {values['nbytes']} bytes the message names"
            )
        if values["offset"] % size or values["nbytes"] % size:
            raise TransportError(
                f"offset {values['offset']} and nbytes {values['nbytes']} must be multiples of the "
                f"{values['dtype']} size {size}"
            )
        values["shape"], values["stride"] = tuple(values["shape"]), tuple(values["stride"])
        handle = None
        if values["kind"] == "pool":
            raw = data.get("pool_handle")
            if known_pool is not None and raw == known_pool[0]:
                handle = known_pool[1]  # equal plain data: the handle decoded and checked before
            else:
                try:
                    handle = handle_from_data(raw)
                except IpcHandleError as exc:
                    raise TransportError(f"pool message has an invalid pool_handle: {exc}") from exc
            # A pool is one flat byte buffer; anything else would index the slice in elements.
            flat = handle.dtype == "uint8" and handle.offset_bytes == 0 and handle.stride == (1,)
            if not flat or len(handle.shape) != 1 or handle.shape[0] > handle.storage_nbytes:
                raise TransportError(
                    f"pool_handle must describe a flat uint8 buffer, got {handle.dtype} {handle.shape} "
                    f"stride {handle.stride} at byte {handle.offset_bytes} of {handle.storage_nbytes}"
                )
            if values["offset"] + values["nbytes"] > handle.shape[0]:
                raise TransportError(
                    f"slice [{values['offset']}, {values['offset'] + values['nbytes']}) exceeds its pool of "
                    f"{handle.shape[0]} bytes"
                )
        host_name = data.get("host_name")
        if values["kind"] == "host" and (not isinstance(host_name, str) or len(host_name) > _MAX_NAME):
            raise TransportError("host message lacks its host_name")
        event = data.get("event")
        if event is not None:
            if values["kind"] != "pool":
                raise TransportError("only pool messages carry an event handle")
            event = decode_event(event)
        return cls(**values, pool_handle=handle, host_name=host_name if values["kind"] == "host" else None,
                   event=event)


_MISSING = object()


def encode_event(handle: bytes) -> str:
    """An event handle as message text (base64: messages stay JSON-safe)."""
    return base64.b64encode(handle).decode("ascii")


def decode_event(text: object) -> bytes:
    """The event handle a message carries: base64 text of 1..EVENT_HANDLE_MAX bytes, else TransportError.
    Its exact length is the platform's to check (`IpcEvents.handle_nbytes`)."""
    if not isinstance(text, str) or not 0 < len(text) <= _EVENT_TEXT_MAX:
        raise TransportError(
            f"message field 'event' = {text!r:.80} must be the base64 text of an event handle "
            f"(1..{EVENT_HANDLE_MAX} bytes)"
        )
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError) as exc:
        raise TransportError(f"message field 'event' = {text!r:.80} is not base64") from exc
