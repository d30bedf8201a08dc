"""docs/tensor-parallel.md's examples run as written: each is a script its text says how to
start (`python ranks.py`, `torchrun --nproc-per-node 2 tp_generate.py tiny-llama`), so each
is saved under that name and started that way.

The torchrun example loads each rank's shard with `from_checkpoint(..., group=group)` and
generates on two CPU ranks over gloo."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.test_docs import DOCS, runnable_blocks

GUIDE = DOCS / "tensor-parallel.md"
ROOT = DOCS.parent


def run_script(directory: Path, name: str, code: str, *command: str) -> subprocess.CompletedProcess[str]:
    """Run the saved example from `directory`, importing this repository's torchhal."""
    (directory / name).write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *command], cwd=directory, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_guide_says_how_each_example_is_started():
    text = GUIDE.read_text()
    assert set(runnable_blocks(GUIDE)) == {"tp_engine", "launcher"}
    assert "`python ranks.py`" in text and "`torchrun --nproc-per-node 2 tp_generate.py tiny-llama`" in text


def test_the_launcher_example_runs_as_written(tmp_path):
    code = runnable_blocks(GUIDE)["launcher"]
    ran = run_script(tmp_path, "ranks.py", code, "ranks.py")
    assert ran.returncode == 0, ran.stderr
    printed = ast.literal_eval(ran.stdout.strip())
    assert printed == [3.0, 3.0]
    assert "# [3.0, 3.0]" in code  # what the example says it prints is what it prints


def test_the_torchrun_example_runs_as_written(tmp_path):
    from tests.hf_models import save_hf_model

    save_hf_model("llama3", tmp_path / "tiny-llama")
    code = runnable_blocks(GUIDE)["tp_engine"]
    ran = run_script(tmp_path, "tp_generate.py", code, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "tp_generate.py", "tiny-llama")
    assert ran.returncode == 0, ran.stderr
    # Both ranks print to one stdout: a line may hold both (each print's newline is a separate write).
    outputs = re.findall(r"rank (\d) of 2 on cpu:0: (\([^)]*\))", ran.stdout)
    assert sorted(rank for rank, _ in outputs) == ["0", "1"], ran.stdout
    tokens = {ids for _, ids in outputs}
    assert len(tokens) == 1 and len(ast.literal_eval(tokens.pop())) == 8  # both ranks, the same 8 tokens
