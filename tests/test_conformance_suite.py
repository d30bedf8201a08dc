"""The conformance suite passes a good plugin and fails each broken one on exactly the right test."""

import json

import pytest

from .conftest import run_cli


def run_suite(tmp_path, *args):
    report = tmp_path / "report.json"
    out = run_cli("conformance", *args, "--json", str(report), with_test_dist=True)
    assert report.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads(report.read_text())
    failed = sorted(t["id"] for t in data["tests"] if t["outcome"] in ("failed", "error", "xpassed"))
    return out, data, failed


def test_cpu_full_profile_is_conformant_with_a_json_report(tmp_path):
    out, data, failed = run_suite(tmp_path, "--platform", "cpu", "--profile", "full")
    assert out.returncode == 0 and failed == []
    assert data["conformant"] is True and data["verdict"] == "CONFORMANT (full)"
    assert "VERDICT: CONFORMANT (full)" in out.stdout
    groups = {t["group"] for t in data["tests"]}
    assert groups == {"contract", "device", "memory", "graphs", "ipc", "distributed"}
    # A skip is never a pass: CPU declares no graphs, and they are reported as skipped.
    graphs = [t for t in data["tests"] if t["group"] == "graphs"]
    assert graphs and all(t["outcome"] == "skipped" and t["skip_reason"].startswith("undeclared:") for t in graphs)
    assert data["environment"]["platform"] == "cpu" and data["suite_version"]
    cost = next(t for t in data["tests"] if t["id"] == "memory::test_memory_info_cost")
    assert cost["measured"]["memory_info_us_per_call"] > 0


def test_reference_simulated_cache_is_conformant(tmp_path):
    out, data, failed = run_suite(tmp_path, "--platform", "simcache")
    assert failed == [] and data["verdict"] == "CONFORMANT (core)", out.stdout[-2000:]


@pytest.mark.parametrize(
    "platform, args, expected_failures",
    [
        ("broken_query_empties", (), ["memory::test_memory_info_never_empties_the_cache"]),
        ("broken_empty_noop", (), ["memory::test_empty_cache_releases_down_to_allocated"]),
        ("broken_ipc_bounds", ("--profile", "full", "-k", "ipc"), ["ipc::test_malformed_handles_are_rejected"]),
        ("broken_detect_raises", ("-k", "contract"), ["contract::test_is_available_never_raises_and_is_idempotent"]),
        ("broken_missing_method", (), ["contract::test_spi_methods_present_with_signatures"]),
    ],
)
def test_broken_plugins_fail_exactly_the_right_tests(tmp_path, platform, args, expected_failures):
    out, data, failed = run_suite(tmp_path, "--platform", platform, *args)
    assert failed == expected_failures, out.stdout[-3000:]
    assert out.returncode == 1
    assert data["conformant"] is False and data["verdict"].startswith("NOT CONFORMANT")


def test_expectation_file_marks_known_failures_and_is_strict(tmp_path):
    expect = tmp_path / "expect.toml"
    expect.write_text(
        '["memory::test_empty_cache_releases_down_to_allocated"]\n'
        'reason = "allocator keeps a pool; fixed in driver 2.0"\ncategory = "temporary"\n'
        '["memory::test_no_such_test"]\nreason = "stale"\ncategory = "permanent"\n'
    )
    out, data, failed = run_suite(tmp_path, "--platform", "broken_empty_noop", "--expect", str(expect))
    outcome = {t["id"]: t["outcome"] for t in data["tests"]}
    assert outcome["memory::test_empty_cache_releases_down_to_allocated"] == "xfailed"
    assert failed == [] and data["conformant"] is True
    assert "matches no conformance test" in out.stdout + out.stderr
    # Strict: the same expectation on a plugin that passes is reported as a failure.
    out, data, failed = run_suite(tmp_path, "--platform", "simcache", "--expect", str(expect))
    assert failed == ["memory::test_empty_cache_releases_down_to_allocated"]
    assert data["conformant"] is False


def test_yaml_expectation_file_with_a_bad_category_is_a_usage_error(tmp_path):
    expect = tmp_path / "expect.yaml"
    expect.write_text("memory::test_memory_info_cost:\n  reason: slow\n  category: someday\n")
    out = run_cli("conformance", "--platform", "cpu", "--expect", str(expect))
    assert out.returncode != 0
    assert "category 'someday'" in out.stdout + out.stderr


def test_junit_output(tmp_path):
    junit = tmp_path / "junit.xml"
    out = run_cli("conformance", "--platform", "cpu", "-k", "contract", "--junit", str(junit))
    assert out.returncode == 0, out.stdout[-2000:]
    assert "testcase" in junit.read_text()


def test_the_suite_runs_as_a_plain_pytest_plugin(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "torchhal.conformance_tests", "--torchhal-platform", "cpu",
         "-k", "contract", "-p", "no:cacheprovider", "--torchhal-json", str(tmp_path / "r.json")],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:]
    assert "VERDICT: CONFORMANT (core)" in out.stdout
    assert "torchhal conformance suite" in out.stdout  # the report header
