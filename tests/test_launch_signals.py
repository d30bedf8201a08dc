"""SIGTERM to a launcher: the ranks are stopped and their log directory removed before the
launcher dies of it, as Ctrl-C does (the default action would end it at once, leaving both)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.test_launch import ROOT, _record_pid, pids, read_variable, running
from torchhal.distributed import launch


def start_launcher(tmp_path: Path, module: str, target: str, args: str, grace: float
                   ) -> tuple[subprocess.Popen[str], Path, list[int]]:
    """`launch(target, 2, (pid_dir, *args), grace=grace)` in a process of its own with its
    temporary directory under `tmp_path`: the process, that directory and the ranks' pids,
    once both ranks have written theirs."""
    pid_dir, temp = tmp_path / "pids", tmp_path / "tmp"
    pid_dir.mkdir()
    temp.mkdir()
    script = (f"from torchhal.distributed import launch; from {module} import {target}; "
              f"launch({target}, 2, ({str(pid_dir)!r}, {args}), grace={grace})")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "TMPDIR": str(temp)},
                              stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 60
    while len(list(pid_dir.glob("*.pid"))) < 2 and time.monotonic() < end:
        time.sleep(0.1)
    return parent, temp, pids(pid_dir, 2)


def test_sigterm_stops_the_ranks_and_removes_their_logs_then_ends_the_launcher(tmp_path: Path) -> None:
    parent, temp, started = start_launcher(tmp_path, "tests.test_launch", "fail_on_rank_one", "'hang'", 1.0)
    try:
        assert len(list(temp.glob("torchhal-launch-*"))) == 1  # the logs are where this test looks
        parent.send_signal(signal.SIGTERM)
        _, stderr = parent.communicate(timeout=15)
    finally:
        parent.kill()
    assert parent.returncode == -signal.SIGTERM, stderr[-2000:]  # still the end a SIGTERM gives
    # Stopped and reaped by the launcher before it ended, not left to exit on their own.
    assert [pid for pid in started if running(pid, zombie_is_gone=False)] == []
    assert list(temp.glob("torchhal-launch-*")) == []


def test_launch_leaves_sigterm_as_it_found_it_and_runs_from_any_thread() -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert launch(read_variable, 1, ("RANK",)) == ["0"]
    assert signal.getsignal(signal.SIGTERM) is before
    results: list[object] = []  # only the main thread may set a handler: elsewhere launch sets none
    thread = threading.Thread(target=lambda: results.append(launch(read_variable, 1, ("RANK",))))
    thread.start()
    thread.join(120)
    assert results == [["0"]]


def stubborn_rank(pid_dir: str) -> None:
    """A rank that ignores SIGTERM and is stuck in C code holding the GIL (as a blocking native
    call is), so only the launcher's kill ends it and its own watch for a dead parent is late."""
    import re

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _record_pid(pid_dir)
    re.match(r"(a+)+$", "a" * 40 + "b")  # exponential backtracking: minutes inside the regex engine


def test_a_second_sigterm_during_the_cleanup_does_not_cut_it_short(tmp_path: Path) -> None:
    """The launcher waits `grace` for ranks that ignore SIGTERM, then kills them; a second
    SIGTERM in that wait must not end the launcher there, leaving the ranks running."""
    parent, temp, started = start_launcher(tmp_path, "tests.test_launch_signals", "stubborn_rank", "", 3.0)
    try:
        parent.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # inside the grace the ranks' ignored SIGTERM left
        parent.send_signal(signal.SIGTERM)
        _, stderr = parent.communicate(timeout=30)
        assert parent.returncode == -signal.SIGTERM, stderr[-2000:]
        assert [pid for pid in started if running(pid, zombie_is_gone=False)] == []
        assert list(temp.glob("torchhal-launch-*")) == []
    finally:
        parent.kill()
        for pid in started:
            if running(pid, zombie_is_gone=True):
                os.kill(pid, signal.SIGKILL)
