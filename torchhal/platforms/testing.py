"""The testing seam: the plugin behind a `Platform`, for the conformance suite and tests.

Engine code reaches a platform only through the `Platform` API; the plugin is
private to it. The conformance suite checks the plugin itself, and must at
times observe or pin one of its calls. It does so here, explicitly, and
nowhere else: `torchhal/core` may not import this module, and it is the only
submodule of `torchhal.platforms` the conformance suite may import
(tests/test_one_way_rule.py enforces both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torchhal.platforms.errors import describe_error, isolated
from torchhal.platforms.platform import Platform
from torchhal.platforms.plugin import SPI_METHODS, PlatformPlugin

#: How the host calls plugin code (every BaseException but Ctrl-C caught) and names what it raised;
#: the suite calls plugin code outside a test the same way, so a sys.exit() there is a plugin failure.
__all__ = ["describe_error", "isolated", "patched_plugin", "plugin_under_test"]

_ABSENT = object()


def plugin_under_test(platform: Platform) -> PlatformPlugin:
    """The plugin behind `platform`. For conformance checks and tests only, never engines."""
    return platform._plugin


@contextmanager
def patched_plugin(platform: Platform, **calls: Callable[..., Any]) -> Iterator[PlatformPlugin]:
    """Answer these SPI calls of the plugin behind `platform` with `calls` while inside.

    Every `Platform` call sees the replacement (pass-throughs are re-bound, facts
    asked again), and everything is restored on exit, even on error.

        with patched_plugin(platform, memory_info=lambda index: pinned):
            platform.available_memory(group)
    """
    unknown = sorted(set(calls) - set(SPI_METHODS))  # a test's typo, which would patch nothing
    assert not unknown, f"patched_plugin: {', '.join(unknown)} is not an SPI method; use one of {SPI_METHODS}"
    plugin = platform._plugin
    saved = {name: plugin.__dict__.get(name, _ABSENT) for name in calls}
    for name, replacement in calls.items():
        setattr(plugin, name, replacement)
    platform._bind()
    try:
        yield plugin
    finally:
        for name, previous in saved.items():
            if previous is _ABSENT:
                plugin.__dict__.pop(name, None)
            else:
                setattr(plugin, name, previous)
        platform._bind()
