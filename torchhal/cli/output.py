"""What every command shares: writing its output, and saying a bad input in one line."""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

#: Exit code of a command refused for bad input or unwritable output (its message names why).
USAGE_EXIT = 2


class OutputError(OSError):
    """stdout could not take the output: a closed pipe, a full disk."""


def _quiet(stream: TextIO) -> None:
    """Nothing more can reach this stdout: point it at devnull so the exit's own flush is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
    except (OSError, ValueError):
        pass


def emit(text: str) -> None:
    """Write `text` and a newline to stdout now; raise OutputError if it cannot be written.

    Flushed here, so a full disk or a closed pipe is seen by the command, not by the
    interpreter's exit (where it would be a traceback)."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except OSError as exc:
        _quiet(sys.stdout)
        raise OutputError(exc.errno, f"cannot write the output: {exc.strerror or exc}") from exc


class GuardedStdout:
    """Stands in for sys.stdout while a command that writes as it goes runs on (the conformance suite,
    whose JSON report comes last): the first failed write is kept in `error`, later output dropped."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.error: OSError | None = None

    def write(self, text: str) -> int:
        if self.error is None:
            try:
                self.stream.write(text)
            except OSError as exc:
                self._broke(exc)
        return len(text)

    def flush(self) -> None:
        if self.error is None:
            try:
                self.stream.flush()
            except OSError as exc:
                self._broke(exc)

    def _broke(self, exc: OSError) -> None:
        self.error = exc
        _quiet(self.stream)

    def __getattr__(self, name: str) -> Any:  # isatty, encoding, fileno …: the real stream's
        return getattr(self.stream, name)


def refuse(command: str, message: str) -> int:
    """One line on stderr naming what was wrong; the usage exit code."""
    try:
        print(f"torchhal {command}: {message}", file=sys.stderr)
    except OSError:
        pass  # stderr closed too: the exit code still says it
    return USAGE_EXIT
