"""Plain-data IPC handles: dtype names and bounds checks shared by every plugin.

A handle is checked against the storage it names before a byte is read: a
view that reaches past the storage, an unknown dtype or a negative or
absurd shape is an `IpcHandleError`, never an out-of-bounds read.
"""

from __future__ import annotations

import base64

import torch

from torchhal.platforms.errors import IpcHandleError
from torchhal.platforms.records import IpcHandle

#: dtypes that may cross a process boundary, by their stable names.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16",
        "int8", "uint8", "bool", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2",
    )
    if hasattr(torch, name)
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_BYTES = 1 << 48  # 256 TiB: larger claims are corrupt, not real
MAX_DIMS = 32


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise IpcHandleError(f"dtype {dtype} cannot be shared; supported: {', '.join(DTYPES)}") from None


def dtype_from_name(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise IpcHandleError(f"unknown dtype {name!r} in IPC handle; supported: {', '.join(DTYPES)}")
    return DTYPES[name]


def _check_int(label: str, value: object, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value < MAX_BYTES:
        raise IpcHandleError(f"IPC handle field {label} = {value!r} must be an int in [{minimum}, 2**48)")
    return value


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def view_extent_bytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Bytes from the view's first element to one past its last (0 for empty views)."""
    if any(size == 0 for size in shape):
        return 0
    return (sum((size - 1) * step for size, step in zip(shape, stride, strict=True)) + 1) * itemsize


def check_view(
    dtype: object, shape: object, stride: object, offset_bytes: object, storage_nbytes: int
) -> torch.dtype:
    """The one validator of a shared tensor view: (dtype, shape, stride, byte offset) inside
    `storage_nbytes` bytes. Returns the dtype; anything else is an `IpcHandleError`.

    Used by every plugin's IPC open (through `validate_handle`) and by the transport's
    message decoder, so a view is judged the same way wherever it arrives.
    """
    resolved = dtype_from_name(dtype)
    if not isinstance(shape, (tuple, list)) or not isinstance(stride, (tuple, list)):
        raise IpcHandleError(f"shape {shape!r} and stride {stride!r} must be sequences of ints")
    if len(shape) != len(stride):
        raise IpcHandleError(f"shape {tuple(shape)} and stride {tuple(stride)} differ in length")
    if len(shape) > MAX_DIMS:
        raise IpcHandleError(f"shape {tuple(shape)} has more than {MAX_DIMS} dimensions")
    for i, size in enumerate(shape):
        _check_int(f"shape[{i}]", size)
    for i, step in enumerate(stride):
        _check_int(f"stride[{i}]", step)
    offset = _check_int("offset_bytes", offset_bytes)
    limit = _check_int("storage_nbytes", storage_nbytes)
    size = itemsize(resolved)
    if offset % size:
        raise IpcHandleError(f"offset_bytes {offset} is not a multiple of the {dtype} size {size}")
    extent = view_extent_bytes(tuple(shape), tuple(stride), size)
    if extent >= MAX_BYTES or offset + extent > limit:
        raise IpcHandleError(
            f"IPC view reaches byte {offset + extent} but its storage holds {limit} bytes "
            f"(offset {offset}, shape {tuple(shape)}, stride {tuple(stride)}, {dtype})"
        )
    return resolved


def validate_handle(handle: IpcHandle, storage_nbytes: int | None = None) -> torch.dtype:
    """Check a handle's view against its storage; return its dtype.

    `storage_nbytes` is the size actually mapped, where the plugin can learn it
    independently of the handle: a handle claiming more than that is refused (mapping
    the claim would read past, or grow, the real object).
    """
    if not isinstance(handle, IpcHandle):
        raise IpcHandleError(f"expected an IpcHandle, got {type(handle).__name__}")
    if not isinstance(handle.shape, tuple) or not isinstance(handle.stride, tuple):
        raise IpcHandleError(f"shape {handle.shape!r} and stride {handle.stride!r} must be tuples")
    claimed = _check_int("storage_nbytes", handle.storage_nbytes)
    if storage_nbytes is not None and claimed > storage_nbytes:
        raise IpcHandleError(
            f"IPC handle claims a storage of {claimed} bytes but the shared object holds {storage_nbytes}"
        )
    return check_view(handle.dtype, handle.shape, handle.stride, handle.offset_bytes, claimed)


# -- plain-data encoding (JSON-safe) -------------------------------------------------------

_STORAGE_FIELD_LIMIT = 16  # storage tuples are a handful of fields; more is not a handle
_BYTES_FIELD_LIMIT = 4096  # one opaque field; native handles are tens of bytes


def _encode_field(value: object) -> object:
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, (int, str, bool)):
        return value
    raise IpcHandleError(f"IPC handle field {value!r} is not plain data (int, bytes, str, bool)")


def _decode_field(value: object) -> int | bytes | str | bool:
    if isinstance(value, dict) and set(value) == {"b64"} and isinstance(value["b64"], str):
        if len(value["b64"]) > _BYTES_FIELD_LIMIT * 2:
            raise IpcHandleError(f"IPC handle bytes field of {len(value['b64'])} characters is too long")
        try:
            return base64.b64decode(value["b64"].encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError) as exc:
            raise IpcHandleError(f"IPC handle bytes field {value['b64']!r} is not base64") from exc
    if isinstance(value, str) and len(value) > _BYTES_FIELD_LIMIT:
        raise IpcHandleError(f"IPC handle str field of {len(value)} characters is too long")
    if isinstance(value, (int, str, bool)):
        return value
    raise IpcHandleError(f"IPC handle field {value!r} is not plain data")


def handle_to_data(handle: IpcHandle) -> dict[str, object]:
    """The handle as JSON-safe plain data (bytes fields base64)."""
    return {
        "platform": handle.platform, "device": handle.device, "storage_nbytes": handle.storage_nbytes,
        "dtype": handle.dtype, "shape": list(handle.shape), "stride": list(handle.stride),
        "offset_bytes": handle.offset_bytes, "storage": [_encode_field(v) for v in handle.storage],
    }


def handle_from_data(data: object) -> IpcHandle:
    """Decode `handle_to_data`'s output, checking every field's type; the view is not yet
    checked against a storage (`validate_handle` does that where the storage is known)."""
    if not isinstance(data, dict):
        raise IpcHandleError(f"IPC handle must be a dict, got {type(data).__name__}")
    expected = {"platform": str, "device": int, "storage_nbytes": int, "dtype": str, "shape": list,
                "stride": list, "offset_bytes": int, "storage": list}
    for key, kind in expected.items():
        value = data.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise IpcHandleError(f"IPC handle field {key!r} = {value!r} is not a {kind.__name__}")
    if len(data["platform"]) > 64:
        raise IpcHandleError(f"IPC handle platform name {data['platform'][:64]!r}... is too long")
    if len(data["storage"]) > _STORAGE_FIELD_LIMIT or len(data["shape"]) > MAX_DIMS:
        raise IpcHandleError("IPC handle has too many storage fields or dimensions")
    for key in ("shape", "stride"):
        for i, v in enumerate(data[key]):
            _check_int(f"{key}[{i}]", v)
    return IpcHandle(
        platform=data["platform"], device=_check_int("device", data["device"]),
        storage=tuple(_decode_field(v) for v in data["storage"]),
        storage_nbytes=_check_int("storage_nbytes", data["storage_nbytes"]), dtype=data["dtype"],
        shape=tuple(data["shape"]), stride=tuple(data["stride"]),
        offset_bytes=_check_int("offset_bytes", data["offset_bytes"]),
    )


def tensor_from_storage(storage: torch.UntypedStorage, handle: IpcHandle, dtype: torch.dtype) -> torch.Tensor:
    """Build the (already validated) view on an opened storage."""
    out = torch.empty((0,), dtype=dtype, device=storage.device)
    out.set_(storage, handle.offset_bytes // itemsize(dtype), handle.shape, handle.stride)
    return out


def describe(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], tuple[int, ...], int]:
    """(dtype name, shape, stride, byte offset in its storage) of a tensor to share."""
    return (
        dtype_name(tensor.dtype),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        int(tensor.storage_offset()) * tensor.element_size(),
    )
