"""Load Hugging Face-format checkpoints (`config.json` + `*.safetensors`) into `LlamaDecoder`.

Supported architectures: `LlamaForCausalLM` (incl. `rope_scaling` type `llama3`),
`MistralForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM`. Every tensor is checked
against the model's layout from the safetensors headers alone *before* anything is
allocated on the device; then the model is built on the meta device, allocated once on
the target device, and filled shard by shard (each tensor read on the host, cast, and
copied into place), so the model is never materialised twice in device memory.

Tensor names: HF names map one to one onto the model's parameters. Two kinds are
ignored as harmless: `*.rotary_emb.inv_freq` (older checkpoints store the rotary
frequencies, which the model derives from the config) and `lm_head.weight` when the
config ties it to the embedding. Any other unexpected name is refused.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchhal.core.model.decoder import Llama3RopeScaling, LlamaDecoder, ModelConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


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


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """`config.json` of a checkpoint directory, as a dict."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} not found: a Hugging Face checkpoint directory needs config.json")
    with config_path.open() as f:
        loaded: dict[str, Any] = json.load(f)
    return loaded


def _rope(hf: dict[str, Any], where: str) -> tuple[float, Llama3RopeScaling | None]:
    # transformers 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
    params = hf.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if float(scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise CheckpointError(f"{where}: partial_rotary_factor is not supported (only full rotary)")
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(f"{where}: rope type {rope_type!r} is not supported; supported: default, llama3")
    return theta, Llama3RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position=int(
            scaling.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        ),
    )


def _sliding_window(hf: dict[str, Any], architecture: str, where: str) -> int | None:
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if architecture == "MistralForCausalLM" and not layer_types:
        return int(window) if window else None
    if layer_types:
        sliding = [kind != "full_attention" for kind in layer_types]
        if all(sliding) and window:
            return int(window)
        if any(sliding):
            raise CheckpointError(
                f"{where}: layers mixing sliding-window and full attention are not supported (layer_types)"
            )
        return None
    if hf.get("use_sliding_window") and window:
        raise CheckpointError(f"{where}: use_sliding_window with max_window_layers is not supported")
    return None


def config_from_hf(hf: dict[str, Any], where: str = "config.json", has_lm_head: bool = True) -> ModelConfig:
    """The `ModelConfig` of an HF config dict; refuses what the decoder would compute differently."""
    architectures = hf.get("architectures") or []
    architecture = architectures[0] if architectures else None
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{where}: architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported; supported: silu")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{where}: mlp_bias is not supported")
    theta, scaling = _rope(hf, where)
    qwen2 = architecture == "Qwen2ForCausalLM"
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=int(hf["num_attention_heads"]),
        intermediate_size=int(hf["intermediate_size"]),
        max_position=int(hf.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        num_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        head_dim=int(hf.get("head_dim") or 0),
        attention_bias=qwen2 or bias,  # Qwen2 always has q/k/v biases (and none on o_proj)
        o_proj_bias=bias and not qwen2,
        qk_norm=architecture == "Qwen3ForCausalLM",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", not has_lm_head)),
        rope_scaling=scaling,
        sliding_window=_sliding_window(hf, architecture, where),
    )


def eos_token_ids(hf: dict[str, Any], where: str = "config.json") -> tuple[int, ...]:
    """Every end-of-sequence id of a config (Llama 3 lists several); () when it names none."""
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or t < 0]
    if bad:
        raise CheckpointError(f"{where}: eos_token_id {eos!r} must be a token id or a list of token ids (ints >= 0)")
    return tuple(ids)


def checkpoint_dtype(hf: dict[str, Any]) -> torch.dtype:
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if name not in _TORCH_DTYPES:
        raise CheckpointError(f"config.json: dtype {name!r} is not supported; supported: {', '.join(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[name]


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: a single file, the shards an index names, or all in a directory."""
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint file or directory")
    index = root / INDEX_FILE
    if index.is_file():
        with index.open() as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files: dict[str, str] = {}
        for tensor, shard in weight_map.items():
            files.setdefault(shard, tensor)
        missing = [f"{shard} (holds {tensor!r})" for shard, tensor in files.items() if not (root / shard).is_file()]
        if missing:
            raise CheckpointError(f"{index}: missing shard(s): {', '.join(missing)}")
        return [root / shard for shard in sorted(files)]
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{root}: no *.safetensors files (and no {INDEX_FILE})")
    return found


def _safe_open(file: Path) -> Any:
    try:
        from safetensors import safe_open
    except ImportError as exc:  # pragma: no cover - safetensors is a dependency of the hf and test extras
        raise RuntimeError("loading checkpoints needs safetensors: pip install safetensors") from exc
    return safe_open(str(file), framework="pt", device="cpu")


def _ignored(name: str, tied: bool) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


def _headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """name -> (file, shape, safetensors dtype), from the headers only."""
    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for file in files:
        with _safe_open(file) as f:
            for name in f.keys():
                if name in found:
                    raise CheckpointError(f"{file}: tensor {name!r} also in {found[name][0]}")
                piece = f.get_slice(name)
                found[name] = (file, tuple(piece.get_shape()), piece.get_dtype())
    return found


def _check(model: LlamaDecoder, headers: dict[str, tuple[Path, tuple[int, ...], str]], files: list[Path]) -> None:
    """Every parameter present with its shape and a floating dtype; no unexpected tensor. All problems at once."""
    params = dict(model.named_parameters())
    tied = model.config.tie_word_embeddings
    problems: list[str] = []
    for name, (file, shape, dtype) in headers.items():
        if _ignored(name, tied):
            continue
        param = params.get(name)
        if param is None:
            problems.append(f"{file.name}: unexpected tensor {name!r}")
        elif shape != tuple(param.shape):
            problems.append(f"{file.name}: tensor {name!r} has shape {shape}, expected {tuple(param.shape)}")
        elif dtype not in _FLOAT_DTYPES:
            problems.append(f"{file.name}: tensor {name!r} has dtype {dtype}, expected a floating dtype")
    names = ", ".join(f.name for f in files)
    problems += [f"missing weight {name!r} (not in {names})" for name in params if name not in headers]
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise CheckpointError(f"{files[0].parent}: checkpoint refused, nothing loaded: " + "; ".join(shown))


def _allocate(model: LlamaDecoder, device: torch.device) -> LlamaDecoder:
    """Uninitialised storage on `device` for a meta-built model: the one device allocation.
    (`Module.to_empty` would do it through `empty_like`, whose meta path imports the compiler stack.)"""
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.tie_weights()  # the move made new parameters: share the embedding again
    return model


def load_checkpoint(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> tuple[LlamaDecoder, LoadReport]:
    """A Hugging Face checkpoint directory as an eval-mode `LlamaDecoder` on `device` (default: host).

    `dtype` overrides the config's `dtype`/`torch_dtype`. The KV cache is not allocated
    (the engine sizes and owns it).
    """
    start = time.perf_counter()
    root = Path(path)
    hf = read_hf_config(root)
    files = checkpoint_files(root)
    headers = _headers(files)
    config = config_from_hf(hf, str(root / "config.json"), has_lm_head="lm_head.weight" in headers)
    dtype = dtype or checkpoint_dtype(hf)
    target = torch.device(device) if device is not None else torch.device("cpu")
    with torch.device("meta"):
        model = LlamaDecoder(config).to(dtype)
    _check(model, headers, files)  # before the device sees a byte
    model = _allocate(model, target)
    params = dict(model.named_parameters())
    bytes_read = tensors = 0
    with torch.no_grad():
        for file in files:
            with _safe_open(file) as f:
                for name in f.keys():
                    if _ignored(name, config.tie_word_embeddings):
                        continue
                    tensor = f.get_tensor(name)
                    params[name].copy_(tensor)
                    bytes_read += tensor.numel() * tensor.element_size()
                    tensors += 1
    model.process_weights()
    model.eval()
    report = LoadReport(
        path=str(root),
        architecture=hf["architectures"][0],
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
    """
    root = Path(path)
    config_dir = root if root.is_dir() else root.parent
    tied = bool((config_dir / "config.json").is_file() and read_hf_config(config_dir).get("tie_word_embeddings"))
    for file in checkpoint_files(root):
        with _safe_open(file) as f:
            for name in f.keys():
                if not _ignored(name, tied):
                    yield name, f.get_tensor(name)
