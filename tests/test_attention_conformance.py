"""The attention clause passes a correct backend and fails each broken one on exactly the
cases its bug touches (the backends live in tests/attention_broken.py)."""

from __future__ import annotations

import pytest

from torchhal.conformance_tests.test_attention import DECODE_CASES, PREFILL_CASES

from .conftest import conformance_group_results, entry_point_distribution

CASES = {**{f"decode_matches_the_reference[{n}]": c for n, c in DECODE_CASES.items()},
         **{f"prefill_matches_the_reference[{n}]": c for n, c in PREFILL_CASES.items()}}


WHOLE_PROMPTS_PAST_ROW_0 = sorted(n for n, c in CASES.items() if n.startswith("prefill_") and any(
    1 < q == s and (c.window is None or c.window >= s) for s, q in zip(c.seq_lens, c.query_lens, strict=True)))


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """A distribution on PYTHONPATH whose entry point is tests.attention_broken."""
    return entry_point_distribution(tmp_path_factory.mktemp("attn_dist"), "attnbroken", "tests.attention_broken")


def attention_results(tmp_path, plugin_path, platform):
    return conformance_group_results(tmp_path, plugin_path, platform, "attention")


def failed(results):
    return sorted(name for name, t in results.items() if t["outcome"] in ("failed", "error"))


@pytest.mark.parametrize("platform", ["attn_declared_reference", "attn_blocks_128", "attn_step_kv"])
def test_a_correct_backend_passes_every_case(tmp_path, plugin_path, platform):
    """Also one that takes only the block size it declares: the layouts use a declared size."""
    out, results = attention_results(tmp_path, plugin_path, platform)
    assert failed(results) == [], out.stdout[-3000:]
    assert out.returncode == 0
    passed = {name for name, t in results.items() if t["outcome"] == "passed"}
    assert set(CASES) <= passed  # every layout ran; none was skipped
    # The CPU platform has no graphs: that test is reported as undeclared, never as passed.
    assert results["decode_replays_from_a_graph"]["outcome"] == "skipped"


@pytest.mark.parametrize("platform, broken_cases", [
    # Every case has a request longer than one block, so reading the next column always shows.
    ("attn_off_by_one_block", sorted(CASES)),
    # h % kv_heads equals h // group only when there is one KV head or one query head per KV head.
    ("attn_wrong_gqa", sorted(n for n, c in CASES.items() if c.kv_heads not in (1, c.q_heads))),
    ("attn_ignores_window", sorted(n for n, c in CASES.items() if c.window is not None)),
    ("attn_writes_packed_rows", ["write_kv_reads_views_into_the_projections"]),
    ("attn_writes_with_keys_strides", ["write_kv_reads_views_into_the_projections"]),
    ("attn_only_into_out", sorted(n for n in CASES if n.startswith("prefill_"))),
    # The prefill cases with a request whose earlier tokens are cached.
    ("attn_step_kv_whole_context", sorted(n for n, c in CASES.items() if n.startswith("prefill_") and any(
        0 < q < s for s, q in zip(c.seq_lens, c.query_lens, strict=True)))),
    # The prefill cases with a whole prompt past its first row (row 0 of packed rows is right).
    ("attn_step_kv_packed_rows", WHOLE_PROMPTS_PAST_ROW_0),
    ("attn_step_kv_keys_strides", WHOLE_PROMPTS_PAST_ROW_0),
])
def test_a_broken_backend_fails_exactly_the_cases_its_bug_touches(tmp_path, plugin_path, platform, broken_cases):
    out, results = attention_results(tmp_path, plugin_path, platform)
    assert failed(results) == sorted(broken_cases), out.stdout[-3000:]
    assert out.returncode == 1
    for name in broken_cases:
        if name in CASES:
            assert "differs from the reference" in results[name]["message"], results[name]["message"]
