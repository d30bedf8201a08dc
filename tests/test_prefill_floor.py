"""The prefill floor benchmark's arithmetic (`benchmarks/prefill_floor.py`): which steps the
engine runs a cell's prompts in, each operation's FLOPs, nvidia-smi sample parsing, and the
judgement of a cell against the long-context goal."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("prefill_floor")


@pytest.mark.parametrize(("prompt", "batch", "expected"), [
    (3968, 1, (1, 1)), (3968, 8, (4, 2)), (3968, 32, (4, 8)), (16000, 8, (1, 8)), (3968, 5, (4, 2)),
    (20000, 2, (1, 2)),  # longer than a step's budget: still one prompt a step
])
def test_step_shapes_admit_whole_prompts_up_to_the_token_budget(bench: ModuleType, prompt: int, batch: int,
                                                                 expected: tuple[int, int]) -> None:
    assert bench.step_shapes(prompt, batch, 16384) == expected


def test_step_shapes_refuses_a_non_positive_size(bench: ModuleType) -> None:
    with pytest.raises(ValueError, match="batch 0"):
        bench.step_shapes(3968, 0, 16384)


def test_operation_flops_count_the_causal_half_per_prompt(bench: ModuleType) -> None:
    one = bench.operation_flops(3968, 1)
    four = bench.operation_flops(4 * 3968, 4)
    long = bench.operation_flops(2 * 3968, 1)
    assert four["gate_up"] == 4 * one["gate_up"]  # projections: linear in tokens
    assert four["attention"] == 4 * one["attention"]  # four prompts attend separately
    assert long["attention"] == pytest.approx(4 * one["attention"], rel=1e-3)  # one twice as long: ~4x
    assert one["attention"] == 4 * 32 * 128 * 3968 * 3969 / 2
    assert one["qkv"] == 2 * 3968 * 4096 * 6144


def test_parse_samples_takes_medians_and_skips_unreadable_lines(bench: ModuleType) -> None:
    text = "1980, 650.5\n1755, 699.9\n[N/A], 100\n1830, 700.1\n1700,"
    parsed = bench.parse_samples(text)
    assert parsed == {"samples": 3, "sm_mhz_median": 1830.0, "power_w_median": 699.9, "power_w_max": 700.1}
    assert bench.parse_samples("")["sm_mhz_median"] is None


def test_judge_cells_scales_the_step_floor_and_sets_it_against_the_goal(bench: ModuleType) -> None:
    steps = {"4x3968": {"stack_ms": 360.0}, "1x16000": {"stack_ms": 450.0}}
    long_context = {"cells": {"3968x8": {"prefill_s": {"transformers": 0.95, "torchhal": 0.80}}}}
    cells = bench.judge_cells(steps, long_context, 16384)
    assert set(cells) == {"3968x8", "3968x32", "16000x1", "16000x8"}  # 1x3968 was not measured
    eight = cells["3968x8"]
    assert eight["steps"] == 2 and eight["floor_s"] == pytest.approx(0.72)
    assert eight["goal_s"] == pytest.approx(0.76)
    assert eight["room_above_floor_s"] == pytest.approx(0.04)
    assert eight["torchhal_above_floor_s"] == pytest.approx(0.08)
    assert cells["16000x8"]["floor_s"] == pytest.approx(3.6)
    assert "goal_s" not in cells["16000x1"]  # no measured figure to judge against
