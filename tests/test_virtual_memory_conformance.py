"""The virtual_memory clause (contract 10) passes the CPU platform's regions and fails a platform
that breaks each contract (tests/vm_broken.py); the regions' own behaviour on the host."""

from __future__ import annotations

import json

import pytest
import torch

import torchhal
from torchhal.plugins.virtual_memory import HostDriver, Regions

from .conftest import conformance_group_results, entry_point_distribution

CLAUSES = ("a_release_gives_the_memory_back_under_kept_addresses",
           "a_backup_comes_back_bit_for_bit_and_takes_what_was_written_while_released",
           "a_graph_on_region_memory_replays_after_the_restore",
           "a_hundred_cycles_leak_nothing")


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    return entry_point_distribution(tmp_path_factory.mktemp("vm_dist"), "vmbroken", "tests.vm_broken")


def test_the_cpu_reference_passes_and_the_graph_clause_is_not_applicable(tmp_path, plugin_path):
    out, results = conformance_group_results(tmp_path, plugin_path, "cpu", "virtual_memory")
    assert set(results) == set(CLAUSES)
    graph = results.pop("a_graph_on_region_memory_replays_after_the_restore")
    assert graph["outcome"] == "skipped" and graph["skip_reason"].startswith("not applicable:")
    assert all(r["outcome"] == "passed" for r in results.values()), out.stdout[-3000:]
    assert out.returncode == 0


@pytest.mark.parametrize("platform, clause, says", [
    ("vm_moves", "a_release_gives_the_memory_back_under_kept_addresses", "moved on restore"),
    ("vm_backup_lost", "a_backup_comes_back_bit_for_bit_and_takes_what_was_written_while_released",
     "does not hold what its backup held"),
    ("vm_not_released", "a_release_gives_the_memory_back_under_kept_addresses",
     "did not go back to the device"),
])
def test_a_broken_implementation_fails_the_clause_it_breaks(tmp_path, plugin_path, platform, clause, says):
    out, results = conformance_group_results(tmp_path, plugin_path, platform, "virtual_memory")
    assert results[clause]["outcome"] == "failed", out.stdout[-3000:]
    assert says in results[clause]["message"], results[clause]["message"]
    assert out.returncode == 1


def test_an_undeclared_platform_skips_the_group(tmp_path, plugin_path, monkeypatch):
    from torchhal.plugins import cpu

    monkeypatch.setattr(cpu.sys, "platform", "darwin")  # not in the child: its own interpreter says linux
    assert cpu.CpuPlatform().virtual_memory_support() is None


def test_a_region_keeps_its_address_and_a_backup_across_a_release():
    regions = Regions(HostDriver(), lambda n: torch.empty(n, dtype=torch.uint8))
    tensor = regions.allocate("a", 1 << 20)
    tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8))
    expected, address = tensor.clone(), tensor.data_ptr()
    assert regions.release("a", backup=True) == 1 << 20 and regions.released("a")
    assert regions.release("a", backup=True) == 0  # already released: nothing more
    regions.restore("a")
    assert tensor.data_ptr() == address and torch.equal(tensor, expected)
    regions.release("a", backup=False)
    regions.restore("a")
    assert not bool(tensor.any())  # no backup: new host pages read as zeros


def test_an_allocation_goes_back_when_no_tensor_views_it():
    import gc

    freed: list[tuple[int, int]] = []

    class Counting(HostDriver):
        def free(self, va: int, size: int) -> None:
            freed.append((va, size))
            super().free(va, size)

    regions = Regions(Counting(), lambda n: torch.empty(n, dtype=torch.uint8))
    view = regions.allocate("a", 8192)[:16].view(torch.float32)
    gc.collect()
    assert not freed and regions.region_bytes("a") == 8192  # a view keeps the whole allocation
    del view
    gc.collect()
    assert len(freed) == 1 and regions.region_bytes("a") == 0


def test_the_cpu_platform_declares_its_reference():
    support = torchhal.current_platform().virtual_memory_support
    assert support is not None and not support.graph_memory and "madvise" in support.note


def test_info_says_whether_sleep_keeps_the_graphs(plugin_path):
    from .conftest import run_cli

    declared = run_cli("info", "--json")
    assert declared.returncode == 0, declared.stderr
    row = json.loads(declared.stdout)["current"]["capabilities"]["virtual_memory"]
    assert row == {"declared": True, "graph_memory": False, "not_released": [],
                   "note": "host pages: mmap, madvise(MADV_DONTNEED)"}
    assert "  virtual memory: host pages: mmap, madvise(MADV_DONTNEED) (not graph memory; sleep keeps the graphs)" in (
        run_cli("info").stdout)
    plain = run_cli("info", env={"PYTHONPATH": plugin_path, "TORCHHAL_PLATFORM": "vm_none"})
    assert "Current platform: vm_none" in plain.stdout, plain.stdout
    assert "  virtual memory: none (an engine sleeps by host offload and captures its graphs again on wake)" in (
        plain.stdout)
