"""Run one function on N ranks of this host, as N fresh processes.

`launch(target, world_size, args)` starts one process per rank with torchrun's variables set
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and MASTER_ADDR=127.0.0.1 with a free
MASTER_PORT for the rendezvous) and torchrun's agent variables (TORCHELASTIC_*) removed, so a
target that calls `torchhal.distributed.init_group()` runs the same here as under torchrun.
Each rank runs this program's `__main__` again as `__mp_main__`, as multiprocessing's spawn
does, imports the target by name and calls it; the results come back in rank order.

The point is failure: a rank that raises, exits or is killed, or ranks still running at the
deadline, make the launcher stop every rank with every process it started (each rank is a
session of its own: SIGTERM to it, then SIGKILL after `grace`) and raise one `LaunchError`
naming the rank, its exception or exit code, and the last lines of its stderr; for ranks still
running at the deadline, their main threads' Python stacks (faulthandler, on SIGUSR1). Ctrl-C
or SIGTERM in the launcher stops the ranks the same way; a rank whose launcher dies ends its
session. Across hosts, start the ranks with torchrun.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import multiprocessing.spawn
import numbers
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler, get_subprocess_handler
from torch.distributed.elastic.utils.distributed import get_free_port

from torchhal.values import as_index, short_repr

#: Ranks launch starts per core of this host, at most: each is a process that imports torch
#: (hundreds of MB), so more only thrash, and a mistyped world size would start without end.
MAX_RANKS_PER_CORE = 8
#: Seconds a rank gets to exit after SIGTERM before it is killed.
DEFAULT_GRACE = 3.0
#: Lines of a failed rank's stderr quoted in the error.
STDERR_TAIL_LINES = 15
#: Lines quoted of a late rank's stack, innermost call first.
STACK_LINES = 40
#: What a rank late at the deadline is sent, to write its main thread's Python stack to a file
#: of its own (faulthandler answers from inside native code too: a collective, a driver call).
STACK_SIGNAL = signal.SIGUSR1
#: How long the launcher waits for the stacks, and between looks at the ranks.
_STACK_WAIT_SECONDS, _POLL_SECONDS = 2.0, 0.02
#: What launch sets in every rank: the rendezvous torchrun would give it.
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: torchrun's agent variables, dropped in every rank: launch's ranks are not torchrun's workers
#: (TORCHELASTIC_USE_AGENT_STORE=True would send them looking for torchrun's store on launch's port).
_TORCHRUN_PREFIX = "TORCHELASTIC_"
#: How each rank starts: it reads its job from the launch's directory.
_RANK_COMMAND = "from torchhal.distributed.launch import _rank_main; _rank_main()"
#: How a rank's preparation names the main it runs again (multiprocessing.spawn.prepare's keys).
_MAINS = frozenset({"init_main_from_name", "init_main_from_path"})
#: True in a rank while it runs the launcher's __main__ again: a launch there is unguarded.
_running_main_again = False


class LaunchError(RuntimeError):
    """A rank failed (raised, exited, was killed) or the ranks missed the deadline; every rank
    has been stopped. `rank` is the failed rank (None when the deadline passed)."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


def launch(
    target: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] | list[Any] = (),
    *,
    timeout: float | None = None,
    grace: float = DEFAULT_GRACE,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """`target(*args)` on `world_size` ranks of this host; the results in rank order.

    `target` must be importable by name (a function at the top level of a module or of the
    script, outside its `if __name__ == "__main__":` block); `args` a tuple or list of
    picklable values; the result picklable (it comes back by value: a tensor as a copy).
    `timeout`: seconds for the whole run (None: no deadline; collectives still time out
    through `init_group(timeout=...)`). `env`: more variables for every rank, other than
    those launch sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) or drops (TORCHELASTIC_*). Bad arguments are refused before any rank starts.

    SIGTERM while launch runs in the main thread, with SIGTERM's default action in place, first
    stops the ranks and removes their log directory, then ends the process by SIGTERM's default
    action all the same. A SIGTERM handler of the caller's own is left in place."""
    problem = _refusal(target, world_size, args, timeout, grace, env)
    if problem is not None:
        raise ValueError(problem)
    ranks, deadline = int(world_size), None if timeout is None else time.monotonic() + timeout
    with _cleanup_on_sigterm(), tempfile.TemporaryDirectory(prefix="torchhal-launch-") as logs:
        try:
            payload = pickle.dumps((target, tuple(args)))
        except Exception as exc:  # noqa: BLE001 - an object's own __reduce__ may raise anything
            raise ValueError(f"{_unsendable(target)} cannot be sent to the ranks, spawned processes that receive "
                             f"their inputs pickled ({type(exc).__name__}: {' '.join(str(exc).split())}): pass "
                             "picklable values (data, module-level functions and classes), not lambdas, local "
                             "functions, locks, open files or generators") from exc
        Path(logs, "job").write_bytes(pickle.dumps((_main_preparation(), payload)))
        common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(get_free_port()), "WORLD_SIZE": str(ranks),
                  "LOCAL_WORLD_SIZE": str(ranks), **(env or {})}
        started: list[SubprocessHandler] = []
        try:
            for rank in range(ranks):
                # torch's elastic launcher's process: a session of its own, stderr to a file from its first line.
                started.append(get_subprocess_handler(
                    sys.executable, ("-c", _RANK_COMMAND, logs, rank),
                    {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}, "", str(_path(logs, rank, "stderr")),
                    rank))
            failure = _watch(started, logs, deadline, timeout)
        finally:
            _stop(started, grace)
        if failure is not None:
            raise LaunchError(*failure)
        return [pickle.loads(_path(logs, rank, "outcome").read_bytes())[1] for rank in range(ranks)]


def _refusal(target: object, world_size: object, args: object, timeout: object, grace: object,
             env: object) -> str | None:
    """What is wrong with a launch call, if anything."""
    ranks, cores = as_index(world_size), os.cpu_count() or 1
    if _running_main_again:
        return ("launch() was called while a rank ran the launching script again as __mp_main__ (every rank runs it "
                "to import the target): call launch under `if __name__ == \"__main__\":`, which the ranks skip")
    if ranks is None or ranks < 1:
        return f"world_size = {world_size!r} must be a positive integer"
    if ranks > MAX_RANKS_PER_CORE * cores:
        return (f"world_size = {ranks}: launch starts one process per rank on this host, and {ranks} is more than "
                f"{MAX_RANKS_PER_CORE} per core of its {cores} (at most {MAX_RANKS_PER_CORE * cores}); check the "
                "value, or start ranks on several hosts with torchrun")
    if timeout is not None and not (_is_seconds(timeout) and timeout > 0):  # type: ignore[operator]
        return f"timeout = {timeout!r} must be a positive number of seconds (a finite int or float), or None for " \
               "no deadline"
    if not (_is_seconds(grace) and grace >= 0):  # type: ignore[operator]
        return f"grace = {grace!r} must be a number of seconds (a finite int or float), 0 or more"
    if env is not None and not isinstance(env, Mapping):
        return f"env = {env!r} must be a mapping of variable names to values (a dict of str), or None"
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not isinstance(value, str):
            return f"env[{name!r}] = {value!r}: variable names and values must be str"
        if not name or "=" in name or "\0" in name or "\0" in value:
            return f"env[{name!r}] = {value!r}: a variable name must be non-empty, without '=' or NUL, and a value " \
                   "without NUL"
        if name == "TORCH_DISTRIBUTED_DEBUG" and not (value.isascii() and value.upper() in ("OFF", "INFO", "DETAIL")):
            return f"env[{name!r}] = {value!r}: torch takes OFF, INFO or DETAIL"  # torch's import would fail on it
        if name in _RANK_VARIABLES or name.startswith(_TORCHRUN_PREFIX):
            return f"env[{name!r}]: launch sets {', '.join(_RANK_VARIABLES)} for every rank and drops " \
                   f"{_TORCHRUN_PREFIX}*; leave {name} out of env"
    if not isinstance(args, (tuple, list)):  # a str would be spread into characters
        return f"args = {_shown(args)} ({type(args).__name__}) must be a tuple or list of the target's arguments: " \
               f"pass args=({_shown(args)},) for a single argument, args=() for none"
    if not callable(target):
        return f"target = {target!r} must be a callable (a module-level function)"
    if getattr(target, "__module__", None) == "__main__" and _MAINS.isdisjoint(_main_preparation()):
        return (f"target {getattr(target, '__qualname__', target)!r} is defined in __main__ of a session the ranks "
                "cannot import (python -c, stdin, interactive): define it in a module or a script file")
    return None


def _is_seconds(value: object) -> bool:
    """A finite real number that is not a bool (True seconds is a mistake, not 1 s)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _unsendable(target: Callable[..., Any]) -> str:
    """Which of launch's inputs failed to pickle: the target (a bound method or callable object
    carries its state), else the args."""
    try:
        pickle.dumps(target)
    except Exception:  # noqa: BLE001 - any failure names the target
        return f"target {_shown(target)}"
    return "args"


def _shown(value: object) -> str:
    return " ".join(short_repr(value).split())  # one line: a tensor's repr has several


def _main_preparation() -> dict[str, Any]:
    """What multiprocessing's spawn hands its child to run this program's __main__ again, as
    `multiprocessing.spawn.prepare` reads it: the main by module name (not a package's
    __main__), or from a script file; none where no rank can run it (`python -c`, standard
    input, an interactive session), so that a target in a module still launches from there."""
    main = sys.modules["__main__"]
    data: dict[str, Any] = {"sys_path": sys.path, "sys_argv": sys.argv, "dir": os.getcwd()}
    name, path = getattr(getattr(main, "__spec__", None), "name", None), getattr(main, "__file__", None)
    if name is not None and name != "__main__" and not name.endswith(".__main__"):
        data["init_main_from_name"] = name
    elif name is None and isinstance(path, str) and os.path.isfile(path) and Path(path).stem != "ipython":
        data["init_main_from_path"] = os.path.abspath(path)
    return data


def _path(logs: str, rank: int, kind: str) -> Path:
    return Path(logs) / f"rank{rank}.{kind}"


def _watch(started: list[SubprocessHandler], logs: str, deadline: float | None,
           timeout: float | None) -> tuple[str, int | None, int | None] | None:
    """Wait until every rank has sent its outcome, or one failed, or the deadline passed; what
    LaunchError then says (message, rank, exit code), None when every rank returned."""
    pending = set(range(len(started)))
    while pending:
        for rank in sorted(pending):
            code = started[rank].proc.poll()  # before the outcome: a rank writes it, then exits
            if _path(logs, rank, "outcome").exists():
                ok, value = pickle.loads(_path(logs, rank, "outcome").read_bytes())
                if not ok:
                    return f"rank {rank} {value}; stopped every rank{_tail(logs, rank)}", rank, None
                pending.discard(rank)
            elif code is not None:
                killer = {sig.value: sig.name for sig in signal.Signals}.get(-code, f"signal {-code}")
                died = f"was killed by {killer}" if code < 0 else f"exited with code {code}"
                return f"rank {rank} {died} before returning a result; stopped every rank{_tail(logs, rank)}", \
                    rank, code
        if pending and deadline is not None and time.monotonic() > deadline:
            late = sorted(pending)
            return (f"rank(s) {', '.join(map(str, late))} of {len(started)} did not finish within {timeout:g} s; "
                    f"stopped every rank{_stacks(started, logs, late)}"), None, None
        time.sleep(_POLL_SECONDS if pending else 0)
    return None


def _stacks(started: list[SubprocessHandler], logs: str, late: list[int]) -> str:
    """Each late rank's main-thread Python stack, quoted (else its stderr's last lines):
    faulthandler writes it to the rank's stack file on STACK_SIGNAL. A rank without a stack
    file is still starting: the signal would kill it unheard."""
    asked = [rank for rank in late if _path(logs, rank, "stack").exists()]
    for rank in asked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(started[rank].proc.pid, STACK_SIGNAL)
    end = time.monotonic() + _STACK_WAIT_SECONDS
    while time.monotonic() < end and not all(_path(logs, rank, "stack").stat().st_size for rank in asked):
        time.sleep(0.05)
    time.sleep(0.05)  # a dump is written at once, from the signal handler: let the last one end
    quoted = []
    for rank in late:
        frames = _path(logs, rank, "stack").read_text(errors="replace").splitlines()[1:] if rank in asked else []
        stack = "".join(f"\n  {line.strip()}" for line in frames[:STACK_LINES])
        quoted.append(f"\nrank {rank}'s Python stack at the deadline (innermost call first):{stack}" if stack
                      else _tail(logs, rank))
    return "".join(quoted)


def _stop(started: list[SubprocessHandler], grace: float) -> None:
    """SIGTERM to every rank's session (a rank that returned may leave processes there), SIGKILL
    to those that outlive `grace`; every rank reaped."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for handler in started:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # a session already empty
                os.killpg(handler.proc.pid, sig)
        end = time.monotonic() + grace
        while sig == signal.SIGTERM and time.monotonic() < end and any(h.proc.poll() is None for h in started):
            time.sleep(_POLL_SECONDS)
    for handler in started:
        handler.proc.wait()


def _tail(logs: str, rank: int) -> str:
    """The last lines of a rank's stderr, quoted; '' when it wrote none."""
    with contextlib.suppress(OSError):
        lines = _path(logs, rank, "stderr").read_text(errors="replace").rstrip().splitlines()[-STDERR_TAIL_LINES:]
        if lines:
            return f"\nlast lines of rank {rank}'s stderr:" + "".join(f"\n  {line}" for line in lines)
    return ""


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread while launch runs; a BaseException, as KeyboardInterrupt,
    so that no `except Exception` holds it."""


def _raise_terminated(signum: int, frame: types.FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the first one's cleanup short
    raise _Terminated


@contextlib.contextmanager
def _cleanup_on_sigterm() -> Iterator[None]:
    """SIGTERM's default action ends the process at once, skipping the `finally` that stops the
    ranks and the removal of their logs: raise it instead, and once launch has unwound, deliver
    it again with the default action, so the process still dies of it. Only where SIGTERM has
    its default action (a handler of the caller's own decides for itself) and on the main
    thread (the only one Python lets set a handler)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    try:
        signal.signal(signal.SIGTERM, _raise_terminated)  # inside the try, to catch a SIGTERM right after
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)  # delivered to this thread before it returns: the process ends here
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _rank_main() -> None:
    """One rank (`python -c _RANK_COMMAND LOGS RANK`, its variables set since it started): run
    the launcher's __main__ again, import the target, call it, and write its outcome where the
    launcher looks; a traceback goes to this rank's stderr, which the launcher quotes."""
    global _running_main_again
    logs, rank = sys.argv[1], int(sys.argv[2])
    for name in [name for name in os.environ if name.startswith(_TORCHRUN_PREFIX)]:
        del os.environ[name]  # a launcher under torchrun passes its agent's on
    # Its own file (other threads may write to stderr meanwhile), held open for the process's life
    # as faulthandler writes to it from a signal handler; named once it answers the signal.
    stack = open(_path(logs, rank, "stack.part"), "w")
    faulthandler.register(STACK_SIGNAL, file=stack, all_threads=False)
    os.replace(_path(logs, rank, "stack.part"), _path(logs, rank, "stack"))
    threading.Thread(target=_end_with_launcher, args=(os.getppid(),), daemon=True).start()
    preparation, payload = pickle.loads(Path(logs, "job").read_bytes())
    stage = f"failed running {preparation.get('init_main_from_path') or preparation.get('init_main_from_name')} " \
            "again as __mp_main__ (each rank does, to import the target): "
    try:
        _running_main_again = True
        multiprocessing.spawn.prepare(preparation)
        _running_main_again = False
        stage = "could not import the target (a function at the top level of a module or of the script, outside " \
                "its `if __name__ == \"__main__\":` block, which the ranks do not run): "
        target, args = pickle.loads(payload)
        stage = "raised "
        outcome: tuple[bool, Any] = (True, target(*args))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the launcher, named
        traceback.print_exc()
        outcome = (False, stage + "".join(traceback.format_exception_only(type(exc), exc)).strip())
    try:
        data = pickle.dumps(outcome)  # plain pickle: by value, a tensor included
    except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be pickled
        data = pickle.dumps((False, f"returned a result that cannot be sent to the launcher ({exc!r})"))
    _path(logs, rank, "outcome.part").write_bytes(data)
    os.replace(_path(logs, rank, "outcome.part"), _path(logs, rank, "outcome"))
    sys.exit(0 if outcome[0] else 1)


def _end_with_launcher(launcher: int) -> None:
    """A rank whose launcher died (SIGKILL, a crash) ends its session, itself included, instead
    of running on as an orphan."""
    while os.getppid() == launcher:
        time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)
