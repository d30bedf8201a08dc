"""`torchhal generate`: greedy generation from a Hugging Face checkpoint through the engine."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from torchhal.core.engine import GenerationEngine, ModelRunner
    from torchhal.core.model import LlamaDecoder

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
DTYPES = ("float32", "bfloat16", "float16")


def make_engine(
    model: LlamaDecoder,
    dtype: torch.dtype,
    max_kv_slots: int = 1 << 16,
    eos_token: int | None = None,
    runner_factory: Callable[[GenerationEngine], ModelRunner] | None = None,
) -> GenerationEngine:
    """A `GenerationEngine` serving `model` (already on the platform's device) in `dtype`."""
    from torchhal.core.engine import EagerRunner, EngineConfig, GenerationEngine

    if "model" in inspect.signature(GenerationEngine).parameters:  # the engine takes its model from outside
        config = EngineConfig(dtype=dtype, max_kv_slots=max_kv_slots, eos_token=eos_token)
        return GenerationEngine(config, model=model, runner_factory=runner_factory)  # type: ignore[call-arg]
    # Transitional, until the engine takes the model: it builds a seeded model of the same
    # shape, which is swapped for the loaded one (its KV pool is kept, it sizes by config).
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert "model" in fields, "EngineConfig without a model config needs GenerationEngine(model=...)"
    engine = GenerationEngine(EngineConfig(model=model.config, dtype=dtype, max_kv_slots=max_kv_slots,
                                           eos_token=eos_token))
    kv = engine.model.kv
    engine.model = model.to(engine.device, dtype).eval()  # type: ignore[assignment]
    engine.model.kv = kv
    engine.runner = runner_factory(engine) if runner_factory else EagerRunner(engine.model)
    return engine


def load_tokenizer(path: Path) -> Any | None:
    """The checkpoint's tokenizer through transformers' AutoTokenizer, or None when it ships none
    or transformers is not installed (the `hf` extra)."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    return AutoTokenizer.from_pretrained(str(path))


def _eos(hf: dict[str, Any]) -> int | None:
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):  # the engine stops on one token; the first is the main one
        return int(eos[0]) if eos else None
    return int(eos) if eos is not None else None


def generate_from_checkpoint(
    path: str | Path,
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    max_new_tokens: int = 32,
    dtype_name: str | None = None,
) -> dict[str, Any]:
    """Load, generate greedily on the current platform, and report what `torchhal generate` prints."""
    import torch

    from torchhal.core.model.checkpoint import CheckpointError, load_checkpoint, read_hf_config
    from torchhal.platforms.selection import current_platform

    root = Path(path)
    tokenizer = None
    if prompt is not None:
        tokenizer = load_tokenizer(root)
        if tokenizer is None:
            raise CheckpointError(
                f"{root} ships no tokenizer, or transformers is missing (pip install 'torchhal[hf]'); "
                "give --prompt-ids instead of --prompt"
            )
        prompt_ids = list(tokenizer(prompt)["input_ids"])
    if not prompt_ids:
        raise ValueError("empty prompt: give --prompt TEXT or --prompt-ids 1,2,3")
    platform = current_platform()
    device = platform.device(platform.current_device())
    dtype = getattr(torch, dtype_name) if dtype_name else None
    model, report = load_checkpoint(root, dtype=dtype, device=device)
    engine = make_engine(model, report.dtype, max_kv_slots=len(prompt_ids) + max_new_tokens + 1,
                         eos_token=_eos(read_hf_config(root)))
    platform.synchronize(engine.device_index)
    start = time.perf_counter()
    result = engine.generate([prompt_ids], max_new_tokens)[0]
    platform.synchronize(engine.device_index)
    seconds = time.perf_counter() - start
    if result.error:
        raise ValueError(result.error)
    output = list(result.output)
    return {
        "model": str(root),
        "architecture": report.architecture,
        "platform": platform.name,
        "device": str(engine.device),
        "dtype": str(report.dtype).removeprefix("torch."),
        "load": {"seconds": report.seconds, "bytes_read": report.bytes_read, "files": len(report.files),
                 "tensors": report.tensors},
        "prompt_ids": prompt_ids,
        "output_ids": output,
        "text": tokenizer.decode(output) if tokenizer is not None else None,
        "new_tokens": len(output),
        "seconds": seconds,
        "tokens_per_s": len(output) / seconds if seconds > 0 else None,
    }


def cmd_generate(args: argparse.Namespace) -> int:
    from torchhal.core.model.checkpoint import CheckpointError

    try:
        ids = [int(t) for t in args.prompt_ids.split(",")] if args.prompt_ids is not None else None
    except ValueError:
        print(f"torchhal: --prompt-ids {args.prompt_ids!r} must be comma-separated integers, like 1,2,3",
              file=sys.stderr)
        return 2
    try:
        out = generate_from_checkpoint(args.model, args.prompt, ids, args.max_new_tokens, args.dtype)
    except (CheckpointError, ValueError) as exc:
        print(f"torchhal: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    load = out["load"]
    print(f"{out['architecture']} from {out['model']}: {load['bytes_read'] / 2**20:.1f} MiB in {load['files']} "
          f"file(s), loaded in {load['seconds']:.2f} s onto {out['device']} ({out['dtype']})")
    print(out["text"] if out["text"] is not None else " ".join(map(str, out["output_ids"])))
    print(f"{out['new_tokens']} tokens in {out['seconds']:.2f} s: {out['tokens_per_s'] or 0:.1f} tokens/s")
    return 0


def add_generate_command(sub: Any) -> None:
    """Register `torchhal generate` on the CLI's subparsers."""
    gen = sub.add_parser("generate", help="greedy generation from a Hugging Face checkpoint directory")
    gen.add_argument("--model", required=True, help="checkpoint directory (config.json + *.safetensors)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer and transformers)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated: 1,2,3")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    gen.add_argument("--dtype", choices=DTYPES, help="override the checkpoint's dtype")
    gen.add_argument("--json", action="store_true", help="machine-readable output")
    gen.set_defaults(func=cmd_generate)
