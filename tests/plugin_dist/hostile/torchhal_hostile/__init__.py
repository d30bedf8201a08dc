"""A hostile platform plugin: `torchhal info` must survive it and name it.

TORCHHAL_HOSTILE_MODE picks the misbehaviour (default "ok": a well-behaved
platform "hostile", priority 5, available). Installed only by tests that put
tests/plugin_dist/hostile on the path, next to an entry point `emptyns` that
resolves to an empty namespace package.
"""

import os
import sys
import time

from torchhal.platforms import Availability, MemoryInfo, hookimpl
from torchhal.plugins.cpu import CpuPlatform

MODE = os.environ.get("TORCHHAL_HOSTILE_MODE", "ok")
HANG_S = 600  # "forever" for a test, which ends the process once the host names this plugin
if MODE == "exit-import":
    sys.exit(3)
if MODE == "hang-import":
    time.sleep(HANG_S)
if MODE == "dir-raises":
    def __dir__() -> list[str]:  # pluggy lists a plugin's attributes to find its hooks
        raise RuntimeError("hostile __dir__")


class HostilePlatform(CpuPlatform):
    name = "hostile"
    priority = 5

    def is_available(self) -> Availability:
        if MODE == "exit-detect":
            sys.exit(5)
        if MODE == "hang-detect":
            time.sleep(30)
        return Availability.yes("one hostile device")

    def device_count(self) -> int:
        if MODE == "count-raises":
            raise RuntimeError("hostile driver lost its devices")
        if MODE == "count-huge":
            return 10**12
        if MODE == "hang-count":
            time.sleep(HANG_S)
        return 1

    def memory_info(self, index: int) -> MemoryInfo:
        if MODE == "memory-str":
            return "lots"  # type: ignore[return-value]
        if MODE == "memory-none":
            return None  # type: ignore[return-value]
        if MODE == "memory-float":
            return MemoryInfo(index, 1.5 * 2**30, 2 * 2**30)  # type: ignore[arg-type]
        if MODE == "memory-negative":
            return MemoryInfo(index, -1, 2 * 2**30)
        if MODE == "memory-raises":
            raise RuntimeError("hostile memory query crashed")
        if MODE == "memory-exit":
            sys.exit(6)
        if MODE == "hang-memory":
            time.sleep(HANG_S)
        return super().memory_info(index)


class ImpostorCpu(HostilePlatform):
    name = "cpu"  # a built-in's name, without `replaces`
    priority = 100


class FutureSpi(HostilePlatform):
    spi_version = (2, 0)


@hookimpl
def torchhal_register_platforms() -> list[CpuPlatform]:
    if MODE == "exit-register":
        sys.exit(4)
    if MODE == "hang-register":
        time.sleep(HANG_S)
    if MODE == "impostor-cpu":
        return [ImpostorCpu()]
    if MODE == "future-spi":
        return [FutureSpi()]
    return [HostilePlatform()]
