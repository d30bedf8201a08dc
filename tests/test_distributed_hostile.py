"""Hostile input to torchhal.distributed: a bad argument to `launch` or `init_group` is refused
in one line naming it, before anything starts (no rank started, no device set, no default
group name taken); what cannot be refused up front (a port that never answers, a script the
ranks cannot run, two processes claiming one rank, ranks that disagree on a collective) fails
within the group's timeout, naming the cause, and no process outlives `launch`.

Most tests refuse before starting anything; a group of one rank runs on threads of this
process; the two-rank scenarios run once each under `launch` (module-scoped fixtures)."""

from __future__ import annotations

import http.server
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.utils.distributed import get_free_port as free_port

import torchhal
import torchhal.distributed.group as group_module
from tests.test_launch import assert_gone
from torchhal.distributed import CollectiveError, LaunchError, RankPlacement, init_group, launch
from torchhal.platforms import DistributedSupport, Platform
from torchhal.platforms.testing import patched_plugin

ROOT = Path(__file__).resolve().parents[1]
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
launch_module = sys.modules["torchhal.distributed.launch"]  # the package's `launch` is the function


# -- targets (run in the ranks) --------------------------------------------------------------
def group_sum_and_torchelastic_variables(timeout_s: float) -> tuple[float, list[str]]:
    group = init_group(timeout=timedelta(seconds=timeout_s))
    try:
        total = group.comm.all_reduce(torch.tensor([float(group.rank + 1)])).item()
    finally:
        group.close()
    return total, sorted(name for name in os.environ if name.startswith("TORCHELASTIC_"))


def groups_one_after_another(cycles: int) -> list[float]:
    """`cycles` groups in turn, each made, used, closed and dropped by a function of its own (as
    the docs' `rank_sum`), rank 0 lingering after each while rank 1 goes on to the next."""
    return [one_group_sum() for _ in range(cycles)]


def one_group_sum() -> float:
    group = init_group(timeout=timedelta(seconds=10))
    try:
        total = group.comm.all_reduce(torch.tensor([group.rank + 1.0])).item()
    finally:
        group.close()
    if group.rank == 0:
        time.sleep(0.3)  # writes its report, say
    return total


def rank_tensor() -> torch.Tensor:
    return torch.arange(3.0) + 10 * int(os.environ["RANK"])


def rank_number() -> int:
    return int(os.environ["RANK"])


def start_a_sleeper_then(pid_dir: str, then: str) -> int:
    """Start a process of this rank's own, write its pid, then return or hang."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    Path(pid_dir, f"{os.environ['RANK']}.sleeper").write_text(str(sleeper.pid))
    if then == "hang":
        time.sleep(120)
    return sleeper.pid


# -- fixtures --------------------------------------------------------------------------------
@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before any rank starts: starting one fails the test."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a rank was started before the bad argument was refused")

    monkeypatch.setattr(launch_module, "get_subprocess_handler", refuse)


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Platform]:
    """The CPU platform, no torchrun variables, and a set_device that fails the test: a refusal
    must come before the device is touched."""
    for var in RANK_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    platform = torchhal.get_platform("cpu")

    def touched(index: int) -> None:
        raise AssertionError(f"set_device({index}) ran before the bad argument was refused")

    with patched_plugin(platform, set_device=touched):
        yield platform


def bounded(call: Callable[[], Any], seconds: float = 60) -> Any:
    """`call()`'s result or the exception it raised, on a thread of its own; "hung" when it has
    not returned within `seconds` (far past any timeout the tests give)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome[0] if outcome else "hung"


def on_threads(world: int, body: Callable[[int], Any]) -> list[Any]:
    """`body(rank)` for each rank on its own thread; each rank's result or error, in rank order."""
    results: list[Any] = ["hung"] * world

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except Exception as exc:
            results[rank] = f"{type(exc).__name__}: {str(exc)[:200]}"

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def run_script(directory: Path, code: str) -> subprocess.CompletedProcess[str]:
    """`code` saved as a script in `directory` and run as __main__, importing this repository's torchhal."""
    (directory / "script.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "script.py"], cwd=directory, env=env, capture_output=True, text=True,
                          timeout=180)


# -- launch: refused before any rank starts --------------------------------------------------
@pytest.mark.parametrize("timeout", [float("inf"), "5", True])
def test_launch_refuses_a_timeout_that_is_not_finite_positive_seconds(no_spawn, timeout):
    with pytest.raises(ValueError, match=f"^timeout = {timeout!r} must be a positive number of seconds"):
        launch(rank_number, 1, timeout=timeout)


@pytest.mark.parametrize("grace", ["3", None, True, -1, float("inf"), float("nan")])
def test_launch_refuses_a_grace_that_is_not_finite_seconds(no_spawn, grace):
    with pytest.raises(ValueError, match=f"^grace = {grace!r} must be a number of seconds"):
        launch(rank_number, 1, grace=grace)


@pytest.mark.parametrize("name", [*RANK_VARIABLES, "TORCHELASTIC_USE_AGENT_STORE"])
def test_launch_refuses_env_that_would_override_or_lose_what_it_sets(no_spawn, name):
    with pytest.raises(ValueError, match=f"^env\\['{name}'\\]: launch sets RANK, .* leave {name} out of env$"):
        launch(rank_number, 2, env={"TORCHHAL_FINE": "1", name: "3"})


@pytest.mark.parametrize("env, named", [
    ({"TORCHHAL_X": 1}, "env['TORCHHAL_X'] = 1: variable names and values must be str"),
    ({1: "x"}, "env[1] = 'x': variable names and values must be str"),
    ({"": "x"}, "env[''] = 'x': a variable name must be non-empty"),
    ({"A=B": "x"}, "env['A=B'] = 'x': a variable name must be non-empty, without '='"),
    (["TORCHHAL_X"], "env = ['TORCHHAL_X'] must be a mapping"),
])
def test_launch_refuses_env_a_rank_could_not_set_naming_the_variable(no_spawn, env, named):
    with pytest.raises(ValueError) as caught:
        launch(rank_number, 1, env=env)
    assert str(caught.value).startswith(named)


@pytest.mark.parametrize("value", ["bogus", "\u0131nfo"])  # dotless i: Python's upper() makes INFO of it, torch's not
def test_launch_refuses_a_torch_distributed_debug_torch_does_not_take(no_spawn: None, value: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"env['TORCH_DISTRIBUTED_DEBUG'] = {value!r}: torch takes OFF, "
                                                   "INFO or DETAIL")):
        launch(rank_number, 2, env={"TORCH_DISTRIBUTED_DEBUG": value})


@pytest.mark.parametrize("args, shown", [
    (5, "5 (int)"), ("ab", "'ab' (str)"), (b"ab", "b'ab' (bytes)"), (None, "None (NoneType)"),
    ({"a": 1}, "{'a': 1} (dict)"),
])
def test_launch_refuses_args_that_are_not_a_tuple_or_list(no_spawn: None, args: Any, shown: str) -> None:
    # "ab" would run target('a', 'b').
    with pytest.raises(ValueError) as caught:
        launch(rank_number, 2, args)
    message = str(caught.value)
    assert message.startswith(f"args = {shown} must be a tuple or list of the target's arguments"), message
    assert message.endswith(f"pass args=({args!r},) for a single argument, args=() for none")


def module_level_lambda() -> Callable[[], int]:
    return lambda: 1


def nested_function() -> Callable[[], int]:
    def nested() -> int:
        return 1

    return nested


class RefusesCopies:
    def __reduce__(self) -> Any:
        raise RuntimeError("this handle is bound to its process")


class LockedWorker:
    def __init__(self) -> None:
        self.lock = threading.Lock()

    def run(self) -> int:
        return 1


@pytest.mark.parametrize("target, args, error", [
    (rank_number, (1, module_level_lambda()),
     "args cannot be sent .* \\(AttributeError: Can't pickle local object 'module_level_lambda.<locals>.<lambda>'"),
    (rank_number, [[threading.Lock()]], "args cannot be sent .* \\(TypeError: cannot pickle '_thread.lock' object"),
    (rank_number, (torch.ones(2, 2), (n for n in range(3))),
     "args cannot be sent .* \\(TypeError: cannot pickle 'generator' object"),
    # a bound method carries its object: here the target is what cannot be sent, not the empty args
    (LockedWorker().run, (), "target <bound method LockedWorker.run of .* cannot be sent .* \\(TypeError: cannot "
                             "pickle '_thread.lock' object"),
    # an object's own __reduce__ may raise anything, not only pickling's errors
    (rank_number, (RefusesCopies(),), "args cannot be sent .* \\(RuntimeError: this handle is bound to its process"),
    # a function no rank can import by name: nested in another, or a lambda
    (nested_function(), (), "target <function nested_function.<locals>.nested .*> cannot be sent .* "
                            "\\(AttributeError: Can't pickle local object 'nested_function.<locals>.nested'"),
    (module_level_lambda(), (), "target <function module_level_lambda.<locals>.<lambda> .*> cannot be sent"),
], ids=["lambda", "lock", "generator", "bound-method", "own-reduce", "nested-target", "lambda-target"])
def test_launch_refuses_what_cannot_be_pickled_before_a_rank_exists(no_spawn: None, target: Any, args: Any,
                                                                   error: str) -> None:
    with pytest.raises(ValueError) as caught:
        launch(target, 2, args)
    message = str(caught.value)
    assert re.match(error, message) and "spawned processes that receive their inputs pickled" in message, message
    assert message.endswith("pass picklable values (data, module-level functions and classes), not lambdas, "
                            "local functions, locks, open files or generators") and "\n" not in message


def test_launch_refuses_a_target_that_is_not_callable(no_spawn: None) -> None:
    with pytest.raises(ValueError, match="target = 'rank_number' must be a callable"):
        launch("rank_number", 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("main_file, main_spec", [
    (None, None),  # python -c, an interactive session
    ("<stdin>", None),  # python - < script
    (None, "tool.__main__"),  # python -m tool: a package's __main__ is not run again in a rank
])
def test_launch_refuses_a_target_in_a_main_the_ranks_cannot_run_again(no_spawn, monkeypatch, main_file, main_spec):
    main = types.ModuleType("__main__")
    exec("def rank_fn():\n    return 1\n", main.__dict__)
    main.__file__ = main_file  # type: ignore[assignment]
    main.__spec__ = None if main_spec is None else types.SimpleNamespace(name=main_spec)  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "__main__", main)
    with pytest.raises(ValueError, match="target 'rank_fn' is defined in __main__ of a session the ranks cannot "
                                         "import .*: define it in a module or a script file"):
        launch(main.rank_fn, 2)


def test_launch_from_stdin_names_why_instead_of_a_bare_exit_code():
    script = "from torchhal.distributed import launch\ndef rank_fn():\n    return 1\nlaunch(rank_fn, 2)\n"
    ran = subprocess.run([sys.executable, "-"], input=script, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ran.returncode != 0
    last = ran.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: target 'rank_fn' is defined in __main__"), ran.stderr[-2000:]


# -- launch: what only a rank can find, named ------------------------------------------------
def test_a_module_target_launches_from_a_program_read_from_stdin():
    script = ("from torchhal.distributed import launch\n"
              "from tests.test_distributed_hostile import rank_number\n"
              "print(launch(rank_number, 2, timeout=120))\n")
    ran = subprocess.run([sys.executable, "-"], input=script, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert ran.returncode == 0 and ran.stdout.strip() == "[0, 1]", ran.stderr[-2000:]


def test_launch_from_a_script_without_a_main_guard_names_the_cause(tmp_path: Path) -> None:
    # Each rank runs the script again to import the target, and so calls launch again.
    ran = run_script(tmp_path, "from torchhal.distributed import launch\n\n\ndef rank_fn() -> int:\n    return 1\n\n\n"
                               "print(launch(rank_fn, 2, timeout=120))\n")
    assert ran.returncode != 0
    assert re.search(r"LaunchError: rank [01] failed running .*script\.py again as __mp_main__ .*: ValueError: "
                     r"launch\(\) was called while a rank ran the launching script again as __mp_main__ .*: call "
                     r"launch under `if __name__ == \"__main__\":`, which the ranks skip; stopped every rank",
                     ran.stderr), ran.stderr[-3000:]


def test_a_target_defined_in_the_scripts_main_block_is_named_by_the_ranks(tmp_path: Path) -> None:
    # The ranks import the script as __mp_main__, where the block does not run.
    ran = run_script(tmp_path, 'from torchhal.distributed import launch\n\nif __name__ == "__main__":\n'
                               '    def rank_fn() -> int:\n        return 1\n\n    launch(rank_fn, 2, timeout=120)\n')
    assert ran.returncode != 0
    assert re.search(r"LaunchError: rank [01] could not import the target \(a function at the top level of a module "
                     r"or of the script, outside its `if __name__ == \"__main__\":` block, which the ranks do not "
                     r"run\): AttributeError: Can't get attribute 'rank_fn' on <module '__mp_main__'", ran.stderr), \
        ran.stderr[-3000:]


def test_a_target_at_the_top_level_of_a_script_run_as_main_still_launches(tmp_path: Path) -> None:
    ran = run_script(tmp_path, """\
import http.server
import os

from torchhal.distributed import launch


def rank_fn() -> int:
    return int(os.environ["RANK"]) + 10


try:
    def in_a_block() -> str:
        return "in a block"
except ImportError:
    pass


if __name__ == "__main__":
    print(launch(rank_fn, 2), launch(in_a_block, 1))
""")
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip() == "[10, 11] ['in a block']"


# -- launch: no process outlives it ----------------------------------------------------------
def test_a_process_a_rank_started_does_not_outlive_launch(tmp_path: Path) -> None:
    [sleeper] = launch(start_a_sleeper_then, 1, (str(tmp_path), "return"), timeout=120)
    assert_gone([sleeper], within=10.0, zombie_is_gone=True)


def test_a_process_a_hung_rank_started_does_not_outlive_launch(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="did not finish within 10 s"):
        launch(start_a_sleeper_then, 1, (str(tmp_path), "hang"), timeout=10, grace=1.0)
    assert_gone([int((tmp_path / "0.sleeper").read_text())], within=10.0, zombie_is_gone=True)


# -- launch: ranks under torchrun, long deadlines, results -----------------------------------
def test_ranks_launched_from_a_torchrun_worker_do_not_look_for_torchruns_store(monkeypatch):
    # What torchrun puts in its workers' environment: a rank keeping it would wait for an agent
    # store on launch's port.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer")
    results = launch(group_sum_and_torchelastic_variables, 2, (5.0,), timeout=60, grace=1.0)
    assert results == [(3.0, []), (3.0, [])]
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the parent's own is kept


def test_a_long_finite_timeout_and_grace_are_waited_in_steps():
    assert launch(rank_number, 1, timeout=1e300, grace=1e300) == [0]


def test_launch_returns_each_ranks_tensor() -> None:
    """Results travel by value, so a tensor comes back after its rank has exited."""
    results = launch(rank_tensor, 2, timeout=120)
    assert [r.tolist() for r in results] == [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]]


# -- init_group: refused before anything is touched -----------------------------------------
@pytest.mark.parametrize("call, error, named", [
    (lambda cpu: init_group("cpu"), TypeError, "platform = 'cpu' must be a torchhal Platform"),
    (lambda cpu: init_group(cpu, store="x"), TypeError, "store = 'x' must be a torch.distributed.Store"),
    (lambda cpu: init_group(cpu, timeout=timedelta.max), ValueError, "timeout = datetime.timedelta(days=999999999"),
    (lambda cpu: init_group(cpu, timeout=timedelta(days=366)), ValueError,
     "timeout = datetime.timedelta(days=366) must be a datetime.timedelta of at least 1 ms and at most 365 days"),
    # Backends would truncate it to 0 ms, which they read as no timeout: a missing peer would hang.
    (lambda cpu: init_group(cpu, timeout=timedelta(microseconds=500)), ValueError,
     "timeout = datetime.timedelta(microseconds=500) must be a datetime.timedelta of at least 1 ms"),
    (lambda cpu: init_group(cpu, timeout=timedelta(0)), ValueError, "timeout = datetime.timedelta(0) must be"),
    (lambda cpu: init_group(cpu, name=""), ValueError, "name = '' must be a non-empty str"),
    (lambda cpu: init_group(cpu, name=5), ValueError, "name = 5 must be a non-empty str"),
])
def test_init_group_refuses_a_bad_argument_naming_it(cpu, call, error, named):
    with pytest.raises(error) as caught:
        call(cpu)
    assert str(caught.value).startswith(named), caught.value


@pytest.mark.parametrize("port", ["notaport", "70000", "0", "-1", ""])
def test_init_group_names_a_bad_master_port(cpu, monkeypatch, port):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    expected = "set MASTER_PORT" if port == "" else f"MASTER_PORT={port!r} must be a TCP port number, 1 to 65535"
    with pytest.raises(ValueError, match=expected):
        init_group(cpu, rank=0, world_size=2)


# torch's rendezvous tried each of these until the group's timeout, then named only a socket:
# "[::1]" too, as torch's TCPStore takes an IPv6 address bare.
@pytest.mark.parametrize("address", [" ", "rank0 host", "127.0.0.1 ", "127.0.0.1:29500", "tcp://127.0.0.1",
                                     "[::1]", "[::1]:29500"])
def test_init_group_names_a_malformed_master_addr(cpu, monkeypatch, address):
    monkeypatch.setenv("MASTER_ADDR", address)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError) as caught:
        init_group(cpu, rank=0, world_size=2)
    message = str(caught.value)
    assert message.startswith(f"MASTER_ADDR={address!r} must be a host name or IP address alone"), message
    assert message.endswith("set MASTER_ADDR to rank 0's host name or IP address"), message


@pytest.mark.parametrize("address", ["no-such-host.invalid", "rank0..example"])  # .invalid never resolves (RFC 6761)
def test_init_group_names_a_master_addr_that_does_not_resolve(cpu, monkeypatch, address):
    monkeypatch.setenv("MASTER_ADDR", address)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match=rf"^MASTER_ADDR={re.escape(repr(address))} does not resolve \(.+\): set "
                                         "MASTER_ADDR to rank 0's host name or IP address$"):
        init_group(cpu, rank=0, world_size=2)


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost", "::1"])
def test_init_group_takes_a_master_addr_of_a_name_or_an_address(cpu, monkeypatch, address):
    monkeypatch.setenv("MASTER_ADDR", address)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(AssertionError, match="set_device"):  # past every check, to the device
        init_group(cpu, rank=0, world_size=2)


def test_a_sub_group_inside_a_larger_torchrun_job_keeps_the_workers_device(monkeypatch):
    """Data parallel x tensor parallel: worker 5 of a 16-rank job on hosts of 8 makes a 2-rank
    group of its own. Its device is still its LOCAL_RANK's: the local variables say where the
    process sits on the host, which may hold more ranks than the group has."""
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert RankPlacement.from_env(rank=1, world_size=2) == RankPlacement(1, 2, 5, 8)
    assert RankPlacement.from_env(rank=0, world_size=1) == RankPlacement(0, 1, 5, 8)


@pytest.mark.parametrize("rendezvous", ["env", "default group"])
def test_a_default_named_group_smaller_than_the_job_it_meets_in_is_refused_naming_the_fix(cpu, monkeypatch,
                                                                                         rendezvous):
    """Data parallel x tensor parallel: two 2-rank groups of a 4-process job, both default-named
    'group0' on the job's rendezvous, would pair up in the order their ranks arrive, across
    replicas, and sum the wrong ranks' tensors."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    if rendezvous == "env":
        monkeypatch.setenv("WORLD_SIZE", "4")
        shared = r"the env:// rendezvous \(MASTER_ADDR:MASTER_PORT, WORLD_SIZE=4\)"
    else:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
        shared = "torch.distributed's default group"
    with pytest.raises(ValueError, match=rf"^name = None: this group of 2 ranks meets on {shared}, which 4 processes "
                                         "share, and default names would pair the ranks of their groups in the order "
                                         r"they arrive: pass a name= unique to each sub-group \(name=f'tp\{replica\}', "
                                         r"say\)$"):
        init_group(cpu, rank=1, world_size=2, local_rank=1)
    with pytest.raises(AssertionError, match="set_device"):  # named, or the whole job: past every check, to the device
        init_group(cpu, rank=1, world_size=2, local_rank=1, name="tp1")
    with pytest.raises(AssertionError, match="set_device"):
        init_group(cpu, rank=1, world_size=4, local_rank=1)


def test_groups_made_one_after_another_under_launch_all_form() -> None:
    """Rank 0's env:// store is kept for the process's life: rank 1, already in the next group's
    rendezvous on rank 0's server, would lose it with the group that made it."""
    assert launch(groups_one_after_another, 2, (3,), timeout=90) == [[3.0] * 3] * 2


def test_a_group_of_several_ranks_without_a_rank_is_refused_naming_it(monkeypatch):
    """Rank 0 by default would make every process of the group rank 0, and the group would wait
    out its whole timeout; refused before any store is touched."""
    for var in RANK_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"world_size 2 needs this process's rank: pass rank= \(0..1\)"):
        init_group(world_size=2, store=dist.HashStore())
    assert RankPlacement.from_env(world_size=1) == RankPlacement(0, 1, 0, 1)  # one process needs no rank
    monkeypatch.setenv("RANK", "1")
    assert RankPlacement.from_env(world_size=2).rank == 1


def test_rank_variables_without_local_rank_are_refused_naming_it(monkeypatch):
    """Local rank 0 by default would put every rank of the host on device 0."""
    for var in RANK_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"RANK=1 and WORLD_SIZE=2 are set but LOCAL_RANK is not: set it"):
        RankPlacement.from_env()
    assert RankPlacement.from_env(local_rank=1).local_rank == 1
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert RankPlacement.from_env() == RankPlacement(1, 2, 1, 2)


@pytest.mark.parametrize("text", ["1_0", " 1", "1 ", "\u0661", "+1", "1.0", "0x1", ""])
def test_a_rank_variable_that_is_not_plain_digits_is_refused_naming_it(monkeypatch, text):
    """int() would read "1_0" as 10 and Arabic-Indic digits as numbers: a mistyped rank would
    silently become another process's."""
    for var in RANK_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", text)
    with pytest.raises(ValueError, match=re.escape(f"RANK={text!r} must be a decimal integer such as 0 or 3")):
        RankPlacement.from_env()
    monkeypatch.setenv("RANK", "1")
    assert RankPlacement.from_env().rank == 1


def test_a_refused_or_failed_init_group_takes_no_default_name(monkeypatch):
    for var in (*RANK_VARIABLES, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    cpu = torchhal.get_platform("cpu")
    first = init_group(cpu)
    first.close()
    refused: list[Callable[[], Any]] = [
        lambda: init_group(cpu, timeout=timedelta.max),
        lambda: init_group(cpu, store="x"),
        lambda: init_group(cpu, rank=0, world_size=2),  # no MASTER_ADDR / MASTER_PORT
    ]
    for call in refused:
        with pytest.raises((ValueError, TypeError)):
            call()
    # One that passes the checks and fails in the rendezvous: rank 1 finds no store on the port.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(Exception, match="127.0.0.1"):
        init_group(cpu, rank=1, world_size=2, timeout=timedelta(seconds=1))
    monkeypatch.delenv("MASTER_PORT")
    second = init_group(cpu)
    second.close()
    assert int(second.name.removeprefix("group")) == int(first.name.removeprefix("group")) + 1


def test_a_store_whose_server_went_is_dropped_so_the_next_init_group_reaches_the_new_one(monkeypatch):
    """env:// stores are kept for the process's life; when rank 0's goes (rank 0 restarted on the
    same address and port), the kept connection is dropped with the group it failed, so the advice
    to call init_group again works."""
    for var in (*RANK_VARIABLES, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(group_module, "_env_stores", {})
    quick = timedelta(seconds=1)
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=quick, wait_for_workers=False)
    key = (os.getpid(), "127.0.0.1", str(port), 1, 2)
    with pytest.raises(CollectiveError, match="did not form"):  # rank 0 never joins: only the store is reached
        init_group(torchhal.get_platform("cpu"), rank=1, world_size=2, timeout=quick)
    assert key in group_module._env_stores
    del server  # rank 0 goes, and comes back on the same port
    restarted = dist.TCPStore("127.0.0.1", port, 2, True, timeout=quick, wait_for_workers=False)
    with pytest.raises(CollectiveError, match="did not form"):
        init_group(torchhal.get_platform("cpu"), rank=1, world_size=2, timeout=quick)
    assert key not in group_module._env_stores, "the dead connection was kept"
    with pytest.raises(CollectiveError, match="did not form"):
        init_group(torchhal.get_platform("cpu"), rank=1, world_size=2, timeout=quick)
    group_module._env_stores[key].set("reached", "1")
    assert restarted.get("reached") == b"1"


# -- init_group: a store that never answers --------------------------------------------------
@pytest.fixture
def deaf_port(request: pytest.FixtureRequest) -> Iterator[int]:
    """A port whose listener accepts connections and never answers a store: a silent one, or an
    HTTP server (a mistyped port), which waits for a request line the store never sends."""
    if request.param == "http":
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield server.server_address[1]
        server.shutdown()
        server.server_close()
        return
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield listener.getsockname()[1]
    listener.close()


def env_rendezvous(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    for var in (*RANK_VARIABLES, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(group_module, "_env_stores", {})


@pytest.mark.parametrize("deaf_port", ["silent", "http"], indirect=True)
def test_a_rank_whose_store_never_answers_raises_within_the_groups_timeout_naming_the_address(
        monkeypatch: pytest.MonkeyPatch, deaf_port: int) -> None:
    """torch's store waits for an answer without bound; the group's timeout bounds it."""
    env_rendezvous(monkeypatch, deaf_port)
    error = bounded(lambda: init_group(torchhal.get_platform("cpu"), rank=1, world_size=2, local_rank=1, name="deaf",
                                       timeout=timedelta(seconds=2)))
    assert isinstance(error, CollectiveError), error
    assert str(error).startswith("init_group: group 'deaf' did not form at rank 1 of 2 within 2 s: "), error
    assert f"127.0.0.1:{deaf_port}" in str(error), error


@pytest.mark.parametrize("deaf_port", ["silent"], indirect=True)
def test_a_rank_0_whose_port_another_process_holds_is_told_so(monkeypatch: pytest.MonkeyPatch,
                                                              deaf_port: int) -> None:
    """Another process listens on MASTER_PORT: a second process with RANK=0, or another program."""
    env_rendezvous(monkeypatch, deaf_port)
    error = bounded(lambda: init_group(torchhal.get_platform("cpu"), rank=0, world_size=2, local_rank=0, name="taken",
                                       timeout=timedelta(seconds=2)))
    assert isinstance(error, CollectiveError), error
    assert (f"rank 0's store at 127.0.0.1:{deaf_port} (MASTER_ADDR:MASTER_PORT) is taken by another process: a "
            "second process with RANK=0, or another program") in str(error), error


def test_a_rank_whose_rank_0_is_stopped_raises_within_the_groups_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", "import datetime, time, torch.distributed as dist; "
         f"store = dist.TCPStore('127.0.0.1', {port}, 2, True, timeout=datetime.timedelta(seconds=60), "
         "wait_for_workers=False); print('up', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "up\n"
        os.kill(server.pid, signal.SIGSTOP)  # rank 0, stopped (a debugger, a job control mistake)
        env_rendezvous(monkeypatch, port)
        error = bounded(lambda: init_group(torchhal.get_platform("cpu"), rank=1, world_size=2, local_rank=1,
                                           name="stopped", timeout=timedelta(seconds=2)))
    finally:
        server.kill()
        server.wait()
    assert isinstance(error, CollectiveError), error
    assert str(error).startswith("init_group: group 'stopped' did not form at rank 1 of 2 within 2 s"), error
    assert f"127.0.0.1:{port}" in str(error), error


# -- init_group: default names under threads -------------------------------------------------
def test_a_default_named_init_group_while_another_thread_is_in_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Default names follow call order, which threads do not have: the second is refused, the
    first works, and the next default-named call gets the next name."""
    for var in (*RANK_VARIABLES, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    cpu = torchhal.get_platform("cpu")
    inside, release = threading.Event(), threading.Event()
    real_form = group_module._form
    formed: list[str] = []

    def slow_form(backend: str, placement: Any, connect: Any, name: str, *args: Any) -> Any:
        formed.append(name)
        if not inside.is_set():  # the first caller waits here, inside init_group, for the second's
            inside.set()
            release.wait(30)
        return real_form(backend, placement, connect, name, *args)

    monkeypatch.setattr(group_module, "_form", slow_form)
    made: list[Any] = []
    first = threading.Thread(target=lambda: made.append(init_group(cpu)), daemon=True)
    first.start()
    try:
        assert inside.wait(30)
        with pytest.raises(ValueError, match="^name = None: another thread of this process is inside a default-named "
                                             "init_group; default names follow call order, which threads do not "
                                             "have: pass name= to each group when threads make groups$"):
            init_group(cpu)
    finally:
        release.set()
        first.join(30)
    [group] = made
    try:
        assert group.comm.all_reduce(torch.tensor([2.0])).item() == 2.0
    finally:
        group.close()
    after = init_group(cpu)
    after.close()
    assert int(after.name.removeprefix("group")) == int(group.name.removeprefix("group")) + 1
    assert formed == [group.name, after.name]  # the refused call formed nothing


def inner_group_hook(cpu: Platform) -> DistributedSupport:
    """A plugin's communicator hook that makes a default-named helper group of its own."""
    def communicator(default: Any) -> Any:
        init_group(cpu)
        return default

    return DistributedSupport(communicator=communicator)


def test_a_default_named_init_group_inside_one_on_the_same_thread_is_refused_as_such(monkeypatch):
    # E.g. a plugin's communicator hook making a helper group: not "another thread".
    for var in (*RANK_VARIABLES, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    cpu = torchhal.get_platform("cpu")
    with patched_plugin(cpu, distributed_support=lambda: inner_group_hook(cpu)), \
            pytest.raises(ValueError, match="^name = None: init_group was called from inside a default-named "
                                            "init_group on the same thread, which would take the outer group's name; "
                                            "pass name= to the inner one$"):
        init_group(cpu)
    group = init_group(cpu)  # the refusal left the naming free
    group.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_inside_a_default_named_init_group_unwinds_with_its_own_error(monkeypatch):
    # The child's init_group frees no naming of its parent's.
    for var in (*RANK_VARIABLES, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    cpu = torchhal.get_platform("cpu")

    def forks(default: Any) -> Any:
        if os.fork() == 0:
            raise KeyError("the child's own error")  # the child unwinds through init_group
        return default

    parent = os.getpid()
    try:
        with patched_plugin(cpu, distributed_support=lambda: DistributedSupport(communicator=forks)):
            group = init_group(cpu)
    except KeyError:
        os._exit(0 if os.getpid() != parent else 9)  # the child, its own error: as it should be
    except BaseException:
        if os.getpid() != parent:
            os._exit(1)  # the child, another error in place of its own
        raise
    group.close()
    _, status = os.wait()
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.getpid() not in group_module._naming


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_can_make_a_default_named_group_while_the_parent_is_inside_one(monkeypatch):
    for var in (*RANK_VARIABLES, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    # as if another thread of this process were inside init_group
    monkeypatch.setitem(group_module._naming, os.getpid(), (threading.get_ident() + 1, object()))
    child = os.fork()
    if child == 0:
        try:
            init_group(torchhal.get_platform("cpu")).close()
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize(("field", "value"), [("communicator", 5), ("graph_capturable", "no"),
                                              ("graph_capturable", 1), ("note", None)])
def test_a_distributed_support_record_with_a_wrong_value_is_refused_naming_the_field(field: str, value: object):

    with pytest.raises(TypeError, match=f"DistributedSupport.{field} is {value!r}"):
        DistributedSupport(**{field: value})  # type: ignore[arg-type]
    assert DistributedSupport(communicator=lambda comm: comm, graph_capturable=True).graph_capturable is True


def gloo_pair(rank: int, store: dist.Store) -> Any:
    from torchhal.platforms.communicator import TorchCommunicator

    backend = dist.ProcessGroupGloo(dist.PrefixStore("pair", store), rank, 2)
    return TorchCommunicator(backend, rank, 2, torch.device("cpu"), name="pair", timeout=timedelta(seconds=20))


def test_in_place_collectives_on_a_non_contiguous_view_write_that_view_and_nothing_else() -> None:
    """A backend reads a tensor's storage as dense: a column of a matrix must be reduced (and
    broadcast into, and received into) as the column, and the rest of the matrix left alone."""
    store = dist.HashStore()

    def body(rank: int) -> list[Any]:
        comm = gloo_pair(rank, store)
        summed = torch.arange(6.0).reshape(2, 3) + 10 * rank
        comm.all_reduce(summed[:, 0])
        sent = torch.zeros(2, 3)
        if rank == 0:
            sent[:, 1] = torch.tensor([7.0, 8.0])
        comm.broadcast(sent[:, 1], 0)
        received = torch.zeros(2, 3)
        if rank == 0:
            comm.send(torch.tensor([[1.0, 2.0], [3.0, 4.0]]).t(), 1)
        else:
            comm.recv(received[:, :2], 0)
        return [summed.tolist(), sent.tolist(), received.tolist()]

    zero, one = on_threads(2, body)
    assert zero[0] == [[10.0, 1.0, 2.0], [16.0, 4.0, 5.0]]
    assert one[0] == [[10.0, 11.0, 12.0], [16.0, 14.0, 15.0]]
    assert zero[1] == one[1] == [[0.0, 7.0, 0.0], [0.0, 8.0, 0.0]]
    assert one[2] == [[1.0, 3.0, 0.0], [2.0, 4.0, 0.0]]


def test_all_gather_reads_sizes_given_as_a_generator_once() -> None:
    store = dist.HashStore()

    def body(rank: int) -> list[float]:
        comm = gloo_pair(rank, store)
        return comm.all_gather(torch.full((rank + 1,), float(rank)), sizes=(n for n in (1, 2))).tolist()

    assert on_threads(2, body) == [[0.0, 1.0, 1.0]] * 2


@pytest.mark.parametrize("tensor, error", [
    (torch.ones(4, device="meta"), "the tensor is on meta, this group's rank 0 on cpu; move it there first"),
    ([1.0, 2.0], "expected a torch.Tensor, got list"),
])
def test_a_ranks_own_bad_tensor_is_refused_before_any_peer_waits(tensor: Any, error: str) -> None:
    """Not a CollectiveError blaming a peer after the timeout: the caller's mistake, named at once."""
    from torchhal.platforms.communicator import TorchCommunicator

    comm = TorchCommunicator(object(), 0, 2, torch.device("cpu"), name="lonely")  # no peer ever joins
    for call in (lambda: comm.all_reduce(tensor), lambda: comm.all_gather(tensor), lambda: comm.broadcast(tensor, 1),
                 lambda: comm.send(tensor, 1), lambda: comm.recv(tensor, 1)):
        with pytest.raises((TypeError, ValueError), match=re.escape(error)):
            call()


@pytest.mark.parametrize("method, arguments, dtype, call", [
    ("all_reduce", ("max",), torch.complex64, "all_reduce(op='max')"),
    ("all_reduce", ("sum",), torch.float8_e4m3fn, "all_reduce(op='sum')"),
    ("all_reduce", ("min",), torch.uint16, "all_reduce(op='min')"),
    ("all_gather", (), torch.complex64, "all_gather"),
    ("broadcast", (0,), torch.uint32, "broadcast(src=0)"),
])
def test_a_dtype_gloo_cannot_take_is_refused_naming_it_and_the_group_still_works(
        method: str, arguments: tuple[Any, ...], dtype: torch.dtype, call: str) -> None:
    """Given alike by every rank, it would fail in the backend once the ranks had met, as a
    CollectiveError blaming a dead or diverged peer and saying the group cannot be reused."""
    store = dist.HashStore()

    def body(rank: int) -> list[Any]:
        comm = gloo_pair(rank, store)
        with pytest.raises(ValueError) as refused:
            getattr(comm, method)(torch.ones(4).to(dtype), *arguments)
        summed = comm.all_reduce(torch.ones(2, dtype=torch.complex64)).tolist()  # complex sums go as reals
        return [str(refused.value), summed, comm.all_reduce(torch.ones(1)).item()]

    shown = str(dtype).removeprefix("torch.")
    taken = "bfloat16, bool, float16, float32, float64, int32, int64, int8, uint8"
    taken += " and complex" if call in ("all_reduce(op='sum')", "broadcast(src=0)") else ""
    refusal = f"{call}: gloo cannot take {shown} tensors here; it takes {taken}: convert the tensor first " \
              "(tensor.to(...))"
    assert on_threads(2, body) == [[refusal, [2 + 0j, 2 + 0j], 2.0]] * 2


@pytest.mark.parametrize("tensor", [torch.ones(1).expand(4), torch.arange(5.0).unfold(0, 3, 1)],
                         ids=["expand", "unfold"])
def test_a_tensor_whose_elements_share_memory_is_refused_where_a_result_is_written(tensor: torch.Tensor) -> None:
    """Refused before the collective, which would run with every peer, then fail writing back on this rank alone."""
    from torchhal.platforms.communicator import TorchCommunicator

    comm = TorchCommunicator(object(), 0, 2, torch.device("cpu"), name="lonely")  # no peer ever joins
    before = tensor.tolist()
    shape, strides = list(tensor.shape), list(tensor.stride())
    for call, name in [(lambda: comm.all_reduce(tensor), "all_reduce(op='sum')"),
                       (lambda: comm.broadcast(tensor, 1), "broadcast(src=1)"),
                       (lambda: comm.recv(tensor, 1), "recv(src=1)")]:
        with pytest.raises(ValueError, match=re.escape(
                f"{name}: elements of the tensor share memory (shape {shape}, strides {strides}: an expand()ed or "
                "unfold()ed view, say), so the result cannot be written into it; pass a tensor of its own "
                "(tensor.clone())")):
            call()
    assert tensor.tolist() == before


def test_ranks_and_dims_take_numpy_integers_and_refuse_bools() -> None:
    """np.int64(0) is a rank of this group; dim=True is no dimension (not dim 1)."""
    import numpy as np

    from torchhal.platforms.communicator import TorchCommunicator

    comm = TorchCommunicator(object(), 0, 2, torch.device("cpu"), name="lonely")
    for call, error in [(lambda: comm.all_gather(torch.ones(2, 3), dim=True), "all_gather(dim=True): give a dimension "
                         "of the tensor (an int; it has 2)"),
                        (lambda: comm.all_gather(torch.ones(2, 3), dim=1.0), "all_gather(dim=1.0)"),
                        (lambda: comm.broadcast(torch.ones(2), True), "broadcast(src=...) True is not a rank of this "
                         "group (an int, 0..1)"),
                        (lambda: comm.send(torch.ones(2), np.float64(1)),
                         "send(dst=...) np.float64(1.0) is not a rank")]:
        with pytest.raises(ValueError, match=re.escape(error)):
            call()
    store = dist.HashStore()

    def body(rank: int) -> list[Any]:
        pair = gloo_pair(rank, store)
        sent = pair.broadcast(torch.full((2,), float(rank)), np.int64(1)).tolist()
        gathered = pair.all_gather(torch.full((1, 1), float(rank)), dim=np.int64(-1)).tolist()
        if rank == 0:
            pair.send(torch.tensor([5.0]), np.int32(1))
            return [sent, gathered]
        return [sent, gathered, pair.recv(torch.zeros(1), np.int64(0)).tolist()]

    assert on_threads(2, body) == [[[1.0, 1.0], [[0.0, 1.0]]], [[1.0, 1.0], [[0.0, 1.0]], [5.0]]]


# -- two ranks: groups made again, retried, claimed twice ------------------------------------
def error_of(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def one_sum(name: str, timeout_s: float = 10, **kwargs: Any) -> float:
    group = init_group(name=name, timeout=timedelta(seconds=timeout_s), **kwargs)
    try:
        return group.comm.all_reduce(torch.ones(1)).item()
    finally:
        group.close()


def two_rank_scenarios(store_dir: str) -> dict[str, Any]:
    """A rank of `launch` (2 ranks): each scenario in turn, with a barrier between them."""
    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    sync = init_group(name="sync", timeout=timedelta(seconds=60))

    def barrier() -> None:
        sync.host.all_reduce(torch.zeros(1))

    def group_sum(group: Any, value: float) -> float:
        return group.comm.all_reduce(torch.tensor([value])).item()

    # A group made again under its name: after the first is closed, and while it is open.
    first = init_group(name="again", timeout=timedelta(seconds=10))
    sums = [group_sum(first, rank + 1.0)]
    first.close()
    again = init_group(name="again", timeout=timedelta(seconds=10))
    third = init_group(name="again", timeout=timedelta(seconds=10))
    sums += [group_sum(again, rank + 10.0), group_sum(third, rank + 100.0), group_sum(again, rank + 1000.0)]
    third.close()
    again.close()
    out["made_again"] = sums

    # The device and host communicators of a CPU group pair their own calls only: each rank makes
    # both sums from two threads, in opposite orders on the two ranks.
    both = init_group(name="both", timeout=timedelta(seconds=10))
    values = {"comm": torch.full((4,), float(rank + 1)), "host": torch.full((4,), 100.0 * (rank + 1))}
    order = ("comm", "host") if rank == 0 else ("host", "comm")
    comms = {"comm": both.comm, "host": both.host}
    thread = threading.Thread(target=comms[order[0]].all_reduce, args=(values[order[0]],))
    thread.start()
    time.sleep(0.3)  # the first call is issued before the second, on each rank
    comms[order[1]].all_reduce(values[order[1]])
    thread.join(20)
    out["both"] = [values["comm"][0].item(), values["host"][0].item()]
    both.close()

    # One rank makes a group alone and times out; then every rank makes it again, and again.
    for case, alone in (("lonely", 1), ("late", 0)):
        if rank == alone:
            out[f"{case}_alone"] = error_of(lambda case=case: one_sum(case, 1))
        barrier()
        if rank == alone:  # the other rank comes first to the retry
            time.sleep(0.3)
        out[f"{case}_retried"] = [one_sum(case, 10), one_sum(case, 10)]
        barrier()

    # Two processes as rank 0 on one store: the second is told at once, the first when it times out.
    store = dist.FileStore(str(Path(store_dir) / "claims"), -1)
    time.sleep(0.3 * rank)
    out["claimed_twice"] = error_of(lambda: init_group(rank=0, world_size=2, local_rank=0, store=store, name="tp",
                                                       timeout=timedelta(seconds=2)))
    barrier()

    # Two processes as rank 0 over env://: rank 1's process cannot host rank 0's store on its port.
    if rank == 1:
        out["env_rank_0_twice"] = error_of(lambda: init_group(rank=0, world_size=2, local_rank=0, name="env0",
                                                              timeout=timedelta(seconds=2)))
    barrier()
    sync.close()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(two_rank_scenarios, 2, (str(tmp_path_factory.mktemp("claims")),), timeout=240)


def test_a_group_made_again_under_its_name_is_a_new_group_that_works(two_ranks) -> None:
    assert [r["made_again"] for r in two_ranks] == [[3.0, 21.0, 201.0, 2001.0]] * 2


def test_the_device_and_host_communicators_of_a_cpu_group_do_not_pair_each_others_calls(two_ranks) -> None:
    """Threads may call `comm` and `host` at once (one feeding requests over `host` while the
    engine steps): one gloo backend for both would pair rank 0's device sum with rank 1's host
    sum, and both would come back wrong (201 and 102), without an error."""
    assert [r["both"] for r in two_ranks] == [[3.0, 300.0]] * 2


@pytest.mark.parametrize("case, alone", [("lonely", 1), ("late", 0)])
def test_a_group_that_did_not_form_forms_when_every_rank_makes_it_again(two_ranks, case: str, alone: int) -> None:
    """A rank that timed out alone (its peer late) is told so, naming the group, the rank and the
    timeout; the generation it failed in is not joined again, so every rank's next call meets."""
    assert two_ranks[alone][f"{case}_alone"].startswith(
        f"CollectiveError: init_group: group {case!r} did not form at rank {alone} of 2 within 1 s: ")
    assert two_ranks[alone][f"{case}_alone"].endswith("calling init_group again on every rank makes a new attempt")
    assert [r[f"{case}_retried"] for r in two_ranks] == [[2.0, 2.0]] * 2


def claimed_twice(rank: int) -> str:
    return (f"ValueError: init_group: two processes are forming group 'tp' as rank {rank} at once: two processes "
            f"with RANK={rank} (or the same rank=), or two groups made under the name 'tp'. Give each process its own "
            "rank and each group its own name; if the other process died making the group, retry")


def test_two_processes_of_one_rank_are_told_so(two_ranks) -> None:
    assert [r["claimed_twice"] for r in two_ranks] == [claimed_twice(0)] * 2


def test_a_second_rank_0_over_env_is_told_its_port_is_taken(two_ranks) -> None:
    error = two_ranks[1]["env_rank_0_twice"]
    assert error.startswith("CollectiveError: init_group: group 'env0' did not form at rank 0 of 2 within 2 s: "
                            "rank 0's store at 127.0.0.1:"), error
    assert "is taken by another process: a second process with RANK=0, or another program" in error, error


# -- ranks that disagree on a collective: torch's TORCH_DISTRIBUTED_DEBUG=DETAIL ----------------
DISAGREEMENTS: dict[str, Callable[[Any, int], Any]] = {
    # [2, 3] against [3, 2]: the same bytes, so unchecked, gloo sums them as if they matched.
    "shape": lambda g, rank: g.comm.all_reduce(torch.ones((2, 3) if rank == 0 else (3, 2))),
    # Other byte counts and dtypes: unchecked, gloo aborts each rank's process (SIGABRT).
    "length": lambda g, rank: g.comm.all_reduce(torch.ones(4 + rank)),
    "dtype": lambda g, rank: g.comm.all_reduce(torch.ones(4, dtype=(torch.float32, torch.float64)[rank])),
    "call": lambda g, rank: g.comm.all_reduce(torch.ones(4)) if rank == 0 else g.comm.broadcast(torch.ones(4), 0),
    "host": lambda g, rank: g.host.all_gather(torch.ones(2 + rank)),
}


def detail_scenarios() -> dict[str, Any]:
    """A rank of `launch` under TORCH_DISTRIBUTED_DEBUG=DETAIL: each disagreement on a group of its
    own, then collectives that match, then a group whose ranks differ on the setting."""
    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {"level": str(dist.get_debug_level())}
    for case, body in DISAGREEMENTS.items():
        group = init_group(name=case, timeout=timedelta(seconds=10))
        out[case] = error_of(lambda group=group, body=body: body(group, rank))
        group.close()
    group = init_group(name="matching", timeout=timedelta(seconds=10))
    out["matching"] = [group.comm.all_reduce(torch.tensor([rank + 1.0])).tolist(),
                       group.comm.all_gather(torch.full((rank + 1,), float(rank)), sizes=(1, 2)).tolist(),
                       group.comm.broadcast(torch.tensor([7.0 if rank == 0 else 0.0]), 0).tolist(),
                       group.host.all_reduce(torch.tensor([10.0 * rank]), "max").tolist()]
    if rank == 0:
        group.comm.send(torch.tensor([5.0, 6.0]), 1)
    else:
        out["matching"].append(group.comm.recv(torch.zeros(2), 0).tolist())
    group.close()
    dist.set_debug_level(dist.DebugLevel.DETAIL if rank == 0 else dist.DebugLevel.OFF)
    out["mixed"] = error_of(lambda: one_sum("mixed", 3))
    return out


@pytest.fixture(scope="module")
def detail_ranks() -> list[dict[str, Any]]:
    """Set as a user sets it: each rank starts with it, and torch reads it as it is imported."""
    return launch(detail_scenarios, 2, timeout=240, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})


@pytest.mark.parametrize("case", list(DISAGREEMENTS))
def test_under_detail_debug_ranks_that_disagree_on_a_collective_are_each_told_both_calls(detail_ranks,
                                                                                         case: str) -> None:
    assert all(r["level"] == "DebugLevel.DETAIL" for r in detail_ranks)
    for rank, report in enumerate(detail_ranks):
        error = report[case]
        assert error.startswith("CollectiveError: ") and "Detected mismatch between collectives on ranks" in error, \
            (rank, error)
        assert f"Rank {rank} is running collective" in error and f"Rank {1 - rank} is running collective" in error, \
            (rank, error)


def test_under_detail_debug_matching_collectives_still_give_their_results(detail_ranks) -> None:
    assert detail_ranks[0]["matching"] == [[3.0], [0.0, 1.0, 1.0], [7.0], [10.0]]
    assert detail_ranks[1]["matching"] == [[3.0], [0.0, 1.0, 1.0], [7.0], [10.0], [5.0, 6.0]]


def test_ranks_that_differ_on_detail_debug_fail_within_the_groups_timeout(detail_ranks) -> None:
    """torch's check is a collective of its own: a rank without it never joins it."""
    for report in detail_ranks:
        assert report["mixed"].startswith("CollectiveError: init_group: group 'mixed' did not form"), report["mixed"]
        assert "TORCH_DISTRIBUTED_DEBUG alike" in report["mixed"], report["mixed"]


def test_a_world_size_past_any_group_is_refused_before_the_store_is_touched(monkeypatch) -> None:
    """2**40 ranks once listed a store key per rank: the host's memory filled before any timeout."""
    from torchhal.distributed.group import MAX_WORLD_SIZE

    with pytest.raises(ValueError, match=r"world_size = 1099511627776 is more ranks than any group torchhal forms"):
        RankPlacement(0, 2**40, 0, 1)
    with pytest.raises(ValueError, match=r"local_world_size = 1048577 is more ranks"):
        RankPlacement(0, 2, 0, MAX_WORLD_SIZE + 1)
    monkeypatch.setenv("WORLD_SIZE", "9" * 25)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match=r"world_size = 9{25} is more ranks.*WORLD_SIZE"):
        RankPlacement.from_env()
    touched = []

    class Store:
        def __getattr__(self, name: str) -> Any:
            touched.append(name)
            raise AssertionError(f"store.{name} called")

    with pytest.raises(ValueError, match="more ranks than any group"):
        init_group(rank=0, world_size=2**40, local_rank=0, store=Store(), timeout=timedelta(seconds=2),  # type: ignore[arg-type]
                   name="huge")
    assert touched == []


def test_a_hostile_variable_is_refused_naming_it_not_pythons_digit_limit(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "9" * 5000)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"WORLD_SIZE='9999.*must be a decimal integer"):
        RankPlacement.from_env()


def test_parse_decimal_reads_text_only() -> None:
    from torchhal.values import MAX_DECIMAL_DIGITS, parse_decimal

    assert parse_decimal("-12") == -12 and parse_decimal("9" * MAX_DECIMAL_DIGITS) == int("9" * MAX_DECIMAL_DIGITS)
    assert parse_decimal("9" * (MAX_DECIMAL_DIGITS + 1)) is None
    for text in ("1_0", " 3", "\u0664", "", "-", "+1"):
        assert parse_decimal(text) is None, text
    for value in (None, 3, b"3"):
        with pytest.raises(TypeError, match="parse_decimal takes the text to read, a str"):
            parse_decimal(value)  # type: ignore[arg-type]


def test_a_placement_of_numpy_integers_is_one_of_plain_ints() -> None:
    np = pytest.importorskip("numpy")
    placement = RankPlacement(np.int64(1), np.int32(2), np.int64(0), np.int64(1))
    assert placement == RankPlacement(1, 2, 0, 1)
    assert all(type(getattr(placement, f)) is int for f in ("rank", "world_size", "local_rank", "local_world_size"))
    with pytest.raises(TypeError, match="rank = True must be an int"):
        RankPlacement(True, 2, 0, 1)
