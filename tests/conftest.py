"""Shared fixtures: every test gets a fresh registry and a clean TORCHHAL_* environment."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import torchhal
from torchhal.platforms import hookimpl, manager, selection

TESTS = Path(__file__).parent
PLUGIN_DIST = TESTS / "plugin_dist"


def pytest_configure(config: pytest.Config) -> None:
    # Tests import the conformance suite's modules, whose marker its plugin registers in its own runs.
    config.addinivalue_line("markers", "conformance(group): a torchhal conformance test of one capability group")


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


@dataclass
class Ran:
    """What an in-process `torchhal generate` call returned and printed."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def generate(capsys: pytest.CaptureFixture[str]) -> Callable[..., Ran]:
    """`torchhal generate ARGS...` run in this process (`torchhal.cli.main`), captured."""
    from torchhal.cli import main

    def run(*args: str) -> Ran:
        code = main(["generate", *args])
        out = capsys.readouterr()
        return Ran(code, out.out, out.err)

    return run


def entry_point_distribution(root: Path, name: str, module: str) -> str:
    """A distribution under `root` whose `torchhal` entry point `name` is `module` (a test
    module of broken plugins); the PYTHONPATH that makes it and this repository importable."""
    info = root / f"torchhal_{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchhal-{name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[torchhal]\n{name} = {module}\n")
    return f"{root}:{TESTS.parent}"


def conformance_group_results(
    tmp_path: Path, pythonpath: str, platform: str, group: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, dict[str, object]]]:
    """`torchhal conformance --profile full` of one group on `platform` (`env`: more variables):
    the run and its tests by id (the group's prefix removed)."""
    import json

    report = tmp_path / "report.json"
    out = run_cli("conformance", "--platform", platform, "--profile", "full", "-k", f"test_{group}",
                  "--json", str(report), env={"PYTHONPATH": pythonpath, **(env or {})})
    assert report.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    tests = json.loads(report.read_text())["tests"]
    return out, {t["id"].removeprefix(f"{group}::test_"): t for t in tests if t["group"] == group}


def suite_summary(out: subprocess.CompletedProcess[str]) -> str:
    """The conformance run's own summary (every failed and skipped clause with its message, and the
    verdict) and stderr's tail: what an assertion on the run prints, so no clause's name is cut off."""
    start = out.stdout.find("torchhal conformance =")
    return (out.stdout[start:] if start >= 0 else out.stdout[-3000:]) + out.stderr[-2000:]
