"""Load Hugging Face-format checkpoints (`config.json` + `*.safetensors`) into `LlamaDecoder`.

Supported architectures: `LlamaForCausalLM` (incl. `rope_scaling` type `llama3`),
`MistralForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM`. Every tensor is checked
against the model's layout, computed from the config arithmetically, from the safetensors
headers alone *before* anything is allocated; then the model is built on the meta device,
allocated once on the target device, and filled shard by shard (each tensor read on the
host, cast, and copied into place), so the model is never materialised twice in device memory.

Checkpoints are untrusted input. Every file is opened through `_open_regular`: it must
resolve inside the checkpoint directory (or, for a Hugging Face cache snapshot, inside that
repository's `blobs/`), be a regular file, and JSON files are read with a size cap.
Config values are checked for type and range (`ModelConfig`'s own checks), safetensors
headers for consistency with the file; anything wrong is one `CheckpointError` line that
names the file and the key or tensor.

Tensor names: HF names map one to one onto the model's parameters. Two kinds are
ignored as harmless: `*.rotary_emb.inv_freq` (older checkpoints store the rotary
frequencies, which the model derives from the config) and `lm_head.weight` when the
config ties it to the embedding. Any other unexpected name is refused.
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path
from typing import Any, NamedTuple

import torch

from torchhal.core.model.config import ConfigValueError, Llama3RopeScaling, ModelConfig
from torchhal.core.model.decoder import LlamaDecoder
from torchhal.core.model.parallel import RankShard, ShardSlice, TensorParallelPlan
from torchhal.values import short_repr

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"  # transformers' `generate` reads its end tokens here first
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # real configs are a few KiB
MAX_INDEX_BYTES = 64 << 20  # the largest public indexes are a few MiB
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
MAX_TENSOR_RANK = 8

_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# safetensors dtype -> torch dtype (element size follows)
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_LAYER_KINDS = ("full_attention", "sliding_attention")
# ModelConfig field -> the config.json key it comes from, so range errors name the key the user wrote.
_HF_KEYS = {
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "max_position": "max_position_embeddings",
    "rms_eps": "rms_norm_eps", "num_kv_heads": "num_key_value_heads", "original_max_position":
    "original_max_position_embeddings",
}


class CheckpointError(ValueError):
    """A checkpoint this loader cannot serve; the message names the file and tensor."""


@dataclass(frozen=True)
class LoadReport:
    path: str
    architecture: str
    files: tuple[str, ...]
    tensors: int
    bytes_read: int
    seconds: float
    dtype: torch.dtype
    device: str


# -- files: where they may resolve, and the one way they are opened ----------------------------------


@dataclass(frozen=True)
class _Scope:
    """The resolved places a checkpoint's files may live in (directories, or one file)."""

    places: tuple[Path, ...]

    @classmethod
    def of_directory(cls, directory: Path) -> _Scope:
        """The directory itself; for a Hugging Face cache snapshot (`<repo>/snapshots/<rev>/`,
        whose files are symlinks to `../../blobs/<hash>`) also that repository's `blobs/`."""
        root = directory.resolve()
        places = [root]
        if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
            places.append((root.parent.parent / "blobs").resolve())
        return cls(tuple(places))

    def holds(self, resolved: Path) -> bool:
        return any(resolved == place or place in resolved.parents for place in self.places)


def _resolve(path: Path, scope: _Scope) -> Path:
    """`path` with every symlink followed; refused unless it exists and resolves inside `scope`."""
    if "\x00" in str(path):
        raise CheckpointError(f"{short_repr(str(path))}: a file name with a NUL byte")
    try:
        resolved = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # missing, dangling or looping symlink, name too long
        reason = getattr(exc, "strerror", None) or str(exc)
        raise CheckpointError(f"{path}: cannot be opened ({reason})") from None
    if not scope.holds(resolved):
        raise CheckpointError(
            f"{path}: resolves to {resolved}, outside the checkpoint directory "
            f"({', '.join(map(str, scope.places))}); copy the file into the checkpoint instead of linking to it"
        )
    return resolved


def _file_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _open_regular(path: Path, scope: _Scope) -> BufferedReader:
    """The one place the loader opens a file: resolved inside `scope`, opened without blocking
    (a FIFO cannot hang the open) and without following a symlink swapped in since, and kept
    only if the opened file itself is a regular file."""
    resolved = _resolve(path, scope)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(resolved, flags)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be opened ({exc.strerror}); check its permissions") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointError(f"{path}: is {_file_kind(mode)}, not a regular file")
    opened = _opened_path(fd)
    if opened is not None and not scope.holds(opened):  # a directory swapped for a symlink since resolving
        os.close(fd)
        raise CheckpointError(f"{path}: opened {opened}, outside the checkpoint directory (changed while opening)")
    return os.fdopen(fd, "rb")


def _opened_path(fd: int) -> Path | None:
    """The path the kernel opened for `fd` (Linux's /proc), or None where that is not known."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None


def _check_regular(path: Path, scope: _Scope) -> None:
    """What `_open_regular` requires, without opening (to list a checkpoint's files)."""
    mode = os.stat(_resolve(path, scope)).st_mode
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: is {_file_kind(mode)}, not a regular file")


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two readers could disagree on which duplicate wins: refuse instead of picking one.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"key {short_repr(key)} appears twice")
        out[key] = value
    return out


def _parse_json_object(data: bytes, where: str) -> dict[str, Any]:
    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{where}: not UTF-8 text (bad byte at offset {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except (_DuplicateKey, ValueError, RecursionError) as exc:  # duplicates, over-long ints, deep nesting
        raise CheckpointError(f"{where}: not acceptable JSON ({short_repr(str(exc))})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: must be a JSON object, not {type(value).__name__} {short_repr(value)}")
    return value


def _read_json(path: Path, scope: _Scope, max_bytes: int) -> dict[str, Any]:
    with _open_regular(path, scope) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise CheckpointError(f"{path}: larger than {max_bytes} bytes, more than any real one; refused unread")
    return _parse_json_object(data, str(path))


# -- safetensors headers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


@dataclass(frozen=True)
class _Shard:
    path: Path
    data_start: int
    tensors: dict[str, _TensorEntry]


def _tensor_entry(file: Path, name: str, raw: object) -> _TensorEntry:
    where = f"{file}: tensor {short_repr(name)}"
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(f"{where}: header entry must be an object of dtype, shape and data_offsets")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _SAFETENSORS_DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {short_repr(dtype)}")
    if (not isinstance(shape, list) or len(shape) > MAX_TENSOR_RANK
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise CheckpointError(f"{where}: shape {short_repr(shape)} must be at most {MAX_TENSOR_RANK} ints >= 0")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: data_offsets {short_repr(offsets)} must be [begin, end], 0 <= begin <= end")
    nbytes = math.prod(shape) * _SAFETENSORS_DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise CheckpointError(
            f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, its {dtype} shape {shape} "
            f"needs {nbytes}"
        )
    return _TensorEntry(dtype, tuple(shape), offsets[0], offsets[1])


def _read_shard_header(file: Path, f: BufferedReader) -> _Shard:
    """The header of an open safetensors file, held to the format: every tensor's bytes inside
    the file, back to back in offset order, exactly covering the data section."""
    size = os.fstat(f.fileno()).st_size
    prefix = f.read(8)
    if len(prefix) < 8:
        raise CheckpointError(f"{file}: {size} bytes, too short for a safetensors file (truncated?)")
    header_bytes = int.from_bytes(prefix, "little")
    if header_bytes > MAX_HEADER_BYTES or 8 + header_bytes > size:
        raise CheckpointError(
            f"{file}: header length {header_bytes} does not fit the file ({size} bytes, header limit "
            f"{MAX_HEADER_BYTES}); truncated or not safetensors"
        )
    header = _parse_json_object(f.read(header_bytes), f"{file}: header")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise CheckpointError(f"{file}: header __metadata__ must be an object, not {short_repr(metadata)}")
    tensors = {name: _tensor_entry(file, name, raw) for name, raw in header.items()}
    position = 0
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            raise CheckpointError(
                f"{file}: tensor {short_repr(name)} starts at data byte {entry.begin}, expected {position} "
                "(tensors must be back to back, no gaps or overlaps)"
            )
        position = entry.end
    data_bytes = size - 8 - header_bytes
    if position != data_bytes:
        raise CheckpointError(f"{file}: tensors cover {position} data bytes, the file holds {data_bytes} (truncated?)")
    return _Shard(file, 8 + header_bytes, tensors)


def _read_tensor(f: BufferedReader, shard: _Shard, name: str, part: ShardSlice | None = None) -> torch.Tensor:
    """Tensor `name` of an open shard; with `part`, only that slice (a tensor-parallel rank's):
    one read per run of it that is contiguous in the file (one for a row slice, one per row
    for a column slice), so a rank never holds more of the tensor than its slice."""
    entry = shard.tensors[name]
    dtype = _SAFETENSORS_DTYPES[entry.dtype]
    shape = list(entry.shape)
    runs, skip, length, stride = 1, 0, entry.end - entry.begin, 0
    if part is not None:
        inner = math.prod(shape[part.dim + 1 :]) * dtype.itemsize  # bytes of one index along part.dim
        runs, skip, length = math.prod(shape[: part.dim]), part.start * inner, part.count * inner
        stride = shape[part.dim] * inner
        shape[part.dim] = part.count
    if runs * length == 0:
        return torch.empty(shape, dtype=dtype)
    buffer = torch.empty(runs * length, dtype=torch.uint8)  # read straight into the tensor's storage (no zero-fill)
    view = buffer.numpy().data
    for run in range(runs):
        start = shard.data_start + entry.begin + run * stride + skip
        if not _read_exactly(f, start, view[run * length : (run + 1) * length]):
            raise CheckpointError(
                f"{shard.path}: tensor {short_repr(name)} is cut short (the file changed while loading)"
            )
    return buffer.view(dtype).reshape(shape)


def _read_exactly(f: BufferedReader, position: int, into: memoryview) -> bool:
    """Fill `into` from `position` (unbuffered: a small slice reads only its own bytes); False at end of file."""
    raw = f.raw
    raw.seek(position, os.SEEK_SET)
    done = 0
    while done < len(into):
        count = raw.readinto(into[done:])
        if not count:
            return False
        done += count
    return True


# -- config.json -----------------------------------------------------------------------------------


def _checkpoint_path(path: object) -> Path:
    """`path` as a Path; refused when it is no path, or empty (which Path reads as the working
    directory: an unset shell variable would load whatever checkpoint is there)."""
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        raise TypeError(f"checkpoint path {short_repr(path)} ({type(path).__name__}) is not a path; pass the "
                        "checkpoint directory as a str or pathlib.Path")
    if os.fspath(path) == "":
        raise CheckpointError("checkpoint path '' is empty; pass the checkpoint directory (use '.' for the working "
                              "directory)")
    return Path(path)


def _checkpoint_directory(path: object) -> Path:
    """`path` as an existing directory, or a refusal naming what it is instead."""
    root = _checkpoint_path(path)
    if os.path.isfile(root):
        holder = f" ({root.parent} does)" if os.path.lexists(root.parent / CONFIG_FILE) else ""
        raise CheckpointError(f"{root}: is a file, not a checkpoint directory; pass the directory that holds "
                              f"config.json and the *.safetensors files{holder}")
    if not os.path.lexists(root):
        raise CheckpointError(f"{root}: no such checkpoint directory (a Hugging Face checkpoint is a directory of "
                              "config.json and *.safetensors files)")
    return root


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """`config.json` of a checkpoint directory, as a dict (a JSON object; values not yet checked)."""
    root = _checkpoint_directory(path)
    config_path = root / CONFIG_FILE
    if not os.path.lexists(config_path):
        raise CheckpointError(f"{config_path} not found: a Hugging Face checkpoint directory needs config.json")
    return _read_json(config_path, _Scope.of_directory(root), MAX_CONFIG_BYTES)


def _optional(hf: Mapping[str, Any], key: str, default: Any) -> Any:
    """`hf[key]`, or `default` where it is absent or null (HF configs write null for unset keys)."""
    value = hf.get(key)
    return default if value is None else value


def _flag(hf: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = _optional(hf, key, default)
    if type(value) is not bool:
        raise CheckpointError(f"{where}: {key} = {short_repr(value)} must be true or false (a JSON boolean)")
    return value


def _text(hf: Mapping[str, Any], key: str, default: str, where: str) -> str:
    value = _optional(hf, key, default)
    if not isinstance(value, str):
        raise CheckpointError(f"{where}: {key} = {short_repr(value)} must be a string")
    return value


def _section(hf: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = _optional(hf, key, {})
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: {key} = {short_repr(value)} must be an object")
    return value


def _architecture(hf: Mapping[str, Any], where: str) -> str:
    architectures = _optional(hf, "architectures", [])
    if not isinstance(architectures, list):
        raise CheckpointError(f"{where}: architectures = {short_repr(architectures)} must be a list of class names")
    architecture = architectures[0] if architectures else None
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{where}: architecture {short_repr(architecture)} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(architecture)


def _range_error(where: str, exc: ConfigValueError, prefix: str = "") -> CheckpointError:
    key = prefix + _HF_KEYS.get(exc.field, exc.field)
    return CheckpointError(f"{where}: {key} = {short_repr(exc.value)} must be {exc.rule}")


def _rope(hf: Mapping[str, Any], where: str) -> tuple[Any, Llama3RopeScaling | None]:
    # transformers 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
    params = _section(hf, "rope_parameters", where)
    theta = _optional(params, "rope_theta", _optional(hf, "rope_theta", 10000.0))
    key = "rope_scaling" if hf.get("rope_scaling") is not None else "rope_parameters"
    scaling = _section(hf, key, where)
    rope_type = _optional(scaling, "rope_type", _optional(scaling, "type", "default"))
    partial = _optional(scaling, "partial_rotary_factor", _optional(hf, "partial_rotary_factor", 1.0))
    if type(partial) not in (int, float) or partial != 1.0:
        raise CheckpointError(
            f"{where}: partial_rotary_factor = {short_repr(partial)} is not supported (only full rotary, 1.0)"
        )
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(
            f"{where}: rope type {short_repr(rope_type)} is not supported; supported: default, llama3"
        )
    missing = [name for name in ("factor", "low_freq_factor", "high_freq_factor") if scaling.get(name) is None]
    if missing:
        raise CheckpointError(f"{where}: {key} of type llama3 lacks {', '.join(missing)}")
    try:
        scaling_config = Llama3RopeScaling(
            factor=scaling["factor"],
            low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_position=_optional(
                scaling, "original_max_position_embeddings", _optional(hf, "max_position_embeddings", 8192)
            ),
        )
    except ConfigValueError as exc:
        raise _range_error(where, exc, prefix=f"{key}.") from None
    return theta, scaling_config


def _sliding_window(hf: Mapping[str, Any], architecture: str, where: str) -> Any:
    window = hf.get("sliding_window")
    layer_types = _optional(hf, "layer_types", [])
    if not isinstance(layer_types, list) or not all(kind in _LAYER_KINDS for kind in layer_types):
        raise CheckpointError(
            f"{where}: layer_types = {short_repr(layer_types)} must be a list of {' or '.join(_LAYER_KINDS)}"
        )
    layers = hf.get("num_hidden_layers")
    if layer_types and len(layer_types) != layers:
        raise CheckpointError(f"{where}: layer_types has {len(layer_types)} entries, num_hidden_layers is {layers}")
    use_sliding_window = _flag(hf, "use_sliding_window", False, where)
    if architecture == "LlamaForCausalLM":  # transformers' Llama attends to the whole context, whatever these say
        return None
    if architecture == "MistralForCausalLM" and not layer_types:
        return window
    if layer_types:
        sliding = [kind != "full_attention" for kind in layer_types]
        if all(sliding):
            return window
        if any(sliding):
            raise CheckpointError(
                f"{where}: layers mixing sliding-window and full attention are not supported (layer_types)"
            )
        return None
    if use_sliding_window and window is not None:
        raise CheckpointError(f"{where}: use_sliding_window with max_window_layers is not supported")
    return None


def config_from_hf(hf: dict[str, Any], where: str = "config.json", has_lm_head: bool = True) -> ModelConfig:
    """The `ModelConfig` of an HF config dict; refuses what the decoder would compute differently,
    and every value of the wrong JSON type or out of range (naming the key and value)."""
    if not isinstance(hf, dict):
        raise CheckpointError(f"{where}: must be a JSON object, not {type(hf).__name__}")
    architecture = _architecture(hf, where)
    hidden_act = _text(hf, "hidden_act", "silu", where)
    if hidden_act != "silu":
        raise CheckpointError(f"{where}: hidden_act {short_repr(hidden_act)} is not supported; supported: silu")
    if _flag(hf, "mlp_bias", False, where):
        raise CheckpointError(f"{where}: mlp_bias is not supported")
    theta, scaling = _rope(hf, where)
    qwen2 = architecture == "Qwen2ForCausalLM"
    bias = _flag(hf, "attention_bias", False, where)
    missing = [key for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size") if hf.get(key) is None]
    if missing:
        raise CheckpointError(f"{where}: {', '.join(missing)} missing (or null); a model config needs them")
    for key in ("num_key_value_heads", "head_dim"):  # 0 would silently mean "derive it": refuse instead
        if hf.get(key) == 0 and type(hf.get(key)) is int:
            raise CheckpointError(f"{where}: {key} = 0 must be an int >= 1 (or left out)")
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_position=_optional(hf, "max_position_embeddings", 4096),
            rope_theta=theta,
            rms_eps=_optional(hf, "rms_norm_eps", 1e-6),
            num_kv_heads=_optional(hf, "num_key_value_heads", 0),
            head_dim=_optional(hf, "head_dim", 0),
            attention_bias=qwen2 or bias,  # Qwen2 always has q/k/v biases (and none on o_proj)
            o_proj_bias=bias and not qwen2,
            qk_norm=architecture == "Qwen3ForCausalLM",
            tie_word_embeddings=_flag(hf, "tie_word_embeddings", not has_lm_head, where),
            rope_scaling=scaling,
            sliding_window=_sliding_window(hf, architecture, where),
        )
    except ConfigValueError as exc:
        raise _range_error(where, exc) from None
    except CheckpointError:  # a flag's or a window's own refusal, which names `where` already
        raise
    except ValueError as exc:  # relations between values (divisibility, even head_dim)
        raise CheckpointError(f"{where}: {exc}") from None


def eos_token_ids(hf: dict[str, Any], where: str = "config.json") -> tuple[int, ...]:
    """Every end-of-sequence id of a config (Llama 3 lists several); () when it names none. Ids outside
    its `vocab_size` are refused, naming `where`."""
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or t < 0]
    if bad:
        raise CheckpointError(
            f"{where}: eos_token_id {short_repr(eos)} must be a token id or a list of token ids (ints >= 0)"
        )
    vocab = hf.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        return tuple(ids)  # a bad vocab_size is config_from_hf's to refuse
    outside = sorted({t for t in ids if t >= vocab})
    if outside:  # an id the model cannot emit would never stop a request
        raise CheckpointError(
            f"{where}: eos_token_id {short_repr(eos)} names token(s) {short_repr(outside)} outside the vocabulary "
            f"0..{vocab - 1} (vocab_size {vocab}), so no request would ever stop on them; correct eos_token_id in "
            "the file, or pass EngineConfig(eos_tokens=(...)) with ids the model can emit"
        )
    return tuple(ids)


def checkpoint_eos_token_ids(path: str | Path, hf: dict[str, Any]) -> tuple[int, ...]:
    """The end-of-sequence ids `generate` stops on, as transformers picks them: those of
    `generation_config.json` where the checkpoint has one naming any, else `config.json`'s (`hf`).
    Chat checkpoints often differ between the two (Qwen2.5-Instruct's config.json names
    <|endoftext|>, its generation config adds <|im_end|>, the token a reply ends with)."""
    root = _checkpoint_path(path)
    generation_path = root / GENERATION_CONFIG_FILE
    if os.path.lexists(generation_path):
        generation = _read_json(generation_path, _Scope.of_directory(root), MAX_CONFIG_BYTES)
        if generation.get("eos_token_id") is not None:
            # Checked against the model's vocabulary, which only config.json gives.
            return eos_token_ids({**generation, "vocab_size": hf.get("vocab_size")}, str(generation_path))
    return eos_token_ids(hf, str(root / CONFIG_FILE))


def checkpoint_dtype(hf: dict[str, Any], where: str = "config.json") -> torch.dtype:
    name = _optional(hf, "dtype", _optional(hf, "torch_dtype", "float32"))
    if not isinstance(name, str) or name not in _TORCH_DTYPES:
        raise CheckpointError(
            f"{where}: dtype {short_repr(name)} is not supported; supported: {', '.join(_TORCH_DTYPES)}"
        )
    return _TORCH_DTYPES[name]


# -- the checkpoint's files and the expected layout ----------------------------------------------------


def _shard_name(name: object, tensor: str, index: Path) -> str:
    """A shard named by the index: a plain file name inside the checkpoint directory."""
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
            or "\x00" in name or os.path.isabs(name)):
        raise CheckpointError(
            f"{index}: weight_map gives {short_repr(tensor)} the shard {short_repr(name)}; "
            "a shard must be a plain file name in the checkpoint directory"
        )
    return name


def _index_weight_map(root: Path, scope: _Scope) -> dict[str, str]:
    """tensor name -> shard file name, from the index, every name checked."""
    index = root / INDEX_FILE
    weight_map = _read_json(index, scope, MAX_INDEX_BYTES).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index}: weight_map = {short_repr(weight_map)} must be a non-empty object of tensor name -> shard file"
        )
    return {tensor: _shard_name(shard, tensor, index) for tensor, shard in weight_map.items()}


def _files_and_map(path: str | Path) -> tuple[list[Path], dict[str, str] | None, _Scope]:
    root = _checkpoint_path(path)
    if os.path.isfile(root):  # one file: it must resolve inside its own directory, like a directory's files
        scope = _Scope.of_directory(root.parent)
        _check_regular(root, scope)
        return [root], None, scope
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint file or directory (or not a regular file)")
    scope = _Scope.of_directory(root)
    if os.path.lexists(root / SINGLE_FILE):
        # transformers' order: the single file, even beside an index (an older sharded save the
        # newer one was copied over); reading the shards instead would load other weights.
        weight_map, files = None, [root / SINGLE_FILE]
    elif os.path.lexists(root / INDEX_FILE):
        weight_map = _index_weight_map(root, scope)
        holders: dict[str, str] = {}
        for tensor, shard in weight_map.items():
            holders.setdefault(shard, tensor)
        missing = [f"{shard} (holds {short_repr(tensor)})" for shard, tensor in holders.items()
                   if not os.path.lexists(root / shard)]
        if missing:
            raise CheckpointError(f"{root / INDEX_FILE}: missing shard(s): {', '.join(missing)}")
        files = [root / shard for shard in sorted(holders)]
    else:
        weight_map = None
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{root}: no *.safetensors files (and no {INDEX_FILE})")
    for file in files:
        _check_regular(file, scope)
    return files, weight_map, scope


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: a single file, the shards an index names, or all in a
    directory; each checked to be a regular file resolving inside the checkpoint (see `_Scope`)."""
    return _files_and_map(path)[0]


def _read_headers(files: list[Path], weight_map: dict[str, str] | None, scope: _Scope) -> list[_Shard]:
    """Every shard's header; a tensor in two shards, or where the index does not say it is, is refused."""
    shards: list[_Shard] = []
    holder: dict[str, Path] = {}
    for file in files:
        with _open_regular(file, scope) as f:
            shard = _read_shard_header(file, f)
        for name in shard.tensors:
            if name in holder:
                raise CheckpointError(f"{file}: tensor {short_repr(name)} also in {holder[name]}")
            holder[name] = file
            if weight_map is not None and weight_map.get(name) != file.name:
                raise CheckpointError(
                    f"{file}: tensor {short_repr(name)} is not where {INDEX_FILE}'s weight_map puts it "
                    f"({short_repr(weight_map.get(name))})"
                )
        shards.append(shard)
    if weight_map is not None:
        absent = [name for name in weight_map if name not in holder]
        if absent:
            raise CheckpointError(
                f"{files[0].parent / INDEX_FILE}: weight_map lists {short_repr(absent[0])} in "
                f"{short_repr(weight_map[absent[0]])}, which does not hold it ({len(absent)} such)"
            )
    return shards


def _ignored(name: str, tied: bool) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


def _layer_layout(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    layout: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
    }
    if config.attention_bias:
        layout |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    if config.o_proj_bias:
        layout["self_attn.o_proj.bias"] = (h,)
    if config.qk_norm:
        layout |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    return layout


def expected_layout(config: ModelConfig, available: int | None = None, where: str = "config.json") -> dict[
        str, tuple[int, ...]]:
    """HF name -> shape of every parameter `LlamaDecoder(config)` has, computed arithmetically (no
    model built). With `available` (the checkpoint's tensor count), a config that needs more
    tensors than that is refused before the per-layer names are even listed."""
    per_layer = _layer_layout(config)
    needed = config.num_layers * len(per_layer) + 2 + (not config.tie_word_embeddings)
    if available is not None and needed > available:
        raise CheckpointError(
            f"{where}: num_hidden_layers = {config.num_layers} needs {needed} tensors, the checkpoint holds "
            f"{available}; checkpoint refused, nothing allocated"
        )
    h, v = config.hidden_size, config.vocab_size
    layout: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(config.num_layers):
        layout |= {f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()}
    layout["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        layout["lm_head.weight"] = (v, h)
    return layout


def _check(layout: dict[str, tuple[int, ...]], shards: list[_Shard], tied: bool) -> None:
    """Every parameter present with its shape and a floating dtype; no unexpected tensor. All problems at once."""
    problems: list[str] = []
    seen: set[str] = set()
    for shard in shards:
        for name, entry in shard.tensors.items():
            if _ignored(name, tied):
                continue
            seen.add(name)
            expected = layout.get(name)
            if expected is None:
                problems.append(f"{shard.path.name}: unexpected tensor {short_repr(name)}")
            elif entry.shape != expected:
                problems.append(f"{shard.path.name}: tensor {name!r} has shape {entry.shape}, expected {expected}")
            elif entry.dtype not in _FLOAT_DTYPES:
                problems.append(
                    f"{shard.path.name}: tensor {name!r} has dtype {entry.dtype}, expected a floating dtype"
                )
    names = ", ".join(shard.path.name for shard in shards)
    problems += [f"missing weight {name!r} (not in {names})" for name in layout if name not in seen]
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise CheckpointError(f"{shards[0].path.parent}: checkpoint refused, nothing loaded: " + "; ".join(shown))


def _allocate(model: LlamaDecoder, device: torch.device) -> LlamaDecoder:
    """The one device allocation (`LlamaDecoder.materialize`)."""
    return model.materialize(device)


def _rank_shard(config: ModelConfig, tensor_parallel: tuple[int, int] | None, where: str) -> RankShard | None:
    """`tensor_parallel=(world_size, rank)` as this checkpoint's `RankShard`; a model that
    cannot be split that way is refused here, before anything is allocated or read."""
    if tensor_parallel is None:
        return None
    world_size, rank = tensor_parallel  # its form checked by load_checkpoint
    try:
        plan = TensorParallelPlan(config, world_size)
    except ValueError as exc:  # the model cannot be split that way: the checkpoint's sizes
        raise CheckpointError(f"{where}: {exc}") from None
    return RankShard(plan, rank)  # a rank outside the group: the caller's ValueError


def _reopen(shard: _Shard, scope: _Scope) -> BufferedReader:
    """A checked shard opened again to read its data; refused if its header changed since the check."""
    f = _open_regular(shard.path, scope)
    try:
        if _read_shard_header(shard.path, f) != shard:
            raise CheckpointError(f"{shard.path}: header changed since it was checked; load again")
    except BaseException:
        f.close()
        raise
    return f


class _Checked(NamedTuple):
    """A checkpoint whose config, files and headers passed every check before allocation."""

    hf: dict[str, Any]
    files: list[Path]
    shards: list[_Shard]
    scope: _Scope
    config: ModelConfig
    layout: dict[str, tuple[int, ...]]


def check_checkpoint(path: str | Path) -> ModelConfig:
    """Everything `load_checkpoint` checks before it allocates (config.json, the files, every
    safetensors header against the model's layout), without reading a weight: the model's
    config, or the CheckpointError a load would raise first. For a caller that starts other
    processes to load it (tensor-parallel ranks) and wants bad input refused in its own."""
    return _checked(_checkpoint_path(path)).config


def _checked(root: Path) -> _Checked:
    where = str(root / CONFIG_FILE)
    hf = read_hf_config(root)
    files, weight_map, scope = _files_and_map(root)
    shards = _read_headers(files, weight_map, scope)
    names = {name for shard in shards for name in shard.tensors}
    config = config_from_hf(hf, where, has_lm_head="lm_head.weight" in names)
    tied = config.tie_word_embeddings
    layout = expected_layout(config, sum(not _ignored(name, tied) for name in names), where)
    _check(layout, shards, tied)
    return _Checked(hf, files, shards, scope, config, layout)


def load_checkpoint(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str | None = None, *,
    tensor_parallel: tuple[int, int] | None = None, check_finite: bool = False,
) -> tuple[LlamaDecoder, LoadReport]:
    """A Hugging Face checkpoint directory as an eval-mode `LlamaDecoder` on `device` (default: host).

    `dtype` overrides the config's `dtype`/`torch_dtype`. The KV cache is not allocated
    (the engine sizes and owns it). Everything is checked from `config.json` and the
    safetensors headers before the model is built or anything allocated.

    `tensor_parallel=(world_size, rank)`: the decoder of that rank's shard (see
    `LlamaDecoder`), reading only its slices of the sharded tensors (`bytes_read` says how
    much). Headers are checked against the whole model's shapes as without it; a model that
    cannot be split over `world_size` ranks is refused (CheckpointError naming the sizes
    that work) before anything is allocated.

    `check_finite`: refuse a tensor holding NaN or infinite values once cast to `dtype` (a
    float32 weight past float16's range becomes inf), naming its file and name; one device
    sync per tensor (`EngineConfig.check_finite_weights` asks for it).
    """
    start = time.perf_counter()
    if not isinstance(check_finite, bool):
        raise ValueError(f"check_finite = {short_repr(check_finite)} must be True or False")
    if tensor_parallel is not None and not (
            isinstance(tensor_parallel, tuple) and len(tensor_parallel) == 2
            and all(type(v) is int for v in tensor_parallel) and 0 <= tensor_parallel[1] < tensor_parallel[0]):
        raise ValueError(f"tensor_parallel = {short_repr(tensor_parallel)} must be (world_size, rank) with "
                         "0 <= rank < world_size, e.g. (2, 0)")
    if dtype is not None and dtype not in _TORCH_DTYPES.values():
        raise ValueError(f"dtype = {short_repr(dtype)} is not a dtype the model runs in; pass one of "
                         f"{', '.join(str(d) for d in _TORCH_DTYPES.values())}, or None for the checkpoint's own")
    try:
        target = torch.device(device) if device is not None else torch.device("cpu")
    except (RuntimeError, TypeError):
        raise ValueError(f"device = {short_repr(device)} is not a torch device; pass e.g. 'cuda:0', "
                         "torch.device('cpu') or platform.device()") from None
    if target.type == "meta":  # nothing would be read into it, yet the report would count it read
        raise ValueError("device = meta holds no data; pass a device to load the weights on, e.g. 'cpu'")
    try:
        torch.empty(0, device=target)  # a device this process cannot use fails here, not after every header
    except (RuntimeError, AssertionError) as exc:
        raise ValueError(f"device = {short_repr(device)} cannot be used here ({' '.join(str(exc).split())[:200]}); "
                         "pass one this process has, e.g. platform.device()") from None
    root = _checkpoint_path(path)
    where = str(root / CONFIG_FILE)
    hf, files, shards, scope, config, layout = _checked(root)  # before the model is built or the device sees a byte
    dtype = dtype or checkpoint_dtype(hf, where)
    tied = config.tie_word_embeddings
    rank = _rank_shard(config, tensor_parallel, where)
    if rank is not None and rank.world_size == 1:
        rank = None
    with torch.device("meta"):
        model = LlamaDecoder(config, rank).to(dtype)
    built = {name: tuple(param.shape) for name, param in model.named_parameters()}
    local = {name: rank.local_shape(name, shape) for name, shape in layout.items()} if rank else layout
    if built != local:  # a decoder change the layout arithmetic has not followed: a bug, not bad input
        raise RuntimeError(f"expected_layout disagrees with LlamaDecoder: {sorted(set(built) ^ set(local))[:5]}")
    model = _allocate(model, target)
    params = dict(model.named_parameters())
    bytes_read = tensors = 0
    with torch.no_grad():
        for shard in shards:
            with _reopen(shard, scope) as f:
                for name in shard.tensors:
                    if _ignored(name, tied):
                        continue
                    part = rank.slice_of(name) if rank is not None else None
                    tensor = _read_tensor(f, shard, name, part)
                    if part is not None and part.count < part.size:  # the vocabulary's padding rows
                        params[name].narrow(part.dim, part.count, part.size - part.count).zero_()
                        params[name].narrow(part.dim, 0, part.count).copy_(tensor)
                    else:
                        params[name].copy_(tensor)
                    if check_finite and not bool(params[name].isfinite().all()):
                        raise CheckpointError(f"{shard.path}: tensor {name!r} holds NaN or infinite values once in "
                                              f"{dtype}; fix the checkpoint, or load it in a wider dtype")
                    bytes_read += tensor.numel() * tensor.element_size()
                    tensors += 1
    model.process_weights()
    model.eval()
    report = LoadReport(
        path=str(root),
        architecture=_architecture(hf, where),
        files=tuple(str(f) for f in files),
        tensors=tensors,
        bytes_read=bytes_read,
        seconds=time.perf_counter() - start,
        dtype=dtype,
        device=str(target),
    )
    return model, report


def iter_checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, host tensor) pairs of a checkpoint directory or a single safetensors file, shard by shard.

    Skips the names `load_checkpoint` ignores (rotary frequencies; a tied `lm_head.weight`
    when a `config.json` beside the weights says so), so the pairs feed a weight update as they are.
    Every header is checked before the first pair is yielded.
    """
    root = _checkpoint_path(path)
    config_dir = root if root.is_dir() else root.parent
    tied = False
    if os.path.lexists(config_dir / CONFIG_FILE):
        tied = _flag(read_hf_config(config_dir), "tie_word_embeddings", False, str(config_dir / CONFIG_FILE))
    files, weight_map, scope = _files_and_map(root)
    shards = _read_headers(files, weight_map, scope)
    for shard in shards:
        with _reopen(shard, scope) as f:
            for name in shard.tensors:
                if not _ignored(name, tied):
                    yield name, _read_tensor(f, shard, name)
