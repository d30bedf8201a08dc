"""Hostile checkpoints: the loader refuses each with one CheckpointError line naming the file and
key or tensor, opens nothing outside the checkpoint, and allocates nothing before it is sure."""

from __future__ import annotations

import json
import math
import os
import re
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from torchhal.core.model import LlamaDecoder, checkpoint
from torchhal.core.model.checkpoint import (
    CheckpointError,
    checkpoint_files,
    config_from_hf,
    expected_layout,
    iter_checkpoint_tensors,
    load_checkpoint,
    read_hf_config,
)
from torchhal.core.model.config import ConfigValueError, Llama3RopeScaling, ModelConfig

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 12, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def tensors_of(config: dict[str, Any], fill: float | None = None) -> dict[str, torch.Tensor]:
    layout = expected_layout(config_from_hf(config, has_lm_head=not config.get("tie_word_embeddings")))
    generator = torch.Generator().manual_seed(0)
    return {name: torch.full(shape, fill) if fill is not None else torch.randn(shape, generator=generator)
            for name, shape in layout.items()}


def write_checkpoint(directory: Path, config: dict[str, Any] | None = None, shards: int = 1) -> Path:
    """A tiny valid checkpoint: one safetensors file, or `shards` files and an index."""
    config = config or CONFIG
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    tensors = tensors_of(config)
    if shards == 1:
        save_file(tensors, directory / "model.safetensors")
        return directory
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, directory / file)
        weight_map |= {n: file for n in part}
    (directory / checkpoint.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    return directory


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "ckpt")


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    """A valid-looking safetensors file outside the checkpoint, every value 7.25."""
    path = tmp_path / "elsewhere" / "x.safetensors"
    path.parent.mkdir()
    save_file(tensors_of(CONFIG, fill=7.25), path)
    return path


def refused(path: Path, match: str, call=load_checkpoint) -> str:
    with pytest.raises(CheckpointError, match=match) as info:
        result = call(path)
        if call is iter_checkpoint_tensors:
            list(result)
    message = str(info.value)
    # short apart from the paths, which are as long as the user's own (a deep TMPDIR in CI)
    assert "\n" not in message and len(message.replace(str(path), "DIR")) < 1000
    return message


def sharded(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "sharded", shards=2)


def set_weight_map(directory: Path, edit) -> None:
    index = directory / checkpoint.INDEX_FILE
    content = json.loads(index.read_text())
    edit(content["weight_map"])
    index.write_text(json.dumps(content))


# -- path traversal and symlinks -----------------------------------------------------------------------


@pytest.mark.parametrize("shard_name", ["../elsewhere/x.safetensors", "ABSOLUTE", "/etc/passwd", "sub/x.safetensors",
                                        "..", "", "a\x00b"])
def test_index_naming_a_shard_outside_the_directory_is_refused(tmp_path, canary, monkeypatch, shard_name):
    directory = sharded(tmp_path)
    name = str(canary) if shard_name == "ABSOLUTE" else shard_name
    set_weight_map(directory, lambda wm: wm.update({key: name for key in wm}))
    opened: list[str] = []
    real_open = checkpoint._open_regular
    monkeypatch.setattr(checkpoint, "_open_regular", lambda p, s: opened.append(str(p)) or real_open(p, s))
    for call in (load_checkpoint, checkpoint_files, iter_checkpoint_tensors):
        message = refused(directory, "a shard a plain file name in the checkpoint directory", call)
        assert checkpoint.INDEX_FILE in message
    assert all(Path(p).parent == directory for p in opened)  # config.json and the index only


@pytest.mark.parametrize("target", ["canary_absolute", "canary_relative", "etc_passwd"])
def test_shard_symlinked_outside_the_directory_is_refused(tmp_path, canary, target):
    directory = write_checkpoint(tmp_path / "ckpt")
    shard = directory / "model.safetensors"
    shard.unlink()
    shard.symlink_to({"canary_absolute": str(canary), "canary_relative": "../elsewhere/x.safetensors",
                      "etc_passwd": "/etc/passwd"}[target])
    for call in (load_checkpoint, checkpoint_files, iter_checkpoint_tensors):
        refused(directory, "model.safetensors: resolves to .*, outside the checkpoint directory", call)
    refused(shard, "outside the checkpoint directory", iter_checkpoint_tensors)  # a single file, too


def test_config_symlinked_outside_is_refused(tmp_path, good):
    outside = tmp_path / "other.json"
    outside.write_text(json.dumps(CONFIG))
    (good / "config.json").unlink()
    (good / "config.json").symlink_to(outside)
    refused(good, "config.json: resolves to .*outside the checkpoint directory", read_hf_config)


def test_symlink_inside_the_directory_is_followed(tmp_path, good):
    (good / "model.safetensors").rename(good / "weights.bin")
    (good / "model.safetensors").symlink_to("weights.bin")
    model, _ = load_checkpoint(good)
    assert torch.equal(model.model.norm.weight, tensors_of(CONFIG)["model.norm.weight"])


def test_hugging_face_cache_snapshot_symlinks_into_its_blobs_are_followed(tmp_path, canary):
    """`<repo>/snapshots/<rev>/` files are symlinks to `<repo>/blobs/<hash>`: allowed; the blobs of
    another repository, or anything else outside, are not."""
    source = write_checkpoint(tmp_path / "source")
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (source / name).rename(repo / "blobs" / f"hash-{name}")
        (snapshot / name).symlink_to(f"../../blobs/hash-{name}")
    model, _ = load_checkpoint(snapshot)
    assert torch.equal(model.model.norm.weight, tensors_of(CONFIG)["model.norm.weight"])
    other = tmp_path / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (repo / "blobs" / "hash-model.safetensors").rename(other / "stolen")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(other / "stolen")
    refused(snapshot, "outside the checkpoint directory")


@pytest.mark.parametrize("blobs", ["elsewhere", "root"])
def test_a_snapshot_whose_blobs_link_out_of_its_repository_is_refused(tmp_path, canary, blobs):
    """A repository-level `blobs` symlinked to another directory (or to `/`) widened the allowed
    scope to it: the weights and config of files outside the repository were loaded."""
    (canary.parent / "config.json").write_text(json.dumps(CONFIG))
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").symlink_to(canary.parent if blobs == "elsewhere" else "/")
    inside = "../../blobs/" + ("" if blobs == "elsewhere" else str(canary.parent).lstrip("/") + "/")
    (snapshot / "config.json").symlink_to(inside + "config.json")
    (snapshot / "model.safetensors").symlink_to(inside + canary.name)
    for call in (load_checkpoint, read_hf_config, iter_checkpoint_tensors, checkpoint_files):
        refused(snapshot, r"(config\.json|model\.safetensors): resolves to .*elsewhere.*, outside the checkpoint "
                          "directory", call)


# -- special files -------------------------------------------------------------------------------------


def test_fifo_named_like_a_shard_is_refused_without_hanging(good):
    (good / "model.safetensors").unlink()
    os.mkfifo(good / "model.safetensors")
    start = time.monotonic()
    for call in (load_checkpoint, checkpoint_files, iter_checkpoint_tensors):
        refused(good, "model.safetensors: is a FIFO, not a regular file", call)
    assert time.monotonic() - start < 5


def test_fifo_config_and_index_are_refused(tmp_path, good):
    (good / "config.json").unlink()
    os.mkfifo(good / "config.json")
    refused(good, "config.json: is a FIFO, not a regular file")
    directory = sharded(tmp_path)
    (directory / checkpoint.INDEX_FILE).unlink()
    os.mkfifo(directory / checkpoint.INDEX_FILE)
    refused(directory, "index.json: is a FIFO, not a regular file")


def test_directory_named_like_a_shard_is_refused(good):
    (good / "model.safetensors").unlink()
    (good / "model.safetensors").mkdir()
    refused(good, "model.safetensors: is a directory, not a regular file")


def test_device_file_is_refused(good):
    (good / "config.json").unlink()
    (good / "config.json").symlink_to("/dev/zero")
    refused(good, "resolves to /dev/zero, outside the checkpoint directory")


def test_unreadable_file_is_a_checkpoint_error(good, monkeypatch):
    real_open = os.open

    def denied(path, flags, *args):
        if str(path).endswith("model.safetensors"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args)

    monkeypatch.setattr(checkpoint.os, "open", denied)  # we run as root in CI: chmod 000 would not stop a read
    refused(good, "model.safetensors: cannot be opened \\(Permission denied\\); check that it exists and is readable")


@pytest.mark.parametrize("link", ["dangling", "loop"])
def test_broken_symlinks_are_refused(good, link):
    (good / "model.safetensors").unlink()
    (good / "model.safetensors").symlink_to("nowhere" if link == "dangling" else "model.safetensors")
    refused(good, "model.safetensors: cannot be opened")


def test_huge_config_is_refused_unread(good):
    with (good / "config.json").open("r+b") as f:
        f.truncate(4 << 30)  # sparse: 4 GiB that cost nothing on disk
    tracemalloc.start()
    refused(good, f"config.json: larger than {checkpoint.MAX_CONFIG_BYTES} bytes")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 * checkpoint.MAX_CONFIG_BYTES


# -- malformed JSON and safetensors: one line, never a traceback -------------------------------------------


@pytest.mark.parametrize("text, match", [
    (b"[1, 2]", "must be a JSON object, not list"),
    (b"", "not valid JSON"),
    (b"{\"vocab_size\": 16", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON .*utf-8"),
    (b"[" * 100_000, "not valid JSON"),
    (b'{"vocab_size": 16, "vocab_size": 32}', "not valid JSON .*key 'vocab_size' appears twice"),
    (b'{"vocab_size": ' + b"9" * 5000 + b"}", "not valid JSON .*digits"),
])
def test_malformed_config_json(good, text, match):
    (good / "config.json").write_bytes(text)
    refused(good, f"config.json.*{match}")


@pytest.mark.parametrize("weight_map, match", [
    ([], "weight_map = \\[\\]; it must be a non-empty object"),
    ({}, "weight_map = \\{\\}; it must be a non-empty object"),
    (None, "weight_map = None; it must be a non-empty object"),
    ({"model.norm.weight": 3}, "weight_map gives 'model.norm.weight' the shard 3; it must be .*, a shard a plain file "
                               "name"),
])
def test_malformed_index(tmp_path, weight_map, match):
    directory = sharded(tmp_path)
    (directory / checkpoint.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    refused(directory, match)


def test_index_that_lies_about_where_a_tensor_is(tmp_path):
    directory = sharded(tmp_path)
    first, second = sorted(p.name for p in directory.glob("*.safetensors"))
    set_weight_map(directory, lambda wm: wm.update({"model.norm.weight": first if wm["model.norm.weight"] == second
                                                    else second}))
    refused(directory, "tensor 'model.norm.weight' is in model-.*, not where model.safetensors.index.json's "
                       "weight_map puts it")
    set_weight_map(directory, lambda wm: wm.update({"model.norm.weight": second if wm["model.norm.weight"] == first
                                                    else first, "model.ghost.weight": first}))  # the truth, plus one
    refused(directory, "tensor 'model.ghost.weight' is in no shard, not where")


def test_a_tensor_in_two_files_is_refused(good):
    save_file({"model.norm.weight": torch.ones(8)}, good / "extra.safetensors")
    (good / "model.safetensors").rename(good / "weights.safetensors")
    refused(good, "tensor 'model.norm.weight' is in extra.safetensors, weights.safetensors; every tensor must be in "
                  "exactly one shard")


def header_of(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write_raw(path: Path, header: dict[str, Any], data: bytes, length: int | None = None) -> None:
    text = json.dumps(header).encode()
    path.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + data)


@pytest.mark.parametrize("lie", ["truncated", "header_length", "too_short", "offsets", "gap", "dtype", "shape",
                                 "rank", "entry", "metadata", "not_json"])
def test_lying_safetensors_header(good, lie):
    """safetensors refuses each; the refusal is one CheckpointError naming the file and the fix."""
    shard = good / "model.safetensors"
    header, data = header_of(shard)
    name = "model.norm.weight"
    entry = header[name]
    length = None
    if lie == "truncated":
        data = data[:-3]
    elif lie == "header_length":
        length = 10**12
    elif lie == "offsets":
        entry["data_offsets"][1] += 4
    elif lie == "gap":
        first = min(header.values(), key=lambda e: e["data_offsets"][0] if isinstance(e, dict) and "data_offsets" in e
                    else math.inf)
        first["data_offsets"] = [4, first["data_offsets"][1] + 4]
        data = bytes(4) + data
    elif lie == "dtype":
        entry["dtype"] = "X9"
    elif lie == "shape":
        entry["shape"] = [-1, 8]
    elif lie == "rank":
        entry["shape"] = [1] * 9
    elif lie == "entry":
        header[name] = [1, 2]
    elif lie == "metadata":
        header["__metadata__"] = ["x"]
    write_raw(shard, header, data, length)
    if lie == "too_short":
        shard.write_bytes(b"\x01\x02")
    elif lie == "not_json":
        text = json.dumps(header).encode()
        shard.write_bytes(len(text).to_bytes(8, "little") + b"\xff" * len(text) + data)
    for call in (load_checkpoint, iter_checkpoint_tensors, checkpoint.check_checkpoint):
        refused(good, f"^{re.escape(str(shard))}: not a valid safetensors file \\(.+\\); download or save it again$",
                call)


# -- config values: types and ranges (silent wrong models before) ------------------------------------


@pytest.mark.parametrize("key, value, match", [
    ("vocab_size", None, "vocab_size missing \\(or null\\)"),
    ("hidden_size", 32.9, "hidden_size = 32.9 must be an int in \\[1, 2147483647\\]"),
    ("hidden_size", 8.0, "hidden_size = 8.0 must be an int"),
    ("num_hidden_layers", True, "num_hidden_layers = True must be an int"),
    ("num_attention_heads", "2", "num_attention_heads = '2' must be an int"),
    ("intermediate_size", -12, "intermediate_size = -12 must be an int in \\[1,"),
    ("max_position_embeddings", 2**40, "max_position_embeddings = 1099511627776 must be an int in"),
    ("num_key_value_heads", 0, "num_key_value_heads = 0 must be an int >= 1"),
    ("head_dim", 0, "head_dim = 0 must be an int >= 1"),
    ("tie_word_embeddings", "false", "tie_word_embeddings = 'false' must be true or false"),
    ("attention_bias", 1, "attention_bias = 1 must be true or false"),
    ("mlp_bias", "no", "mlp_bias = 'no' must be true or false"),
    ("rope_theta", math.nan, "rope_theta = nan must be a finite number >= 1"),
    ("rope_theta", 0, "rope_theta = 0 must be a finite number >= 1"),
    ("rope_theta", "1e4", "rope_theta = '1e4' must be a finite number >= 1"),
    ("rms_norm_eps", math.nan, "rms_norm_eps = nan must be a finite number in \\(0, 1\\)"),
    ("rms_norm_eps", 0.0, "rms_norm_eps = 0.0 must be a finite number in \\(0, 1\\)"),
    ("rms_norm_eps", math.inf, "rms_norm_eps = inf must be a finite number in \\(0, 1\\)"),
    ("rope_scaling", "llama3", "rope_scaling = 'llama3' must be an object"),
    ("rope_parameters", [], "rope_parameters = \\[\\] must be an object"),
    ("architectures", "LlamaForCausalLM", "architectures = 'LlamaForCausalLM' must be a list"),
    ("hidden_act", ["silu"], "hidden_act = \\['silu'\\] must be a string"),
    ("torch_dtype", ["float32"], "dtype \\['float32'\\] is not supported"),
    ("sliding_window", "4", "sliding_window = '4' must be an int"),
    ("layer_types", "full_attention", "layer_types = 'full_attention' must be a list of"),
    ("layer_types", ["full_attention"], "layer_types has 1 entries, num_hidden_layers is 2"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor = 0.5 is not supported"),
])
def test_config_values_of_the_wrong_type_or_range_are_refused(good, key, value, match):
    config = dict(CONFIG, **{key: value})
    if key == "sliding_window":
        config["architectures"] = ["MistralForCausalLM"]
    (good / "config.json").write_text(json.dumps(config))
    message = refused(good, match)
    assert str(good / "config.json") in message


@pytest.mark.parametrize("key, value, match", [
    ("factor", 0.5, "rope_scaling.factor = 0.5 must be a finite number >= 1"),
    ("factor", math.nan, "rope_scaling.factor = nan must be"),
    ("low_freq_factor", 0, "rope_scaling.low_freq_factor = 0 must be a finite number > 0"),
    ("high_freq_factor", 1.0, "rope_scaling.high_freq_factor = 1.0 must be a finite number > low_freq_factor"),
    ("original_max_position_embeddings", 32.5, "rope_scaling.original_max_position_embeddings = 32.5 must be an int"),
    ("factor", None, "rope_scaling of type llama3 lacks factor"),
])
def test_llama3_rope_scaling_out_of_range_is_refused(good, key, value, match):
    (good / "config.json").write_text(json.dumps(dict(CONFIG, rope_scaling=dict(LLAMA3, **{key: value}))))
    refused(good, match)


def test_null_optional_values_take_their_defaults(tmp_path):
    """HF configs write null for unset optional keys: that means the default, not an error."""
    config = dict(CONFIG, head_dim=None, num_key_value_heads=None, rope_scaling=None, sliding_window=None,
                  tie_word_embeddings=None, rms_norm_eps=None, max_position_embeddings=None)
    model, _ = load_checkpoint(write_checkpoint(tmp_path / "nulls", config))
    c = model.config
    assert (c.head_dim, c.num_kv_heads, c.rms_eps, c.max_position, c.tie_word_embeddings) == (4, 2, 1e-6, 4096, False)


def test_model_config_itself_refuses_bools_and_non_finite_numbers():
    with pytest.raises(ConfigValueError, match="ModelConfig.num_layers = True must be an int"):
        ModelConfig(num_layers=True)
    with pytest.raises(ConfigValueError, match="ModelConfig.rms_eps = nan must be a finite number in \\(0, 1\\)"):
        ModelConfig(rms_eps=math.nan)
    with pytest.raises(ConfigValueError, match="ModelConfig.tie_word_embeddings = 'false' must be True or False"):
        ModelConfig(tie_word_embeddings="false")  # type: ignore[arg-type]
    with pytest.raises(ConfigValueError, match="Llama3RopeScaling.high_freq_factor = 1.0 must be"):
        Llama3RopeScaling(low_freq_factor=1.0, high_freq_factor=1.0)
    assert ModelConfig(rope_theta=10**30).rope_theta == 1e30  # a huge int theta is a float, as torch needs


def test_accepted_edge_values_give_finite_non_zero_logits(good):
    from torchhal.core.model import AttentionMetadata, KVCache

    config = dict(CONFIG, rope_theta=1, rms_norm_eps=0.999, rope_scaling=dict(LLAMA3, factor=1e300))
    (good / "config.json").write_text(json.dumps(config))
    model, _ = load_checkpoint(good)
    model.kv = KVCache(model.config, 2, 16, torch.device("cpu"), torch.float32)  # block 0: scratch
    hidden = model(torch.tensor([1, 2]), AttentionMetadata.build([[1]], [2], [2], 16, torch.device("cpu")))
    logits = model.logits(hidden, torch.tensor([1]))
    assert torch.isfinite(logits).all() and logits.abs().sum() > 0


# -- resource bombs: refused from the headers before anything is built or allocated ----------------------


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 100_000), ("head_dim", 10**9),
                                        ("vocab_size", 2**31 - 1), ("intermediate_size", 2**30)])
def test_huge_config_with_a_tiny_checkpoint_is_refused_before_allocation(good, monkeypatch, key, value):
    built: list[int] = []
    monkeypatch.setattr(checkpoint, "LlamaDecoder", lambda *a: built.append(1))
    monkeypatch.setattr(LlamaDecoder, "materialize", lambda *a: built.append(1))
    (good / "config.json").write_text(json.dumps(dict(CONFIG, **{key: value})))
    tracemalloc.start()
    start = time.monotonic()
    message = refused(good, "checkpoint refused, nothing")
    seconds = time.monotonic() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert built == [] and seconds < 2 and peak < 16 << 20, (seconds, peak)
    if key == "num_hidden_layers":
        assert "num_hidden_layers = 100000 needs 900003 tensors, the checkpoint holds 21" in message


def test_expected_layout_is_the_decoders_parameters():
    """The layout the headers are checked against, computed arithmetically, is what LlamaDecoder builds."""
    cases = [ModelConfig(vocab_size=16, hidden_size=8, num_layers=3, num_heads=2, intermediate_size=12),
             ModelConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=6,
                         attention_bias=True, o_proj_bias=True, qk_norm=True, tie_word_embeddings=True)]
    for config in cases:
        with torch.device("meta"):
            model = LlamaDecoder(config)
        assert expected_layout(config) == {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_a_file_moved_outside_between_resolving_and_opening_is_refused(good, canary, monkeypatch):
    """The race: the path resolved inside the directory, then a directory on it swapped for a
    symlink leading out before the open (O_NOFOLLOW guards only the last component): the file
    the kernel opened is checked, and safetensors reads that very file."""
    real_open = os.open

    def swapped(path, flags, *args):
        return real_open(canary if Path(path).name == "model.safetensors" else path, flags, *args)

    monkeypatch.setattr(checkpoint.os, "open", swapped)
    refused(good, "model.safetensors: resolves to .*elsewhere/x.safetensors, outside the checkpoint directory",
            iter_checkpoint_tensors)


@pytest.mark.parametrize(("keyword", "value", "message"), [
    ("dtype", "bfloat16", r"dtype = 'bfloat16' is not a dtype the model runs in; pass one of torch.float16, "
                          r"torch.bfloat16, torch.float32, or None"),
    ("dtype", torch.int8, r"dtype = torch.int8 is not a dtype the model runs in"),
    ("dtype", torch.float8_e4m3fn, r"dtype = torch.float8_e4m3fn is not a dtype the model runs in"),
    ("device", "bfloat16", r"device = 'bfloat16' cannot be used here \(.*bfloat16.*\); pass one this process has"),
    ("device", 3.5, r"device = 3.5 cannot be used here"),
    ("device", "meta", r"device = 'meta' cannot be used here \(.*meta tensor.*\)"),
])
def test_a_bad_dtype_or_device_is_refused_before_anything_is_read(tmp_path, monkeypatch, keyword, value, message):
    path = write_checkpoint(tmp_path / "model")
    import torchhal.core.model.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "read_hf_config", lambda *a, **k: pytest.fail("the checkpoint was read"))
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path, **{keyword: value})


def test_an_end_token_outside_the_vocabulary_in_config_json_is_refused_naming_the_file(tmp_path, monkeypatch):
    from torchhal.core.engine import EngineConfig, GenerationEngine

    path = write_checkpoint(tmp_path / "model", dict(CONFIG, eos_token_id=[2, 99]))
    with monkeypatch.context() as patch:  # refused before a weight is read
        patch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("a weight was read"))
        message = refused(path, "eos_token_id", call=GenerationEngine.from_checkpoint)
    assert message == (f"{path / 'config.json'}: eos_token_id [2, 99] names token(s) [99] outside the vocabulary "
                       "0..15 (vocab_size 16), so no request would ever stop on them; correct eos_token_id in the "
                       "file, or pass EngineConfig(eos_tokens=(...)) with ids the model can emit")
    # A bad id passed explicitly is still the EngineConfig's, and good ones override the file's.
    with pytest.raises(ValueError, match=r"^EngineConfig end-of-sequence token\(s\) \[50\] are outside"):
        GenerationEngine.from_checkpoint(path, EngineConfig(eos_tokens=(3, 50)))
    assert GenerationEngine.from_checkpoint(path, EngineConfig(eos_tokens=(3,))).config.eos_tokens == (3,)
    for bad in ("2", -1, True, [2, 2.0]):  # and ids that are no token ids at all
        typed = write_checkpoint(tmp_path / f"typed-{bad}", dict(CONFIG, eos_token_id=bad))
        refused(typed, r"config\.json: eos_token_id .* must be a token id or a list of token ids \(ints >= 0\)",
                call=GenerationEngine.from_checkpoint)


@pytest.mark.parametrize("generation", [{"eos_token_id": [5, 2]}, {"eos_token_id": 7}, {"temperature": 0.6}, None])
def test_the_end_tokens_are_those_transformers_generate_stops_on(tmp_path, generation):
    # A chat checkpoint's generation_config.json names the token a reply ends with; config.json
    # often names only the pretraining one, and a reply ran on past its end.
    from transformers import AutoModelForCausalLM

    from torchhal.core.engine import GenerationEngine

    path = write_checkpoint(tmp_path / "model", dict(CONFIG, model_type="llama", eos_token_id=2))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    theirs = AutoModelForCausalLM.from_pretrained(path).generation_config.eos_token_id
    ours = GenerationEngine.from_checkpoint(path).config.eos_tokens
    if generation is not None and "eos_token_id" not in generation:
        # transformers stops on none then; the engine keeps config.json's rather than run every
        # request to its limit.
        assert theirs is None and ours == (2,)
    else:
        assert ours == tuple(theirs if isinstance(theirs, list) else [theirs])


def test_a_bad_generation_config_is_refused_naming_the_file(tmp_path, monkeypatch):
    from torchhal.core.engine import EngineConfig, GenerationEngine

    path = write_checkpoint(tmp_path / "model", dict(CONFIG, eos_token_id=2))
    generation = path / "generation_config.json"
    generation.write_text(json.dumps({"eos_token_id": [2, 16]}))
    with monkeypatch.context() as patch:  # refused before a weight is read
        patch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("a weight was read"))
        message = refused(path, "eos_token_id", call=GenerationEngine.from_checkpoint)
    assert message.startswith(f"{generation}: eos_token_id [2, 16] names token(s) [16] outside the vocabulary 0..15")
    generation.write_text("{not json")
    refused(path, r"generation_config\.json", call=GenerationEngine.from_checkpoint)
    # End tokens the config names leave the file unread.
    assert GenerationEngine.from_checkpoint(path, EngineConfig(eos_tokens=(3,))).config.eos_tokens == (3,)


def test_a_single_file_beside_an_index_is_read_as_transformers_reads_it(tmp_path):
    # An older sharded save with a newer model.safetensors copied in: the index won, and the
    # model loaded other weights than transformers' (which takes the single file first).
    path = write_checkpoint(tmp_path / "mixed", shards=2)
    newer = {name: tensor + 1.0 for name, tensor in tensors_of(CONFIG).items()}
    save_file(newer, path / "model.safetensors")
    model, report = load_checkpoint(path)
    assert report.files == (str(path / "model.safetensors"),)
    assert torch.equal(model.model.norm.weight, newer["model.norm.weight"])


@pytest.mark.parametrize("fault", ["nan", "past float16"])
def test_check_finite_weights_refuses_a_checkpoint_at_load_as_it_does_an_update(tmp_path, fault):
    # from_checkpoint ignored it: the same file an update refused was loaded and gave garbage.
    from torchhal.core.engine import EngineConfig, GenerationEngine

    tensors = tensors_of(CONFIG)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][0, 0] = math.nan if fault == "nan" else 1e6  # float16 ends at 65504
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    save_file(tensors, path / "model.safetensors")
    dtype = torch.float32 if fault == "nan" else torch.float16
    message = refused(path, f"model.safetensors: tensor '{name}' holds NaN or infinite values once in {dtype}",
                      call=lambda p: GenerationEngine.from_checkpoint(
                          p, EngineConfig(dtype=dtype, max_kv_slots=64, check_finite_weights=True)))
    assert message.endswith("fix the checkpoint, or load it in a wider dtype")
    engine = GenerationEngine.from_checkpoint(path, EngineConfig(dtype=dtype, max_kv_slots=64,
                                                                 check_finite_weights=False))  # not asked: loads
    assert engine.checkpoint is not None and engine.checkpoint.tensors == len(tensors)


@pytest.mark.parametrize("fault, dtype", [("nan", torch.float32), ("inf", torch.float32),
                                          ("past float16", torch.float16)])
def test_weights_that_are_not_finite_are_refused_by_default(tmp_path, fault, dtype):
    # They loaded and generated garbage unless the caller asked for the check.
    tensors = tensors_of(CONFIG)
    name = "model.layers.1.mlp.down_proj.weight"  # row-parallel: column 11 is rank 1's of 2
    tensors[name][0, 11] = {"nan": math.nan, "inf": math.inf, "past float16": 1e6}[fault]  # float16 ends at 65504
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    save_file(tensors, path / "model.safetensors")
    message = f"model.safetensors: tensor '{name}' holds NaN or infinite values once in {dtype}"
    refused(path, message, call=lambda p: load_checkpoint(p, dtype))
    refused(path, message, call=lambda p: load_checkpoint(p, dtype, tensor_parallel=(2, 1)))  # that rank's slice
    assert load_checkpoint(path, dtype, tensor_parallel=(2, 0))[1].tensors == len(tensors)  # the other's is finite
    _, report = load_checkpoint(path, dtype, check_finite=False)  # asked not to check: loads
    assert report.tensors == len(tensors)


def test_a_checkpoint_larger_than_the_free_memory_is_refused_before_a_weight_is_read(good, monkeypatch):
    # A consistent 61 GiB checkpoint met torch's raw allocator error.
    import psutil

    real = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real()._replace(available=4_000))
    monkeypatch.setattr(LlamaDecoder, "materialize", lambda *a: pytest.fail("allocated"))
    monkeypatch.setattr(checkpoint, "_read_tensor", lambda *a: pytest.fail("a weight was read"))
    needed = sum(tensor.numel() for tensor in tensors_of(CONFIG).values()) * 4
    message = refused(good, "the weights need")
    assert message == (f"{good}: the weights need {needed:,} bytes (0.00 GiB) in torch.float32 on cpu, which has 4,000 "
                       "bytes (0.00 GiB) free; refused unread: free memory there, load it in a smaller dtype, or "
                       "split it over ranks (tensor_parallel)")
    with pytest.raises(MemoryError):  # what a caller handling out-of-memory catches
        load_checkpoint(good)


@pytest.mark.parametrize("vocab_size", [0, -5, True])
def test_a_bad_vocab_size_is_the_checkpoints_error_not_the_engine_configs(tmp_path, vocab_size):
    from torchhal.core.engine import GenerationEngine

    path = write_checkpoint(tmp_path / "model")
    (path / "config.json").write_text(json.dumps(dict(CONFIG, vocab_size=vocab_size, eos_token_id=2)))
    refused(path, f"config.json: vocab_size = {vocab_size} must be an int", call=GenerationEngine.from_checkpoint)


def test_refusals_name_the_file_once_and_caller_arguments_as_the_callers(tmp_path, monkeypatch):
    path = write_checkpoint(tmp_path / "model")
    (path / "config.json").write_text(json.dumps(dict(CONFIG, tie_word_embeddings="false")))
    message = refused(path, "tie_word_embeddings = 'false' must be true or false")
    assert message.count(str(path / "config.json")) == 1, message
    (path / "config.json").write_text(json.dumps(dict(CONFIG, torch_dtype="float64")))
    from torchhal.core.engine import GenerationEngine

    message = refused(path, "dtype 'float64' is not supported", call=GenerationEngine.from_checkpoint)
    assert message.startswith(str(path / "config.json"))
    (path / "config.json").write_text(json.dumps(CONFIG))
    monkeypatch.setattr(checkpoint, "read_hf_config", lambda *a, **k: pytest.fail("the checkpoint was read"))
    for bad in ((2, 5), (2, -1), (0, 0), (2,), [2, 0]):
        with pytest.raises(ValueError, match=r"tensor_parallel = .* must be \(world_size, rank\) with 0 <= rank"):
            load_checkpoint(path, tensor_parallel=bad)  # type: ignore[arg-type]


def test_model_config_refuses_a_seed_torch_cannot_take():
    for seed in ("x", True, -1, 2**64, 1.5):
        with pytest.raises(ConfigValueError, match=r"ModelConfig.seed = .* must be an int in \[0, 2\*\*64\)"):
            ModelConfig(seed=seed)  # type: ignore[arg-type]
    assert ModelConfig(seed=2**64 - 1).seed == 2**64 - 1


def test_a_llama_config_naming_sliding_layers_attends_to_the_whole_context_as_transformers_does():
    # Honoured for every architecture, a window transformers' Llama never applies changed the logits.
    sliding = dict(CONFIG, sliding_window=4, layer_types=["sliding_attention"] * 2)
    assert config_from_hf(sliding).sliding_window is None
    assert config_from_hf(dict(sliding, architectures=["MistralForCausalLM"])).sliding_window == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a process without CUDA")
def test_a_device_this_process_cannot_use_is_refused_before_anything_is_read(tmp_path, monkeypatch):
    path = write_checkpoint(tmp_path / "model")
    monkeypatch.setattr(checkpoint, "read_hf_config", lambda *a, **k: pytest.fail("the checkpoint was read"))
    with pytest.raises(ValueError, match=r"device = 'cuda:0' cannot be used here \(.*\); pass one this process has"):
        load_checkpoint(path, device="cuda:0")


# -- the path itself: what a shell hands over when a variable is unset or names the wrong thing ---------


def test_an_empty_path_is_refused_not_read_as_the_working_directory(good, monkeypatch):
    # Path("") is ".": an unset `--model "$MODEL"` loaded whatever checkpoint the shell stood in.
    monkeypatch.chdir(good)
    for call in (load_checkpoint, checkpoint.check_checkpoint, read_hf_config, checkpoint_files):
        with pytest.raises(CheckpointError, match=r"^checkpoint path '' is empty; pass the checkpoint directory"):
            call("")
    with pytest.raises(CheckpointError, match=r"^checkpoint path '' is empty"):
        list(iter_checkpoint_tensors(""))
    assert load_checkpoint(".")[1].tensors > 0  # the working directory, when named, is still a checkpoint


@pytest.mark.parametrize("value", [None, 3, ["ckpt"]])
def test_a_path_that_is_no_path_is_named(value):
    with pytest.raises(TypeError, match=rf"^checkpoint path {re.escape(repr(value))} \({type(value).__name__}\) is "
                                        r"not a path; pass the checkpoint directory as a str or pathlib.Path$"):
        load_checkpoint(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_file_given_for_the_checkpoint_directory_names_the_directory_to_pass(good, name):
    # It said ".../model.safetensors/config.json not found", a path nobody wrote.
    message = refused(good / name, "is a file", call=checkpoint.check_checkpoint)
    assert message == (f"{good / name}: is a file, not a checkpoint directory; pass the directory that holds "
                       f"config.json and the *.safetensors files ({good} does)")
    assert list(iter_checkpoint_tensors(good / "model.safetensors"))  # a single weights file is still readable


def test_a_missing_directory_is_named_as_missing(tmp_path):
    message = refused(tmp_path / "nope", "no such checkpoint directory", call=load_checkpoint)
    assert message == (f"{tmp_path / 'nope'}: no such checkpoint directory (a Hugging Face checkpoint is a directory "
                       "of config.json and *.safetensors files)")
