"""Plain-data IPC handles: dtype names and the one view validator every plugin's open uses.

A handle is checked against the storage it names before a byte is read: a
view that reaches past the storage, an unknown dtype or a negative or
absurd shape is an `IpcHandleError`, never an out-of-bounds read.
"""

from __future__ import annotations

import base64
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from torchhal.platforms.errors import IpcHandleError
from torchhal.platforms.records import IpcHandle
from torchhal.values import short_repr

#: dtypes that may cross a process boundary, by their stable names.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16",
        "int8", "uint8", "bool", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2",
    )  # every one is in torch >= 2.5
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_BYTES = 1 << 48  # 256 TiB: larger claims are corrupt, not real
MAX_DIMS = 32


#: Where POSIX shared memory lives, and torch's process-wide names there (at::NewProcessWideShmHandle:
#: CPU filename storages and CUDA IPC ref-counters share the generator). The driver's own
#: "cuda.shm.<uid>.<pid hex>.<n>" files (IPC events) are not torch's: refused.
SHM_DIR = "/dev/shm"
TORCH_SHM_NAME = re.compile(rb"/torch_\d{1,10}_\d{1,10}_\d{1,20}")


def owned_file(path: str, kind: str, is_type: Callable[[int], bool]) -> os.stat_result:
    """Stat without following a symlink: this user's own object of the expected type, with one link."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        gone = isinstance(exc, FileNotFoundError)
        raise IpcHandleError(f"shared {kind} {path!r} " + ("no longer exists: its producer freed it or exited"
                                                           if gone else f"cannot be inspected: {exc}")) from None
    if not is_type(info.st_mode) or info.st_uid != os.geteuid() or info.st_nlink != 1:
        raise IpcHandleError(f"{path!r} is not a {kind} of this user with one link (a symlink, a hard link or "
                             "another user's object)")
    return info


def dtype_name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)
    if name is None:
        raise IpcHandleError(f"dtype {dtype} cannot be shared; supported: {', '.join(DTYPES)}")
    return name


def _sizes(values: Sequence[object], labels: str | Sequence[str]) -> tuple[int, ...]:
    """`values` as sizes (exact ints in [0, 2**48): a bool is no size), else an IpcHandleError
    naming the first bad one (`labels`: one per value, or a name to index)."""
    for i, value in enumerate(values):
        if type(value) is not int or not 0 <= value < MAX_BYTES:
            label = f"{labels}[{i}]" if isinstance(labels, str) else labels[i]
            raise IpcHandleError(f"{label} = {short_repr(value)} is not a size (an int in [0, 2**48))")
    return tuple(values)  # type: ignore[arg-type]


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


class View(NamedTuple):
    """A checked view: its dtype, shape and stride (the contiguous one where none was given)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def check_view(dtype: object, shape: object, stride: object, offset_bytes: object, storage_nbytes: object) -> View:
    """The one validator of a shared tensor view: (dtype, shape, stride, byte offset) inside
    `storage_nbytes` bytes; `stride` None is the contiguous one. Anything else is an
    `IpcHandleError`.

    Used by every plugin's IPC open (through `validate_handle`) and by the transport's
    message decoder, so a view is judged the same way wherever it arrives.
    """
    resolved = DTYPES.get(dtype) if isinstance(dtype, str) else None
    if resolved is None:
        raise IpcHandleError(f"unknown dtype {short_repr(dtype)}; supported: {', '.join(DTYPES)}")
    if not isinstance(shape, (tuple, list)) or len(shape) > MAX_DIMS or not (
            stride is None or isinstance(stride, (tuple, list)) and len(stride) == len(shape)):
        raise IpcHandleError(f"shape {short_repr(shape)} and stride {short_repr(stride)} are not a view: int "
                             f"sequences that do not differ in length, of no more than {MAX_DIMS} dimensions")
    sizes, item = _sizes(shape, "shape"), resolved.itemsize
    offset, limit = _sizes((offset_bytes, storage_nbytes), ("offset_bytes", "storage_nbytes"))
    if offset % item:
        raise IpcHandleError(f"offset_bytes {offset} is not a multiple of the {dtype} size {item}")
    if isinstance(stride, (tuple, list)):
        steps = _sizes(stride, "stride")
        extent = 0 if 0 in sizes else (sum((n - 1) * s for n, s in zip(sizes, steps, strict=True)) + 1) * item
    else:
        steps, extent = contiguous_stride(sizes), math.prod(sizes) * item
    if offset + extent > limit:  # limit < MAX_BYTES: no extent past it passes
        raise IpcHandleError(f"IPC view reaches byte {offset + extent} but its storage holds {limit} bytes "
                             f"(offset {offset}, shape {sizes}, stride {steps}, {dtype})")
    return View(resolved, sizes, steps)


def validate_handle(handle: IpcHandle, storage_nbytes: int | None = None) -> torch.dtype:
    """Check a handle's view against its storage; return its dtype.

    `storage_nbytes` is the size actually mapped, where the plugin can learn it
    independently of the handle: a handle claiming more than that is refused (mapping
    the claim would read past, or grow, the real object).
    """
    assert isinstance(handle, IpcHandle)  # the transport decodes every handle it opens into one
    dtype = check_view(handle.dtype, handle.shape, handle.stride, handle.offset_bytes, handle.storage_nbytes).dtype
    if storage_nbytes is not None and handle.storage_nbytes > storage_nbytes:
        raise IpcHandleError(
            f"IPC handle claims a storage of {handle.storage_nbytes} bytes but the shared object holds {storage_nbytes}"
        )
    return dtype


def handle_to_data(handle: IpcHandle) -> dict[str, object]:
    """The handle as JSON-safe plain data (bytes fields base64)."""
    return {
        "platform": handle.platform, "device": handle.device, "storage_nbytes": handle.storage_nbytes,
        "dtype": handle.dtype, "shape": list(handle.shape), "stride": list(handle.stride),
        "offset_bytes": handle.offset_bytes,
        "storage": [{"b64": base64.b64encode(v).decode("ascii")} if isinstance(v, bytes) else v
                    for v in handle.storage],
    }


def handle_from_data(data: Any) -> IpcHandle:
    """`handle_to_data`'s output as a handle again. Its fields are taken as they are: the
    platform's open checks every one of them (plugin, device, storage fields, view) before
    anything is mapped. Data of another form raises TypeError, KeyError or ValueError."""
    fields = dict(data)
    storage = tuple(base64.b64decode(v["b64"], validate=True) if isinstance(v, dict) else v
                    for v in fields.pop("storage"))
    shape, stride = tuple(fields.pop("shape")), tuple(fields.pop("stride"))
    return IpcHandle(storage=storage, shape=shape, stride=stride, **fields)


def tensor_from_storage(storage: torch.UntypedStorage, handle: IpcHandle, dtype: torch.dtype) -> torch.Tensor:
    """Build the (already validated) view on an opened storage."""
    out = torch.empty((0,), dtype=dtype, device=storage.device)
    out.set_(storage, handle.offset_bytes // dtype.itemsize, handle.shape, handle.stride)
    return out


def describe(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], tuple[int, ...], int]:
    """(dtype name, shape, stride, byte offset in its storage) of a tensor to share."""
    return (
        dtype_name(tensor.dtype),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        int(tensor.storage_offset()) * tensor.element_size(),
    )
