"""Helpers shared by the conformance tests (no vendor names: the one-way rule)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue as queue_module
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from torchhal.platforms import Platform
from torchhal.platforms.testing import patched_plugin, plugin_under_test

MiB = 1 << 20


def spawn_context() -> Any:
    return multiprocessing.get_context("spawn")


def python_code_command(code: str) -> list[str]:
    """`python -c code` that imports the torchhal this process runs.

    `-c` puts the working directory first on sys.path, where a folder named `torchhal`
    (a clone's root, say) would be imported as a namespace package instead; the child
    looks first in the folder this process's torchhal came from."""
    import torchhal

    root = os.path.dirname(os.path.dirname(os.path.abspath(torchhal.__file__)))
    prelude = f"import sys; sys.path[:] = [{root!r}] + [p for p in sys.path if p]\n"
    return [sys.executable, "-c", prelude + code]


def receive(q: Any, what: str, timeout: float = 180) -> Any:
    """One ('ok', value) message from a worker; fail clearly on an error or a hang."""
    try:
        status, value = q.get(timeout=timeout)
    except queue_module.Empty:
        pytest.fail(f"{what}: no answer from the worker process within {timeout:.0f} s")
    if status != "ok":
        pytest.fail(f"{what}: worker failed: {value}")
    return value


def wait_exit(proc: Any, timeout: float = 60) -> int | None:
    """Wait for a worker to exit, by its pid rather than its sentinel pipe.

    A child that started torch's shared-memory manager leaves that manager holding
    the sentinel open, so `Process.join` would wait for the manager, not the child.
    """
    deadline = time.monotonic() + timeout
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return proc.exitcode


@contextlib.contextmanager
def spies(platform: Platform, names: tuple[str, ...] = ("empty_cache", "synchronize")) -> Iterator[list[str]]:
    """Record calls to these names on the plugin (through the testing seam) and on its device module."""
    calls: list[str] = []

    def spy_on(original: Any, tag: str) -> Any:
        def spy(*args: Any, **kwargs: Any) -> Any:
            calls.append(tag)
            return original(*args, **kwargs)

        return spy

    plugin = plugin_under_test(platform)
    module = plugin.device_module()
    plugin_spies = {
        name: spy_on(getattr(plugin, name), f"plugin.{name}") for name in names if callable(getattr(plugin, name, None))
    }
    saved = []
    for name in names:
        original = getattr(module, name, None)
        if callable(original):
            saved.append((name, module.__dict__.get(name, _MISSING)))
            setattr(module, name, spy_on(original, f"device module.{name}"))
    try:
        with patched_plugin(platform, **plugin_spies):
            yield calls
    finally:
        for name, previous in reversed(saved):
            if previous is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, previous)


_MISSING = object()


def fill_cache(platform: Platform, index: int, nbytes: int = 256 * MiB) -> None:
    """Allocate and free a block so the caching allocator (if any) holds it."""
    import torch

    block = torch.empty(nbytes, dtype=torch.uint8, device=platform.device(index))
    block.fill_(1)
    platform.synchronize(index)
    del block
