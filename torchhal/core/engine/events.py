"""The engine's trace and its one way to empty the cache (always at a named release point)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from torchhal.platforms import Platform, ReleasePoint


class EngineEvents:
    #: Events the trace keeps: the latest, so a long-running engine's trace stays bounded.
    KEPT = 4096

    def __init__(self, platform: Platform, device_index: int) -> None:
        self.platform, self.device_index = platform, device_index
        self.trace: deque[dict[str, Any]] = deque(maxlen=self.KEPT)

    def record(self, kind: str, **fields: Any) -> None:
        event = {"kind": kind, "t": time.monotonic(), **fields}
        self.trace.append(event)
        self.platform.emit_event(event)

    def empty(self, reason: ReleasePoint) -> int | None:
        released = self.platform.empty_cache(reason, self.device_index)
        self.record("empty_cache", reason=reason.value, bytes_released=released)
        return released


class IdleClock:
    """Empties the cache once the engine has sat idle for `interval` seconds since its last
    working step ended (or since it was built): the idle release point."""

    def __init__(self, events: EngineEvents, interval: float | None) -> None:
        self.events, self.interval = events, interval
        self.since: float | None = time.monotonic()  # None while a step works
        self.emptied = False

    def working(self) -> None:
        self.since, self.emptied = None, False

    def stopped(self) -> None:
        if self.since is None:  # a step that worked: the idle clock starts when it ends
            self.since = time.monotonic()

    def tick(self, waiting: bool) -> None:
        """A step with nothing to run."""
        if self.interval is None or self.since is None or self.emptied or waiting:
            return
        if time.monotonic() - self.since >= self.interval:
            self.events.empty(ReleasePoint.IDLE)
            self.emptied = True
