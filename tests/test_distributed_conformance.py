"""The distributed clauses pass correct platforms and fail each broken one on exactly the
clause its bug touches (the platforms live in tests/distributed_broken.py)."""

from __future__ import annotations

import json

import pytest

from .conftest import conformance_group_results, entry_point_distribution, run_cli, suite_summary

CLAUSES = {
    "the_declared_dist_backend_is_available",
    "each_rank_runs_on_the_device_device_for_rank_names", "all_reduce_sum_max_min_on_float32_bfloat16_int64",
    "all_gather_even_and_uneven_sizes_in_rank_order", "broadcast_from_the_last_rank", "send_recv_around_a_ring",
    "available_memory_over_the_host_communicator_is_the_minimum",
}
#: The dead-rank clause, once with a one-element sum and once with a decode step's hidden row.
DEAD_PEER = "a_rank_that_dies_stops_the_others_within_a_bound"
DEAD_PEER_PROBES = (f"{DEAD_PEER}[one_element]", f"{DEAD_PEER}[decode_row]")
CLAUSES |= set(DEAD_PEER_PROBES)

#: Every collective engines capture in a decode graph: the all_reduces and the logits' all_gather.
CAPTURE_CLAUSES = ("captured_all_reduce_replays_on_new_inputs", "captured_all_gather_replays_on_new_inputs")


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """A distribution on PYTHONPATH whose entry point is tests.distributed_broken."""
    return entry_point_distribution(tmp_path_factory.mktemp("dist_dist"), "distbroken", "tests.distributed_broken")


def distributed_results(tmp_path, plugin_path, platform):
    return conformance_group_results(tmp_path, plugin_path, platform, "distributed")


def outcome(results, outcome_name):
    return sorted(name for name, t in results.items() if t["outcome"] == outcome_name)


@pytest.mark.parametrize("platform", ["dist_wrapped_correctly", "dist_two_devices", "dist_four_devices"])
def test_a_correct_platform_passes_every_clause(tmp_path, plugin_path, platform):
    """A vendor communicator wrapping the default, and platforms of two and four devices mapped
    right (four ranks: every clause's values, bfloat16's included, hold for more than two)."""
    out, results = distributed_results(tmp_path, plugin_path, platform)
    assert outcome(results, "failed") == [] and outcome(results, "error") == [], suite_summary(out)
    assert out.returncode == 0, suite_summary(out)
    assert set(outcome(results, "passed")) == CLAUSES
    for clause in CAPTURE_CLAUSES:
        assert results[clause]["skip_reason"].startswith("undeclared:")
    for probe in DEAD_PEER_PROBES:
        assert results[probe]["measured"]["outcome"] == "CollectiveError"


def test_the_gather_clause_holds_for_up_to_eight_ranks_in_every_dtype():
    """The clause runs up to eight ranks; each rank's values must survive every dtype it is
    gathered in (bfloat16 holds integers exactly only up to 256), and differ from every other's."""
    import torch

    from torchhal.conformance_tests._workers import DISTRIBUTED_DTYPES, gather_piece, gathered_rows

    for rank in range(8):
        piece = gather_piece(rank)
        for dtype in DISTRIBUTED_DTYPES.values():
            assert torch.equal(piece.to(dtype).to(torch.int64), piece), (rank, dtype)
    values = [v for row in gathered_rows(8) for v in row]
    assert len(set(values)) == len(values)


def test_a_backend_that_ends_the_process_on_a_dead_peer_passes_the_clause(tmp_path, plugin_path):
    """NCCL's way under torch's default error handling: the collective returns, its watchdog
    ends the process. Never silent, never a hang: the clause passes and says which it saw."""
    out, results = distributed_results(tmp_path, plugin_path, "dist_peer_loss_ends_process")
    for probe in DEAD_PEER_PROBES:
        clause = results[probe]
        assert clause["outcome"] == "passed", clause["message"]
        assert clause["measured"]["outcome"] == "the backend ended the process (exit code 6)"
    assert out.returncode == 0, suite_summary(out)


def test_a_communicator_whose_collectives_capture_passes_every_clause_and_both_replays(tmp_path, plugin_path):
    out, results = distributed_results(tmp_path, plugin_path, "dist_captures_correctly")
    assert outcome(results, "failed") == [] and outcome(results, "error") == [], suite_summary(out)
    assert set(outcome(results, "passed")) == CLAUSES | set(CAPTURE_CLAUSES)
    assert out.returncode == 0, suite_summary(out)


@pytest.mark.parametrize("platform, clause, words", [
    ("dist_wrong_reduction", "all_reduce_sum_max_min_on_float32_bfloat16_int64", "'max/float32'"),
    ("dist_ignores_sizes", "all_gather_even_and_uneven_sizes_in_rank_order", "all_gather(sizes=...)"),
    ("dist_swapped_devices", "each_rank_runs_on_the_device_device_for_rank_names", "device_for_rank gave index 1"),
    # The engine captures the logits' all_gather too: a communicator that captures only all_reduce must fail.
    ("dist_gather_not_capturable", "captured_all_gather_replays_on_new_inputs",
     "RuntimeError: all_gather: operation not permitted when stream is capturing"),
    ("dist_gather_stale_in_replay", "captured_all_gather_replays_on_new_inputs",
     "all_gather(dim=-1) captured in a graph (as engines capture the logits' gather) gave"),
    # A dead peer: a wrong sum read back, a hang, a clean exit.
    ("dist_peer_loss_silent", DEAD_PEER_PROBES, "a wrong sum, silently"),
    ("dist_peer_loss_hangs", DEAD_PEER_PROBES, "neither raised CollectiveError nor ended within 45 s"),
    ("dist_peer_loss_exits_cleanly", DEAD_PEER_PROBES, "exited with code 0 without reporting"),
    # Only the decode-sized probe takes the path that misses the dead peer.
    ("dist_small_sums_miss_peer_loss", f"{DEAD_PEER}[decode_row]", "a wrong sum, silently"),
    # A declared backend torch.distributed lacks is the plugin's failure, not an undeclared skip.
    ("dist_unknown_backend", "the_declared_dist_backend_is_available", "dist_backend = 'acmeccl'"),
])
def test_a_broken_platform_fails_exactly_the_clause_its_bug_touches(tmp_path, plugin_path, platform, clause, words):
    out, results = distributed_results(tmp_path, plugin_path, platform)
    clauses = sorted([clause] if isinstance(clause, str) else clause)
    assert outcome(results, "failed") == clauses, suite_summary(out)
    for name in clauses:
        assert words in results[name]["message"], results[name]["message"]
    assert out.returncode == 1, suite_summary(out)


def test_the_dead_peer_clause_judges_the_plugins_own_path_under_detail_debug(tmp_path, plugin_path):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL puts a cross-rank check over gloo in front of every
    collective, and that check would raise on the dead peer before the plugin's path ran."""
    out, results = conformance_group_results(tmp_path, plugin_path, "dist_small_sums_miss_peer_loss", "distributed",
                                             env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert outcome(results, "failed") == [f"{DEAD_PEER}[decode_row]"], suite_summary(out)


def test_a_declared_backend_torch_lacks_names_it_and_the_fix_and_blocks_the_verdict(tmp_path, plugin_path):
    out, results = distributed_results(tmp_path, plugin_path, "dist_unknown_backend")
    message = results["the_declared_dist_backend_is_available"]["message"]
    assert "torch.distributed does not have in this process (available here: gloo" in message, message
    assert "correct the name" in message and "torch.distributed.Backend.register_backend" in message, message
    # The clauses that need the backend could not run: required skips that name it, never "undeclared".
    skipped = {name: t["skip_reason"] for name, t in results.items() if t["outcome"] == "skipped"}
    assert set(skipped) == CLAUSES - {"the_declared_dist_backend_is_available"} | set(CAPTURE_CLAUSES) | {
        "visible_devices_renumber_what_ranks_see"}
    for name in skipped.keys() - {"visible_devices_renumber_what_ranks_see"}:
        assert skipped[name].startswith("could not run: torch.distributed backend 'acmeccl'"), skipped[name]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict_class"] == "NOT CONFORMANT" and out.returncode == 1, suite_summary(out)


def test_ranks_that_disagree_point_at_the_platforms_communicator_and_its_conformance_clause():
    from torchhal.cli.generate import RanksDisagree, agreed_report

    reports = [{"output_ids": [4, 5, 6], "device": "cpu:0", "platform": "acme"},
               {"output_ids": [4, 5, 7], "device": "cpu:0", "platform": "acme"}]
    with pytest.raises(RanksDisagree) as raised:
        agreed_report(reports)
    message = str(raised.value)
    assert message.startswith("tensor-parallel ranks disagree: rank 1 generated [4, 5, 7]"), message
    assert "communicator" in message and "under graph capture" in message, message
    assert "torchhal conformance --platform acme --profile full -k test_distributed" in message, message
    assert "engine's tensor-parallel path is wrong: report it" in message, message


def test_info_shows_the_backend_the_communicator_and_graph_capture(plugin_path):
    out = run_cli("info", "--json", env={"PYTHONPATH": plugin_path, "TORCHHAL_PLATFORM": "dist_wrapped_correctly"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["current"]["capabilities"]["distributed"] == {
        "backend": "gloo", "communicator": "vendor", "graph_capturable": False,
        "note": "dist_wrapped_correctly: a wrapped default communicator"}
    text = run_cli("info", env={"PYTHONPATH": plugin_path, "TORCHHAL_PLATFORM": "cpu"}).stdout
    assert ("  distributed: gloo backend, torchhal's default (torch.distributed) communicator, "
            "collectives not graph-captured\n") in text
