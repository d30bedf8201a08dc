"""One reentrant lock serializes every public engine method that reads or changes its state.

`generate` takes it per step, so calls from several threads share the continuous batch and
each returns exactly its own results. An interrupt (Ctrl-C) can arrive between any two lines
of a call's bookkeeping: if the call raises and leaves the requests' book inconsistent (a
reservation, admission, retraction or token half-done), the engine recovers it: every request
waits again and is prefilled with what it has generated so far (`RequestBook.recover`), so
nothing is lost or left stuck.
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Concatenate, ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")
_S = TypeVar("_S", bound="Serialized")

#: What a closed engine still answers: closing again, and whether anything is pending (nothing).
CALLS_AFTER_CLOSE = frozenset({"close", "pending", "_group_closing"})


def serialized(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """Run a method holding the engine lock (see `Serialized.exclusive`)."""

    @functools.wraps(method)
    def locked(self: _S, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self.exclusive(method.__name__):
            return method(self, *args, **kwargs)

    return locked


class Serialized(ABC):
    """The lock, the stepping flag and recovery; subclasses say what is inconsistent and how
    to recover."""

    closed: bool

    def __init__(self) -> None:
        # Reentrant: public methods call each other (flush_cache drains, pause drains, ...).
        self._lock = threading.RLock()
        self._resumed = threading.Condition(self._lock)  # notified when a pause ends
        self._stepping = False  # a step is running (on the thread holding the lock)

    @abstractmethod
    def _inconsistencies(self) -> list[str]: ...

    @abstractmethod
    def _recover(self, error: BaseException) -> None: ...

    @contextmanager
    def exclusive(self, call: str) -> Iterator[None]:
        """Hold the lock for `call`. Refused on the stepping thread inside a step (a model,
        runner or hook calling back into the engine): the step's state is half-built, and a
        plain lock would deadlock there instead of saying so."""
        with self._lock:
            if self.closed and call not in CALLS_AFTER_CLOSE:
                raise RuntimeError(f"{call}() on a closed engine (close() gave its KV cache and graphs back); "
                                   "build a new engine")
            if self._stepping:
                raise RuntimeError(f"{call}() called from inside a step on the same thread (a model, runner or hook "
                                   "calling back into the engine); the engine is not re-entrant there: call it "
                                   "after step() returns")
            with self.recovering():
                yield

    @contextmanager
    def recovering(self) -> Iterator[None]:
        """If the block raises leaving the book inconsistent, recover it."""
        try:
            yield
        except BaseException as exc:
            if self._inconsistencies():
                self._recover(exc)
            raise

    def check_consistent(self) -> None:
        """Raise RuntimeError naming what is inconsistent in the engine's requests and KV blocks
        (see `RequestBook.inconsistencies`); for tests and debugging, it walks every block."""
        with self._lock:  # not `exclusive`: its error path would recover what this reports
            problems = self._inconsistencies()
        if problems:
            raise RuntimeError("the engine's request book is inconsistent: " + "; ".join(problems))
