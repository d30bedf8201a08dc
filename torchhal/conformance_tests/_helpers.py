"""Helpers shared by the conformance tests (no vendor names: the one-way rule)."""

from __future__ import annotations

import contextlib
import multiprocessing
import queue as queue_module
import time
from collections.abc import Iterator
from typing import Any

import pytest

from torchhal.platforms import Platform

MiB = 1 << 20


def spawn_context() -> Any:
    return multiprocessing.get_context("spawn")


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
    """Record calls to these names on the plugin and on its device module."""
    calls: list[str] = []
    targets = [(platform.plugin, "plugin"), (platform.device_module, "device module")]
    saved = []
    for target, label in targets:
        for name in names:
            original = getattr(target, name, None)
            if original is None or not callable(original):
                continue

            def spy(*args: Any, _original: Any = original, _tag: str = f"{label}.{name}", **kwargs: Any) -> Any:
                calls.append(_tag)
                return _original(*args, **kwargs)

            own = target.__dict__.get(name, _MISSING) if hasattr(target, "__dict__") else _MISSING
            saved.append((target, name, own))
            setattr(target, name, spy)
    try:
        yield calls
    finally:
        for target, name, previous in reversed(saved):
            if previous is _MISSING:
                delattr(target, name)
            else:
                setattr(target, name, previous)


_MISSING = object()


def fill_cache(platform: Platform, index: int, nbytes: int = 256 * MiB) -> None:
    """Allocate and free a block so the caching allocator (if any) holds it."""
    import torch

    block = torch.empty(nbytes, dtype=torch.uint8, device=platform.device(index))
    block.fill_(1)
    platform.synchronize(index)
    del block
