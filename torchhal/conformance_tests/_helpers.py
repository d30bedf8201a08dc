"""Helpers shared by the conformance tests (no vendor names: the one-way rule)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue as queue_module
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

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


class Spawned:
    """A `_workers.worker` in a spawned process, inside a `with` block: `answer` reads what it
    reports; it holds what it made until `finish` (at the end of the block at the latest), which
    waits for it to exit and returns its exit code."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = spawn_context()
        self.queue, self.release = ctx.Queue(), ctx.Event()
        self.proc = ctx.Process(target=target, args=(*args, self.queue, self.release))

    def __enter__(self) -> Spawned:
        self.proc.start()
        return self

    def answer(self, what: str) -> Any:
        return receive(self.queue, what)

    def finish(self) -> int | None:
        self.release.set()
        return wait_exit(self.proc)

    def __exit__(self, *exc_info: object) -> None:
        self.finish()


def memory_taken(platform: Platform, device: int, target: Callable[..., None], *args: Any) -> tuple[Any, float]:
    """(what the worker `target(*args)` reports, the MiB of `device`'s free memory it holds then)."""
    platform.memory_info(device)  # this process's own context on `device`, before the baseline
    baseline = platform.memory_info(device).free
    with Spawned(target, *args) as spawned:
        value = spawned.answer("worker")
        during = platform.memory_info(device).free
    return value, (baseline - during) / MiB


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
    """Record calls to these names on the plugin (through the testing seam) and on its device
    module; the list is filled when the block ends."""
    plugin = plugin_under_test(platform)
    module = plugin.device_module()
    calls: list[str] = []
    with contextlib.ExitStack() as stack:
        watched = {f"plugin.{name}": mock.Mock(wraps=getattr(plugin, name))
                   for name in names if callable(getattr(plugin, name, None))}
        stack.enter_context(patched_plugin(platform, **{tag.removeprefix("plugin."): spy
                                                         for tag, spy in watched.items()}))
        for name in names:
            if callable(getattr(module, name, None)):
                watched[f"device module.{name}"] = stack.enter_context(
                    mock.patch.object(module, name, wraps=getattr(module, name)))
        try:
            yield calls
        finally:
            calls.extend(tag for tag, spy in watched.items() for _ in range(spy.call_count))


def capture(platform: Platform, index: int, fn: Callable[[], Any], pool: Any = None) -> tuple[Any, Any]:
    """(a new graph, what `fn()` returned as it was captured): `fn` warmed up on a side stream
    (compiling, or starting a communicator, outside the graph), then recorded on it into the
    graph, with `pool` (a new one by default)."""
    support = platform.graph_support
    assert support is not None, "the group runs only where graph support is declared"
    graph, stream = support.graph_class(), platform.new_stream(index)
    stream.wait_stream(platform.current_stream(index))
    with platform.use_stream(stream):
        fn()
    platform.current_stream(index).wait_stream(stream)
    with support.capture(graph, support.new_pool() if pool is None else pool, stream):
        out = fn()
    platform.current_stream(index).wait_stream(stream)
    return graph, out


def fill_cache(platform: Platform, index: int, nbytes: int = 256 * MiB) -> None:
    """Allocate and free a block so the caching allocator (if any) holds it."""
    import torch

    block = torch.empty(nbytes, dtype=torch.uint8, device=platform.device(index))
    block.fill_(1)
    platform.synchronize(index)
    del block
