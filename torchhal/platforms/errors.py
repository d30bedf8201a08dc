"""Errors raised by the platform layer, and how a plugin's own errors are caught and named.

Each message says what, with what value, and what to do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


class PlatformError(RuntimeError):
    """Base class for torchhal platform errors."""


class UnknownPlatformError(PlatformError, LookupError):
    """A platform name that no registered plugin provides."""


class PlatformUnavailableError(PlatformError):
    """A known platform that cannot run on this machine."""


class AmbiguousPlatformError(PlatformError):
    """Kept for compatibility: no longer raised, a priority tie now resolves by a fixed rule."""


class PluginConflictError(PlatformError):
    """Two distributions registered the same platform name."""


class PluginContractError(PlatformError, TypeError):
    """A plugin returned a value of the wrong type from an SPI call."""


class IpcHandleError(PlatformError, ValueError):
    """An IPC handle that does not describe a valid view of its storage."""


class TorchhalPluginWarning(UserWarning):
    """A plugin failed to import, register, validate or detect, or an observer raised."""


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
