"""Hostile input to torchhal.distributed: a bad argument to `launch` or `init_group` is refused
in one line naming it, before anything starts (no rank spawned, no device set, no default
group name taken), and what used to hang (launch under torchrun, a group made again under a
closed one's name) works.

Most tests refuse before spawning, and ranks of a group are threads of this process over a
HashStore; only a few tests start processes (and the scripts run as __main__ start them)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.util
import os
import re
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

import torchhal
import torchhal.distributed.group as group_module
from torchhal.distributed import RankPlacement, WrappedCommunicator, init_group, launch
from torchhal.platforms import DistributedSupport, Platform
from torchhal.platforms.testing import patched_plugin

ROOT = Path(__file__).resolve().parents[1]
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# -- targets (run in spawned ranks) ----------------------------------------------------------
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


# -- fixtures --------------------------------------------------------------------------------
@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before any rank starts: starting one fails the test."""
    def refuse(self: Any) -> None:
        raise AssertionError(f"{self.name} was spawned before the bad argument was refused")

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", refuse)


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
                          timeout=120)


def main_module(monkeypatch: pytest.MonkeyPatch, source: str, file: Path, spec: str | None = None) -> types.ModuleType:
    """This process's __main__ replaced by `source`, run as the script `file` (or as module `spec`, python -m)."""
    main = types.ModuleType("__main__")
    main.__file__ = str(file)
    main.__spec__ = None if spec is None else types.SimpleNamespace(name=spec)  # type: ignore[assignment]
    exec(source, main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    return main


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


@pytest.mark.parametrize("args, shown", [
    (5, "5 (int)"), ("ab", "'ab' (str)"), (b"ab", "b'ab' (bytes)"), (None, "None (NoneType)"),
    ({"a": 1}, "{'a': 1} (dict)"),
])
def test_launch_refuses_args_that_are_not_a_tuple_or_list(no_spawn: None, args: Any, shown: str) -> None:
    # 5 was a bare TypeError from the spawning loop; "ab" ran target('a', 'b').
    with pytest.raises(ValueError) as caught:
        launch(rank_number, 2, args)
    message = str(caught.value)
    assert message.startswith(f"args = {shown} must be a tuple or list of the target's arguments"), message
    assert message.endswith(f"pass args=({args!r},) for a single argument, args=() for none")


def module_level_lambda() -> Callable[[], int]:
    return lambda: 1


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
    (LockedWorker().run, (), "target <bound method LockedWorker.run of .*> cannot be sent .* \\(TypeError: cannot "
                             "pickle '_thread.lock' object"),
    # an object's own __reduce__ may raise anything, not only pickling's errors
    (rank_number, (RefusesCopies(),), "args cannot be sent .* \\(RuntimeError: this handle is bound to its process"),
], ids=["lambda", "lock", "generator", "bound-method", "own-reduce"])
def test_launch_refuses_what_cannot_be_pickled_before_a_rank_exists(monkeypatch: pytest.MonkeyPatch, target: Any,
                                                                   args: Any, error: str) -> None:
    # Each failed with a pickling traceback that did not say which input was the cause.
    spawn = multiprocessing.util.spawnv_passfds

    def no_rank(path: bytes, args: list[Any], passfds: Any) -> int:  # the resource tracker may start
        if any("spawn_main" in str(arg) for arg in args):
            raise AssertionError("a rank process was created")
        return spawn(path, args, passfds)

    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", no_rank)
    with pytest.raises(ValueError) as caught:
        launch(target, 2, args)
    message = str(caught.value)
    assert re.match(error, message) and "spawned processes that receive their inputs pickled" in message, message
    assert message.endswith("pass picklable values (data, module-level functions and classes), not lambdas, "
                            "local functions, locks, open files or generators") and "\n" not in message


def test_launch_refuses_a_target_no_rank_can_import(no_spawn):
    def nested() -> int:
        return 1

    for target, named in [(nested, "nested"), (lambda: 1, "<lambda>")]:
        with pytest.raises(ValueError, match=f"<locals>.{named} .*cannot be imported by name.*define it at the top "
                                             "level of a module$"):
            launch(target, 2)
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


def test_launch_from_stdin_refuses_even_a_module_target_before_any_rank_starts():
    # Every rank re-ran __main__ from '<stdin>' and died before its log was opened: launch said only
    # "rank 0 exited with code 1 before returning a result".
    script = ("from torchhal.distributed import launch\n"
              "from tests.test_distributed_hostile import rank_number\n"
              "launch(rank_number, 2)\n")
    ran = subprocess.run([sys.executable, "-"], input=script, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ran.returncode != 0
    last = ran.stderr.strip().splitlines()[-1]
    assert last == ("ValueError: this program's __main__ has __file__ = '<stdin>', which is not a file, and every "
                    "rank (a spawned process) runs __main__ again from it before it imports the target: run the "
                    "program from a script file (python script.py) or as python -c, not from standard input"), \
        ran.stderr[-2000:]
    assert "spawn_main" not in ran.stderr, "a rank was started"


def test_launch_refuses_a_target_defined_in_the_scripts_main_block(tmp_path: Path) -> None:
    # The ranks import the script as __mp_main__, where the block does not run: each one failed
    # with "Can't get attribute 'rank_fn' on <module '__mp_main__'>".
    ran = run_script(tmp_path, """\
import multiprocessing.context
import multiprocessing.util

from torchhal.distributed import launch


def refuse(self):
    raise SystemExit(f"{self.name} was spawned before the target was refused")


if __name__ == "__main__":
    def rank_fn() -> int:
        return 1

    multiprocessing.context.SpawnProcess.start = refuse
    launch(rank_fn, 2)
""")
    assert ran.returncode != 0
    last = ran.stderr.strip().splitlines()[-1]
    assert last == (f"ValueError: target 'rank_fn' is defined inside the `if __name__ == \"__main__\":` block of "
                    f"{tmp_path / 'script.py'}, which the ranks do not run (they import the script as __mp_main__): "
                    "define it at the top level of the script, outside that block"), ran.stderr[-2000:]


def test_a_target_at_the_top_level_of_a_script_run_as_main_still_launches(tmp_path: Path) -> None:
    ran = run_script(tmp_path, """\
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


MAIN_ONLY = 'if __name__ == "__main__":\n'


@pytest.mark.parametrize("source", [
    MAIN_ONLY + "    def rank_fn():\n        return 1\n",
    MAIN_ONLY + "    for _ in range(1):\n        try:\n            def rank_fn():\n                return 1\n"
                "        finally:\n            pass\n",
    'if "__main__" == __name__:\n    def rank_fn():\n        return 1\n',
    'if __name__ != "__main__":\n    pass\nelse:\n    def rank_fn():\n        return 1\n',
    'try:\n    if __name__ == "__main__":\n        async def rank_fn():\n            return 1\nexcept Exception:\n'
    '    pass\n',
    MAIN_ONLY + "    class Ranks:\n        @staticmethod\n        def rank_fn():\n            return 1\n"
                "    rank_fn = Ranks.rank_fn\n",
], ids=["in the block", "nested in the block", "reversed", "else of !=", "inside try", "a method"])
def test_launch_refuses_a_target_the_scripts_main_block_defines(no_spawn: None, monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path, source: str) -> None:
    (tmp_path / "script.py").write_text(source)
    main = main_module(monkeypatch, source, tmp_path / "script.py")
    with pytest.raises(ValueError, match=r"^target '(Ranks\.)?rank_fn' is defined inside the `if __name__ == "
                                         r"\"__main__\":` block of .*script\.py, .*: define it at the top level of "
                                         "the script, outside that block$"):
        launch(main.rank_fn, 2)


@pytest.mark.parametrize("source", [
    "def rank_fn():\n    return 1\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    pass\nelse:\n    def rank_fn():\n        return 1\n",
    "try:\n    def rank_fn():\n        return 1\nexcept ImportError:\n    pass\n",
    'def rank_fn():\n    return 1\nif __name__ == "__main__":\n    def rank_fn():\n        return 2\n',
], ids=["top level", "else of TYPE_CHECKING", "inside try", "also at the top level"])
def test_launch_takes_a_target_the_ranks_define_when_importing_the_script(
        no_spawn: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, source: str) -> None:
    (tmp_path / "script.py").write_text(source)
    main = main_module(monkeypatch, source, tmp_path / "script.py")
    with pytest.raises(AssertionError, match="was spawned"):  # past every check
        launch(main.rank_fn, 1)


@pytest.mark.parametrize("file_state", ["absent", "not python"])
def test_launch_does_not_refuse_a_main_block_target_when_the_script_cannot_be_read(
        no_spawn: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, file_state: str) -> None:
    """No source to read (a module run by name whose file is gone, a compiled script): launch
    cannot tell, so the ranks decide."""
    file = tmp_path / "script.py"
    if file_state == "not python":
        file.write_bytes(b"\x00\x01compiled")
    source = MAIN_ONLY + "    def rank_fn():\n        return 1\n"
    main = main_module(monkeypatch, source, file, "tool" if file_state == "absent" else None)
    with pytest.raises(AssertionError, match="was spawned"):
        launch(main.rank_fn, 1)


# -- launch: ranks that used to hang or overflow ----------------------------------------------
def test_ranks_launched_from_a_torchrun_worker_do_not_look_for_torchruns_store(monkeypatch):
    # What torchrun puts in its workers' environment: ranks inheriting it waited for an agent
    # store on launch's port and timed out.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer")
    results = launch(group_sum_and_torchelastic_variables, 2, (5.0,), timeout=60, grace=1.0)
    assert results == [(3.0, []), (3.0, [])]
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the parent's own is kept


def test_a_long_finite_timeout_and_grace_are_waited_in_steps():
    assert launch(rank_number, 1, timeout=1e300, grace=1e300) == [0]


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
    'group0' on the job's rendezvous, used to pair up in the order their ranks arrived, across
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
    """Rank 0's env:// store used to go with the group that made it: rank 1, already in the next
    group's rendezvous on rank 0's server, lost it there ("did not form ... Connection closed")."""
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
    from torchhal.distributed.launch import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(Exception, match="127.0.0.1"):
        init_group(cpu, rank=1, world_size=2, timeout=timedelta(seconds=1))
    monkeypatch.delenv("MASTER_PORT")
    second = init_group(cpu)
    second.close()
    assert int(second.name.removeprefix("group")) == int(first.name.removeprefix("group")) + 1


def test_a_store_whose_server_went_is_dropped_so_the_next_init_group_reaches_the_new_one(monkeypatch):
    """env:// stores are kept for the process's life; when rank 0's went (rank 0 restarted on the
    same address and port), the kept connection failed every later init_group of this process
    ("Broken pipe"), so the advice to call init_group again could never work."""
    from torchhal.distributed.launch import free_port

    for var in (*RANK_VARIABLES, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(group_module, "_env_stores", {})
    quick = timedelta(seconds=1)
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=quick, wait_for_workers=False)
    key = ("127.0.0.1", str(port), 1, 2)
    with pytest.raises(Exception, match="did not form"):  # rank 0 never joins: only the store is reached
        init_group(torchhal.get_platform("cpu"), rank=1, world_size=2, timeout=quick)
    assert key in group_module._env_stores
    del server  # rank 0 goes, and comes back on the same port
    restarted = dist.TCPStore("127.0.0.1", port, 2, True, timeout=quick, wait_for_workers=False)
    with pytest.raises(Exception, match="did not form"):
        init_group(torchhal.get_platform("cpu"), rank=1, world_size=2, timeout=quick)
    assert key not in group_module._env_stores, "the dead connection was kept"
    with pytest.raises(Exception, match="did not form"):
        init_group(torchhal.get_platform("cpu"), rank=1, world_size=2, timeout=quick)
    group_module._env_stores[key].set("reached", "1")
    assert restarted.get("reached") == b"1"


# -- init_group: a name used again on the same store -----------------------------------------
@pytest.mark.parametrize("first_closed", [True, False], ids=["after close", "while open"])
def test_a_group_made_again_under_its_name_on_the_same_store_works(first_closed):
    store = dist.HashStore()
    cpu = torchhal.get_platform("cpu")

    def rank_main(rank: int) -> list[float]:
        def make() -> Any:
            return init_group(cpu, rank=rank, world_size=2, local_rank=rank, store=store, name="tp",
                              timeout=timedelta(seconds=5))

        first = make()
        sums = [first.comm.all_reduce(torch.tensor([rank + 1.0])).item()]
        if first_closed:
            first.close()
        if rank == 1:
            time.sleep(0.5)  # rank 0 makes its group first and must wait for this rank's new address
        again = make()
        sums.append(again.comm.all_reduce(torch.tensor([rank + 10.0])).item())
        if not first_closed:
            sums.append(first.comm.all_reduce(torch.tensor([rank + 100.0])).item())  # the first still works
            first.close()
        again.close()
        return sums

    expected = [3.0, 21.0] if first_closed else [3.0, 21.0, 201.0]
    assert on_threads(2, rank_main) == [expected, expected]


# -- init_group: default names under threads -------------------------------------------------
def test_a_default_named_init_group_while_another_thread_is_in_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both read the same counter and built "group0" (sharing its store keys). Default names
    follow call order, which threads do not have: the second is refused, the first works,
    and the next default-named call gets the next name."""
    for var in (*RANK_VARIABLES, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    cpu = torchhal.get_platform("cpu")
    inside, release = threading.Event(), threading.Event()
    real_attempt = group_module._attempt
    store_names: list[str] = []

    def slow_attempt(store: dist.Store, name: str, *args: Any) -> Any:
        store_names.append(name)
        if not inside.is_set():  # the first caller waits here, inside init_group, for the second's
            inside.set()
            release.wait(30)
        return real_attempt(store, name, *args)

    monkeypatch.setattr(group_module, "_attempt", slow_attempt)
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
    assert store_names == [group.name, after.name]  # the refused call reached no store


def test_a_default_named_init_group_inside_one_on_the_same_thread_is_refused_as_such(monkeypatch):
    # E.g. a plugin's communicator hook making a helper group: not "another thread".
    for var in (*RANK_VARIABLES, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    cpu = torchhal.get_platform("cpu")
    real_attempt = group_module._attempt

    def nested(*args: Any) -> Any:
        init_group(cpu)
        return real_attempt(*args)

    monkeypatch.setattr(group_module, "_attempt", nested)
    with pytest.raises(ValueError, match="^name = None: init_group was called from inside a default-named init_group "
                                         "on the same thread, which would take the outer group's name; pass name= to "
                                         "the inner one$"):
        init_group(cpu)
    monkeypatch.setattr(group_module, "_attempt", real_attempt)
    group = init_group(cpu)  # the refusal left the naming free
    group.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_inside_a_default_named_init_group_unwinds_with_its_own_error(monkeypatch):
    # The child's init_group releases the lock it took, not the fresh one the fork gave it
    # (releasing that raised "release unlocked lock" over the child's own error).
    for var in (*RANK_VARIABLES, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    real_attempt = group_module._attempt

    def forks(*args: Any) -> Any:
        if os.fork() == 0:
            raise KeyError("the child's own error")  # the child unwinds through init_group
        return real_attempt(*args)

    monkeypatch.setattr(group_module, "_attempt", forks)
    parent = os.getpid()
    try:
        group = init_group(torchhal.get_platform("cpu"))
    except KeyError:
        os._exit(0 if os.getpid() != parent else 9)  # the child, its own error: as it should be
    except BaseException:
        if os.getpid() != parent:
            os._exit(1)  # the child, another error in place of its own
        raise
    group.close()
    _, status = os.wait()
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_can_make_a_default_named_group_while_the_parent_is_inside_one():
    # The child inherited the lock held, with no thread left to release it: refused forever.
    with group_module._default_naming:  # as if another thread were inside init_group
        child = os.fork()
        if child == 0:
            os._exit(0 if group_module._default_naming.acquire(blocking=False) else 1)
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
    """Given alike by every rank, it used to fail in the backend once the ranks had met, as a
    CollectiveError blaming a dead or diverged peer and saying the group could not be reused."""
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
    """The collective used to run with every peer, then fail writing back on this rank alone."""
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
    """np.int64(0) used to be "not a rank of this group"; dim=True was taken as dim 1."""
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


def test_launch_returns_each_ranks_tensor() -> None:
    """Results travel by value: a connection's own pickler would send a tensor through shared
    memory that the launcher cannot open once its rank has exited ("exited before returning")."""
    results = launch(rank_tensor, 2, timeout=120)
    assert [r.tolist() for r in results] == [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]]


def pair_sum(store: dist.Store, name: str, timeout_s: float = 10) -> Callable[[int], float]:
    """One rank's body for `on_threads`: join the 2-rank group `name` on `store` and sum a one."""
    cpu = torchhal.get_platform("cpu")

    def body(rank: int) -> float:
        group = init_group(cpu, rank=rank, world_size=2, local_rank=rank, store=store, name=name,
                           timeout=timedelta(seconds=timeout_s))
        try:
            return group.comm.all_reduce(torch.ones(1)).item()
        finally:
            group.close()

    return body


@pytest.mark.parametrize("alone", [0, 1])
def test_a_group_that_did_not_form_forms_when_every_rank_retries_under_its_name(alone: int) -> None:
    """A rank that timed out alone (its peer late) is told so, naming the group, the rank and the
    timeout; its attempt costs the ranks' next one nothing. The join counted on the store by the
    failed attempt used to shift every later attempt under the name: the ranks never met again."""
    from torchhal.distributed import CollectiveError

    store = dist.HashStore()
    waited_for = "rank 0 opened no new attempt to form group 'tp'" if alone else "Wait timeout"
    with pytest.raises(CollectiveError, match=rf"group 'tp' did not form at rank {alone} of 2 within 1 s: "
                                              rf"{waited_for}.* calling init_group again on every rank makes a "
                                              "new attempt$"):
        init_group(torchhal.get_platform("cpu"), rank=alone, world_size=2, local_rank=alone, store=store, name="tp",
                   timeout=timedelta(seconds=1))
    body = pair_sum(store, "tp", timeout_s=5)
    assert on_threads(2, body) == [2.0, 2.0]
    assert on_threads(2, body) == [2.0, 2.0]  # and again


def test_a_late_rank_joins_rank_0s_next_attempt_not_the_one_it_gave_up_on() -> None:
    """Rank 0 timed out alone; rank 1 comes first to the retry. It used to take rank 0's failed
    attempt (rank 0's keys still on the store) and wait there, while rank 0 made a new one."""
    store = dist.HashStore()
    with pytest.raises(torchhal.distributed.CollectiveError):
        init_group(torchhal.get_platform("cpu"), rank=0, world_size=2, store=store, name="tp",
                   timeout=timedelta(seconds=1))
    body = pair_sum(store, "tp", timeout_s=5)

    def rank_1_first(rank: int) -> float:
        if rank == 0:
            time.sleep(0.3)
        return body(rank)

    assert on_threads(2, rank_1_first) == [2.0, 2.0]


def forming_twice(rank: int) -> str:
    return (f"init_group: two processes are forming group 'tp' as rank {rank} at once: two processes with "
            f"RANK={rank} (or the same rank=), or two groups made under the name 'tp'. Give each process its own rank "
            "and each group its own name; if the other process died making the group, retry")


def test_two_processes_of_one_rank_are_told_so() -> None:
    """Two rank 0s (the same RANK twice, or two groups made under one name at once) used to wait
    out the timeout, each told only that the group did not form; each is now told why."""
    store = dist.HashStore()
    cpu = torchhal.get_platform("cpu")

    def body(rank_0: int) -> str:
        time.sleep(0.2 * rank_0)  # the second comes while the first is forming the group
        try:
            init_group(cpu, rank=0, world_size=2, store=store, name="tp", timeout=timedelta(seconds=1))
        except ValueError as exc:
            return str(exc)
        return "formed"

    assert on_threads(2, body) == [forming_twice(0), forming_twice(0)]


def test_a_second_process_joining_as_another_ranks_number_is_told_so_and_the_group_forms() -> None:
    """Rank 1 twice: the first to join forms the group with rank 0; the second is refused at once
    (it used to count a join of its own and wait out the timeout alone)."""
    store = dist.HashStore()
    body = pair_sum(store, "tp")
    results = on_threads(3, lambda thread: body(min(thread, 1)))
    assert results[0] == 2.0
    assert sorted(results[1:], key=str) == [2.0, f"ValueError: {forming_twice(1)[:200]}"]


# -- ranks that disagree on a collective (TORCH_DISTRIBUTED_DEBUG=DETAIL) -----------------------
@pytest.fixture
def detail_debug() -> Iterator[None]:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL for this test (torch reads the variable once, at import)."""
    before = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        yield
    finally:
        dist.set_debug_level(before)


def detail_pair(store: dist.Store, rank: int, body: Callable[[Any], Any], platform: str = "cpu",
                timeout_s: float = 10) -> Any:
    group = init_group(torchhal.get_platform(platform), rank=rank, world_size=2, local_rank=rank, store=store,
                       name="checked", timeout=timedelta(seconds=timeout_s))
    try:
        return body(group)
    finally:
        group.close()


def disagreement(rank: int, call: str, calls: str, group: str = "checked") -> str:
    """The error each rank raises, as `on_threads` reports it (type, then 200 characters)."""
    return (f"CollectiveError: {call}: the ranks of group {group!r} disagree on this collective ({calls}). Every "
            "rank must make the same collectives in the same order, with the same shapes, dtypes and arguments; "
            f"this rank ({rank}) ran nothing of it")


MISMATCHES = {
    # [2, 3] against [3, 2]: the same bytes, so unchecked, gloo sums them as if they matched.
    "shape": (lambda g: g.comm.all_reduce(torch.ones((2, 3) if g.rank == 0 else (3, 2))),
              ("all_reduce(op='sum') float32 [2, 3]", "all_reduce(op='sum') float32 [3, 2]")),
    "reduction": (lambda g: g.comm.all_reduce(torch.ones(4), "sum" if g.rank == 0 else "max"),
                  ("all_reduce(op='sum') float32 [4]", "all_reduce(op='max') float32 [4]")),
    "root": (lambda g: g.comm.broadcast(torch.ones(4), g.rank),
             ("broadcast(src=0) float32 [4]", "broadcast(src=1) float32 [4]")),
    "call": (lambda g: g.comm.all_reduce(torch.ones(4)) if g.rank == 0 else g.comm.broadcast(torch.ones(4), 0),
             ("all_reduce(op='sum') float32 [4]", "broadcast(src=0) float32 [4]")),
    "gather": (lambda g: g.comm.all_gather(torch.ones(g.rank + 1, 3), sizes=(g.rank + 1, 2)),
               ("all_gather(dim=0, sizes=[1, 2]) float32 [*, 3]", "all_gather(dim=0, sizes=[2, 2]) float32 [*, 3]")),
    "host": (lambda g: g.host.all_reduce(torch.ones(2), ("sum", "min")[g.rank]),
             ("all_reduce(op='sum') float32 [2]", "all_reduce(op='min') float32 [2]")),
}
# (Mismatched byte counts abort an unchecked gloo process: those cases run under launch, below.)


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_under_detail_debug_ranks_that_disagree_on_a_collective_are_each_told_both_calls(detail_debug, case):
    store = dist.HashStore()
    body, (zero, one) = MISMATCHES[case]
    group = "checked/host" if case == "host" else "checked"
    calls = f"rank 0: {zero}; rank 1: {one}"
    assert on_threads(2, lambda rank: detail_pair(store, rank, body)) == [
        disagreement(0, zero, calls, group)[:217], disagreement(1, one, calls, group)[:217]]


def test_under_detail_debug_a_collective_facing_one_of_the_host_communicator_names_it(detail_debug: None) -> None:
    """The device and host communicators are checked over groups of their own (threads may call
    both), so rank 0's device sum facing rank 1's host sum cannot be paired: each times out, and
    the error names what the other rank last began, on which communicator, and how many calls in."""
    store = dist.HashStore()

    def body(group: Any) -> str:
        try:
            group.comm.all_reduce(torch.ones(3))  # both agree on this first one
            if group.rank == 0:
                group.comm.all_reduce(torch.ones(4))
            else:
                group.host.all_reduce(torch.ones(2))
            return "summed"
        except torchhal.distributed.CollectiveError as exc:
            return str(exc)

    zero, one = on_threads(2, lambda rank: detail_pair(store, rank, body, timeout_s=2))
    assert zero.startswith("all_reduce(op='sum') float32 [4]: checking this call (this rank's call 2 on 'checked') "
                           "with the other ranks of group 'checked' failed"), zero
    assert ("The other ranks' last calls: rank 1's call 1 on 'checked' was all_reduce(op='sum') float32 [3]; "
            "rank 1's call 1 on 'checked/host' was all_reduce(op='sum') float32 [2]") in zero, zero
    assert ("The other ranks' last calls: rank 0's call 2 on 'checked' was all_reduce(op='sum') float32 [4]; "
            "rank 0 began no call on 'checked/host'") in one, one


def test_under_detail_debug_a_send_and_a_recv_of_other_shapes_are_both_told(detail_debug: None) -> None:
    store = dist.HashStore()

    def body(group: Any) -> Any:
        if group.rank == 0:
            return group.comm.send(torch.ones(4), 1)
        return group.comm.recv(torch.zeros(5), 0).tolist()

    calls = "rank 0: send to rank 1 float32 [4]; rank 1: recv from rank 0 float32 [5]"
    assert on_threads(2, lambda rank: detail_pair(store, rank, body)) == [
        disagreement(0, "send to rank 1 float32 [4]", calls)[:217],
        disagreement(1, "recv from rank 0 float32 [5]", calls)[:217]]


class OwnPathForLargeSums(WrappedCommunicator):
    """A plugin's communicator with a path of its own for sums of 16 bytes or more (as a
    peer-memory all-reduce has): here it returns at once, leaving a peer on the other path waiting."""

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        return tensor if tensor.numel() * tensor.element_size() >= 16 else self.inner.all_reduce(tensor, op)


def test_under_detail_debug_a_plugins_communicator_is_checked_too(detail_debug: None) -> None:
    """Ranks that disagree on a sum's size would take different roads through the plugin's
    communicator (unchecked: rank 1 returns, rank 0 waits out the timeout); the check runs first."""
    cpu = torchhal.get_platform("cpu")
    support = DistributedSupport(communicator=OwnPathForLargeSums)
    with patched_plugin(cpu, distributed_support=lambda: support):
        store = dist.HashStore()
        results = on_threads(2, lambda rank: detail_pair(store, rank, lambda g: g.comm.all_reduce(
            torch.ones(3 + rank)).tolist()))
    calls = "rank 0: all_reduce(op='sum') float32 [3]; rank 1: all_reduce(op='sum') float32 [4]"
    assert results == [disagreement(0, "all_reduce(op='sum') float32 [3]", calls)[:217],
                       disagreement(1, "all_reduce(op='sum') float32 [4]", calls)[:217]]


def test_under_detail_debug_calls_that_differ_past_the_shared_text_still_differ(detail_debug: None) -> None:
    """A rank shares its call's digest with as much text as fits: shapes of 100 dimensions that
    differ only in the last two (the same bytes: unchecked, gloo sums them) are told apart."""
    store = dist.HashStore()
    shapes = ([1] * 98 + [2, 3], [1] * 98 + [3, 2])

    def body(group: Any) -> str:
        try:
            group.comm.all_reduce(torch.ones(shapes[group.rank]))
            return "summed"
        except torchhal.distributed.CollectiveError as exc:
            return "disagree" if "disagree on this collective" in str(exc) else str(exc)

    assert on_threads(2, lambda rank: detail_pair(store, rank, body)) == ["disagree"] * 2


def test_under_detail_debug_matching_calls_too_long_to_show_whole_still_agree(detail_debug: None) -> None:
    store = dist.HashStore()
    shape = [1] * 90 + [2]

    def body(group: Any) -> list[float]:
        if group.rank == 0:
            group.comm.send(torch.full(shape, 3.0), 1)
            return group.comm.all_reduce(torch.ones(shape)).flatten().tolist()
        received = group.comm.recv(torch.zeros(shape), 0)
        return (group.comm.all_reduce(torch.ones(shape)) + received).flatten().tolist()

    assert on_threads(2, lambda rank: detail_pair(store, rank, body)) == [[2.0, 2.0], [5.0, 5.0]]


def test_under_detail_debug_a_dimension_written_two_ways_is_one_call(detail_debug: None) -> None:
    store = dist.HashStore()
    results = on_threads(2, lambda rank: detail_pair(store, rank, lambda g: g.comm.all_gather(
        torch.full((2, g.rank + 1), float(g.rank)), dim=(-1, 1)[g.rank], sizes=(1, 2)).tolist()))
    assert results == [[[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]] * 2


def test_under_detail_debug_a_ranks_own_extent_that_is_not_its_size_is_shown_to_all(detail_debug: None) -> None:
    """Refused on that rank alone, its peer would wait in the gather until the timeout."""
    store = dist.HashStore()
    results = on_threads(2, lambda rank: detail_pair(
        store, rank, lambda g: g.comm.all_gather(torch.ones(3 if g.rank == 0 else 2, 4), sizes=(1, 2))))
    zero = "all_gather(dim=0, sizes=[1, 2]) float32 [*, 4] of 3 along dim 0, not sizes[0]"
    calls = f"rank 0: {zero}; rank 1: all_gather(dim=0, sizes=[1, 2]) float32 [*, 4]"
    assert results[0] == disagreement(0, zero, calls)[:217], results


@pytest.mark.parametrize("call", ["all_reduce", "send"])
def test_under_detail_debug_a_ranks_tensor_on_another_device_is_shown_to_all(detail_debug: None, call: str) -> None:
    """Refused by that rank's own communicator after the check, its peer would wait on it (for
    ever at a peer-memory barrier); the description carries it, so both ranks are told."""
    store = dist.HashStore()

    def body(group: Any) -> Any:
        tensor = torch.ones(4, device="meta" if group.rank == 0 else "cpu")
        if call == "all_reduce":
            return group.comm.all_reduce(tensor)
        return group.comm.send(tensor, 1) if group.rank == 0 else group.comm.recv(tensor, 0)

    results = on_threads(2, lambda rank: detail_pair(store, rank, body))
    assert all(isinstance(r, str) and "float32 [4] on meta, not rank 0's cpu" in r and "disagree" in r
               for r in results), results


def test_under_detail_debug_a_ranks_tensor_whose_elements_share_memory_is_shown_to_all(detail_debug: None) -> None:
    """Refused by that rank's own communicator after the check, its peer would wait on it."""
    store = dist.HashStore()
    results = on_threads(2, lambda rank: detail_pair(store, rank, lambda g: g.comm.all_reduce(
        torch.ones(1).expand(4) if g.rank == 0 else torch.ones(4))))
    calls = ("rank 0: all_reduce(op='sum') float32 [4] whose elements share memory; "
             "rank 1: all_reduce(op='sum') float32 [4]")
    assert results == [disagreement(0, "all_reduce(op='sum') float32 [4] whose elements share memory", calls)[:217],
                       disagreement(1, "all_reduce(op='sum') float32 [4]", calls)[:217]]


def test_under_detail_debug_a_bool_dim_is_refused_not_taken_as_one(detail_debug: None) -> None:
    store = dist.HashStore()
    results = on_threads(2, lambda rank: detail_pair(store, rank, lambda g: g.comm.all_gather(torch.ones(2, 3),
                                                                                          dim=True)))
    assert results == ["ValueError: all_gather(dim=True): give a dimension of the tensor (an int; it has 2)"] * 2


def test_under_detail_debug_a_numpy_integer_dim_is_the_same_call(detail_debug: None) -> None:
    import numpy as np

    store = dist.HashStore()
    dims = (np.int64(-1), 1)
    results = on_threads(2, lambda rank: detail_pair(store, rank, lambda g: g.comm.all_gather(
        torch.full((2, 1), float(g.rank)), dim=dims[g.rank]).tolist()))
    assert results == [[[0.0, 1.0], [0.0, 1.0]]] * 2


def test_under_detail_debug_a_failed_check_names_the_callers_call_not_its_own_gather(detail_debug: None) -> None:
    store = dist.HashStore()

    def body(group: Any) -> None:
        group.close()
        group.comm.all_reduce(torch.ones(4))

    for result in on_threads(2, lambda rank: detail_pair(store, rank, body)):
        assert result.startswith("CollectiveError: all_reduce(op='sum') float32 [4]: checking this call (this rank's "
                                 "call 1 on 'checked') with the other ranks of group 'checked' failed: all_gather: "
                                 "group 'checked/check/device' is closed"), result


def test_under_detail_debug_the_device_and_host_checks_run_on_groups_of_their_own(detail_debug: None) -> None:
    """Threads may call group.comm and group.host at once (each on a backend of its own on a
    GPU): checks sharing one gloo group would meet in another order on each rank."""
    store = dist.HashStore()
    backends = on_threads(2, lambda rank: detail_pair(store, rank, lambda g: [
        id(c.backend) for c in (g.comm.checker, g.host.checker, g.host.inner)]))
    assert all(len(set(ids)) == 3 for ids in backends), backends


def test_under_detail_debug_checks_of_both_communicators_from_two_threads_do_not_cross() -> None:
    """The check's design on its own (CheckedCommunicator over gloo pairs, device and host on
    backends of their own as on a GPU): one thread sums on the device, another maxes on the host."""
    from torchhal.distributed.checked import CheckedCommunicator

    stores = {part: dist.HashStore() for part in ("device", "host", "check-device", "check-host")}

    def body(rank: int) -> list[Any]:
        pair = {part: gloo_pair(rank, store) for part, store in stores.items()}
        device = CheckedCommunicator(pair["device"], pair["check-device"], "d")
        host = CheckedCommunicator(pair["host"], pair["check-host"], "h")
        done: list[Any] = []
        maxes = threading.Thread(target=lambda: done.append(
            [host.all_reduce(torch.tensor([float(rank), 2.0]), "max").tolist() for _ in range(100)][-1]))
        maxes.start()
        sums = [device.all_reduce(torch.ones(4)).tolist() for _ in range(100)][-1]
        maxes.join(60)
        return [sums, done]

    assert on_threads(2, body) == [[[2.0] * 4, [[1.0, 2.0]]]] * 2


def detail_on_rank_zero_only() -> str:
    """A rank of `launch`: DETAIL on rank 0 alone (as a variable exported on one host would be)."""
    level = dist.DebugLevel.DETAIL if os.environ["RANK"] == "0" else dist.DebugLevel.OFF
    dist.set_debug_level(level)
    try:
        init_group(timeout=timedelta(seconds=20)).close()
        return "formed"
    except ValueError as exc:
        return str(exc)


def test_ranks_that_differ_on_detail_debug_are_refused_naming_which() -> None:
    """The check is a collective of its own: a rank without it would never join it."""
    results = launch(detail_on_rank_zero_only, 2, timeout=120)
    assert results == ["init_group: TORCH_DISTRIBUTED_DEBUG=DETAIL is set on rank(s) [0] of group 'group0' and not "
                       "on rank(s) [1]: set it on every rank or on none (its check of each collective is a collective "
                       "every rank takes part in)"] * 2


@pytest.mark.parametrize("value", ["bogus", "\u0131nfo"])  # dotless i: Python's upper() makes INFO of it, torch's not
def test_launch_refuses_a_torch_distributed_debug_torch_does_not_take(no_spawn: None, value: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"env['TORCH_DISTRIBUTED_DEBUG'] = {value!r}: torch takes OFF, "
                                                   "INFO or DETAIL")):
        launch(rank_number, 2, env={"TORCH_DISTRIBUTED_DEBUG": value})


def reduce_mismatched(kind: str) -> str:
    """A rank of `launch`: ranks 0 and 1 all-reduce tensors of other lengths or dtypes."""
    group = init_group(timeout=timedelta(seconds=10))
    tensor = (torch.ones(4 + group.rank, device=group.device) if kind == "length"
              else torch.ones(4, dtype=(torch.float32, torch.float64)[group.rank], device=group.device))
    try:
        group.comm.all_reduce(tensor)
        return "summed"
    except torchhal.distributed.CollectiveError as exc:
        return str(exc)
    finally:
        group.close()


@pytest.mark.parametrize("kind", ["length", "dtype"])
def test_under_detail_debug_ranks_reducing_other_sizes_are_told_so(kind: str) -> None:
    """Other byte counts: unchecked, gloo aborts each rank's process (SIGABRT), so ranks of
    their own, through launch, with the variable set as a user would set it (each rank starts
    with it, and torch reads it as it is imported)."""
    results = launch(reduce_mismatched, 2, (kind,), timeout=120, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert all("disagree on this collective" in r for r in results), results


def test_under_detail_debug_matching_collectives_still_give_their_results(detail_debug: None) -> None:
    store = dist.HashStore()

    def body(group: Any) -> list[Any]:
        rank = group.rank
        summed = group.comm.all_reduce(torch.tensor([rank + 1.0])).tolist()
        gathered = group.comm.all_gather(torch.full((rank + 1,), float(rank)), sizes=(n for n in (1, 2))).tolist()
        sent = group.comm.broadcast(torch.tensor([7.0 if rank == 0 else 0.0]), 0).tolist()
        host = group.host.all_reduce(torch.tensor([10.0 * rank])).tolist()
        if rank == 0:
            group.comm.send(torch.tensor([5.0, 6.0]), 1)
            received = None
        else:
            received = group.comm.recv(torch.zeros(2), 0).tolist()
        return [summed, gathered, sent, host, received]

    zero, one = on_threads(2, lambda rank: detail_pair(store, rank, body))
    assert zero == [[3.0], [0.0, 1.0, 1.0], [7.0], [10.0], None]
    assert one == [[3.0], [0.0, 1.0, 1.0], [7.0], [10.0], [5.0, 6.0]]


def test_without_detail_debug_the_group_is_not_checked() -> None:
    """The check costs a host round trip a collective: only the debugging setting pays it."""
    from torchhal.distributed.checked import CheckedCommunicator

    assert dist.get_debug_level() != dist.DebugLevel.DETAIL
    store = dist.HashStore()
    kinds = on_threads(2, lambda rank: detail_pair(store, rank, lambda g: (type(g.comm), type(g.host))))
    assert all(CheckedCommunicator not in kind for kind in kinds), kinds


def test_the_device_and_host_communicators_of_a_cpu_group_do_not_pair_each_others_calls() -> None:
    """Threads may call `comm` and `host` at once (one feeding requests over `host` while the
    engine steps). Here each rank makes both sums, in opposite orders on the two ranks: on the
    CPU both used to be one gloo backend, which pairs calls by their order on it, so rank 0's
    device sum met rank 1's host sum and both came back wrong (201 and 102), without an error."""
    store = dist.HashStore()
    cpu = torchhal.get_platform("cpu")

    def body(rank: int) -> list[float]:
        group = init_group(cpu, rank=rank, world_size=2, local_rank=rank, store=store, name="both",
                           timeout=timedelta(seconds=10))
        try:
            sums = {"comm": torch.full((4,), float(rank + 1)), "host": torch.full((4,), 100.0 * (rank + 1))}
            first, second = ("comm", "host") if rank == 0 else ("host", "comm")
            comm = {"comm": group.comm, "host": group.host}
            thread = threading.Thread(target=comm[first].all_reduce, args=(sums[first],))
            thread.start()
            time.sleep(0.3)  # the first call is issued before the second, on each rank
            comm[second].all_reduce(sums[second])
            thread.join(20)
            return [sums["comm"][0].item(), sums["host"][0].item()]
        finally:
            group.close()

    assert on_threads(2, body) == [[3.0, 300.0], [3.0, 300.0]]


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
