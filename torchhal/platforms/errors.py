"""Errors raised by the platform layer, and how the host calls a plugin's code.

Each message says what, with what value, and what to do.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

_T = TypeVar("_T")


class PlatformError(RuntimeError):
    """Base class for torchhal platform errors."""


class UnknownPlatformError(PlatformError, LookupError):
    """A platform name that no registered plugin provides."""


class PlatformUnavailableError(PlatformError):
    """A known platform that cannot run on this machine."""


class PluginConflictError(PlatformError):
    """Two distributions registered the same platform name."""


class PluginContractError(PlatformError, TypeError):
    """A plugin declared or returned a value of the wrong type (a class attribute, an SPI answer)."""


class IpcHandleError(PlatformError, ValueError):
    """An IPC handle that does not describe a valid view of its storage."""


class TorchhalPluginWarning(UserWarning):
    """A plugin failed to import, register, validate or detect, an observer raised, or the host waits on a plugin."""


def describe_error(exc: BaseException) -> str:
    """One line for a plugin's exception; sys.exit() is named as such."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {exc}"


def isolated(call: Callable[..., _T], *args: Any, **kwargs: Any) -> tuple[_T | None, BaseException | None]:
    """Run a plugin's code `call(*args, **kwargs)`: (result, None), or (None, what it raised). Only Ctrl-C passes.

    SystemExit and other BaseExceptions are caught: a plugin must never end the host.
    """
    try:
        return call(*args, **kwargs), None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - isolation is the point
        return None, exc


@contextmanager
def watched(seconds: float | None, message: str) -> Iterator[None]:
    """Warn `message` (a TorchhalPluginWarning) once the block has run `seconds` (None: never).

    The block goes on: a plugin's import or call cannot be stopped from outside, but the
    user learns which plugin the host waits on, and how to skip it, instead of a silent hang.
    """
    done = threading.Event()
    if seconds is not None:
        def speak() -> None:
            if not done.wait(seconds):
                warnings.warn(message, TorchhalPluginWarning, stacklevel=1)

        threading.Thread(target=speak, name="torchhal-watch", daemon=True).start()
    try:
        yield
    finally:
        done.set()
