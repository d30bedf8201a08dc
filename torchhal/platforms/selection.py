"""Which platform is current, and why.

Resolved lazily on the first `current_platform()` (never at import), then
cached for the process: later calls are one global read. What resolved it,
and from which call site, is remembered for `torchhal info`.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from types import FrameType

from torchhal.platforms.errors import (
    PlatformError,
    PlatformUnavailableError,
    PluginConflictError,
    UnknownPlatformError,
)
from torchhal.platforms.manager import ALLOW_LIST_ENV, PlatformRegistry, build_registry
from torchhal.platforms.platform import Platform, notify_observers

PLATFORM_ENV = "TORCHHAL_PLATFORM"
#: torchhal's own files: the call site that resolved the platform is the first frame outside them.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: The stages at which an installed plugin fails to load: a platform it would provide is
#: explained by that failure, not by "install the plugin".
LOAD_STAGES = ("import", "register", "validate", "version")

_lock = threading.RLock()
_registry: PlatformRegistry | None = None
_platforms: dict[str, Platform] = {}
_current: Platform | None = None
_how: str | None = None
_resolved_at: str | None = None


@dataclass(frozen=True)
class PlatformStatus:
    name: str
    available: bool
    reason: str
    priority: int
    source: str
    distribution: str
    version: str


def registry() -> PlatformRegistry:
    global _registry
    with _lock:
        if _registry is None:
            _registry = build_registry()
        return _registry


def use_registry(new_registry: PlatformRegistry | None) -> None:
    """Replace the process registry and forget the current platform (tests, embedding)."""
    global _registry, _current, _how, _resolved_at
    with _lock:
        _registry = new_registry
        _platforms.clear()
        _current = _how = _resolved_at = None


def current_platform() -> Platform:
    """The platform engine code runs on. Cached after the first call."""
    platform = _current
    if platform is not None:
        return platform
    return _select_current()


def how_resolved() -> tuple[str | None, str | None]:
    """(why the current platform was chosen, the call site outside torchhal that resolved it: None when
    torchhal itself did, as `torchhal info` does)."""
    return _how, _resolved_at


def get_platform(name: str) -> Platform:
    """The named platform; raises if it is unknown or unavailable here."""
    reg = registry()
    _require_known(reg, name)
    availability = reg.availability(name)
    if not availability:
        raise PlatformUnavailableError(f"platform {name!r} is not available: {availability.reason}")
    return _platform(reg, name)


def list_platforms() -> list[PlatformStatus]:
    reg = registry()
    return [PlatformStatus(name, (availability := reg.availability(name)).available, availability.reason,
                           entry.priority, entry.source, entry.distribution, entry.version)
            for name, entry in sorted(reg.platforms.items())]


def _platform(reg: PlatformRegistry, name: str) -> Platform:
    with _lock:
        platform = _platforms.get(name)
        if platform is None:
            entry = reg.platforms[name]
            platform = Platform(entry.plugin, reg.pm, entry.distribution, entry.version)
            _platforms[name] = platform
        return platform


def _require_known(reg: PlatformRegistry, name: str) -> None:
    """Refuse a name no registered platform has, saying why it is missing: replaced, in a conflict,
    its plugin failed to load or was excluded (then not "install it"), or unknown."""
    if name in reg.platforms:
        return
    known = f"registered platforms: {', '.join(reg.names()) or 'none'}"
    replaced, conflict = reg.replacement_note(name), reg.conflict_for(name)
    loading = [f for f in reg.failures if f.stage in LOAD_STAGES]
    failed = [f for f in loading
              if name in (f.plugin, f.plugin.rsplit(".", 1)[-1], *f.involves) or f"(platform {name!r})" in f.error]
    error: PlatformError
    if replaced is not None:
        error = UnknownPlatformError(f"{replaced} ({known})")
    elif conflict is not None:
        error = PluginConflictError(conflict.error)
    elif failed:
        error = UnknownPlatformError(f"platform {name!r} is not registered: " + "; ".join(map(str, failed))
                                     + f". {known}")
    elif name in reg.excluded:
        allowed = ",".join(sorted(reg.allow or ())) or "(empty)"
        error = UnknownPlatformError(
            f"platform {name!r} is not registered: entry point {name!r} of distribution {reg.excluded[name]} is "
            f"installed but excluded by {ALLOW_LIST_ENV}={allowed}; add {name!r} to {ALLOW_LIST_ENV}, or unset it. "
            f"{known}")
    else:
        hints = []
        if loading:
            hints.append("plugins that failed to load, which may provide it: " + "; ".join(map(str, loading)))
        if reg.excluded:
            hints.append(f"entry points excluded by {ALLOW_LIST_ENV}: {', '.join(sorted(reg.excluded))}")
        error = UnknownPlatformError(f"unknown platform {name!r}; {known}. Set {PLATFORM_ENV} to one of them, or "
                                     f"install the plugin that provides {name!r}"
                                     + "".join(f". Note: {hint}" for hint in hints))
    raise error


def _select_current() -> Platform:
    global _current, _how, _resolved_at
    with _lock:
        if _current is not None:
            return _current
        reg = registry()
        requested = os.environ.get(PLATFORM_ENV, "").strip()
        if requested:
            platform = get_platform(requested)
            how = f"{PLATFORM_ENV}={requested}"
        else:
            platform, how = _by_priority(reg)
        _current, _how = platform, how
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith((_PACKAGE_DIR, "<")):
            frame = frame.f_back
        _resolved_at = None if frame is None else _site(frame)
    notify_observers(reg.pm, "torchhal_platform_activated", platform=platform, how=how)
    return platform


def _site(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


#: How a tie of the highest priority is broken (stated by `torchhal info`).
TIE_RULE = "built-in platforms first, then name order"


def _by_priority(reg: PlatformRegistry) -> tuple[Platform, str]:
    found: list[tuple[int, bool, str]] = []
    for name in reg.names():
        if reg.availability(name):
            entry = reg.platforms[name]
            found.append((entry.priority, entry.builtin, name))
    if not found:
        reasons = "; ".join(f"{n}: {reg.availability(n).reason}" for n in reg.names())
        raise PlatformUnavailableError(f"no platform is available ({reasons or 'none registered'})")
    # Highest priority; a tie goes to a built-in, then to the first name: deterministic.
    found.sort(key=lambda item: (-item[0], not item[1], item[2]))
    best_priority, _, best = found[0]
    ties = [name for priority, _, name in found[1:] if priority == best_priority]
    others = ", ".join(f"{n} ({p})" for p, _, n in found[1:] if n not in ties)
    how = f"highest priority available: {best} ({best_priority})"
    if ties:
        how += f", tied with {', '.join(ties)}: broken by the tie rule ({TIE_RULE})"
    if others:
        how += f" over {others}"
    return _platform(reg, best), how
