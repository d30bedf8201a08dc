"""The simulated runtime's device module: the CUDA-style names the SPI defaults call.

`is_initialized()` is False until something uses the device (a memory query, a
synchronize, set_device): detection must leave it False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

_initialized = False
_current = 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]


def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def heap_counter_available() -> bool:
    return _LIBC is not None and hasattr(_LIBC, "mallinfo2")


def heap_in_use() -> int:
    """Bytes the process heap has handed out: small-chunk arenas plus mmapped chunks."""
    _LIBC.mallinfo2.restype = _MallInfo2
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def init() -> None:
    global _initialized
    _initialized = True


def is_initialized() -> bool:
    return _initialized


def is_available() -> bool:
    return heap_counter_available()


def device_count() -> int:
    return 1


def current_device() -> int:
    return _current


def set_device(index: int) -> None:
    if index != 0:
        raise ValueError(f"simaccel has one device, 0; got {index}")
    init()


def synchronize(index: int = 0) -> None:
    init()


class Stream:
    """Host execution is in order: a stream is only a name for the default queue."""

    def synchronize(self) -> None:
        return None


class Event:
    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = Stream()


def current_stream(index: int = 0) -> Stream:
    return _DEFAULT_STREAM
