"""`torchhal generate` refuses bad arguments in one line, before anything is loaded or sized,
and says why a run ended early."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.conftest import Ran
from tests.hf_models import save_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    save_hf_model("llama3", directory)  # vocab 128, max_position 256
    return directory


def one_line_refusal(ran: Ran, *expected: str) -> None:
    assert ran.returncode == 2, ran
    assert ran.stdout == "" and len(ran.stderr.strip().splitlines()) == 1, ran.stderr
    assert "Traceback" not in ran.stderr
    for text in expected:
        assert text in ran.stderr, ran.stderr


@pytest.mark.parametrize("ids, expected", [
    ("", "must be comma-separated integers"),
    ("1,,2", "must be comma-separated integers"),
    ("1e3", "'1e3' is not one"),
    ("-1", "token id -1 is outside the vocabulary 0..127"),
    ("128", "token id 128 is outside the vocabulary 0..127"),
    ("99999999999999999999999", "outside the vocabulary"),
])
def test_bad_prompt_ids_are_one_line(tiny, generate, ids, expected):
    one_line_refusal(generate("--model", str(tiny), "--prompt-ids", ids), expected)


@pytest.mark.parametrize("new, expected", [
    ("0", "--max-new-tokens 0 must be a positive integer"),
    ("-5", "--max-new-tokens -5 must be a positive integer"),
    ("1000000000", "exceeds max_position 256"),
])
def test_bad_lengths_are_refused_before_loading(tiny, generate, new, expected):
    start = time.perf_counter()
    one_line_refusal(generate("--model", str(tiny), "--prompt-ids", "1,2", "--max-new-tokens", new), expected)
    assert time.perf_counter() - start < 5  # no KV pool sized for a billion tokens


@pytest.mark.parametrize("flags, expected", [
    # int() would read each of these as a number: 10, 10, 4 and 4
    (("--prompt-ids", "1_0"), "('1_0' is not one)"),
    (("--prompt-ids", "1", "--max-new-tokens", "1_0"), "--max-new-tokens 1_0 must be a positive integer"),
    (("--prompt-ids", "1", "--max-new-tokens", "\u0664"), "--max-new-tokens \u0664 must be a positive integer"),
    (("--prompt-ids", "1", "--max-new-tokens", " 4"), "--max-new-tokens ' 4' must be a positive integer"),
    # not argparse's usage block: the one line every other bad value gets
    (("--prompt-ids", "1", "--max-new-tokens", "abc"), "--max-new-tokens abc must be a positive integer"),
    (("--prompt-ids", "1", "--tensor-parallel", "1_0"), "--tensor-parallel 1_0 must be a positive integer"),
])
def test_every_numeric_flag_reads_plain_decimals_only(tiny, generate, flags, expected):
    one_line_refusal(generate("--model", str(tiny), *flags), expected)


def test_a_huge_prompt_id_is_refused_in_a_short_line(tiny, generate):
    """5000 digits: past Python's int-from-text limit, once said to be "not an integer" and
    printed twice whole."""
    ran = generate("--model", str(tiny), "--prompt-ids", "9" * 5000)
    one_line_refusal(ran, "must be comma-separated integers")
    assert len(ran.stderr) < 400


def test_a_missing_or_wrong_model_path_is_one_line(tmp_path, generate):
    one_line_refusal(generate("--model", str(tmp_path / "nope"), "--prompt-ids", "1"), "config.json")
    (tmp_path / "file").write_text("x")
    one_line_refusal(generate("--model", str(tmp_path / "file"), "--prompt-ids", "1"), "config.json")


def test_a_run_that_stops_at_end_of_sequence_says_so(tmp_path, tiny, generate):
    full = generate("--model", str(tiny), "--prompt-ids", "5,17,3", "--max-new-tokens", "16", "--json")
    assert full.returncode == 0, full.stderr
    tokens = json.loads(full.stdout)["output_ids"]
    assert len(tokens) == 16 and json.loads(full.stdout)["stop"] == "length"
    eos = tokens[3]
    stop_at = tokens.index(eos) + 1  # the first time the model says it
    model = tmp_path / "with-eos"
    shutil.copytree(tiny, model)
    config = json.loads((tiny / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))

    ran = generate("--model", str(model), "--prompt-ids", "5,17,3", "--max-new-tokens", "16")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines()[1] == " ".join(map(str, tokens[:stop_at]))
    assert f"stopped at end-of-sequence token {eos} after {stop_at} of 16 tokens" in ran.stdout
    as_json = json.loads(generate("--model", str(model), "--prompt-ids", "5,17,3", "--max-new-tokens", "16",
                                  "--json").stdout)
    assert as_json["stop"] == "eos" and as_json["new_tokens"] == stop_at


@pytest.fixture(scope="module")
def roomy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("roomy")
    save_hf_model("llama3", directory, max_position_embeddings=2048)  # 312,576 bytes of float32 weights
    return directory


@pytest.mark.parametrize("free, new, expected", [
    # Less free memory than the weights take: refused before a weight is read, the fix naming
    # what the command can change.
    (3_000, "1", ["no room for the weights and a KV cache", "the weights need 312,576 bytes", "which has 3,000 bytes",
                  "--tensor-parallel N", "smaller --dtype"]),
    # Room for 544 tokens beside the weights, 553 asked: the most --max-new-tokens that fits.
    (320_000, "550", ["room for 544 tokens of KV cache beside the weights", "need 553",
                      "lower --max-new-tokens to at most 541"]),
    # More than the free memory holds even without the weights: refused before anything is loaded
    # (else the pool would be sized to all the memory there is, allocated and filled, then refused).
    # (320,000 B x 0.9 // 512 B a token of the tiny model's K and V = 562)
    (320_000, "600", ["free memory holds at most 562 tokens of KV cache, before the weights are loaded", "need 603",
                      "lower --max-new-tokens to at most 559"]),
])
def test_a_device_without_room_for_the_request_is_one_line_naming_the_flag(roomy, generate, monkeypatch, free, new,
                                                                           expected):
    import psutil

    real = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real()._replace(available=free))
    ran = generate("--model", str(roomy), "--prompt-ids", "1,2,3", "--max-new-tokens", new)
    one_line_refusal(ran, *expected)
    assert "kv_fraction" not in ran.stderr and "EngineConfig" not in ran.stderr  # settings a CLI user cannot set


def test_one_request_takes_most_of_the_free_memory_for_its_kv_cache(tiny, generate, monkeypatch):
    """At 30% of 340 kB (the engine's default share) 200 new tokens would not fit; at 90% they do."""
    import psutil

    real = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real()._replace(available=340_000))
    ran = generate("--model", str(tiny), "--prompt-ids", "1,2,3", "--max-new-tokens", "200", "--json")
    assert ran.returncode == 0, ran.stderr
    assert len(json.loads(ran.stdout)["output_ids"]) == 200


def test_weights_that_are_not_finite_are_refused_unless_asked_not_to(tmp_path, tiny, generate):
    # NaN weights loaded and generated "0 0 0 0", exit 0: nothing said the model was broken.
    from safetensors.torch import load_file, save_file

    model = tmp_path / "nan"
    shutil.copytree(tiny, model)
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(tensors, model / "model.safetensors")
    args = ("--model", str(model), "--prompt-ids", "1,2", "--max-new-tokens", "4")
    one_line_refusal(generate(*args), "model.safetensors: tensor 'model.layers.0.mlp.down_proj.weight' holds NaN or "
                                      "infinite values once in torch.float32")
    ran = generate(*args, "--no-check-finite", "--json")
    assert ran.returncode == 0, ran.stderr
    assert len(json.loads(ran.stdout)["output_ids"]) == 4


def test_a_tiny_model_decodes_on_one_cpu_thread_unless_omp_num_threads_says(tiny, generate, monkeypatch):
    """Its per-token work is too small to share: torch's default thread count ran it 20x slower
    on a busy host. The command's threads are its own: the caller's count is kept."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        args = ("--model", str(tiny), "--prompt-ids", "1,2", "--max-new-tokens", "2", "--json")
        assert json.loads(generate(*args).stdout)["threads"] == 1
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's count: left as torch has it
        assert json.loads(generate(*args).stdout)["threads"] == 2
    finally:
        torch.set_num_threads(before)


def test_the_thread_count_follows_the_model_size_and_the_ranks(monkeypatch):
    import os

    from torchhal.cli.generate import cpu_threads
    from torchhal.core.model import ModelConfig

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    tiny = ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96)
    seven_b = ModelConfig(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, intermediate_size=11008)
    mid = ModelConfig(vocab_size=32000, hidden_size=512, num_layers=8, num_heads=8, intermediate_size=2048)  # 58M
    assert (cpu_threads(tiny, 1), cpu_threads(tiny, 2)) == (1, 1)
    assert (cpu_threads(seven_b, 1), cpu_threads(seven_b, 2), cpu_threads(seven_b, 32)) == (16, 8, 1)
    assert cpu_threads(mid, 1) == 3
