"""Host memory as a process may use it: the OS's figures, capped by the memory cgroup it runs in.

In a container the kernel's free and total memory are the host's, while the cgroup's limit
is what the process is killed at: a KV cache sized by the host's figures is sized for memory
the container cannot have. Both cgroup versions are read (v2's `memory.max`, v1's
`memory.limit_in_bytes`), at every level from the process's cgroup up to the mount, and the
tightest limit wins. Used memory counts the page cache the kernel would drop first
(`inactive_file`) as free, as `free`'s "available" does on the host.

Which levels set a limit, and the limits themselves, are found once (`HostMemory`); a query
reads only the figures that change: the OS's available memory and each limited level's usage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
UNLIMITED_V1 = 1 << 62  # v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712)


@dataclass(frozen=True)
class CgroupLevel:
    """One cgroup level that sets a memory limit: the limit, and the files its usage is read from."""

    limit: int
    usage: Path  # memory.current (v2), memory.usage_in_bytes (v1)
    stat: Path  # memory.stat
    inactive_key: str  # the page cache the kernel drops first: inactive_file (v2), total_inactive_file (v1)

    def room(self) -> int | None:
        """Bytes left under the limit now; None where the files cannot be read (the cgroup went away)."""
        try:
            used = int(self.usage.read_text()) - _stat(self.stat, self.inactive_key)
        except (OSError, ValueError):
            return None
        return max(0, self.limit - used)


class HostMemory:
    """(free, total) bytes this process may use, with the cgroup levels found once."""

    def __init__(self, cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> None:
        self.levels = limited_levels(cgroup_root, proc_cgroup)
        self.total = min([int(psutil.virtual_memory().total), *(level.limit for level in self.levels)])

    def __call__(self) -> tuple[int, int]:
        rooms = [room for level in self.levels if (room := level.room()) is not None]
        return min([int(psutil.virtual_memory().available), *rooms]), self.total


def cgroup_limit(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> tuple[int, int] | None:
    """(free, limit) bytes under the tightest memory cgroup limit above this process, found and
    read in one call; None where no limit is set or the files cannot be read (then the OS's
    figures stand)."""
    levels = limited_levels(cgroup_root, proc_cgroup)
    rooms = [room for level in levels if (room := level.room()) is not None]
    return (min(rooms), min(level.limit for level in levels)) if rooms else None


def limited_levels(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> tuple[CgroupLevel, ...]:
    """Every cgroup level above this process whose memory limit is set (and readable)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return ()
    found: list[CgroupLevel] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        controllers, path = fields[1], fields[2]
        if controllers == "":  # v2: the one unified hierarchy
            directories, read = _directories(cgroup_root, path), _v2_level
        elif "memory" in controllers.split(","):
            # v1's memory.stat gives the limit over the whole hierarchy: the process's own level is enough.
            directories, read = _directories(cgroup_root / "memory", path)[:1], _v1_level
        else:
            continue
        for directory in directories:
            try:
                level = read(directory)
            except (OSError, ValueError):  # no such files at this level, or unreadable: no limit known here
                continue
            if level is not None:
                found.append(level)
    return tuple(found)


def _directories(mount: Path, path: str) -> list[Path]:
    """The cgroup's directory and its ancestors up to the mount. A container that sees the host's
    path without the host's tree mounted (cgroup namespace shared) gets the mount alone, which is
    its own cgroup there."""
    directory = mount / path.strip("/")
    if not directory.is_dir():
        return [mount]
    return [directory, *[parent for parent in directory.parents if parent.is_relative_to(mount)]]


def _stat(path: Path, key: str) -> int:
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def _v2_level(directory: Path) -> CgroupLevel | None:
    limit_text = (directory / "memory.max").read_text().strip()
    if limit_text == "max":
        return None
    return CgroupLevel(int(limit_text), directory / "memory.current", directory / "memory.stat", "inactive_file")


def _v1_level(directory: Path) -> CgroupLevel | None:
    stat = directory / "memory.stat"
    limit = _stat(stat, "hierarchical_memory_limit") or int((directory / "memory.limit_in_bytes").read_text())
    if limit >= UNLIMITED_V1:
        return None
    return CgroupLevel(limit, directory / "memory.usage_in_bytes", stat, "total_inactive_file")
