"""Run one function on N ranks of the current platform, as N fresh processes.

`launch(target, world_size, args)` spawns (never forks) one process per rank with
torchrun's variables set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and
MASTER_ADDR=127.0.0.1 with a free MASTER_PORT for the rendezvous) and torchrun's agent
variables (TORCHELASTIC_*, inherited when launch itself runs under torchrun) removed, so a
target that calls `torchhal.distributed.init_group()` runs the same here as under `torchrun`.
It returns each rank's result (picklable) in rank order.

The point is failure: a rank that raises, exits or is killed, or ranks still running at
the deadline, make the launcher stop every rank (terminate, then kill after `grace`) and
raise one `LaunchError` naming the rank, its exception or exit code, and the last lines
of its stderr; for ranks still running at the deadline, their main threads' Python stacks
(faulthandler, on SIGUSR1), so a hang says where it is. Ctrl-C or SIGTERM in the parent
stops the ranks the same way. No rank outlives the call; a rank whose parent dies exits on its own.
"""

from __future__ import annotations

import ast
import contextlib
import faulthandler
import math
import multiprocessing
import numbers
import os
import pickle
import reprlib
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

from torchhal.values import as_index

#: Ranks launch starts per core of this host, at most: each is a process that imports torch
#: (hundreds of MB), so more only thrash, and a mistyped world size would spawn without end.
MAX_RANKS_PER_CORE = 8
#: Seconds a rank gets to exit after SIGTERM before it is killed.
DEFAULT_GRACE = 3.0
#: Lines of a failed rank's stderr quoted in the error.
STDERR_TAIL_LINES = 15
#: Lines quoted of a late rank's stack, innermost call first.
STACK_LINES = 40
#: What a rank late at the deadline is sent, to write its main thread's Python stack to a
#: stack file of its own (faulthandler answers from inside native code too: a collective, a driver call).
#: None where the system has no such signal.
STACK_SIGNAL: signal.Signals | None = getattr(signal, "SIGUSR1", None)
#: How long the launcher waits for the stacks before it stops the ranks.
_STACK_WAIT_SECONDS = 2.0
_PARENT_POLL_SECONDS = 1.0
#: The longest single wait: poll() takes at most 2**31 - 1 ms, so longer waits are made in steps.
_LONGEST_WAIT_SECONDS = 86400.0
#: What launch sets in every rank: the rendezvous torchrun would give it.
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: How a refused value is shown: short, on one line.
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 80
#: torchrun's agent variables, dropped from every rank: launch's ranks are not torchrun's workers
#: (TORCHELASTIC_USE_AGENT_STORE=True would send them looking for torchrun's store on launch's port).
_TORCHRUN_PREFIX = "TORCHELASTIC_"
#: Held while this process's environment is a rank's, for that rank's spawn: one launch at a time.
_spawning = threading.Lock()


class LaunchError(RuntimeError):
    """A rank failed (raised, exited, was killed) or the ranks missed the deadline; every rank
    has been stopped. `rank` is the failed rank (None when the deadline passed)."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


@dataclass(frozen=True)
class _Outcome:
    ok: bool
    value: Any  # the result; when not ok, what went wrong ("raised ValueError: ...")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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

    `target` must be importable by name (a module-level function): ranks are spawned. So are
    `args`: a tuple or list of picklable values.
    `timeout`: seconds for the whole run (None: no deadline; collectives still time out
    through `init_group(timeout=...)`). `env`: more variables for every rank, other than
    those launch sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) or drops (TORCHELASTIC_*). Bad arguments are refused before any rank starts.

    SIGTERM while launch runs in the main thread, with SIGTERM's default action in place, first
    stops the ranks and removes their log directory, then ends the process by SIGTERM's default
    action all the same (its exit status says SIGTERM; the caller's own cleanup is skipped, as
    it would have been). A SIGTERM handler of the caller's own is left in place."""
    ranks = as_index(world_size)
    if ranks is None or ranks < 1:
        raise ValueError(f"world_size = {world_size!r} must be a positive integer")
    cores = os.cpu_count() or 1
    if ranks > MAX_RANKS_PER_CORE * cores:
        raise ValueError(f"world_size = {ranks}: launch starts one process per rank on this host, and "
                         f"{ranks} is more than {MAX_RANKS_PER_CORE} per core of its {cores} "
                         f"(at most {MAX_RANKS_PER_CORE * cores}); check the value, or start ranks on several "
                         "hosts with torchrun")
    world_size = ranks
    if timeout is not None and not (_is_seconds(timeout) and timeout > 0):
        raise ValueError(f"timeout = {timeout!r} must be a positive number of seconds (a finite int or float), "
                         "or None for no deadline")
    if not (_is_seconds(grace) and grace >= 0):
        raise ValueError(f"grace = {grace!r} must be a number of seconds (a finite int or float), 0 or more")
    _check_env(env)
    _check_importable(target)
    _check_main_reruns()
    _check_args(args)
    context = multiprocessing.get_context("spawn")
    rank_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size), **(env or {})}
    deadline = None if timeout is None else time.monotonic() + timeout
    with _cleanup_on_sigterm(), tempfile.TemporaryDirectory(prefix="torchhal-launch-") as logs:
        processes: list[BaseProcess] = []
        receivers: list[Connection] = []
        try:
            for rank in range(world_size):
                receiver, sender = context.Pipe(duplex=False)
                variables = {**rank_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                process = context.Process(
                    target=_rank_main, name=f"torchhal-rank{rank}",
                    args=(target, tuple(args), sender, str(_stderr_path(logs, rank)), os.getpid()),
                )
                try:
                    with _environment_of_rank(variables):
                        process.start()
                except Exception as exc:
                    receiver.close()
                    sender.close()
                    # the first rank's start pickled the same inputs; and not every failure is pickling's
                    if rank or not _fails_to_pickle(target, args):
                        raise
                    # Spawn pickles the process object before it creates the child: no rank runs.
                    raise ValueError(f"{_unsendable(target)} cannot be sent to the ranks, spawned processes that "
                                     f"receive their inputs pickled ({type(exc).__name__}: {_shown_text(exc)}): pass "
                                     "picklable values (data, module-level functions and classes), not lambdas, "
                                     "local functions, locks, open files or generators") from exc
                sender.close()  # the child holds the only sending end: its exit closes the pipe
                processes.append(process)
                receivers.append(receiver)
            return _collect(processes, receivers, logs, deadline, timeout)
        finally:
            _stop(processes, grace)
            for receiver in receivers:
                receiver.close()


@contextlib.contextmanager
def _environment_of_rank(variables: Mapping[str, str]) -> Iterator[None]:
    """This process's environment as a rank's (its `variables` set, torchrun's agent variables
    dropped) while a rank is spawned, restored after: a spawned process starts with its parent's
    environment, so the rank's own is there from its first line, for its imports (torch reads
    OMP_NUM_THREADS and TORCH_DISTRIBUTED_DEBUG as it is imported) and its modules' top-level code."""
    with _spawning:
        dropped = [name for name in os.environ if name.startswith(_TORCHRUN_PREFIX)]
        saved = {name: os.environ.get(name) for name in [*variables, *dropped]}
        try:
            for name in dropped:
                del os.environ[name]
            os.environ.update(variables)
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


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
    on_main_thread = threading.current_thread() is threading.main_thread()
    if not on_main_thread or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
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


def _is_seconds(value: object) -> bool:
    """A finite real number that is not a bool (True seconds is a mistake, not 1 s)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check_env(env: Mapping[str, str] | None) -> None:
    """Every variable a rank could set: str names and values, none that launch sets or drops."""
    if env is None:
        return
    if not isinstance(env, Mapping):
        raise ValueError(f"env = {env!r} must be a mapping of variable names to values (a dict of str), or None")
    for name, value in env.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ValueError(f"env[{name!r}] = {value!r}: variable names and values must be str")
        if not name or "=" in name or "\0" in name or "\0" in value:
            raise ValueError(f"env[{name!r}] = {value!r}: a variable name must be non-empty, without '=' or NUL, "
                             "and a value without NUL")
        if name == "TORCH_DISTRIBUTED_DEBUG" and not (value.isascii() and value.upper() in ("OFF", "INFO", "DETAIL")):
            # a rank would fail reading it before its stderr is kept, leaving the error no cause
            raise ValueError(f"env[{name!r}] = {value!r}: torch takes OFF, INFO or DETAIL")
        if name in _RANK_VARIABLES or name.startswith(_TORCHRUN_PREFIX):
            raise ValueError(f"env[{name!r}]: launch sets {', '.join(_RANK_VARIABLES)} for every rank and drops "
                             f"{_TORCHRUN_PREFIX}*; leave {name} out of env")


def _check_args(args: object) -> None:
    """A tuple or list: a str would be spread into characters, and a single value is no list of
    arguments. Whether each value can be sent is found when the first rank is spawned."""
    if not isinstance(args, (tuple, list)):
        shown = _shown(args)
        raise ValueError(f"args = {shown} ({type(args).__name__}) must be a tuple or list of the target's "
                         f"arguments: pass args=({shown},) for a single argument, args=() for none")


def _fails_to_pickle(target: Callable[..., Any], args: object) -> bool:
    """Whether the inputs a rank receives fail to pickle, however their pickling raises (an
    object's own __reduce__ may raise anything)."""
    try:
        ForkingPickler.dumps((target, args))
    except Exception:  # noqa: BLE001 - any failure is the inputs'
        return True
    return False


def _unsendable(target: Callable[..., Any]) -> str:
    """Which of launch's inputs failed to pickle: the target (a bound method or callable object
    carries its state), else the args."""
    try:
        ForkingPickler.dumps(target)
    except Exception:  # noqa: BLE001 - any failure names the target
        return f"target {_shown(target)}"
    return "args"


def _shown(value: object) -> str:
    return _shown_text(_SHOWN.repr(value))


def _shown_text(text: object) -> str:
    return " ".join(str(text).split())


def _check_importable(target: Callable[..., Any]) -> None:
    """Ranks are spawned, so they import `target` by its module and name, as pickle does: a
    function nested in another, a lambda, or one defined where no rank can import it (`python -c`,
    stdin, an interactive session, a script's `if __name__ == "__main__":` block) would fail
    there with no cause to show."""
    if not callable(target):
        raise ValueError(f"target = {target!r} must be a callable (a module-level function)")
    module_name = getattr(target, "__module__", None)
    if isinstance(target, types.FunctionType):
        found: Any = sys.modules.get(module_name or "")
        for part in target.__qualname__.split("."):
            found = getattr(found, part, None)
        if found is not target:
            raise ValueError(f"target {target.__qualname__} (in {module_name}) cannot be imported by name, and "
                             "ranks are spawned processes that import it: define it at the top level of a module")
    if module_name == "__main__" and not _main_is_importable():
        raise ValueError(f"target {getattr(target, '__qualname__', target)!r} is defined in __main__ of a "
                         "session the ranks cannot import (python -c, stdin, interactive): define it in a "
                         "module or a script file")
    if module_name == "__main__":
        qualname = getattr(target, "__qualname__", None)
        path = getattr(sys.modules["__main__"], "__file__", None)
        if isinstance(qualname, str) and isinstance(path, str) and _only_in_main_block(path, qualname.split(".")[0]):
            raise ValueError(f"target {qualname!r} is defined inside the `if __name__ == \"__main__\":` block of "
                             f"{path}, which the ranks do not run (they import the script as __mp_main__): define "
                             "it at the top level of the script, outside that block")


def _check_main_reruns() -> None:
    """A spawned process runs this process's __main__ again from its `__file__` before it
    imports the target, whatever module that is in: a `__file__` that names no file (python -
    sets '<stdin>') fails every rank there, before its output is redirected to its log."""
    main = sys.modules["__main__"]
    path = getattr(main, "__file__", None)
    if (getattr(getattr(main, "__spec__", None), "name", None) is None and isinstance(path, str)
            and not os.path.isfile(path) and Path(path).stem != "ipython"):
        raise ValueError(f"this program's __main__ has __file__ = {path!r}, which is not a file, and every rank "
                         "(a spawned process) runs __main__ again from it before it imports the target: run the "
                         "program from a script file (python script.py) or as python -c, not from standard input")


def _main_is_importable() -> bool:
    """Whether a spawned process can run this process's __main__ again, as multiprocessing.spawn
    does: by module name (not a package's __main__), or from a script file (not ipython's)."""
    main = sys.modules["__main__"]
    module_name = getattr(getattr(main, "__spec__", None), "name", None)
    if module_name is not None:
        return not (module_name == "__main__" or module_name.endswith(".__main__"))
    path = getattr(main, "__file__", None)
    return isinstance(path, str) and os.path.isfile(path) and Path(path).stem != "ipython"


def _only_in_main_block(path: str, name: str) -> bool:
    """Whether every def or class named `name` at the top level of the script at `path` (in
    blocks, not in other defs) is inside an `if __name__ == "__main__":` block. False when the
    source cannot be read or has no such def: the ranks are then left to find it."""
    try:
        tree = ast.parse(Path(path).read_bytes(), path)
    except (OSError, SyntaxError, ValueError):
        return False
    guarded: list[bool] = []

    def visit(node: ast.AST, in_main_block: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                guarded.append(in_main_block)
            return  # what a def's body defines is not at the top level
        if isinstance(node, ast.If) and (is_main := _tests_main(node.test)) is not None:
            for statement in node.body:
                visit(statement, in_main_block or is_main)
            for statement in node.orelse:
                visit(statement, in_main_block or not is_main)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, in_main_block)

    visit(tree, False)
    return bool(guarded) and all(guarded)


def _tests_main(test: ast.expr) -> bool | None:
    """True for `__name__ == "__main__"` (either way round), False for `!=`, None for any other test."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.NotEq))):
        return None
    sides = [test.left, test.comparators[0]]
    if not (any(isinstance(side, ast.Name) and side.id == "__name__" for side in sides)
            and any(isinstance(side, ast.Constant) and side.value == "__main__" for side in sides)):
        return None
    return isinstance(test.ops[0], ast.Eq)


def _collect(processes: list[BaseProcess], receivers: list[Connection], logs: str,
             deadline: float | None, timeout: float | None) -> list[Any]:
    results: dict[int, Any] = {}
    pending = {rank: receivers[rank] for rank in range(len(processes))}
    while pending:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            late = sorted(pending)
            stacks = _stacks(processes, logs, late)
            where = "".join(f"\nrank {rank}'s Python stack at the deadline (innermost call first):\n{stacks[rank]}"
                            if rank in stacks else _tails(logs, [rank]) for rank in late)
            raise LaunchError(
                f"rank(s) {', '.join(map(str, late))} of {len(processes)} did not finish within {timeout:g} s; "
                f"stopped every rank{where}"
            )
        ready = wait([*pending.values(), *(processes[rank].sentinel for rank in pending)],
                     None if remaining is None else min(remaining, _LONGEST_WAIT_SECONDS))
        for rank in sorted(pending):
            receiver, process = pending[rank], processes[rank]
            if receiver in ready or process.sentinel in ready:
                outcome = _receive(receiver)
                if outcome is None:  # the pipe closed with nothing in it: the rank died
                    process.join()
                    raise LaunchError(f"rank {rank} {_describe_exit(process.exitcode)} before returning a "
                                      f"result; stopped every rank{_tails(logs, [rank])}",
                                      rank, process.exitcode)
                if not outcome.ok:
                    raise LaunchError(f"rank {rank} {outcome.value}; stopped every rank"
                                      f"{_tails(logs, [rank])}", rank)
                results[rank] = outcome.value
                del pending[rank]
    return [results[rank] for rank in range(len(processes))]


def _stacks(processes: list[BaseProcess], logs: str, ranks: list[int]) -> dict[int, str]:
    """Each late rank's main-thread Python stack (where it hangs is the first thing its error
    needs), quoted: faulthandler writes it to a file of the rank's own on STACK_SIGNAL. Ranks
    that write none (still starting, or a target that took the signal for itself) are left out."""
    if STACK_SIGNAL is None:
        return {}
    asked = []
    for rank in ranks:
        process = processes[rank]
        # No stack file yet: the rank is still starting, and the signal would kill it unheard.
        if process.pid is None or not process.is_alive() or not _stack_path(_stderr_path(logs, rank)).exists():
            continue
        try:
            os.kill(process.pid, STACK_SIGNAL)
        except ProcessLookupError:
            continue
        asked.append(rank)
    end = time.monotonic() + _STACK_WAIT_SECONDS
    while time.monotonic() < end and not all(_stack_path(_stderr_path(logs, rank)).stat().st_size for rank in asked):
        time.sleep(0.05)
    time.sleep(0.05)  # a dump is written at once, from the signal handler: let the last one end
    found = {}
    for rank in asked:
        frames = _stack_path(_stderr_path(logs, rank)).read_text(errors="replace").splitlines()[1 : STACK_LINES + 1]
        if frames:
            found[rank] = "\n".join(f"  {line.strip()}" for line in frames)
    return found


def _receive(receiver: Connection) -> _Outcome | None:
    try:
        if not receiver.poll():
            return None
        data = receiver.recv_bytes()
    except (EOFError, OSError):
        return None
    try:
        outcome: _Outcome = pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - the rank finished; its result is what failed
        return _Outcome(False, f"returned a result the launcher cannot unpickle ({exc!r})")
    return outcome


def _stop(processes: list[BaseProcess], grace: float) -> None:
    """Terminate every rank still running, kill those that outlive `grace`; reap them all."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    end = time.monotonic() + grace
    for process in processes:
        while process.is_alive() and (left := end - time.monotonic()) > 0:
            process.join(min(left, _LONGEST_WAIT_SECONDS))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stderr_path(logs: str, rank: int) -> Path:
    return Path(logs) / f"rank{rank}.stderr"


def _stack_path(stderr_path: Path) -> Path:
    """Where the rank whose stderr is `stderr_path` writes its stack when asked."""
    return stderr_path.with_suffix(".stack")


def _tails(logs: str, ranks: list[int]) -> str:
    parts = []
    for rank in ranks:
        try:
            lines = _stderr_path(logs, rank).read_text(errors="replace").rstrip().splitlines()
        except OSError:
            lines = []
        if lines:
            quoted = "\n".join(f"  {line}" for line in lines[-STDERR_TAIL_LINES:])
            parts.append(f"\nlast lines of rank {rank}'s stderr:\n{quoted}")
    return "".join(parts)


def _rank_main(target: Callable[..., Any], args: tuple[Any, ...], sender: Connection, stderr_path: str,
               parent_pid: int) -> None:
    """One rank (its variables set since it started): its stderr (fd 2, so native output too)
    kept for the parent's error, the outcome sent back."""
    log = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 2)
    os.close(log)
    if STACK_SIGNAL is not None:  # the launcher asks a rank late at its deadline where it is
        # A file of its own: the rank's other threads may be writing to stderr meanwhile. Held
        # open for the process's life, as faulthandler writes to it from a signal handler.
        stack = os.open(_stack_path(Path(stderr_path)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        faulthandler.register(STACK_SIGNAL, file=stack, all_threads=False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops the ranks
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        outcome = _Outcome(True, target(*args))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent, named
        traceback.print_exc()  # into the rank's stderr, which the parent quotes
        outcome = _Outcome(False, "raised " + "".join(traceback.format_exception_only(type(exc), exc)).strip())
    # Plain pickle, by value: a connection's own pickler would send tensors through shared memory
    # that the launcher can no longer open once this rank has exited.
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be pickled
        data = pickle.dumps(_Outcome(False, f"returned a result that cannot be sent to the launcher ({exc!r})"))
    sender.send_bytes(data)
    sender.close()


def _exit_with_parent(parent_pid: int) -> None:
    """A rank whose launcher died (SIGKILL, a crash) exits instead of running on as an orphan."""
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_SECONDS)
    os._exit(1)
