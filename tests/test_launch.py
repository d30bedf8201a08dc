"""The rank launcher: results in rank order, and every failure (a raise, an exit, a kill, a
hang, Ctrl-C) stops all ranks, names the rank, and leaves no process behind.

The targets are module-level functions here: ranks are spawned and import them by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from torchhal.distributed import LaunchError, launch

ROOT = Path(__file__).resolve().parents[1]


#: What this module saw of its process's environment when imported: in a rank, before any target runs.
AT_IMPORT = {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "TORCHHAL_LAUNCH_TEST",
                                                      "TORCHELASTIC_RUN_ID")}


# -- targets (run in the rank processes) ----------------------------------------------------
def environment_at_import() -> dict[str, str | None]:
    return AT_IMPORT


def report_placement(tag: str) -> tuple[str, int, int, int, int, str, str]:
    env = os.environ
    return (tag, int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"]),
            env["MASTER_ADDR"], env["MASTER_PORT"])


def read_variable(name: str) -> str | None:
    return os.environ.get(name)


def _record_pid(pid_dir: str) -> int:
    """Write this rank's pid, then wait for every rank's: the test needs them all to check
    that none survives (a rank killed while still starting would leave no pid behind)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (Path(pid_dir) / f"{rank}.pid.part").write_text(str(os.getpid()))
    (Path(pid_dir) / f"{rank}.pid.part").rename(Path(pid_dir) / f"{rank}.pid")
    end = time.monotonic() + 60
    while len(list(Path(pid_dir).glob("*.pid"))) < world_size and time.monotonic() < end:
        time.sleep(0.02)
    return rank


def fail_on_rank_one(pid_dir: str, how: str) -> int:
    """Rank 1 fails as `how` says; the others wait, as a rank in a collective would."""
    rank = _record_pid(pid_dir)
    if rank != 1:
        time.sleep(120)
        return rank
    if how == "raise":
        print("rank one was about to fail", file=sys.stderr, flush=True)
        raise ValueError("rank one cannot go on")
    if how == "exit":
        os._exit(3)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "hang":
        time.sleep(120)
    raise AssertionError(how)


def sum_ranks_over_gloo(timeout_s: float) -> list[float]:
    """A real group through the launcher's rendezvous: every rank gets the same all-reduce."""
    import torch

    from torchhal.distributed import init_group

    group = init_group(timeout=timedelta(seconds=timeout_s))
    try:
        tensor = torch.tensor([float(group.rank + 1), 10.0 * group.rank])
        return group.comm.all_reduce(tensor).tolist()
    finally:
        group.close()


def rank_one_never_reaches_the_collective(pid_dir: str) -> list[float]:
    """Rank 1 joins the group, then hangs: rank 0's all-reduce times out through init_group."""
    import torch

    from torchhal.distributed import init_group

    rank = _record_pid(pid_dir)
    group = init_group(timeout=timedelta(seconds=2))
    if rank == 1:
        time.sleep(120)
    return group.comm.all_reduce(torch.ones(2)).tolist()


def unpicklable_result() -> object:
    return lambda: None


# -- helpers ---------------------------------------------------------------------------------
def pids(pid_dir: Path, world_size: int) -> list[int]:
    found = [int((pid_dir / f"{rank}.pid").read_text()) for rank in range(world_size)
             if (pid_dir / f"{rank}.pid").exists()]
    assert len(found) == world_size, f"only {len(found)} of {world_size} ranks started"
    return found


def running(pid: int, zombie_is_gone: bool) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return not (zombie_is_gone and state == "Z")


def assert_gone(process_ids: list[int], within: float = 5.0, zombie_is_gone: bool = False) -> None:
    """The ranks are gone: reaped by the launcher, or (`zombie_is_gone`, when the launcher
    itself was killed) at least dead, waiting for whoever adopted them to reap them."""
    end = time.monotonic() + within
    alive = process_ids
    while alive and time.monotonic() < end:
        alive = [pid for pid in process_ids if running(pid, zombie_is_gone)]
        time.sleep(0.05)
    assert alive == [], f"rank processes {alive} outlived the launcher"


# -- tests -----------------------------------------------------------------------------------
def test_every_rank_runs_with_its_variables_and_results_come_back_in_rank_order():
    results = launch(report_placement, 3, ("x",))
    assert [r[:5] for r in results] == [("x", rank, 3, rank, 3) for rank in range(3)]
    assert {r[5:] for r in results} == {results[0][5:]}  # one rendezvous for all
    assert results[0][5] == "127.0.0.1" and int(results[0][6]) > 0


def test_extra_variables_reach_every_rank_and_the_parent_keeps_its_own(monkeypatch):
    monkeypatch.delenv("TORCHHAL_LAUNCH_TEST", raising=False)
    assert launch(read_variable, 2, ("TORCHHAL_LAUNCH_TEST",), env={"TORCHHAL_LAUNCH_TEST": "on"}) == ["on", "on"]
    assert "TORCHHAL_LAUNCH_TEST" not in os.environ and "RANK" not in os.environ


def test_a_rank_starts_with_its_variables_for_its_imports_too(monkeypatch):
    """Set from the rank's first line: its target module's top-level code sees them, and so do
    torch's import-time settings (OMP_NUM_THREADS, TORCH_DISTRIBUTED_DEBUG)."""
    for name in ("RANK", "WORLD_SIZE", "TORCHHAL_LAUNCH_TEST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer")  # torchrun's, dropped from every rank
    results = launch(environment_at_import, 2, env={"TORCHHAL_LAUNCH_TEST": "on"}, timeout=90)
    assert results == [{"RANK": str(rank), "WORLD_SIZE": "2", "TORCHHAL_LAUNCH_TEST": "on", "TORCHELASTIC_RUN_ID": None}
                       for rank in range(2)]
    assert os.environ["TORCHELASTIC_RUN_ID"] == "outer"  # the launcher's own, as they were
    assert not {"RANK", "WORLD_SIZE", "TORCHHAL_LAUNCH_TEST"} & set(os.environ)


def test_ranks_form_a_group_and_agree_on_a_collective():
    assert launch(sum_ranks_over_gloo, 2, (30.0,)) == [[3.0, 10.0], [3.0, 10.0]]


@pytest.mark.parametrize("how, expected", [
    ("raise", ["rank 1 raised ValueError: rank one cannot go on", "rank one was about to fail", "Traceback"]),
    ("exit", ["rank 1 exited with code 3 before returning a result"]),
    ("kill", ["rank 1 was killed by SIGKILL before returning a result"]),
])
def test_a_failed_rank_stops_the_others_and_is_named(tmp_path, how, expected):
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        launch(fail_on_rank_one, 3, (str(tmp_path), how), grace=1.0)
    assert time.monotonic() - start < 60  # the others' two-minute sleep was cut short
    message = str(caught.value)
    for text in expected:
        assert text in message, message
    assert "stopped every rank" in message
    assert caught.value.rank == 1
    assert_gone(pids(tmp_path, 3))


def test_the_exception_summary_is_the_first_line_and_stderr_is_quoted_after_it(tmp_path):
    with pytest.raises(LaunchError) as caught:
        launch(fail_on_rank_one, 2, (str(tmp_path), "raise"), grace=1.0)
    lines = str(caught.value).splitlines()
    assert lines[0] == "rank 1 raised ValueError: rank one cannot go on; stopped every rank"
    assert lines[1] == "last lines of rank 1's stderr:"
    assert lines[-1].strip() == "ValueError: rank one cannot go on"  # the traceback's end


def test_a_hung_rank_is_stopped_at_the_deadline(tmp_path):
    # The deadline leaves room for both ranks to start on a loaded 2-core machine (they
    # record their pids once started, after the interpreter and the imports).
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        launch(fail_on_rank_one, 2, (str(tmp_path), "hang"), timeout=12.0, grace=1.0)
    elapsed = time.monotonic() - start
    assert 12.0 <= elapsed < 12.0 + 1.0 + 10.0, elapsed  # deadline + grace + spawn slack
    message = str(caught.value)
    assert "rank(s) 0, 1 of 2 did not finish within 12 s" in message
    # Where each one hangs: its Python stack at the deadline, the target's frame first.
    for rank in (0, 1):
        stack = message.split(f"rank {rank}'s Python stack at the deadline (innermost call first):\n")[1]
        assert stack.lstrip().startswith('File "') and "in fail_on_rank_one" in stack.splitlines()[0], message
    assert caught.value.rank is None
    assert_gone(pids(tmp_path, 2))


def chatter_then_hang(deep: int) -> None:
    """Writes to stderr all the while, from another thread, and hangs `deep` calls down."""
    import threading

    def chatter() -> None:
        while True:
            print("still working", file=sys.stderr, flush=True)
            time.sleep(0.001)

    threading.Thread(target=chatter, daemon=True).start()
    if deep:
        chatter_then_hang(deep - 1)
    time.sleep(120)


def test_a_late_ranks_stack_is_quoted_innermost_first_through_stderr_chatter_and_depth():
    with pytest.raises(LaunchError) as caught:
        launch(chatter_then_hang, 1, (60,), timeout=8.0, grace=1.0)
    message = str(caught.value)
    stack = message.split("rank 0's Python stack at the deadline (innermost call first):\n")[1].splitlines()
    assert "in chatter_then_hang" in stack[0] and "still working" not in "\n".join(stack), message


def test_ranks_run_when_the_launchers_stderr_is_closed(tmp_path):
    """A rank's stderr is its own file; the launcher's may be closed (a daemon's `2>&-`)."""
    script = ("from torchhal.distributed import launch; from tests.test_launch import report_placement; "
              "print(len(launch(report_placement, 2, ('ok',), timeout=120)))")
    out = subprocess.run(f'{sys.executable} -c "{script}" 2>&-', shell=True, cwd=ROOT, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip() == "2", out


def test_a_rank_hung_before_a_collective_fails_its_peer_through_the_group_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        launch(rank_one_never_reaches_the_collective, 2, (str(tmp_path),), grace=1.0)
    assert time.monotonic() - start < 45
    assert caught.value.rank == 0, caught.value  # the peer that waited is the one that raised
    assert "rank 0 raised" in str(caught.value)
    assert_gone(pids(tmp_path, 2))


def test_a_result_that_cannot_be_pickled_is_named():
    with pytest.raises(LaunchError, match="rank 0 returned a result that cannot be sent to the launcher"):
        launch(unpicklable_result, 1)


def test_ctrl_c_in_the_parent_stops_the_ranks(tmp_path):
    script = ("import sys; from torchhal.distributed import launch; from tests.test_launch import fail_on_rank_one; "
              f"launch(fail_on_rank_one, 2, ({str(tmp_path)!r}, 'hang'), grace=1.0)")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < end:
            time.sleep(0.1)
        started = pids(tmp_path, 2)
        parent.send_signal(signal.SIGINT)
        _, stderr = parent.communicate(timeout=120)  # a hang guard only: a loaded machine is slow
    finally:
        parent.kill()
    assert parent.returncode != 0
    assert "KeyboardInterrupt" in stderr
    assert_gone(started)


def test_a_rank_whose_launcher_is_killed_exits_on_its_own(tmp_path):
    script = ("from torchhal.distributed import launch; from tests.test_launch import fail_on_rank_one; "
              f"launch(fail_on_rank_one, 2, ({str(tmp_path)!r}, 'hang'))")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < end:
            time.sleep(0.1)
        started = pids(tmp_path, 2)
        parent.kill()  # SIGKILL: no chance to stop its ranks
        parent.wait(timeout=120)  # a hang guard only
    finally:
        parent.kill()
    assert_gone(started, within=10.0, zombie_is_gone=True)


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True, "2"])
def test_a_bad_world_size_is_refused_before_any_process_starts(world_size):
    with pytest.raises(ValueError, match=f"world_size = {world_size!r} must be a positive integer"):
        launch(report_placement, world_size, ("x",))  # type: ignore[arg-type]


def test_more_ranks_than_the_host_can_run_are_refused_before_any_process_starts(monkeypatch):
    launch_module = sys.modules["torchhal.distributed.launch"]  # the package's `launch` is the function
    monkeypatch.setattr(launch_module.os, "cpu_count", lambda: 2)
    started = []
    monkeypatch.setattr(launch_module, "get_subprocess_handler", lambda *args: started.append(args))
    limit = 2 * launch_module.MAX_RANKS_PER_CORE
    with pytest.raises(ValueError, match=rf"world_size = {limit + 1}: launch starts one process per rank on this host.*"
                                         rf"at most {limit}"):
        launch(report_placement, limit + 1, ("x",))
    with pytest.raises(ValueError, match=r"world_size = 1000000:"):
        launch(report_placement, 10**6, ("x",))
    assert started == []


def test_a_numpy_world_size_is_a_world_size():
    np = pytest.importorskip("numpy")
    [(tag, rank, world_size, *_)] = launch(report_placement, np.int64(1), ("x",))
    assert (tag, rank, world_size) == ("x", 0, 1)


def test_a_bad_timeout_is_refused():
    with pytest.raises(ValueError, match="timeout = 0 must be a positive number of seconds"):
        launch(report_placement, 1, ("x",), timeout=0)
