"""Host memory as a process may use it: the OS's figures, capped by the memory cgroup it runs in.

In a container the kernel's free and total memory are the host's, while the cgroup's limit
is what the process is killed at: a KV cache sized by the host's figures is sized for memory
the container cannot have. Both cgroup versions are read (v2's `memory.max`, v1's
`memory.limit_in_bytes`), at every level from the process's cgroup up to the mount, and the
tightest limit wins. Used memory counts the page cache the kernel would drop first
(`inactive_file`) as free, as `free`'s "available" does on the host.
"""

from __future__ import annotations

from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
UNLIMITED_V1 = 1 << 62  # v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712)


def host_memory(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> tuple[int, int]:
    """(free, total) bytes this process may use."""
    vm = psutil.virtual_memory()
    free, total = int(vm.available), int(vm.total)
    limit = cgroup_limit(cgroup_root, proc_cgroup)
    if limit is not None:
        free, total = min(free, limit[0]), min(total, limit[1])
    return free, total


def cgroup_limit(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> tuple[int, int] | None:
    """(free, limit) bytes under the tightest memory cgroup limit above this process; None
    where no limit is set or the files cannot be read (then the OS's figures stand)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rooms: list[tuple[int, int]] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        controllers, path = fields[1], fields[2]
        if controllers == "":  # v2: the one unified hierarchy
            levels, read = _levels(cgroup_root, path), _v2_room
        elif "memory" in controllers.split(","):
            # v1's memory.stat gives the limit over the whole hierarchy: the process's own level is enough.
            levels, read = _levels(cgroup_root / "memory", path)[:1], _v1_room
        else:
            continue
        for level in levels:
            try:
                room = read(level)
            except (OSError, ValueError):  # no such files at this level, or unreadable: no limit known here
                continue
            if room is not None:
                rooms.append(room)
    if not rooms:
        return None
    return min(free for free, _ in rooms), min(limit for _, limit in rooms)


def _levels(mount: Path, path: str) -> list[Path]:
    """The cgroup's directory and its ancestors up to the mount. A container that sees the host's
    path without the host's tree mounted (cgroup namespace shared) gets the mount alone, which is
    its own cgroup there."""
    directory = mount / path.strip("/")
    if not directory.is_dir():
        return [mount]
    return [directory, *[parent for parent in directory.parents if parent.is_relative_to(mount)]]


def _stat(directory: Path, key: str) -> int:
    for line in (directory / "memory.stat").read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def _v2_room(directory: Path) -> tuple[int, int] | None:
    limit_text = (directory / "memory.max").read_text().strip()
    if limit_text == "max":
        return None
    limit = int(limit_text)
    used = int((directory / "memory.current").read_text()) - _stat(directory, "inactive_file")
    return max(0, limit - used), limit


def _v1_room(directory: Path) -> tuple[int, int] | None:
    limit = _stat(directory, "hierarchical_memory_limit") or int((directory / "memory.limit_in_bytes").read_text())
    if limit >= UNLIMITED_V1:
        return None
    used = int((directory / "memory.usage_in_bytes").read_text()) - _stat(directory, "total_inactive_file")
    return max(0, limit - used), limit
