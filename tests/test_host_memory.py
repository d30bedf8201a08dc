"""The CPU platform's memory is the host's, capped by the process's memory cgroup: read from
fake cgroup trees of both versions, as containers lay them out."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from torchhal.plugins import host_memory as hm
from torchhal.plugins.cpu import CpuPlatform

GiB = 1 << 30


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_level(directory: Path, limit: str, current: int, inactive_file: int = 0) -> None:
    write(directory / "memory.max", f"{limit}\n")
    write(directory / "memory.current", f"{current}\n")
    write(directory / "memory.stat", f"anon {current}\nfile 0\ninactive_file {inactive_file}\nactive_file 0\n")


def v1_level(directory: Path, limit: int, usage: int, inactive_file: int = 0) -> None:
    write(directory / "memory.limit_in_bytes", f"{limit}\n")
    write(directory / "memory.usage_in_bytes", f"{usage}\n")
    write(directory / "memory.stat", f"cache 0\ninactive_file {inactive_file}\nhierarchical_memory_limit {limit}\n"
                                     f"total_inactive_file {inactive_file}\n")


def test_v2_takes_the_tightest_level_and_counts_inactive_page_cache_as_free(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "cgroup.txt"
    write(proc, "0::/kubepods/pod1/container\n")
    v2_level(root / "kubepods", "max", 40 * GiB)
    v2_level(root / "kubepods/pod1", str(8 * GiB), 5 * GiB)  # the pod's limit: 3 GiB left
    v2_level(root / "kubepods/pod1/container", str(16 * GiB), 5 * GiB, inactive_file=1 * GiB)
    assert hm.cgroup_limit(root, proc) == (3 * GiB, 8 * GiB)
    # The container's own limit tighter than its pod's, with page cache the kernel drops first.
    v2_level(root / "kubepods/pod1/container", str(6 * GiB), 5 * GiB, inactive_file=1 * GiB)
    assert hm.cgroup_limit(root, proc) == (2 * GiB, 6 * GiB)


def test_v2_inside_a_cgroup_namespace_reads_the_mount_as_the_process_cgroup(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "cgroup.txt"
    write(proc, "0::/\n")
    v2_level(root, str(4 * GiB), 1 * GiB)
    assert hm.cgroup_limit(root, proc) == (3 * GiB, 4 * GiB)
    # A host path that is not mounted here (namespace shared): the mount is this cgroup.
    write(proc, "0::/docker/0123abcd\n")
    assert hm.cgroup_limit(root, proc) == (3 * GiB, 4 * GiB)


def test_v1_reads_the_hierarchical_limit_of_the_memory_controller(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "cgroup.txt"
    write(proc, "9:cpu,cpuacct:/job\n4:memory:/job\n0::/\n")
    v1_level(root / "memory/job", 2 * GiB, 1 * GiB + 512 * 2**20, inactive_file=512 * 2**20)
    assert hm.cgroup_limit(root, proc) == (1 * GiB, 2 * GiB)
    v1_level(root / "memory/job", 9223372036854771712, 1 * GiB)  # v1's "no limit"
    assert hm.cgroup_limit(root, proc) is None


@pytest.mark.parametrize("broken", ["no proc file", "no memory files", "garbage", "unlimited v2"])
def test_no_readable_limit_leaves_the_os_figures(tmp_path, broken):
    root, proc = tmp_path / "cgroup", tmp_path / "cgroup.txt"
    if broken != "no proc file":
        write(proc, "0::/job\nnot a cgroup line\n")
    (root / "job").mkdir(parents=True)
    if broken == "garbage":
        write(root / "job/memory.max", "lots\n")
        write(root / "job/memory.current", "1\n")
    if broken == "unlimited v2":
        v2_level(root / "job", "max", 1 * GiB)
    assert hm.cgroup_limit(root, proc) is None


def test_the_levels_are_found_once_and_each_query_reads_their_usage(tmp_path):
    """The CPU plugin's memory_info read /proc/self/cgroup, every level's memory.max and memory.stat
    on every call (176-185 us idle, up to 1.6 ms on a loaded host)."""
    root, proc = tmp_path / "cgroup", tmp_path / "cgroup.txt"
    write(proc, "0::/kubepods/pod1\n")
    v2_level(root / "kubepods", "max", 40 * GiB)
    v2_level(root / "kubepods/pod1", str(8 * GiB), 5 * GiB)
    memory = hm.HostMemory(root, proc)
    assert [level.limit for level in memory.levels] == [8 * GiB] and memory.total == min(8 * GiB, memory.total)
    # Which files apply is not asked again: the process's cgroup and the limits may go.
    proc.unlink()
    for limit in root.rglob("memory.max"):
        limit.unlink()
    write(root / "kubepods/pod1/memory.current", f"{7 * GiB}\n")  # what changes is read on every query
    assert memory()[0] == min(1 * GiB, int(psutil.virtual_memory().available))
    write(root / "kubepods/pod1/memory.stat", f"inactive_file {2 * GiB}\n")
    assert memory()[0] == min(3 * GiB, int(psutil.virtual_memory().available))


def test_the_cpu_platform_reports_the_container_limit_not_the_hosts(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "cgroup.txt"
    write(proc, "0::/job\n")
    v2_level(root / "job", str(GiB), GiB - 256 * 2**20)
    def cpu_platform() -> CpuPlatform:
        plugin = CpuPlatform()
        plugin._host_memory = hm.HostMemory(root, proc)  # the tree this test laid out
        return plugin

    host = psutil.virtual_memory()
    plugin = cpu_platform()
    info = plugin.memory_info(0)
    assert (info.free, info.total) == (min(256 * 2**20, int(host.available)), min(GiB, int(host.total)))
    assert plugin.device_info(0).total_memory == info.total
    # A limit above the host's memory does not raise the host's figures.
    v2_level(root / "job", str(10 * host.total), GiB)
    info = cpu_platform().memory_info(0)
    assert info.total == host.total and info.free <= host.total
