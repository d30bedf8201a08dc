"""Shared fixtures: every test gets a fresh registry and a clean TORCHHAL_* environment."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import torchhal
from torchhal.platforms import hookimpl, manager, selection

TESTS = Path(__file__).parent
PLUGIN_DIST = TESTS / "plugin_dist"


@pytest.fixture(autouse=True)
def clean_platform_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in list(os.environ):
        if key.startswith("TORCHHAL_"):
            monkeypatch.delenv(key)
    torchhal.use_registry(None)
    yield
    torchhal.use_registry(None)


@pytest.fixture
def make_registry() -> Callable[..., manager.PlatformRegistry]:
    """Install a registry of the CPU built-in plus in-process plugins; no entry points."""

    def make(*plugins: object, builtins: tuple[str, ...] = ("torchhal.plugins.cpu",)) -> manager.PlatformRegistry:
        reg = manager.build_registry(
            builtins,
            entry_points=False,
            extra=[(p, f"test-plugin-{i}") for i, p in enumerate(plugins)],
        )
        selection.use_registry(reg)
        return reg

    return make


@pytest.fixture
def empties(make_registry: Callable[..., manager.PlatformRegistry]) -> list[object]:
    """The reasons of every cache empty, in order, seen through the observer hook."""
    seen: list[object] = []

    class Observer:
        @hookimpl
        def torchhal_cache_emptied(self, reason: object) -> None:
            seen.append(reason)

    make_registry(Observer())
    return seen


def run_cli(
    *args: str, env: dict[str, str] | None = None, with_test_dist: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run `python -m torchhal.cli ...` in a fresh process."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHHAL_")}
    if with_test_dist:
        full_env["PYTHONPATH"] = os.pathsep.join([str(PLUGIN_DIST), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "torchhal.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )
