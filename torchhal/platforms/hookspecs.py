"""Every torchhal hookspec, grouped by concern.

A plugin is any module or object with functions named like these, decorated
with `torchhal.hookimpl`. A hookimpl whose name matches no spec here is
rejected at registration (a typo must not silently do nothing).

Observer hooks are called with keyword arguments; an implementation may accept
any subset of them. They must be quick and must not raise: an observer that
raises is reported and does not stop the engine (`platform.notify_observers`).

The registry (`manager.py`) reads these specs; this module imports the SPI
and the API for typing only, and nothing it imports reads it back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from torchhal.platforms.platform import Platform
    from torchhal.platforms.plugin import PlatformPlugin
    from torchhal.platforms.records import ReleasePoint

PROJECT_NAME = "torchhal"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -- registration ---------------------------------------------------------


@hookspec
def torchhal_register_platforms() -> list[PlatformPlugin]:
    """Return the platform plugins this package provides.

    Result: a list of `PlatformPlugin` instances (may be empty). Each name must
    be unique across all installed distributions unless the plugin declares
    `replaces = "<name>"`. Must not import the vendor runtime or touch a device.

    Example::

        @torchhal.hookimpl
        def torchhal_register_platforms():
            return [MyAcceleratorPlatform()]
    """


# -- observers --------------------------------------------------------------


@hookspec
def torchhal_platform_activated(platform: Platform, how: str) -> None:
    """The process resolved its current platform.

    `how` says why this platform was chosen (environment variable, priority …).
    Called once per process, from the first `current_platform()`.

    Example::

        @torchhal.hookimpl
        def torchhal_platform_activated(platform, how):
            log.info("torchhal: %s (%s)", platform.name, how)
    """


@hookspec
def torchhal_cache_emptied(
    platform: Platform, device: int, reason: ReleasePoint, bytes_released: int | None
) -> None:
    """`Platform.empty_cache(reason)` ran on `device`.

    `bytes_released` is reserved-before minus reserved-after where the backend
    can tell, else None. This is the only place the cache is ever emptied, so an
    observer sees every empty.

    Example::

        @torchhal.hookimpl
        def torchhal_cache_emptied(platform, device, reason, bytes_released):
            metrics.empties.labels(reason.value).inc()
    """


@hookspec
def torchhal_out_of_memory(
    platform: Platform, device: int, error: BaseException, context: str
) -> None:
    """Engine code caught an out-of-memory error of this platform.

    `context` names where (e.g. "residency: request 7", "scheduler: decode step").
    Called before the engine empties the cache with `ReleasePoint.OOM`.

    Example::

        @torchhal.hookimpl
        def torchhal_out_of_memory(platform, device, error, context):
            log.warning("OOM on %s:%d in %s", platform.name, device, context)
    """


@hookspec
def torchhal_component_moved(
    component: str, source: str, destination: str, nbytes: int
) -> None:
    """The residency manager moved a component's weights between host and device.

    `source`/`destination` are device strings ("cpu", "cuda:0" …).

    Example::

        @torchhal.hookimpl
        def torchhal_component_moved(component, source, destination, nbytes):
            moved_bytes[component] += nbytes
    """


@hookspec
def torchhal_engine_event(event: dict[str, Any]) -> None:
    """A structured engine trace event (residency, scheduler, graph runner).

    `event` is a flat JSON-serialisable dict with at least "kind" and "t"
    (seconds, monotonic). Tracing plugins write these out.

    Example::

        @torchhal.hookimpl
        def torchhal_engine_event(event):
            trace_file.write(json.dumps(event) + "\\n")
    """
