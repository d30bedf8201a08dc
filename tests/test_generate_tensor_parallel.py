"""`torchhal generate --tensor-parallel N`: refused in one line before any rank starts when it
cannot run; otherwise N ranks generate, must agree token for token, and the command prints
what N = 1 prints plus the tensor-parallel size.

The end-to-end tests (marked `needs_tp_engine` in their names) start real rank processes
of the tensor-parallel engine (`GenerationEngine.from_checkpoint(..., group=group)`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import torchhal.cli.generate as generate_module
import torchhal.distributed
from tests.hf_models import save_hf_model
from tests.test_generate_command import one_line_refusal

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gqa")
    save_hf_model("llama3", directory)  # 4 query heads, 2 KV heads, intermediate 96, vocab 128
    return directory


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tied")
    save_hf_model("llama_tied", directory)  # tied embeddings, one KV head (replicated over ranks)
    return directory


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before any rank starts."""
    def refuse_to_launch(*args: Any, **kwargs: Any) -> list[Any]:
        raise AssertionError("a rank was started for a request that should have been refused")

    monkeypatch.setattr(torchhal.distributed, "launch", refuse_to_launch)


def fake_launch_from_one_device(edit_rank_one: Any = None):
    """A launcher whose ranks are one-device runs of the real engine (no processes): every
    rank's report is real; `edit_rank_one` may change rank 1's."""
    def fake(target: Any, world_size: int, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        assert target is generate_module.generate_on_rank and world_size == args[0].tensor_parallel
        reports = [generate_module.run_generation(args[0]) for _ in range(world_size)]
        if edit_rank_one is not None:
            edit_rank_one(reports[1])
        return reports

    return fake


# -- refusals, before anything starts -----------------------------------------------------------
@pytest.mark.parametrize("size, shown", [("0", "0"), ("-2", "-2"), ("two", "two"), ("1.5", "1.5"), ("", "''"),
                                         ("1_0", "1_0"), (" 2", "' 2'"), ("\u0662", "\u0662")])
def test_a_size_that_is_not_a_positive_integer_is_one_line(gqa, generate, no_ranks, size, shown):
    """Shown as typed, quoted only where blanks would hide what was typed."""
    one_line_refusal(generate("--model", str(gqa), "--prompt-ids", "1,2", "--tensor-parallel", size),
                     f"--tensor-parallel {shown} must be a positive integer")


def test_a_model_that_cannot_be_split_is_one_line_naming_the_valid_sizes(gqa, generate, no_ranks):
    one_line_refusal(generate("--model", str(gqa), "--prompt-ids", "1,2", "--tensor-parallel", "3"),
                     "cannot split this model over 3 ranks", "num_attention_heads = 4 is not divisible by 3",
                     "choose a tensor-parallel size from [1, 2, 4]")


def test_a_truncated_checkpoint_is_one_line_before_any_rank_starts(gqa, generate, no_ranks, tmp_path, monkeypatch):
    # Its headers were first read inside the ranks: the launch ended with exit 1 and rank 0's traceback.
    import os
    import shutil

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    broken = tmp_path / "truncated"
    shutil.copytree(gqa, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    one_line_refusal(generate("--model", str(broken), "--prompt-ids", "1,2", "--tensor-parallel", "2"),
                     "model.safetensors: not a valid safetensors file", "download or save it again")


def test_more_cpu_ranks_than_cores_is_one_line(gqa, generate, no_ranks, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    one_line_refusal(generate("--model", str(gqa), "--prompt-ids", "1,2", "--tensor-parallel", "2"),
                     "--tensor-parallel 2 needs 2 ranks", "this host's 1 core(s): choose at most 1")


def test_more_ranks_than_accelerator_devices_is_one_line(gqa, generate, no_ranks, monkeypatch):
    accelerator = SimpleNamespace(name="fakeaccel", device_type="fakeaccel", device_count=lambda: 1,
                                  visible_devices_env=("FAKEACCEL_VISIBLE_DEVICES",))
    monkeypatch.setattr("torchhal.platforms.selection.current_platform", lambda: accelerator)
    monkeypatch.setenv("FAKEACCEL_VISIBLE_DEVICES", "3")
    one_line_refusal(generate("--model", str(gqa), "--prompt-ids", "1,2", "--tensor-parallel", "2"),
                     "--tensor-parallel 2 needs 2 fakeaccel devices, but 1 is visible "
                     "(FAKEACCEL_VISIBLE_DEVICES='3'): choose at most 1, or make more devices visible")


@pytest.mark.parametrize("args, expected", [
    (("--prompt-ids", "1,128"), "token id 128 is outside the vocabulary 0..127"),
    (("--prompt-ids", "1,2", "--max-new-tokens", "0"), "--max-new-tokens 0 must be a positive integer"),
    (("--prompt-ids", "1,2", "--max-new-tokens", "1000000"), "exceeds max_position 256"),
    (("--prompt", "hello"), "ships no tokenizer"),
])
def test_the_prompt_and_length_checks_come_first_with_several_ranks(gqa, generate, no_ranks, args, expected):
    one_line_refusal(generate("--model", str(gqa), *args, "--tensor-parallel", "2"), expected)


# -- what the parent does with the ranks' reports ------------------------------------------------
def test_agreeing_ranks_print_the_one_device_report_plus_the_size(gqa, generate, monkeypatch):
    args = ("--model", str(gqa), "--prompt-ids", "5,17,3", "--max-new-tokens", "6")
    one = generate(*args)
    assert one.returncode == 0, one.stderr
    assert "tensor parallel" not in one.stdout  # N = 1 prints what it always printed
    monkeypatch.setattr(torchhal.distributed, "launch", fake_launch_from_one_device())
    two = generate(*args, "--tensor-parallel", "2")
    assert two.returncode == 0, two.stderr
    one_lines, two_lines = one.stdout.splitlines(), two.stdout.splitlines()
    assert two_lines[1] == one_lines[1]  # the tokens
    assert len(two_lines) == len(one_lines) + 1 and two_lines[-1] == "tensor parallel: 2 ranks on cpu:0, cpu:0"
    as_json = json.loads(generate(*args, "--tensor-parallel", "2", "--json").stdout)
    assert as_json["tensor_parallel"] == {"size": 2, "devices": ["cpu:0", "cpu:0"]}
    assert "tensor_parallel" not in json.loads(generate(*args, "--json").stdout)


def test_ranks_that_disagree_are_an_error_not_a_pick(gqa, generate, monkeypatch):
    def change_third_token(report: dict[str, Any]) -> None:
        report["output_ids"] = report["output_ids"][:2] + [(report["output_ids"][2] + 1) % 128] + \
            report["output_ids"][3:]

    monkeypatch.setattr(torchhal.distributed, "launch", fake_launch_from_one_device(change_third_token))
    ran = generate("--model", str(gqa), "--prompt-ids", "5,17,3", "--max-new-tokens", "6", "--tensor-parallel", "2")
    assert ran.returncode == 1 and ran.stdout == "", ran
    assert "tensor-parallel ranks disagree: rank 1 generated" in ran.stderr
    assert "(first difference at output token 2)" in ran.stderr


def test_a_rank_that_stops_early_disagrees_at_the_first_missing_token():
    reports = [{"output_ids": [4, 5, 6], "device": "cpu:0"}, {"output_ids": [4, 5], "device": "cpu:0"}]
    with pytest.raises(generate_module.RanksDisagree, match="first difference at output token 2"):
        generate_module.agreed_report(reports)


def test_the_ranks_run_with_the_commands_finite_check_and_thread_count(gqa, generate, monkeypatch):
    requests: list[Any] = []

    def fake(target: Any, world_size: int, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        requests.append(args[0])
        return [generate_module.run_generation(args[0]) for _ in range(world_size)]

    monkeypatch.setattr(torchhal.distributed, "launch", fake)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    args = ("--model", str(gqa), "--prompt-ids", "5,17,3", "--max-new-tokens", "2", "--tensor-parallel", "2")
    assert generate(*args).returncode == generate(*args, "--no-check-finite").returncode == 0
    assert [(r.check_finite, r.threads) for r in requests] == [(True, 1), (False, 1)]


def test_a_failed_rank_is_reported_with_the_launchers_error(gqa, generate, monkeypatch):
    def failing(*args: Any, **kwargs: Any) -> list[Any]:
        raise torchhal.distributed.LaunchError(
            "rank 1 exited with code 3 before returning a result; stopped every rank", rank=1, exitcode=3)

    monkeypatch.setattr(torchhal.distributed, "launch", failing)
    ran = generate("--model", str(gqa), "--prompt-ids", "5,17,3", "--tensor-parallel", "2")
    assert ran.returncode == 1 and ran.stdout == ""
    assert ran.stderr == "torchhal generate: rank 1 exited with code 3 before returning a result; stopped every rank\n"


# -- end to end: real ranks on the tensor-parallel engine ------------------------------------------
def ids_of(generate, model: Path, *extra: str) -> list[int]:
    ran = generate("--model", str(model), "--prompt-ids", "5,17,3,99", "--max-new-tokens", "12", "--json", *extra)
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout)["output_ids"]


@pytest.mark.parametrize("model", ["gqa", "tied"])
def test_needs_tp_engine_two_ranks_generate_what_one_does(request, generate, model):
    path = request.getfixturevalue(model)
    one = ids_of(generate, path)
    assert len(one) == 12
    assert ids_of(generate, path, "--tensor-parallel", "2") == one


def test_needs_tp_engine_graphs_keep_working_with_two_ranks(gqa, generate):
    one = ids_of(generate, gqa)
    ran = generate("--model", str(gqa), "--prompt-ids", "5,17,3,99", "--max-new-tokens", "12", "--json",
                   "--graphs", "--tensor-parallel", "2")
    assert ran.returncode == 0, ran.stderr
    out = json.loads(ran.stdout)
    assert out["output_ids"] == one and out["decode_graphs"] is not None
    assert out["tensor_parallel"]["size"] == 2
    # The platform's reason, as one device gives it (not the rank program's all-reduce breaks).
    assert out["decode_graphs"]["unavailable"] == "platform 'cpu' declares no graph support"


def test_needs_tp_engine_weights_that_are_not_finite_stop_every_rank(gqa, generate, tmp_path):
    # Every rank loaded and generated from them, exit 0.
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "nan"
    shutil.copytree(gqa, model)
    tensors = load_file(model / "model.safetensors")
    tensors["model.norm.weight"][7] = float("inf")  # every rank holds all of it
    save_file(tensors, model / "model.safetensors")
    ran = generate("--model", str(model), "--prompt-ids", "5,17,3", "--max-new-tokens", "4", "--tensor-parallel", "2")
    assert ran.returncode == 1 and ran.stdout == "", ran
    assert "tensor 'model.norm.weight' holds NaN or infinite values" in ran.stderr


def test_needs_tp_engine_the_command_line_runs_two_ranks(gqa):
    command = [sys.executable, "-m", "torchhal.cli", "generate", "--model", str(gqa), "--prompt-ids", "5,17,3,99",
               "--max-new-tokens", "12"]
    one = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    two = subprocess.run([*command, "--tensor-parallel", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout.splitlines()[1] == one.stdout.splitlines()[1]
    assert two.stdout.splitlines()[-1] == "tensor parallel: 2 ranks on cpu:0, cpu:0"
