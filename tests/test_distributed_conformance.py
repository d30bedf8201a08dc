"""The distributed clauses pass correct platforms and fail each broken one on exactly the
clause its bug touches (the platforms live in tests/distributed_broken.py)."""

from __future__ import annotations

import json

import pytest

from .conftest import conformance_group_results, entry_point_distribution, run_cli

CLAUSES = {
    "each_rank_runs_on_the_device_device_for_rank_names", "all_reduce_sum_max_min_on_float32_bfloat16_int64",
    "all_gather_even_and_uneven_sizes_in_rank_order", "broadcast_from_the_last_rank", "send_recv_around_a_ring",
    "available_memory_over_the_host_communicator_is_the_minimum",
    "a_rank_that_dies_surfaces_as_collective_error_on_the_others",
}


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """A distribution on PYTHONPATH whose entry point is tests.distributed_broken."""
    return entry_point_distribution(tmp_path_factory.mktemp("dist_dist"), "distbroken", "tests.distributed_broken")


def distributed_results(tmp_path, plugin_path, platform):
    return conformance_group_results(tmp_path, plugin_path, platform, "distributed")


def outcome(results, outcome_name):
    return sorted(name for name, t in results.items() if t["outcome"] == outcome_name)


@pytest.mark.parametrize("platform", ["dist_wrapped_correctly", "dist_two_devices"])
def test_a_correct_platform_passes_every_clause(tmp_path, plugin_path, platform):
    """A vendor communicator wrapping the default, and a platform of two devices mapped right."""
    out, results = distributed_results(tmp_path, plugin_path, platform)
    assert outcome(results, "failed") == [] and outcome(results, "error") == [], out.stdout[-3000:]
    assert out.returncode == 0
    assert set(outcome(results, "passed")) == CLAUSES
    assert results["captured_all_reduce_replays_on_new_inputs"]["skip_reason"].startswith("undeclared:")


@pytest.mark.parametrize("platform, clause, words", [
    ("dist_wrong_reduction", "all_reduce_sum_max_min_on_float32_bfloat16_int64", "'max/float32'"),
    ("dist_ignores_sizes", "all_gather_even_and_uneven_sizes_in_rank_order", "all_gather(sizes=...)"),
    ("dist_swapped_devices", "each_rank_runs_on_the_device_device_for_rank_names", "device_for_rank gave index 1"),
])
def test_a_broken_platform_fails_exactly_the_clause_its_bug_touches(tmp_path, plugin_path, platform, clause, words):
    out, results = distributed_results(tmp_path, plugin_path, platform)
    assert outcome(results, "failed") == [clause], out.stdout[-3000:]
    assert words in results[clause]["message"], results[clause]["message"]
    assert out.returncode == 1


def test_info_shows_the_backend_the_communicator_and_graph_capture(plugin_path):
    out = run_cli("info", "--json", env={"PYTHONPATH": plugin_path, "TORCHHAL_PLATFORM": "dist_wrapped_correctly"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["current"]["capabilities"]["distributed"] == {
        "backend": "gloo", "communicator": "vendor", "graph_capturable": False,
        "note": "dist_wrapped_correctly: a wrapped default communicator"}
    text = run_cli("info", env={"PYTHONPATH": plugin_path, "TORCHHAL_PLATFORM": "cpu"}).stdout
    assert ("  distributed: gloo backend, torchhal's default (torch.distributed) communicator, "
            "collectives not graph-captured\n") in text
