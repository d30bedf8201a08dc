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
