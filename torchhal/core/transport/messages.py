"""Transport messages: plain-data dicts (JSON-safe, never pickle), decoded as untrusted input."""

from __future__ import annotations

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

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in _FIELDS}
        out["shape"], out["stride"] = list(self.shape), list(self.stride)
        if self.pool_handle is not None:
            out["pool_handle"] = handle_to_data(self.pool_handle)
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
            raise TransportError(f"malformed message: {type(exc).__name__}: {exc}") from exc

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
            try:
                handle = handle_from_data(data.get("pool_handle"))
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
        return cls(**values, pool_handle=handle, host_name=host_name if values["kind"] == "host" else None)
