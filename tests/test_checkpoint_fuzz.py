"""The checkpoint loader's fuzzer in CI: 5,000 seeded hostile checkpoints, no traceback, hang, read
outside the directory or insane accepted model; and the fuzzer itself finds each defence disabled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "fuzz_checkpoint.py"
KINDS = {"config_value", "config_drop", "config_file", "rope", "header", "header_bytes", "index", "special_file",
         "extra_file", "valid", "stacked"}


def fuzz(*args: str) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    result = subprocess.run([sys.executable, str(SCRIPT), "--workers", "2", *args], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines and "cases" in lines[-1], (result.returncode, result.stdout[-3000:], result.stderr[-3000:])
    return result.returncode, lines[:-1], lines[-1]


def test_five_thousand_hostile_checkpoints_without_a_finding():
    code, findings, summary = fuzz("--cases", "5000", "--seed", "11")
    assert (code, findings, summary["findings"]) == (0, [], 0), findings[:5]
    assert summary["cases"] == 5000
    assert set(summary["kinds"]) == KINDS and min(summary["kinds"].values()) >= 40, summary["kinds"]
    assert min(summary["entries"].values()) >= 200, summary["entries"]
    outcomes = summary["outcomes"]
    assert set(outcomes) == {"accepted", "refused"} and outcomes["accepted"] >= 1000 and outcomes["refused"] >= 2500


@pytest.mark.parametrize("defence, finding", [
    ("scope", "opened outside the checkpoint directory"),  # symlinks followed out: the canary is read
    ("regular", "IsADirectoryError"),  # special files opened
    ("ranges", "Error"),  # non-finite or out-of-range numbers reach the math
    ("types", "accepted "),  # "false" taken for a bool, 32.0 for an int
])
def test_the_fuzzer_finds_each_defence_disabled(defence, finding):
    code, findings, summary = fuzz("--cases", "1500", "--seed", "5", "--break", defence)
    assert code == 1 and summary["findings"] == len(findings) > 0
    assert any(finding in f["finding"] for f in findings), findings[:5]
