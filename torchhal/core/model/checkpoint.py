"""Load Hugging Face-format checkpoints (`config.json` + `*.safetensors`) into `LlamaDecoder`.

Supported architectures: `LlamaForCausalLM` (incl. `rope_scaling` type `llama3`),
`MistralForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM`. The weights are read through
`safetensors` (`safe_open`; `get_slice` for a tensor-parallel rank's part), which refuses a
damaged file. Every tensor's name, shape and dtype is checked against the model's layout,
computed from the config arithmetically, before anything is allocated; the weights must fit
in the target device's free memory; then the model is built on the meta device, allocated
once on the target device and filled tensor by tensor (each read from the host mapping, cast,
and copied into place), so the model is never materialised twice in device memory.

Checkpoints are untrusted input. Every file is opened through `_open_regular`: it must
resolve inside the checkpoint directory (or, for a Hugging Face cache snapshot, inside that
repository's own `blobs/` directory), be a regular file, and JSON files are read with a size
cap. Config values are checked for type and range (`ModelConfig`'s own checks); anything
wrong is one `CheckpointError` line that names the file and the key or tensor. Weights that
hold NaN or infinite values once cast are refused too (`check_finite`).

Tensor names: HF names map one to one onto the model's parameters. Two kinds are
ignored as harmless: `*.rotary_emb.inv_freq` (some checkpoints store the rotary
frequencies, which the model derives from the config) and `lm_head.weight` when the
config ties it to the embedding. Any other unexpected name is refused.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from io import BufferedReader
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from torchhal.core.model.config import ConfigValueError, Llama3RopeScaling, ModelConfig
from torchhal.core.model.decoder import LlamaDecoder
from torchhal.core.model.parallel import RankShard, ShardSlice, TensorParallelPlan
from torchhal.platforms import current_platform, get_platform
from torchhal.values import as_indices, check_bool, short_repr

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"  # transformers' `generate` reads its end tokens here first
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # real configs are a few KiB
MAX_INDEX_BYTES = 64 << 20  # the largest public indexes are a few MiB

_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_LAYER_KINDS = ("full_attention", "sliding_attention")
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_BOOL = (bool, "true or false (a JSON boolean)")
# config.json keys read as they are: the JSON type each must have (when present and not null).
_JSON_TYPES: dict[str, tuple[type, str]] = {
    "architectures": (list, "a list of class names"), "hidden_act": (str, "a string"),
    "layer_types": (list, f"a list of {' or '.join(_LAYER_KINDS)}"),
    "rope_scaling": (dict, "an object"), "rope_parameters": (dict, "an object"),
    "mlp_bias": _BOOL, "attention_bias": _BOOL, "tie_word_embeddings": _BOOL, "use_sliding_window": _BOOL,
}
# ModelConfig field -> the config.json key it comes from, so range errors name the key the user wrote.
_HF_KEYS = {
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "max_position": "max_position_embeddings",
    "rms_eps": "rms_norm_eps", "num_kv_heads": "num_key_value_heads", "original_max_position":
    "original_max_position_embeddings",
}
_ROPE_FIELDS = {field.name for field in fields(Llama3RopeScaling)}
_FILE_KINDS = {"d": "a directory", "p": "a FIFO", "s": "a socket", "c": "a device", "b": "a device"}
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class CheckpointError(ValueError):
    """A checkpoint this loader cannot serve; the message names the file and tensor."""


class CheckpointTooLarge(CheckpointError, MemoryError):
    """A consistent checkpoint whose weights do not fit in the target device's free memory."""


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
    """The resolved directories a checkpoint's files may live in."""

    places: tuple[Path, ...]

    @classmethod
    def of_directory(cls, directory: Path) -> _Scope:
        """The directory itself; for a Hugging Face cache snapshot (`<repo>/snapshots/<rev>/`,
        whose files are symlinks to `../../blobs/<hash>`) also that repository's `blobs/`, when
        it is a directory of the repository and not a link leading elsewhere."""
        root = directory.resolve()
        blobs = root.parent.parent / "blobs"
        snapshot = root.parent.name == "snapshots" and blobs.is_dir() and not blobs.is_symlink()
        return cls((root, blobs) if snapshot else (root,))

    def holds(self, resolved: Path) -> bool:
        return any(resolved == place or place in resolved.parents for place in self.places)


def _open_regular(path: Path, scope: _Scope) -> BufferedReader:
    """The one place the loader opens a file: resolved inside `scope`, opened without blocking
    (a FIFO cannot hang the open) and without following a symlink swapped in since, and kept
    only if the file the kernel opened is a regular file inside `scope`."""
    fd = None
    try:
        resolved = path.resolve(strict=True)
        if scope.holds(resolved):
            fd = os.open(resolved, _OPEN_FLAGS)
    except (OSError, RuntimeError, ValueError) as exc:  # missing, dangling or looping link, NUL byte, permissions
        reason = getattr(exc, "strerror", None) or str(exc)
        raise CheckpointError(f"{path}: cannot be opened ({reason}); check that it exists and is readable") from None
    opened, mode = resolved, 0
    if fd is not None:
        opened, mode = _opened_path(fd) or resolved, os.fstat(fd).st_mode
    if fd is None or not scope.holds(opened) or not stat.S_ISREG(mode):
        if fd is not None:
            os.close(fd)
        reason = (f"resolves to {opened}, outside the checkpoint directory ({', '.join(map(str, scope.places))}); "
                  "copy the file into the checkpoint instead of linking to it") if not scope.holds(opened) else \
            f"is {_FILE_KINDS.get(stat.filemode(mode)[0], 'not a regular file')}, not a regular file"
        raise CheckpointError(f"{path}: {reason}")
    return os.fdopen(fd, "rb")


def _opened_path(fd: int) -> Path | None:
    """The path the kernel opened for `fd` (Linux's /proc), or None where that is not known."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two readers could disagree on which duplicate wins: refuse instead of picking one.
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"key {short_repr(next(k for k in keys if keys.count(k) > 1))} appears twice")
    return dict(pairs)


def _read_json(path: Path, scope: _Scope, max_bytes: int) -> dict[str, Any]:
    with _open_regular(path, scope) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise CheckpointError(f"{path}: larger than {max_bytes} bytes, more than any real one; refused unread")
    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as exc:  # not UTF-8 or JSON, a key twice, an over-long int, deep nesting
        raise CheckpointError(f"{path}: not valid JSON ({short_repr(str(exc), 160)})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: must be a JSON object, not {type(value).__name__} {short_repr(value)}")
    return value


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
    if not root.is_dir():
        holder = f" ({root.parent} does)" if os.path.lexists(root.parent / CONFIG_FILE) else ""
        raise CheckpointError(
            f"{root}: is a file, not a checkpoint directory; pass the directory that holds config.json and the "
            f"*.safetensors files{holder}" if os.path.lexists(root) else f"{root}: no such checkpoint directory (a "
            "Hugging Face checkpoint is a directory of config.json and *.safetensors files)")
    return root


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """`config.json` of a checkpoint directory, as a dict (a JSON object; values not yet checked)."""
    root = _checkpoint_directory(path)
    return _read_json(root / CONFIG_FILE, _Scope.of_directory(root), MAX_CONFIG_BYTES)


def _optional(hf: Mapping[str, Any], key: str, default: Any) -> Any:
    """`hf[key]`, or `default` where it is absent or null (HF configs write null for unset keys)."""
    value = hf.get(key)
    return default if value is None else value


def _setting(hf: Mapping[str, Any], key: str, default: Any, where: str) -> Any:
    """`hf[key]` of the JSON type `_JSON_TYPES` gives it, or `default` where it is absent or null."""
    value = _optional(hf, key, default)
    kind, rule = _JSON_TYPES[key]
    if not isinstance(value, kind):
        raise CheckpointError(f"{where}: {key} = {short_repr(value)} must be {rule}")
    return value


def config_from_hf(hf: dict[str, Any], where: str = "config.json", has_lm_head: bool = True) -> ModelConfig:
    """The `ModelConfig` of an HF config dict; refuses what the decoder would compute differently,
    and every value of the wrong JSON type or out of range (naming the key and value)."""
    architectures = _setting(hf, "architectures", [], where)
    architecture = architectures[0] if architectures else None
    hidden_act = _setting(hf, "hidden_act", "silu", where)
    # transformers 5 writes `rope_parameters`; other configs `rope_theta` + `rope_scaling`.
    params = _setting(hf, "rope_parameters", {}, where)
    rope_key = "rope_scaling" if hf.get("rope_scaling") is not None else "rope_parameters"
    rope = _setting(hf, rope_key, {}, where)
    rope_type = _optional(rope, "rope_type", _optional(rope, "type", "default"))
    partial = _optional(rope, "partial_rotary_factor", _optional(hf, "partial_rotary_factor", 1.0))
    layer_types = _setting(hf, "layer_types", [], where)
    sliding = [kind != "full_attention" for kind in layer_types]
    use_sliding_window = _setting(hf, "use_sliding_window", False, where)
    bias, tied = _setting(hf, "attention_bias", False, where), _setting(hf, "tie_word_embeddings", not has_lm_head,
                                                                            where)
    missing = [key for key in _REQUIRED_KEYS if hf.get(key) is None]
    lacking = [name for name in ("factor", "low_freq_factor", "high_freq_factor") if rope.get(name) is None]
    unsupported = [problem for bad, problem in (
        (architecture not in SUPPORTED_ARCHITECTURES, f"architecture {short_repr(architecture)} is not supported; "
                                                      f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"),
        (bool(missing), f"{', '.join(missing)} missing (or null); a model config needs them"),
        *((type(hf.get(key)) is int and hf.get(key) == 0, f"{key} = 0 must be an int >= 1 (or left out)")
          for key in ("num_key_value_heads", "head_dim")),  # 0 would silently mean "derive it"
        (hidden_act != "silu", f"hidden_act {short_repr(hidden_act)} is not supported; supported: silu"),
        (_setting(hf, "mlp_bias", False, where), "mlp_bias is not supported"),
        (type(partial) not in (int, float) or partial != 1.0,
         f"partial_rotary_factor = {short_repr(partial)} is not supported (only full rotary, 1.0)"),
        (rope_type not in ("default", "llama3"), f"rope type {short_repr(rope_type)} is not supported; supported: "
                                                 "default, llama3"),
        (rope_type == "llama3" and bool(lacking), f"{rope_key} of type llama3 lacks {', '.join(lacking)}"),
        (not all(kind in _LAYER_KINDS for kind in layer_types),
         f"layer_types = {short_repr(layer_types)} must be a list of {' or '.join(_LAYER_KINDS)}"),
        (bool(layer_types) and len(layer_types) != hf.get("num_hidden_layers"),
         f"layer_types has {len(layer_types)} entries, num_hidden_layers is {short_repr(hf.get('num_hidden_layers'))}"),
        # transformers' Llama attends to the whole context, whatever these say
        (architecture != "LlamaForCausalLM" and any(sliding) and not all(sliding),
         "layers mixing sliding-window and full attention are not supported (layer_types)"),
        (architecture not in ("LlamaForCausalLM", "MistralForCausalLM") and not layer_types and use_sliding_window
         and hf.get("sliding_window") is not None, "use_sliding_window with max_window_layers is not supported"),
    ) if bad]
    if unsupported:
        raise CheckpointError(f"{where}: {'; '.join(unsupported)}")
    window = hf.get("sliding_window") if architecture != "LlamaForCausalLM" and (
        all(sliding) if layer_types else architecture == "MistralForCausalLM") else None
    qwen2 = architecture == "Qwen2ForCausalLM"
    try:
        scaling = None if rope_type == "default" else Llama3RopeScaling(
            factor=rope["factor"], low_freq_factor=rope["low_freq_factor"], high_freq_factor=rope["high_freq_factor"],
            original_max_position=_optional(rope, "original_max_position_embeddings",
                                            _optional(hf, "max_position_embeddings", 8192)))
        return ModelConfig(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"], intermediate_size=hf["intermediate_size"],
            max_position=_optional(hf, "max_position_embeddings", 4096),
            rope_theta=_optional(params, "rope_theta", _optional(hf, "rope_theta", 10000.0)),
            rms_eps=_optional(hf, "rms_norm_eps", 1e-6), num_kv_heads=_optional(hf, "num_key_value_heads", 0),
            head_dim=_optional(hf, "head_dim", 0),
            attention_bias=qwen2 or bias,  # Qwen2 always has q/k/v biases (and none on o_proj)
            o_proj_bias=bias and not qwen2, qk_norm=architecture == "Qwen3ForCausalLM", tie_word_embeddings=tied,
            rope_scaling=scaling, sliding_window=window,
        )
    except ValueError as exc:  # a value out of its range (named by its config.json key), or values that disagree
        problem = str(exc)
        if isinstance(exc, ConfigValueError):
            prefix = f"{rope_key}." if exc.field in _ROPE_FIELDS else ""
            problem = f"{prefix}{_HF_KEYS.get(exc.field, exc.field)} = {short_repr(exc.value)} must be {exc.rule}"
        raise CheckpointError(f"{where}: {problem}") from None


def eos_token_ids(hf: dict[str, Any], where: str = "config.json") -> tuple[int, ...]:
    """Every end-of-sequence id of a config (Llama 3 lists several); () when it names none. Ids outside
    its `vocab_size` are refused, naming `where`."""
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    ids = as_indices(eos if isinstance(eos, list) else [eos], 0)
    if ids is None:
        raise CheckpointError(
            f"{where}: eos_token_id {short_repr(eos)} must be a token id or a list of token ids (ints >= 0)"
        )
    vocab = hf.get("vocab_size")
    if type(vocab) is not int or vocab < 1:
        return ids  # a bad vocab_size is config_from_hf's to refuse
    outside = sorted({t for t in ids if t >= vocab})
    if outside:  # an id the model cannot emit would never stop a request
        raise CheckpointError(
            f"{where}: eos_token_id {short_repr(eos)} names token(s) {short_repr(outside)} outside the vocabulary "
            f"0..{vocab - 1} (vocab_size {vocab}), so no request would ever stop on them; correct eos_token_id in "
            "the file, or pass EngineConfig(eos_tokens=(...)) with ids the model can emit"
        )
    return ids


def checkpoint_eos_token_ids(path: str | Path, hf: dict[str, Any]) -> tuple[int, ...]:
    """The end-of-sequence ids `generate` stops on, as transformers picks them: those of
    `generation_config.json` where the checkpoint has one naming any, else `config.json`'s (`hf`).
    Chat checkpoints often differ between the two (Qwen2.5-Instruct's config.json names
    <|endoftext|>, its generation config adds <|im_end|>, the token a reply ends with)."""
    root = Path(path)  # read_hf_config(path) gave `hf`: a checked checkpoint directory
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


# -- the checkpoint's files, their tensors and the expected layout --------------------------------------


def _plain_name(name: object) -> bool:
    """A file name in the checkpoint directory itself (no directory part, no way out of it)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and not {"/", "\\", "\x00"} & set(name)
            and not os.path.isabs(name))


def _index_weight_map(root: Path, scope: _Scope) -> dict[str, str]:
    """tensor name -> shard file name, from the index; every shard a plain file name beside it."""
    index = root / INDEX_FILE
    weight_map = _read_json(index, scope, MAX_INDEX_BYTES).get("weight_map")
    bad = next(((t, n) for t, n in weight_map.items() if not _plain_name(n)), None) \
        if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or bad is not None:
        shown = f"gives {short_repr(bad[0])} the shard {short_repr(bad[1])}" if bad else f"= {short_repr(weight_map)}"
        raise CheckpointError(f"{index}: weight_map {shown}; it must be a non-empty object of tensor name -> shard, "
                              "a shard a plain file name in the checkpoint directory")
    return weight_map


def _files_and_map(root: Path) -> tuple[list[Path], dict[str, str] | None, _Scope]:
    if os.path.isfile(root):  # one file: it must resolve inside its own directory, like a directory's files
        return [root], None, _Scope.of_directory(root.parent)
    scope = _Scope.of_directory(_checkpoint_directory(root))
    if os.path.lexists(root / SINGLE_FILE):
        # transformers' order: the single file, even beside an index (a sharded save the single
        # file was copied over); reading the shards instead would load other weights.
        return [root / SINGLE_FILE], None, scope
    if os.path.lexists(root / INDEX_FILE):
        weight_map = _index_weight_map(root, scope)
        return [root / name for name in sorted(set(weight_map.values()))], weight_map, scope
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files (and no {INDEX_FILE})")
    return files, None, scope


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: a single file, the shards an index names, or all in a
    directory; each checked to be a regular file resolving inside the checkpoint (see `_Scope`)."""
    files, _, scope = _files_and_map(_checkpoint_path(path))
    for file in files:
        _open_regular(file, scope).close()
    return files


def _open_safetensors(file: Path, scope: _Scope) -> Any:
    """`safe_open` of a checkpoint file, which the library refuses when damaged."""
    with _open_regular(file, scope) as f:
        # The library opens a path: the kernel's name of the file checked above (Linux), so it
        # reads that very file, not whatever the path has been made to name since.
        source = f"/proc/self/fd/{f.fileno()}"
        try:
            return safe_open(source if os.path.exists(source) else str(file), framework="pt", device="cpu")
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: not a valid safetensors file ({str(exc)[:300]}); "
                                  "download or save it again") from None


def _open_shards(files: list[Path], weight_map: dict[str, str] | None, scope: _Scope) -> dict[Path, Any]:
    """Every file's `safe_open` handle; each tensor must be in exactly one file, the one the index names."""
    shards = {file: _open_safetensors(file, scope) for file in files}
    holders: dict[str, list[str]] = {}
    for file, handle in shards.items():
        for name in handle.keys():
            holders.setdefault(name, []).append(file.name)
    wrong = [name for name, held in holders.items()
             if len(held) > 1 or (weight_map is not None and weight_map.get(name) != held[0])]
    wrong += [name for name in weight_map or {} if name not in holders]
    if wrong:
        name = wrong[0]
        indexed = f", not where {INDEX_FILE}'s weight_map puts it ({short_repr(weight_map.get(name))})" \
            if weight_map is not None else ""
        raise CheckpointError(f"{files[0].parent}: tensor {short_repr(name)} is in "
                              f"{', '.join(holders.get(name, [])) or 'no shard'}{indexed}; every tensor must be in "
                              f"exactly one shard ({len(wrong)} such)")
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


def expected_layout(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every parameter `LlamaDecoder(config)` has, computed arithmetically (no
    model built)."""
    h, v = config.hidden_size, config.vocab_size
    layout: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(config.num_layers):
        layout |= {f"model.layers.{layer}.{name}": shape for name, shape in _layer_layout(config).items()}
    layout["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        layout["lm_head.weight"] = (v, h)
    return layout


def _layout_problems(config: ModelConfig, shards: dict[Path, Any]) -> list[str]:
    """Every parameter present with its shape and a floating dtype, no unexpected tensor: what is not."""
    tied = config.tie_word_embeddings
    present = {name: file for file, handle in shards.items() for name in handle.keys() if not _ignored(name, tied)}
    needed = config.num_layers * len(_layer_layout(config)) + 2 + (not tied)
    if needed > len(present):  # refused before a layout of that many names is even listed
        return [f"num_hidden_layers = {config.num_layers} needs {needed} tensors, the checkpoint holds {len(present)}"]
    layout, problems = expected_layout(config), []
    for name, file in present.items():
        tensor = shards[file].get_slice(name)
        shape, dtype, expected = tuple(tensor.get_shape()), tensor.get_dtype(), layout.get(name)
        if expected is None:
            problems.append(f"{file.name}: unexpected tensor {short_repr(name)}")
        elif shape != expected:
            problems.append(f"{file.name}: tensor {name!r} has shape {shape}, expected {expected}")
        elif dtype not in _FLOAT_DTYPES:
            problems.append(f"{file.name}: tensor {name!r} has dtype {dtype}, expected a floating dtype")
    names = ", ".join(file.name for file in shards)
    return problems + [f"missing weight {name!r} (not in {names})" for name in layout if name not in present]


class _Checked(NamedTuple):
    """A checkpoint whose config, files and tensors passed every check before allocation."""

    hf: dict[str, Any]
    shards: dict[Path, Any]
    config: ModelConfig
    rank: RankShard | None


def _checked(root: Path, tensor_parallel: tuple[int, int] | None = None) -> _Checked:
    where = str(root / CONFIG_FILE)
    hf = read_hf_config(root)
    shards = _open_shards(*_files_and_map(root))
    has_lm_head = any("lm_head.weight" in handle.keys() for handle in shards.values())
    config = config_from_hf(hf, where, has_lm_head)
    problems, rank = _layout_problems(config, shards), None
    if tensor_parallel is not None and tensor_parallel[0] > 1:
        try:
            rank = RankShard(TensorParallelPlan(config, tensor_parallel[0]), tensor_parallel[1])
        except ValueError as exc:  # the model cannot be split that way: the checkpoint's sizes
            problems.append(str(exc))
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise CheckpointError(f"{root}: checkpoint refused, nothing loaded: " + "; ".join(shown))
    return _Checked(hf, shards, config, rank)


def check_checkpoint(path: str | Path, tensor_parallel: int = 1) -> ModelConfig:
    """Everything `load_checkpoint` checks before it allocates (config.json, the files, every
    tensor's name, shape and dtype against the model's layout, a split over `tensor_parallel`
    ranks), without reading a weight: the model's config, or the CheckpointError a load would
    raise first. For a caller that starts other processes to load it (tensor-parallel ranks)
    and wants bad input refused in its own."""
    return _checked(_checkpoint_path(path), (tensor_parallel, 0)).config


def _free_bytes(device: torch.device) -> int | None:
    """The free memory of `device` as its platform observes it; None where no platform here serves it."""
    platform = current_platform()
    if platform.device_type != device.type:
        if device.type != "cpu":
            return None
        platform = get_platform("cpu")
    return platform.memory_info(device.index).free


def _read_tensor(handle: Any, name: str, part: ShardSlice | None) -> torch.Tensor:
    """Tensor `name` of an open file (a view of its host mapping); with `part`, only that slice
    (a tensor-parallel rank's), so a rank never reads more of the tensor than its slice."""
    if part is None:
        return handle.get_tensor(name)
    return handle.get_slice(name)[(slice(None),) * part.dim + (slice(part.start, part.stop),)]


def load_checkpoint(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str | None = None, *,
    tensor_parallel: tuple[int, int] | None = None, check_finite: bool = True,
) -> tuple[LlamaDecoder, LoadReport]:
    """A Hugging Face checkpoint directory as an eval-mode `LlamaDecoder` on `device` (default: host).

    `dtype` overrides the config's `dtype`/`torch_dtype`. The KV cache is not allocated
    (the engine sizes and owns it). Everything is checked from `config.json` and the
    safetensors headers before the model is built or anything allocated, and the weights
    must fit in the free memory of `device` (CheckpointTooLarge, a MemoryError, names both).

    `tensor_parallel=(world_size, rank)`: the decoder of that rank's shard (see
    `LlamaDecoder`), reading only its slices of the sharded tensors (`bytes_read` says how
    much). Tensors are checked against the whole model's shapes as without it; a model that
    cannot be split over `world_size` ranks is refused (CheckpointError naming the sizes
    that work) before anything is allocated.

    `check_finite` (default on): refuse a tensor holding NaN or infinite values once cast to
    `dtype` (a float32 weight past float16's range becomes inf), naming its file and name; one
    device sync for the whole load. `check_finite=False` skips it.
    """
    start = time.perf_counter()
    check_bool("check_finite", check_finite)
    if tensor_parallel is not None and not (
            isinstance(tensor_parallel, tuple) and len(tensor_parallel) == 2
            and all(type(v) is int for v in tensor_parallel) and 0 <= tensor_parallel[1] < tensor_parallel[0]):
        raise ValueError(f"tensor_parallel = {short_repr(tensor_parallel)} must be (world_size, rank) with "
                         "0 <= rank < world_size, e.g. (2, 0)")
    if dtype is not None and dtype not in _TORCH_DTYPES.values():
        raise ValueError(f"dtype = {short_repr(dtype)} is not a dtype the model runs in; pass one of "
                         f"{', '.join(str(d) for d in _TORCH_DTYPES.values())}, or None for the checkpoint's own")
    try:  # a device this process cannot use (or meta, which holds no data) fails here, before any read
        target = torch.device("cpu" if device is None else device)  # type: ignore[arg-type]
        torch.zeros(1, device=target).tolist()
    except (RuntimeError, TypeError, NotImplementedError, AssertionError) as exc:
        raise ValueError(f"device = {short_repr(device)} cannot be used here ({' '.join(str(exc).split())[:200]}); "
                         "pass one this process has, e.g. 'cpu' or platform.device()") from None
    root = _checkpoint_path(path)
    hf, shards, config, rank = _checked(root, tensor_parallel)  # before the model is built or the device sees a byte
    dtype = dtype or checkpoint_dtype(hf, str(root / CONFIG_FILE))
    with torch.device("meta"):
        model = LlamaDecoder(config, rank).to(dtype)
    needed, free = sum(p.numel() for p in model.parameters()) * dtype.itemsize, _free_bytes(target)
    if free is not None and needed > free:
        raise CheckpointTooLarge(
            f"{root}: the weights need {needed:,} bytes ({needed / 2**30:.2f} GiB) in {dtype} on {target}, which has "
            f"{free:,} bytes ({free / 2**30:.2f} GiB) free; refused unread: free memory there, load it in a smaller "
            "dtype, or split it over ranks (tensor_parallel)")
    model = model.materialize(target)  # the one device allocation
    params, tied = dict(model.named_parameters()), config.tie_word_embeddings
    finite: list[tuple[Path, str, torch.Tensor]] = []  # each tensor's verdict, read back once at the end
    bytes_read = tensors = 0
    with torch.no_grad():
        for file, handle in shards.items():
            for name in handle.keys():
                if _ignored(name, tied):
                    continue
                part = rank.slice_of(name) if rank is not None else None
                tensor, param = _read_tensor(handle, name, part), params[name]
                into: torch.Tensor = param
                if part is not None and part.count < part.size:  # the vocabulary's padding rows
                    param.narrow(part.dim, part.count, part.size - part.count).zero_()
                    into = param.narrow(part.dim, 0, part.count)
                into.copy_(tensor)
                if check_finite:
                    finite.append((file, name, param.isfinite().all()))
                bytes_read += tensor.numel() * tensor.element_size()
                tensors += 1
    verdicts = torch.stack([verdict for *_, verdict in finite]).tolist() if finite else []
    if not all(verdicts):
        file, name, _ = finite[verdicts.index(False)]
        raise CheckpointError(f"{file}: tensor {name!r} holds NaN or infinite values once in {dtype}; fix the "
                              "checkpoint, or load it in a wider dtype")
    model.process_weights()
    model.eval()
    report = LoadReport(path=str(root), architecture=str(hf["architectures"][0]), files=tuple(map(str, shards)),
                        tensors=tensors, bytes_read=bytes_read, seconds=time.perf_counter() - start, dtype=dtype,
                        device=str(target))
    return model, report


def iter_checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, host tensor) pairs of a checkpoint directory or a single safetensors file, file by file.

    Skips the names `load_checkpoint` ignores (rotary frequencies; a tied `lm_head.weight`
    when a `config.json` beside the weights says so), so the pairs feed a weight update as they are.
    Every file is opened and checked before the first pair is yielded.
    """
    root = _checkpoint_path(path)
    config_dir = root if root.is_dir() else root.parent
    tied = False
    if os.path.lexists(config_dir / CONFIG_FILE):
        tied = _setting(read_hf_config(config_dir), "tie_word_embeddings", False, str(config_dir / CONFIG_FILE))
    for handle in _open_shards(*_files_and_map(root)).values():
        for name in handle.keys():
            if not _ignored(name, tied):
                yield name, handle.get_tensor(name)
