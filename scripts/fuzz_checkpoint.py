"""Seeded fuzzing of the Hugging Face checkpoint loader against hostile checkpoints.

    python scripts/fuzz_checkpoint.py --cases 1000000 --seed 0 --workers 2
    python scripts/fuzz_checkpoint.py --seed 0 --case 1234      # replay one case, with its traceback

Each case takes a tiny valid checkpoint (one of five families, one sharded with an index),
applies one to three mutations (config values and structure, rope scaling, safetensors
headers and their bytes, the index, special files, symlinks, path traversal) and calls one
public entry point (`load_checkpoint`, `iter_checkpoint_tensors`, `checkpoint_files`,
`read_hf_config` + `config_from_hf`). A finding is:
- any exception other than `CheckpointError` (a traceback);
- a case over `--case-seconds` (a hang; a SIGALRM watchdog in the worker, and the parent
  gives up on a worker that stops answering);
- any open outside the checkpoint directory, seen by an audit hook on "open" and by a wrapper
  on the loader's one open function (`checkpoint._open_regular`); or a load that returns the
  values of the canary checkpoint planted outside the directory (which the mutations point at
  through `..`, absolute paths and symlinks);
- an accepted checkpoint that is not sane: on a sample of loads, one forward of 2 tokens must
  give finite logits that are not all zero; an accepted config must give finite rotary frequencies.
Prints each finding as a JSON line (seed and case, to replay) and a summary JSON line last:
cases, seconds, findings, and counts per mutation kind, entry point and outcome. Exits 1 on findings.

`--break NAME` disables one loader defence first (the fuzzer's self-test: it must then report findings).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import stat
import sys
import tempfile
import time
import traceback
import types
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from torchhal.core.model import (  # noqa: E402
    AttentionMetadata,
    KVCache,
    LlamaDecoder,
)
from torchhal.core.model import checkpoint as ckpt  # noqa: E402
from torchhal.core.model import config as model_config  # noqa: E402
from torchhal.core.model.decoder import rope_inv_freq  # noqa: E402

CANARY_VALUE = 7.25
SANITY_EVERY = 8  # one forward per this many successful loads
ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

BASE = dict(vocab_size=16, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=12, max_position_embeddings=64, rms_norm_eps=1e-5, hidden_act="silu",
            torch_dtype="float32")
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {**BASE, "architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0, "tie_word_embeddings": False},
    "llama3_sharded": {**BASE, "architectures": ["LlamaForCausalLM"], "rope_scaling": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    "qwen2_bf16": {**BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False,
                   "sliding_window": None, "dtype": "bfloat16", "torch_dtype": None},
    "qwen3_tied": {**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 8, "tie_word_embeddings": True,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "mistral": {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4, "head_dim": 4,
                "num_key_value_heads": 2},
}
STORED_DTYPE = {"qwen2_bf16": "BF16"}
SHARDED = {"llama3_sharded"}

JUNK: list[Any] = [None, True, False, "false", "true", "32", "", "llama3", 0, -1, 1, 2, 3, 7, 32.0, 32.9, 0.5,
                   -0.0, 1e-300, 1e300, float("nan"), float("inf"), float("-inf"), 2**31, 2**63, 10**9, 10**30,
                   10**400, [], [1], {}, {"a": 1}, [[[]]], "a" * 3000, "é\x00/..", "../x", "/etc/passwd"]
CONFIG_KEYS = ["architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_theta",
               "head_dim", "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act", "dtype", "torch_dtype",
               "sliding_window", "use_sliding_window", "layer_types", "rope_scaling", "rope_parameters",
               "partial_rotary_factor", "max_window_layers"]
ROPE_KEYS = ["rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "rope_theta", "partial_rotary_factor"]
SPECIAL_KINDS = ["fifo", "directory", "symlink_canary_rel", "symlink_canary_abs", "symlink_inside", "dangling",
                 "loop", "symlink_etc_passwd", "symlink_dev_zero", "symlink_outside_dir", "empty"]


class CaseTimeout(Exception):
    pass


@dataclass
class Shard:
    header: dict[str, Any]
    data: bytes
    raw: bytes | None = None  # replaces the serialised file when a mutation works on bytes


@dataclass
class Case:
    config: Any
    shards: dict[str, Shard]
    index: Any | None
    raw: dict[str, bytes] = field(default_factory=dict)  # file name -> bytes written as they are
    specials: list[tuple[str, str]] = field(default_factory=list)  # (file name, special kind)
    extra: dict[str, Shard] = field(default_factory=dict)


def serialise(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


def tensors_to_shard(tensors: dict[str, torch.Tensor], dtype: str) -> Shard:
    header: dict[str, Any] = {}
    chunks: list[bytes] = []
    offset = 0
    for name, tensor in tensors.items():
        raw = tensor.to(ST_DTYPES[dtype]).contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    return Shard(header, b"".join(chunks))


def base_cases() -> dict[str, Case]:
    generator = torch.Generator().manual_seed(0)
    out = {}
    for family, config in FAMILIES.items():
        model_config = ckpt.config_from_hf(config, family, has_lm_head=not config.get("tie_word_embeddings"))
        tensors = {}
        for name, shape in ckpt.expected_layout(model_config).items():
            values = torch.randn(shape, generator=generator) * 0.5
            tensors[name] = values + 1 if name.endswith("norm.weight") else values
        dtype = STORED_DTYPE.get(family, "F32")
        if family in SHARDED:
            names = list(tensors)
            half = len(names) // 2
            parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
            shards = {file: tensors_to_shard({n: tensors[n] for n in part}, dtype) for file, part in parts.items()}
            index = {"metadata": {"total_size": 0},
                     "weight_map": {n: file for file, shard in shards.items() for n in shard.header}}
            out[family] = Case(config, shards, index)
        else:
            out[family] = Case(config, {"model.safetensors": tensors_to_shard(tensors, dtype)}, None)
    return out


# -- mutations ---------------------------------------------------------------------------------------


def junk(rng: random.Random, original: Any = None) -> Any:
    """A hostile value: from the pool, or the original with its type or size bent."""
    if original is not None and rng.random() < 0.5:
        if type(original) is int:
            return rng.choice([float(original), original + 0.9, str(original), -original, 0, original * 10**6,
                               original + 1, original * 2, original // 2, True])
        if type(original) is float:
            whole = int(original) if math.isfinite(original) else 0
            return rng.choice([0.0, -original, float("nan"), float("inf"), str(original), whole,
                               original * 1e30, original * 1e-30, True, 1.0])
        if type(original) is bool:
            return rng.choice([str(original).lower(), int(original), not original, None, "yes"])
        if isinstance(original, str):
            return rng.choice([original.upper(), original + "x", "", [original], None, 1])
        if isinstance(original, list):
            return rng.choice([original * 2, original[:0], original + [None], {}, original[0] if original else 0])
    return copy.deepcopy(rng.choice(JUNK))


def mutate_config_value(case: Case, rng: random.Random) -> None:
    key = rng.choice(CONFIG_KEYS + list(case.config))
    case.config[key] = junk(rng, case.config.get(key))


def mutate_config_drop(case: Case, rng: random.Random) -> None:
    if not case.config:
        return
    key = rng.choice(list(case.config))
    if rng.random() < 0.5:
        del case.config[key]
    else:
        case.config[key] = None


def mutate_rope(case: Case, rng: random.Random) -> None:
    section = rng.choice(["rope_scaling", "rope_parameters"])
    rope = case.config.get(section)
    if not isinstance(rope, dict):
        rope = copy.deepcopy(FAMILIES["llama3_sharded"]["rope_scaling"])
    key = rng.choice(ROPE_KEYS)
    roll = rng.random()
    if roll < 0.7:
        rope[key] = junk(rng, rope.get(key))
    elif roll < 0.85:
        rope.pop(key, None)
    else:
        rope = junk(rng)
    case.config[section] = rope


def mutate_config_file(case: Case, rng: random.Random) -> None:
    text = json.dumps(case.config).encode()
    choice = rng.randrange(12)
    case.raw["config.json"] = [
        b"[1, 2]", b'"config"', b"42", b"null", text[: rng.randrange(len(text))], b"\xff\xfe" + text,
        b"", b"[" * 100_000, text[:-1] + b', "vocab_size": 16}', b'{"vocab_size": NaN, "x": Infinity}',
        text + b" " * (ckpt.MAX_CONFIG_BYTES + 1 - len(text)) if rng.random() < 0.1 else text + b"x",
        text.replace(b'"', b"'", 1),
    ][choice]


def _shard_name(case: Case, rng: random.Random) -> str:
    return rng.choice(sorted(case.shards))


def mutate_header(case: Case, rng: random.Random) -> None:
    shard = case.shards[_shard_name(case, rng)]
    if not isinstance(shard.header, dict) or not shard.header:
        shard.header = junk(rng)  # type: ignore[assignment]
        return
    names = sorted(shard.header)
    name = rng.choice(names)
    entry = shard.header[name]
    if not isinstance(entry, dict):
        del shard.header[name]
        return
    choice = rng.randrange(12)
    if choice == 0:
        entry["dtype"] = rng.choice(["F64", "I64", "I32", "U8", "BOOL", "F8_E4M3", "F32", "BF16", "X", 3, None])
    elif choice == 1:
        shape = entry["shape"]
        entry["shape"] = junk(rng, shape) if rng.random() < 0.5 else [d + rng.choice([-1, 1]) for d in shape]
    elif choice == 2:
        begin, end = entry["data_offsets"]
        shift = rng.choice([-4, 4, 1, -1, 10**12, -(10**12)])
        entry["data_offsets"] = rng.choice([[begin + shift, end + shift], [begin, end + shift], [end, begin],
                                            junk(rng)])
    elif choice == 3:
        del shard.header[name]
    elif choice == 4:
        shard.header[name + rng.choice([".x", "", "\x00", "/../y"])] = shard.header.pop(name)
    elif choice == 5:
        shard.header["__metadata__"] = junk(rng)
    elif choice == 6:
        shard.header[name] = junk(rng)
    elif choice == 7:  # two entries swap their data: same shape passes, else refused
        other = shard.header[rng.choice(names)]
        if isinstance(other, dict):
            entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
    elif choice == 8:
        entry[rng.choice(["extra", "dtype", "shape"])] = junk(rng)
    elif choice == 9:  # an unexpected tensor (at the end of the data)
        shard.header["model.layers.9.extra.weight"] = {"dtype": "F32", "shape": [2],
                                                      "data_offsets": [len(shard.data), len(shard.data) + 8]}
        shard.data += b"\0" * 8
    elif choice == 10:
        entry["shape"] = [2**62, 2**62] if rng.random() < 0.5 else [1] * rng.choice([9, 64, 100_000])
    else:
        shard.header = junk(rng)  # type: ignore[assignment]


def mutate_header_bytes(case: Case, rng: random.Random) -> None:
    name = _shard_name(case, rng)
    shard = case.shards[name]
    raw = serialise(shard.header, shard.data)
    length = int.from_bytes(raw[:8], "little")
    choice = rng.randrange(8)
    if choice == 0:
        raw = raw[: rng.randrange(len(raw))]
    elif choice == 1:
        lie = max(0, length + rng.choice([-8, -1, 1, 8, 10**6, 2**40, 2**63]))
        raw = lie.to_bytes(8, "little") + raw[8:]
    elif choice == 2:
        raw += bytes(rng.randrange(1, 64))
    elif choice == 3:
        raw = raw[:8] + b"\xff" * length + raw[8 + length:]
    elif choice == 4:
        raw = raw[:8] + b"[" * length + raw[8 + length:]
    elif choice == 5:
        raw = raw[: rng.randrange(8)]
    elif choice == 6:  # flip a byte of the header text
        at = rng.randrange(8, 8 + length)
        raw = raw[:at] + bytes([raw[at] ^ (1 << rng.randrange(8))]) + raw[at + 1:]
    else:
        raw = (2**64 - 1).to_bytes(8, "little") + raw[8:]
    shard.raw = raw


TRAVERSALS = ["../outside/canary.safetensors", "{outside}/canary.safetensors", "/etc/passwd", "..", ".", "",
              "sub/model.safetensors", "a\x00b", "x" * 300, "model.safetensors/", "..\\outside\\canary.safetensors",
              "outside_link/canary.safetensors"]


def _ensure_index(case: Case) -> dict[str, Any]:
    if not isinstance(case.index, dict):
        case.index = {"weight_map": {n: file for file, shard in case.shards.items() for n in shard.header}}
    return case.index


def mutate_index(case: Case, rng: random.Random) -> None:
    index = _ensure_index(case)
    weight_map = index.get("weight_map")
    choice = rng.randrange(8)
    if choice < 3 and isinstance(weight_map, dict) and weight_map:
        tensor = rng.choice(sorted(weight_map))
        weight_map[tensor] = rng.choice(TRAVERSALS)
        if rng.random() < 0.5:  # every tensor pointed there
            target = weight_map[tensor]
            for key in weight_map:
                weight_map[key] = target
    elif choice == 3:
        index["weight_map"] = junk(rng)
    elif choice == 4 and isinstance(weight_map, dict) and weight_map:
        weight_map.pop(rng.choice(sorted(weight_map)))
    elif choice == 5 and isinstance(weight_map, dict):
        weight_map[rng.choice(["lm_head.weight", "ghost", "model.norm.weight"])] = rng.choice(
            [*sorted(case.shards), "missing.safetensors"])
    elif choice == 6:
        case.index = junk(rng)
    else:
        case.raw["model.safetensors.index.json"] = rng.choice([b"{", b"[]", b"\xff", b"{}", b'{"weight_map": {}}'])


def mutate_special(case: Case, rng: random.Random) -> None:
    files = ["config.json", *case.shards, "model.safetensors.index.json"]
    case.specials.append((rng.choice(files), rng.choice(SPECIAL_KINDS)))


def mutate_extra_file(case: Case, rng: random.Random) -> None:
    base = next(iter(case.shards.values()))
    if not isinstance(base.header, dict) or not all(isinstance(e, dict) for e in base.header.values()):
        return
    name = rng.choice(sorted(base.header))
    header = copy.deepcopy(base.header)
    header = {name: header[name]} if rng.random() < 0.5 else {"junk": {"dtype": "F32", "shape": [0],
                                                                       "data_offsets": [0, 0]}}
    data = base.data if name in header else b""
    begin = header[name]["data_offsets"][0] if name in header else 0
    if name in header:
        end = header[name]["data_offsets"][1]
        header[name]["data_offsets"] = [0, end - begin]
        data = base.data[begin:end]
    case.extra[rng.choice(["aaa.safetensors", "zzz.safetensors", "model.safetensors.bak"])] = Shard(header, data)


def mutate_none(case: Case, rng: random.Random) -> None:
    """The unmutated checkpoint: must load (and pass the sanity checks)."""


MUTATIONS: dict[str, Callable[[Case, random.Random], None]] = {
    "config_value": mutate_config_value, "config_drop": mutate_config_drop, "config_file": mutate_config_file,
    "rope": mutate_rope, "header": mutate_header, "header_bytes": mutate_header_bytes, "index": mutate_index,
    "special_file": mutate_special, "extra_file": mutate_extra_file, "valid": mutate_none,
}
WEIGHTS = {"config_value": 30, "config_drop": 8, "config_file": 4, "rope": 10, "header": 14, "header_bytes": 6,
           "index": 10, "special_file": 8, "extra_file": 3, "valid": 3, "stacked": 4}


# -- running a case ------------------------------------------------------------------------------------


def write_special(path: Path, kind: str, outside: Path, case_dir: Path) -> None:
    if os.path.lexists(path):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink_canary_rel":
        path.symlink_to(os.path.relpath(outside / "canary.safetensors", case_dir))
    elif kind == "symlink_canary_abs":
        path.symlink_to(outside / ("config.json" if path.name.endswith(".json") else "canary.safetensors"))
    elif kind == "symlink_inside":  # allowed: a copy of the file inside the directory
        real = case_dir / f"real-{path.name}.bin"
        if real.exists():
            path.symlink_to(real.name)
    elif kind == "dangling":
        path.symlink_to("does-not-exist")
    elif kind == "loop":
        path.symlink_to(path.name)
    elif kind == "symlink_etc_passwd":
        path.symlink_to("/etc/passwd")
    elif kind == "symlink_dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "symlink_outside_dir":
        path.symlink_to(outside)
    else:
        path.write_bytes(b"")


def materialise(case: Case, case_dir: Path, outside: Path) -> None:
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir()
    (case_dir / "outside_link").symlink_to(outside)  # a symlinked directory inside, leading out
    files: dict[str, bytes] = {}
    config = case.config
    files["config.json"] = json.dumps(config).encode() if "config.json" not in case.raw else b""
    for name, shard in {**case.shards, **case.extra}.items():
        files[name] = shard.raw if shard.raw is not None else serialise(shard.header, shard.data)
    if case.index is not None:
        files["model.safetensors.index.json"] = json.dumps(case.index).encode()
    files.update(case.raw)
    for name, data in files.items():
        (case_dir / name).write_bytes(data)
    for name, kind in case.specials:
        path = case_dir / name
        if kind == "symlink_inside" and name in files:
            (case_dir / f"real-{name}.bin").write_bytes(files[name])
        write_special(path, kind, outside, case_dir)


@dataclass
class Observed:
    """Paths opened while an entry point runs (audit hook and the loader's open function)."""

    recording: bool = False
    paths: list[str] = field(default_factory=list)


OBSERVED = Observed()


def audit(event: str, args: tuple[Any, ...]) -> None:
    if OBSERVED.recording and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        OBSERVED.paths.append(os.fsdecode(args[0]))


def observe_loader_opens() -> None:
    real = ckpt._open_regular

    def recorded(path: Path, scope: Any) -> Any:
        opened = real(path, scope)
        OBSERVED.paths.append(os.readlink(f"/proc/self/fd/{opened.fileno()}"))  # what was really opened
        return opened

    ckpt._open_regular = recorded  # type: ignore[assignment]
    free_bytes = ckpt._free_bytes

    def unrecorded(device: Any) -> Any:  # the OS's memory figures (/proc, cgroup files), not the checkpoint's
        OBSERVED.recording = False
        try:
            return free_bytes(device)
        finally:
            OBSERVED.recording = True

    ckpt._free_bytes = unrecorded  # type: ignore[assignment]


# config.json key -> (ModelConfig field, JSON type it must have been written as)
LITERAL_KEYS = {"vocab_size": ("vocab_size", int), "hidden_size": ("hidden_size", int),
                "num_hidden_layers": ("num_layers", int), "num_attention_heads": ("num_heads", int),
                "intermediate_size": ("intermediate_size", int), "max_position_embeddings": ("max_position", int),
                "num_key_value_heads": ("num_kv_heads", int), "head_dim": ("head_dim", int),
                "tie_word_embeddings": ("tie_word_embeddings", bool), "rms_norm_eps": ("rms_eps", float)}


def literal_problem(written: Any, config: Any) -> str | None:
    """An accepted config must have been read as written: no bool taken for an int, no string or
    float bent into a bool or an int (silently wrong models)."""
    if not isinstance(written, dict):
        return None
    for key, (name, kind) in LITERAL_KEYS.items():
        value = written.get(key)
        if value is None:
            continue
        typed = type(value) in (int, float) if kind is float else type(value) is kind
        if not typed or value != getattr(config, name):
            return f"accepted {key} = {value!r} as {getattr(config, name)!r}"
    return None


def sane_forward(model: LlamaDecoder) -> str | None:
    model.kv = KVCache(model.config, 2, 16, torch.device("cpu"), next(model.parameters()).dtype)  # block 0: scratch
    with torch.no_grad():
        hidden = model(torch.tensor([1, 2]), AttentionMetadata.build([[1]], [2], [2], 16, torch.device("cpu")))
        logits = model.logits(hidden, torch.tensor([1])).float()
    model.kv = None
    if not torch.isfinite(logits).all():
        return "logits not finite"
    if not logits.abs().sum() > 0:
        return "logits all zero"
    return None


def is_canary(tensor: torch.Tensor) -> bool:
    return tensor.numel() > 0 and tensor.is_floating_point() and bool((tensor.float() == CANARY_VALUE).all())


def run_entry(entry: str, case_dir: Path, rng: random.Random) -> tuple[Any, list[torch.Tensor]]:
    if entry == "load_checkpoint":
        model, _ = ckpt.load_checkpoint(case_dir)
        return model, list(model.parameters())
    if entry == "iter_checkpoint_tensors":
        # A directory the caller names is trusted wherever it links; one file must resolve beside it.
        files = sorted(name for name in os.listdir(case_dir)
                       if name.endswith(".safetensors") and not os.path.isdir(case_dir / name))
        target = case_dir / rng.choice(files) if files and rng.random() < 0.2 else case_dir
        return None, [tensor for _, tensor in ckpt.iter_checkpoint_tensors(target)]
    if entry == "checkpoint_files":
        return ckpt.checkpoint_files(case_dir), []
    return ckpt.config_from_hf(ckpt.read_hf_config(case_dir), "config.json"), []


ENTRIES = {"load_checkpoint": 70, "iter_checkpoint_tensors": 12, "checkpoint_files": 6, "config_from_hf": 12}


@dataclass
class Worker:
    seed: int
    workdir: Path
    case_seconds: float
    bases: dict[str, Case] = field(default_factory=base_cases)
    successes: int = 0

    def __post_init__(self) -> None:
        self.outside = self.workdir / "outside"
        self.case_dir = self.workdir / "ckpt"
        self.outside.mkdir(parents=True, exist_ok=True)
        canary = self.bases["llama"]
        tensors = {}
        for name, entry in canary.shards["model.safetensors"].header.items():
            tensors[name] = torch.full(entry["shape"], CANARY_VALUE)
        (self.outside / "canary.safetensors").write_bytes(serialise(tensors_to_shard(tensors, "F32").header,
                                                                    tensors_to_shard(tensors, "F32").data))
        (self.outside / "model.safetensors").write_bytes((self.outside / "canary.safetensors").read_bytes())
        (self.outside / "config.json").write_text(json.dumps(canary.config))
        self.outside_real = os.path.realpath(self.outside)

    def make_case(self, index: int) -> tuple[random.Random, str, str, str, Case]:
        rng = random.Random(f"{self.seed}/{index}")
        family = rng.choice(sorted(self.bases))
        case = copy.deepcopy(self.bases[family])
        kind = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
        if kind == "stacked":
            for _ in range(rng.randint(2, 3)):
                name = rng.choice([k for k in MUTATIONS if k != "valid"])
                # A later mutation may not apply to what an earlier one left (a header already junk): skipped.
                with contextlib.suppress(TypeError, AttributeError, KeyError, IndexError, ValueError, OverflowError):
                    MUTATIONS[name](case, rng)
        else:
            MUTATIONS[kind](case, rng)
        entry = rng.choices(list(ENTRIES), weights=list(ENTRIES.values()))[0]
        return rng, family, kind, entry, case

    def run(self, index: int) -> tuple[str, str, str, dict[str, Any] | None]:
        """(kind, entry, outcome, finding or None) of case `index`."""
        try:
            rng, family, kind, entry, case = self.make_case(index)
            materialise(case, self.case_dir, self.outside)
        except Exception as exc:  # noqa: BLE001  # the fuzzer's own bug: reported, the run goes on
            unbuilt = f"fuzzer could not build the case: {type(exc).__name__}: {str(exc)[:300]}"
            return "unbuilt", "none", "unbuilt", {"finding": unbuilt, "seed": self.seed, "case": index}
        case_real = os.path.realpath(self.case_dir)
        OBSERVED.paths.clear()
        problem: str | None = None
        result: Any = None
        tensors: list[torch.Tensor] = []
        signal.setitimer(signal.ITIMER_REAL, self.case_seconds)
        try:
            OBSERVED.recording = True
            result, tensors = run_entry(entry, self.case_dir, rng)
            outcome = "accepted"
        except ckpt.CheckpointError as exc:
            outcome = "refused"
            if "\n" in str(exc):
                problem = f"CheckpointError message spans lines: {str(exc)[:300]!r}"
        except CaseTimeout:
            outcome, problem = "hang", f"over {self.case_seconds} s"
        except Exception as exc:  # noqa: BLE001  # any other exception is the finding
            outcome = "traceback"
            problem = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:500]
        finally:
            OBSERVED.recording = False
            signal.setitimer(signal.ITIMER_REAL, 0)
        outside = [p for p in OBSERVED.paths if not os.path.realpath(p).startswith(case_real + os.sep)]
        if outside and problem is None:
            problem = f"opened outside the checkpoint directory: {outside[:3]}"
        if problem is None and outcome == "accepted":
            try:
                problem = self.check_accepted(entry, result, tensors, case.config)
            except Exception as exc:  # noqa: BLE001  # an accepted model that cannot run is a finding
                problem = f"accepted, then failed its sanity check: {type(exc).__name__}: {str(exc)[:300]}"
        finding = None
        if problem is not None:
            finding = {"finding": problem, "seed": self.seed, "case": index, "family": family, "kind": kind,
                       "entry": entry}
        return kind, entry, outcome, finding

    def check_accepted(self, entry: str, result: Any, tensors: list[torch.Tensor], written: Any) -> str | None:
        if any(is_canary(t) for t in tensors):
            return "returned the canary's values (read from outside the directory)"
        if entry in ("load_checkpoint", "config_from_hf"):
            config = result.config if entry == "load_checkpoint" else result
            problem = literal_problem(written, config)
            if problem is not None:
                return problem
        if entry == "load_checkpoint":
            self.successes += 1
            if self.successes % SANITY_EVERY == 1:
                return sane_forward(result)
        if entry == "config_from_hf" and result.head_dim <= 4096:
            inv_freq = rope_inv_freq(result)
            if not bool(torch.isfinite(inv_freq).all()):
                return "accepted config gives non-finite rotary frequencies"
        return None


def on_alarm(signum: int, frame: Any) -> None:
    raise CaseTimeout


WORKER: Worker | None = None


def init_worker(seed: int, root: str, case_seconds: float, breakage: str | None) -> None:
    global WORKER
    apply_breakage(breakage)
    signal.signal(signal.SIGALRM, on_alarm)
    workdir = Path(tempfile.mkdtemp(prefix="w", dir=root))
    WORKER = Worker(seed, workdir, case_seconds)
    sys.addaudithook(audit)
    observe_loader_opens()
    # Warm the lazy imports outside any case's time bound.
    materialise(copy.deepcopy(WORKER.bases["llama"]), WORKER.case_dir, WORKER.outside)
    sane_forward(ckpt.load_checkpoint(WORKER.case_dir)[0])


def run_chunk(bounds: tuple[int, int]) -> tuple[Counter[str], list[dict[str, Any]]]:
    assert WORKER is not None
    counts: Counter[str] = Counter()
    findings = []
    for index in range(*bounds):
        kind, entry, outcome, finding = WORKER.run(index)
        counts[f"kind:{kind}"] += 1
        counts[f"entry:{entry}"] += 1
        counts[f"outcome:{outcome}"] += 1
        if finding is not None:
            findings.append(finding)
    return counts, findings


def apply_breakage(name: str | None) -> None:
    """Disable one defence (the fuzzer's self-test)."""
    if name is None:
        return
    if name == "scope":
        ckpt._Scope.holds = lambda self, resolved: True  # type: ignore[method-assign]
    elif name == "regular":
        # A copy of `stat` only the loader sees (os.path.isfile must keep working), taking
        # directories for files. (Not FIFOs: safetensors would block opening one, in native code
        # the watchdog cannot interrupt.)
        ckpt.stat = types.SimpleNamespace(**{**vars(stat), "S_ISREG": lambda mode: stat.S_ISREG(mode)  # type: ignore
                                             or stat.S_ISDIR(mode)})
    elif name == "ranges":
        model_config.check_number = lambda *args, **kwargs: None  # type: ignore[assignment]
    elif name == "types":  # flags read for their truth: "false" taken for True
        real = ckpt._setting

        def truthy(hf: Any, key: str, default: Any, where: str) -> Any:
            if isinstance(default, bool):
                return bool(ckpt._optional(hf, key, default))
            return real(hf, key, default, where)

        ckpt._setting = truthy  # type: ignore[assignment]
    else:
        raise SystemExit(f"--break {name!r}: choose scope, regular, ranges or types")


def chunks(cases: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, cases, size):
        yield start, min(cases, start + size)


def fuzz(cases: int, seed: int, workers: int, case_seconds: float, breakage: str | None,
         chunk: int = 250, progress: int = 50_000) -> dict[str, Any]:
    start = time.perf_counter()
    counts: Counter[str] = Counter()
    findings: list[dict[str, Any]] = []
    root = tempfile.mkdtemp(prefix="fuzz-checkpoint-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        context = multiprocessing.get_context("fork")
        with context.Pool(workers, init_worker, (seed, root, case_seconds, breakage)) as pool:
            results = pool.imap_unordered(run_chunk, chunks(cases, chunk))
            for _ in range(math.ceil(cases / chunk)):
                try:
                    chunk_counts, chunk_findings = results.next(timeout=max(120.0, case_seconds * chunk))
                except multiprocessing.TimeoutError:
                    findings.append({"finding": "a worker stopped answering (hang)", "seed": seed})
                    pool.terminate()
                    break
                counts += chunk_counts
                done = sum(v for k, v in counts.items() if k.startswith("outcome:"))
                if done % progress < chunk:
                    print(f"{done} cases, {time.perf_counter() - start:.0f} s, {len(findings)} findings",
                          file=sys.stderr, flush=True)
                for finding in chunk_findings:
                    print(json.dumps(finding), flush=True)
                findings += chunk_findings
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def by(prefix: str) -> dict[str, int]:
        return {k.split(":", 1)[1]: v for k, v in sorted(counts.items()) if k.startswith(prefix)}

    return {"cases": sum(by("outcome:").values()), "seconds": round(time.perf_counter() - start, 1),
            "findings": len(findings), "seed": seed, "workers": workers, "outcomes": by("outcome:"),
            "kinds": by("kind:"), "entries": by("entry:")}


def replay(seed: int, index: int, breakage: str | None) -> int:
    apply_breakage(breakage)
    with tempfile.TemporaryDirectory() as root:
        worker = Worker(seed, Path(root), case_seconds=60.0)
        rng, family, kind, entry, case = worker.make_case(index)
        print(f"case {index} (seed {seed}): family {family}, mutation {kind}, entry {entry}", flush=True)
        materialise(case, worker.case_dir, worker.outside)
        for name in sorted(os.listdir(worker.case_dir)):
            path = worker.case_dir / name
            info = os.lstat(path)
            target = f" -> {os.readlink(path)}" if stat.S_ISLNK(info.st_mode) else ""
            print(f"  {name!r}: mode {stat.filemode(info.st_mode)}, {info.st_size} bytes{target}")
        try:
            run_entry(entry, worker.case_dir, rng)  # any other exception: its traceback
        except ckpt.CheckpointError as exc:
            print(f"refused: {exc}")
        else:
            print("accepted")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--case-seconds", type=float, default=10.0, help="a case running longer is a hang")
    parser.add_argument("--case", type=int, default=None, help="replay this one case with its traceback")
    parser.add_argument("--break", dest="breakage", default=None, help="self-test: scope, regular, ranges or types")
    args = parser.parse_args(argv)
    if args.case is not None:
        return replay(args.seed, args.case, args.breakage)
    summary = fuzz(args.cases, args.seed, args.workers, args.case_seconds, args.breakage)
    print(json.dumps(summary), flush=True)
    return 1 if summary["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
