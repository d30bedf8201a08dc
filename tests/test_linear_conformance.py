"""The linear clause passes a correct kernel and fails each broken one on exactly the cases its
bug touches (the kernels live in tests/linear_broken.py)."""

from __future__ import annotations

import json

import pytest

from torchhal.conformance_tests.test_linear import SHAPES

from .conftest import conformance_group_results, entry_point_distribution, suite_summary

MATCHES = {f"linear_matches_f_linear[{name}]": shape for name, shape in SHAPES.items()}


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """A distribution on PYTHONPATH whose entry point is tests.linear_broken."""
    return entry_point_distribution(tmp_path_factory.mktemp("linear_dist"), "linearbroken", "tests.linear_broken")


def failed(results):
    return sorted(name for name, t in results.items() if t["outcome"] in ("failed", "error"))


def test_a_correct_kernel_passes_every_case(tmp_path, plugin_path):
    out, results = conformance_group_results(tmp_path, plugin_path, "linear_correct", "linear")
    assert failed(results) == [], suite_summary(out)
    assert out.returncode == 0, suite_summary(out)
    passed = {name for name, t in results.items() if t["outcome"] == "passed"}
    assert set(MATCHES) | {"linear_is_deterministic"} <= passed  # every shape ran; none was skipped
    # The CPU platform has no graphs: that test is reported as undeclared, never as passed.
    replay = results["linear_replays_from_a_graph"]
    assert replay["outcome"] == "skipped" and replay["skip_reason"].startswith("undeclared:")


@pytest.mark.parametrize("platform, broken_cases", [
    # Only a K that is not a multiple of the 64-wide block has a tail to drop.
    ("linear_drops_k_tail", sorted(n for n, (_, k) in MATCHES.items() if k % 64)),
    # Every shape runs with a bias.
    ("linear_ignores_bias", sorted(MATCHES)),
    # Every shape runs with 2 to 4 rows.
    ("linear_swaps_rows", sorted(MATCHES)),
    # Rows are misread only where K is not a multiple of 8, and never with one output row.
    ("linear_wrong_row_stride", sorted(n for n, (out, k) in MATCHES.items() if k % 8 and out > 1)),
    # Within rounding every time, but float32 shows the changed order in the last bits.
    ("linear_racing_split_k", ["linear_is_deterministic"]),
])
def test_a_broken_kernel_fails_exactly_the_cases_its_bug_touches(tmp_path, plugin_path, platform, broken_cases):
    out, results = conformance_group_results(tmp_path, plugin_path, platform, "linear")
    assert failed(results) == sorted(broken_cases), suite_summary(out)
    assert out.returncode == 1, suite_summary(out)
    for name in broken_cases:
        message = results[name]["message"]
        assert ("differs from F.linear" if name in MATCHES else "gave other bits") in message, message


def test_a_platform_without_a_kernel_skips_the_clause_as_undeclared(tmp_path, plugin_path):
    out, results = conformance_group_results(tmp_path, plugin_path, "cpu", "linear")
    assert out.returncode == 0 and results, suite_summary(out)
    assert all(t["outcome"] == "skipped" and t["skip_reason"].startswith("undeclared:") for t in results.values())


def test_info_shows_the_linear_kernel_or_f_linear(plugin_path):
    from .conftest import run_cli

    env = {"PYTHONPATH": plugin_path, "TORCHHAL_PLATFORM": "linear_correct"}
    out = run_cli("info", "--json", env=env)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)["current"]["capabilities"]["linear"]
    assert row == {"name": "linear-correct", "max_rows": 4, "dtypes": ["float32", "bfloat16"],
                   "graph_capture": False, "note": ""}
    assert "  linear: linear-correct for inputs of at most 4 row(s), F.linear above (float32/bfloat16)" in (
        run_cli("info", env=env).stdout)
    plain = run_cli("info", "--json", env={"PYTHONPATH": plugin_path, "TORCHHAL_PLATFORM": "cpu"})
    assert json.loads(plain.stdout)["current"]["capabilities"]["linear"] == {"name": None}
    assert "  linear: F.linear (the platform supplies no linear kernel)" in run_cli("info").stdout
