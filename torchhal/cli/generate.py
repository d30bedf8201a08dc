"""`torchhal generate`: greedy generation from a Hugging Face checkpoint through the engine."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchhal.cli.output import emit, refuse

if TYPE_CHECKING:
    from torchhal.core.engine import GenerationEngine

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
DTYPES = ("float32", "bfloat16", "float16")


class GenerateError(ValueError):
    """A request `torchhal generate` refuses before loading anything; the message says the fix."""


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


def parse_prompt_ids(text: str) -> list[int]:
    """`1,2,3` as token ids; GenerateError naming the bad item."""
    ids = []
    for item in text.split(","):
        try:
            ids.append(int(item.strip()))
        except ValueError:
            raise GenerateError(f"--prompt-ids {text!r} must be comma-separated integers, like 1,2,3 "
                                f"({item.strip()!r} is not one)") from None
    return ids


def generate_from_checkpoint(
    path: str | Path,
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    max_new_tokens: int = 32,
    dtype_name: str | None = None,
    graphs: bool = False,
) -> dict[str, Any]:
    """Load, generate greedily on the current platform, and report what `torchhal generate` prints.

    The request (prompt, length, dtype) is checked against the checkpoint's config before a
    weight is read or a KV cache sized. `graphs`: full-graph decode (one graph replay per
    decode step) where the platform can capture graphs; elsewhere every step runs eagerly
    and the report says why."""
    import torch

    from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine
    from torchhal.core.engine.requests import check_prompt
    from torchhal.core.model.checkpoint import checkpoint_dtype, config_from_hf, read_hf_config
    from torchhal.platforms.selection import current_platform

    root = Path(path)
    if dtype_name is not None and dtype_name not in DTYPES:
        raise GenerateError(f"--dtype {dtype_name!r} is not one of {', '.join(DTYPES)}")
    hf = read_hf_config(root)
    model_config = config_from_hf(hf, str(root / "config.json"))
    tokenizer = None
    if prompt is not None:
        tokenizer = load_tokenizer(root)
        if tokenizer is None:
            raise GenerateError(
                f"{root} ships no tokenizer, or transformers is missing (pip install 'torchhal[hf]'); "
                "give --prompt-ids instead of --prompt"
            )
        prompt_ids = list(tokenizer(prompt)["input_ids"])
    if not prompt_ids:
        raise GenerateError("empty prompt: give --prompt TEXT or --prompt-ids 1,2,3")
    try:
        check_prompt(prompt_ids, max_new_tokens, model_config.vocab_size, model_config.max_position)
    except (TypeError, ValueError) as exc:
        raise GenerateError(f"{exc} (the model's config.json)") from None
    context = len(prompt_ids) + max_new_tokens
    platform = current_platform()
    decode_graphs = DecodeGraphConfig(batch_buckets=(1,), context_buckets=(context,)) if graphs else None
    dtype = getattr(torch, dtype_name) if dtype_name else checkpoint_dtype(hf)
    # Whole blocks for the context (a block's worth more covers the last partial one).
    config = EngineConfig(dtype=dtype, max_kv_slots=context + EngineConfig.kv_block_size, decode_graphs=decode_graphs)
    engine = GenerationEngine.from_checkpoint(root, config, platform=platform)
    report = engine.checkpoint
    assert report is not None
    platform.synchronize(engine.device_index)
    start = time.perf_counter()
    result = engine.generate([prompt_ids], max_new_tokens)[0]
    platform.synchronize(engine.device_index)
    seconds = time.perf_counter() - start
    if result.error:
        raise GenerateError(result.error)
    output = list(result.output)
    eos = set(engine.config.eos_tokens)
    stopped_at_eos = len(output) < max_new_tokens and bool(output) and output[-1] in eos
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
        "max_new_tokens": max_new_tokens,
        "new_tokens": len(output),
        "stop": "eos" if stopped_at_eos else "length",
        "seconds": seconds,
        "tokens_per_s": len(output) / seconds if seconds > 0 else None,
        "decode_graphs": _graph_report(engine) if graphs else None,
        "attention": {"backend": engine.attention.name, "why": engine.attention.why},
    }


def _graph_report(engine: GenerationEngine) -> dict[str, Any]:
    runner = engine.decode_runner
    assert runner is not None
    capture = runner.report
    return {
        "replays": runner.steps,
        "unavailable": runner.unsupported,
        "capture_seconds": capture.seconds if capture is not None else None,
    }


def format_generation(out: dict[str, Any]) -> str:
    """The text `torchhal generate` prints."""
    load = out["load"]
    lines = [
        f"{out['architecture']} from {out['model']}: {load['bytes_read'] / 2**20:.1f} MiB in {load['files']} "
        f"file(s), loaded in {load['seconds']:.2f} s onto {out['device']} ({out['dtype']})",
        out["text"] if out["text"] is not None else " ".join(map(str, out["output_ids"])),
        f"{out['new_tokens']} tokens in {out['seconds']:.2f} s: {out['tokens_per_s'] or 0:.1f} tokens/s",
        f"attention: {out['attention']['backend']} ({out['attention']['why']})",
    ]
    if out["stop"] == "eos":
        lines.append(f"stopped at end-of-sequence token {out['output_ids'][-1]} after {out['new_tokens']} of "
                     f"{out['max_new_tokens']} tokens")
    graphs = out["decode_graphs"]
    if graphs is not None:
        lines.append(f"full-graph decode: {graphs['replays']} replay(s)" if graphs["unavailable"] is None
                     else f"full-graph decode unavailable ({graphs['unavailable']}); ran eagerly")
    return "\n".join(lines)


def cmd_generate(args: argparse.Namespace) -> int:
    from torchhal.core.model.checkpoint import CheckpointError

    try:
        ids = parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
        out = generate_from_checkpoint(args.model, args.prompt, ids, args.max_new_tokens, args.dtype, args.graphs)
    except (CheckpointError, GenerateError) as exc:
        return refuse("generate", str(exc))
    emit(json.dumps(out, indent=2) if args.json else format_generation(out))
    return 0


def add_command(sub: Any) -> None:
    gen = sub.add_parser("generate", help="greedy generation from a Hugging Face checkpoint directory")
    gen.add_argument("--model", required=True, help="checkpoint directory (config.json + *.safetensors)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer: pip install 'torchhal[hf]')")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated: 1,2,3")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    gen.add_argument("--dtype", choices=DTYPES, help="override the checkpoint's dtype")
    gen.add_argument("--graphs", action="store_true",
                     help="full-graph decode (one graph replay per decode step) where the platform captures graphs")
    gen.add_argument("--json", action="store_true", help="machine-readable output")
    gen.set_defaults(func=cmd_generate)
