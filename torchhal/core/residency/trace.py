"""Residency events: recorded, logged as JSON lines, sent to observers, exported and plotted.

The manager and its strategies report what they do through `ResidencyTrace.event`;
nothing here changes what sits on the device.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torchhal.platforms import Platform


class ResidencyTrace:
    """Events go to `events` (when `record`), to `log` as one JSON line each (when given),
    and to `torchhal_engine_event` observers; with none of the three no event is built.

    `events` keeps the newest MAX_EVENTS (a server's trace stays bounded: a Flux-sized
    layerwise request records ~1600 events of ~300 bytes); past it the oldest quarter goes."""

    MAX_EVENTS = 1 << 16

    def __init__(self, platform: Platform, device_index: int, *, record: bool = True, log: Any = None) -> None:
        self.platform, self.device_index = platform, device_index
        self.record, self.log = record, log
        self.events: list[dict[str, Any]] = []

    def event(self, kind: str, component: str | None, **fields: Any) -> None:
        """Record one action with the device memory at that moment (memory_info: observes only)."""
        if not (self.record or self.log is not None or self.platform.traces_events):
            return
        event: dict[str, Any] = {"kind": kind, "t": time.monotonic(), "component": component, **fields}
        memory = self.platform.memory_info(self.device_index)
        event["reserved"], event["allocated"], event["used"] = memory.reserved, memory.allocated, memory.used
        if self.record:
            if len(self.events) >= self.MAX_EVENTS:
                del self.events[: self.MAX_EVENTS // 4]  # a quarter at a time: amortised O(1) an event
            self.events.append(event)
        self.platform.emit_event(event)
        if self.log is not None:
            self.log.info("torchhal.residency %s", json.dumps(event, default=str))

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Observe memory and time around a pipeline stage (one "stage" event; changes nothing)."""
        before = self.platform.memory_info(self.device_index)
        start = time.perf_counter()
        yield
        after = self.platform.memory_info(self.device_index)
        self.event("stage", None, stage=name, seconds=time.perf_counter() - start,
                   reserved_before=before.reserved, reserved_after=after.reserved, used_after=after.used)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    def last_request(self) -> list[dict[str, Any]]:
        """The events from the last request_start on (all of them if there is none)."""
        starts = [i for i, e in enumerate(self.events) if e["kind"] == "request_start"]
        return self.events[starts[-1]:] if starts else list(self.events)

    def export(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.events, f, indent=1, default=str)  # a strategy's own fields (a dtype, say)

    def plot_memory_timeline(self, path: str) -> None:
        """PNG of device memory over the events, every empty_cache marked (needs matplotlib)."""
        plot_memory_timelines({"device memory": self.events}, path)


def plot_memory_timelines(timelines: Mapping[str, Sequence[Mapping[str, Any]]], path: str) -> None:
    """One panel per named event list: reserved memory (else used) over time, and allocated
    memory where the events have it (what the weights and activations hold: it shows the
    components moving in and out when reserved stays flat), each empty_cache a red line.
    Events are dicts with "t", "kind" and "reserved"/"used" (and "allocated") bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 2.6 * len(timelines) + 0.9), squeeze=False)
    for ax, (title, events) in zip(axes[:, 0], timelines.items(), strict=True):
        t0 = events[0]["t"] if events else 0.0
        key = "reserved" if any(e.get("reserved") is not None for e in events) else "used"
        for series in (key, "allocated"):
            points = [(e["t"] - t0, e[series] / 2**20) for e in events if e.get(series) is not None]
            if points:
                ax.step([p[0] for p in points], [p[1] for p in points], where="post", label=f"{series} (MiB)")
        ax.set_ylim(bottom=0)
        for event in events:
            if event["kind"] == "empty_cache":
                ax.axvline(event["t"] - t0, color="red", alpha=0.5, linestyle="--")
        ax.set_ylabel("MiB")
        ax.set_title(f"{title}; red lines: empty_cache", fontsize=10)
        ax.legend(loc="upper left")
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
