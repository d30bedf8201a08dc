"""Fake vendor device modules that mirror the documented API names and record calls.

They prove a plugin's *mapping* onto a vendor API (which names, which arguments,
what is never called). They prove nothing about the vendor runtime itself.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from typing import Any

import torch

MiB = 1 << 20

#: Device modules that define their own `OutOfMemoryError`. torch.xpu (torch 2.13) and
#: torch.npu (torch_npu 2.13) have none: their allocators raise torch.OutOfMemoryError.
VENDOR_OOM_CLASS = frozenset({"cuda", "musa"})
#: Device modules whose device properties have `major`/`minor`; torch.xpu's (torch 2.13) have none.
VENDOR_CAPABILITY = frozenset({"cuda", "musa", "npu"})


class FakeGraph:
    def __init__(self, log: list[tuple]) -> None:
        self.log = log

    def capture_begin(self, pool: Any = None) -> None:
        self.log.append(("capture_begin", pool))

    def capture_end(self) -> None:
        self.log.append(("capture_end",))

    def replay(self) -> None:
        self.log.append(("replay",))


def make_device_module(
    name: str,
    *,
    count: int = 2,
    graph_class: str | None = None,
    mem_get_info_raises: bool = False,
    peer_access: bool = True,
) -> types.ModuleType:
    """A module named torch.<name> with the CUDA-style API; `module.calls` logs every call."""
    module = types.ModuleType(f"torch.{name}")
    calls: list[tuple] = []
    state = {"reserved": {i: 64 * MiB for i in range(count)}, "allocated": {i: 16 * MiB for i in range(count)}}
    module.calls = calls  # type: ignore[attr-defined]
    module.state = state  # type: ignore[attr-defined]

    def record(fn_name: str, result: Any = None):
        def fn(*args: Any, **kwargs: Any) -> Any:
            calls.append((fn_name, *args, *kwargs.values()))
            return result(*args, **kwargs) if callable(result) else result

        fn.__name__ = fn_name
        setattr(module, fn_name, fn)

    def mem_get_info(index: int) -> tuple[int, int]:
        if mem_get_info_raises:
            raise RuntimeError(f"{name}: device does not support querying free memory")
        return (1000 * MiB - state["reserved"][index], 1000 * MiB)

    def empty_cache() -> None:
        for i in state["reserved"]:
            state["reserved"][i] = state["allocated"][i]

    record("is_available", True)
    record("device_count", count)
    record("current_device", 0)
    record("set_device")
    record("synchronize")
    record("mem_get_info", mem_get_info)
    record("memory_reserved", lambda i: state["reserved"][i])
    record("memory_allocated", lambda i: state["allocated"][i])
    record("empty_cache", empty_cache)
    capability = {"major": 9, "minor": 0} if name in VENDOR_CAPABILITY else {}
    record(
        "get_device_properties",
        lambda i: types.SimpleNamespace(name=f"Fake {name.upper()} {i}", total_memory=1000 * MiB, **capability),
    )
    record("Stream", lambda device=None: ("stream", device))
    record("current_stream", lambda i=None: ("stream", i))
    record("Event", lambda: "event")
    record("can_device_access_peer", peer_access)
    record("max_memory_reserved", lambda i: 2 * state["reserved"][i])
    record("max_memory_allocated", lambda i: 2 * state["allocated"][i])
    record("reset_peak_memory_stats")
    record("is_current_stream_capturing", False)
    record("graph_pool_handle", (0, 7))

    @contextlib.contextmanager
    def ctx(kind: str, arg: Any):
        calls.append((kind + ":enter", arg))
        yield
        calls.append((kind + ":exit", arg))

    module.stream = lambda s: ctx("stream", s)  # type: ignore[attr-defined]
    module.device = lambda d: ctx("device", d)  # type: ignore[attr-defined]
    if name in VENDOR_OOM_CLASS:
        module.OutOfMemoryError = type(f"{name.upper()}OutOfMemoryError", (RuntimeError,), {})  # type: ignore[attr-defined]
    if graph_class:
        graph_type = type(graph_class, (FakeGraph,), {"__init__": lambda self: FakeGraph.__init__(self, calls)})
        setattr(module, graph_class, graph_type)
    return module


def names_called(module: types.ModuleType) -> list[str]:
    return [c[0] for c in module.calls]  # type: ignore[attr-defined]


def install_extension(
    monkeypatch, module_name: str, device_name: str, device_module: types.ModuleType
) -> types.ModuleType:
    """Make `import <module_name>` succeed and expose torch.<device_name>."""
    ext = types.ModuleType(module_name)
    ext.__spec__ = importlib.machinery.ModuleSpec(module_name, None)
    ext.__version__ = "9.9-fake"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module_name, ext)
    monkeypatch.setattr(torch, device_name, device_module, raising=False)
    return ext


class _FailingLoader(importlib.machinery.BuiltinImporter):
    pass


def install_broken_extension(monkeypatch, module_name: str, error: BaseException) -> None:
    """`import <module_name>` is found but raises `error` (e.g. torch_npu without CANN)."""

    class Finder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name != module_name:
                return None
            loader = types.SimpleNamespace(
                create_module=lambda spec: None,
                exec_module=lambda module: (_ for _ in ()).throw(error),
            )
            return importlib.machinery.ModuleSpec(name, loader)

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, module_name, raising=False)
