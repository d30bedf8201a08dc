"""Plain-data IPC handles: dtype names and bounds checks shared by every plugin.

A handle is checked against the storage it names before a byte is read: a
view that reaches past the storage, an unknown dtype or a negative or
absurd shape is an `IpcHandleError`, never an out-of-bounds read.
"""

from __future__ import annotations

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


def view_extent_bytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Bytes from the view's first element to one past its last (0 for empty views)."""
    if any(size == 0 for size in shape):
        return 0
    return (sum((size - 1) * step for size, step in zip(shape, stride, strict=True)) + 1) * itemsize


def validate_handle(handle: IpcHandle, storage_nbytes: int | None = None) -> torch.dtype:
    """Check a handle's view against its storage; return its dtype.

    `storage_nbytes` is the size actually mapped, where the plugin can learn it
    independently of the handle (it then wins over the handle's own claim).
    """
    if not isinstance(handle, IpcHandle):
        raise IpcHandleError(f"expected an IpcHandle, got {type(handle).__name__}")
    dtype = dtype_from_name(handle.dtype)
    if not isinstance(handle.shape, tuple) or not isinstance(handle.stride, tuple):
        raise IpcHandleError(f"shape {handle.shape!r} and stride {handle.stride!r} must be tuples")
    if len(handle.shape) != len(handle.stride):
        raise IpcHandleError(f"shape {handle.shape} and stride {handle.stride} differ in length")
    for i, size in enumerate(handle.shape):
        _check_int(f"shape[{i}]", size)
    for i, step in enumerate(handle.stride):
        _check_int(f"stride[{i}]", step)
    offset = _check_int("offset_bytes", handle.offset_bytes)
    claimed = _check_int("storage_nbytes", handle.storage_nbytes)
    limit = claimed if storage_nbytes is None else min(claimed, storage_nbytes)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if offset % itemsize:
        raise IpcHandleError(f"offset_bytes {offset} is not a multiple of the {handle.dtype} size {itemsize}")
    extent = view_extent_bytes(handle.shape, handle.stride, itemsize)
    if extent >= MAX_BYTES or offset + extent > limit:
        raise IpcHandleError(
            f"IPC view reaches byte {offset + extent} but its storage holds {limit} bytes "
            f"(offset {offset}, shape {handle.shape}, stride {handle.stride}, {handle.dtype})"
        )
    return dtype


def tensor_from_storage(storage: torch.UntypedStorage, handle: IpcHandle, dtype: torch.dtype) -> torch.Tensor:
    """Build the (already validated) view on an opened storage."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    out = torch.empty((0,), dtype=dtype, device=storage.device)
    out.set_(storage, handle.offset_bytes // itemsize, handle.shape, handle.stride)
    return out


def describe(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], tuple[int, ...], int]:
    """(dtype name, shape, stride, byte offset in its storage) of a tensor to share."""
    return (
        dtype_name(tensor.dtype),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        int(tensor.storage_offset()) * tensor.element_size(),
    )
