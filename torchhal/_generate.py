"""`torchhal generate`: greedy generation from a Hugging Face checkpoint through the engine."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from torchhal.core.engine import DecodeGraphConfig, GenerationEngine, ModelRunner
    from torchhal.core.model import LlamaDecoder

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
DTYPES = ("float32", "bfloat16", "float16")


def make_engine(
    model: LlamaDecoder,
    dtype: torch.dtype,
    max_kv_slots: int = 1 << 16,
    eos_tokens: tuple[int, ...] = (),
    runner_factory: Callable[[GenerationEngine], ModelRunner] | None = None,
    decode_graphs: DecodeGraphConfig | None = None,
) -> GenerationEngine:
    """A `GenerationEngine` serving `model`; load it in `dtype` on the platform's device, so the
    engine's move is a no-op (no second copy of the weights)."""
    from torchhal.core.engine import EngineConfig, GenerationEngine

    config = EngineConfig(dtype=dtype, max_kv_slots=max_kv_slots, eos_tokens=eos_tokens, decode_graphs=decode_graphs)
    return GenerationEngine(config, model=model, runner_factory=runner_factory)


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


def eos_tokens_of(hf: dict[str, Any]) -> tuple[int, ...]:
    """Every end-of-sequence id of a config.json (Llama 3 lists several)."""
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(t) for t in eos) if isinstance(eos, list) else (int(eos),)


def generate_from_checkpoint(
    path: str | Path,
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    max_new_tokens: int = 32,
    dtype_name: str | None = None,
    graphs: bool = False,
) -> dict[str, Any]:
    """Load, generate greedily on the current platform, and report what `torchhal generate` prints.

    `graphs`: full-graph decode (one graph replay per decode step) where the platform can
    capture graphs; elsewhere every step runs eagerly and the report says why."""
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
    context = len(prompt_ids) + max_new_tokens
    decode_graphs = None
    if graphs:
        from torchhal.core.engine import DecodeGraphConfig

        decode_graphs = DecodeGraphConfig(batch_buckets=(1,), context_buckets=(context,))  # one graph: this run
    engine = make_engine(model, report.dtype, max_kv_slots=context + 1, eos_tokens=eos_tokens_of(read_hf_config(root)),
                         decode_graphs=decode_graphs)
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
        "decode_graphs": _graph_report(engine) if graphs else None,
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


def cmd_generate(args: argparse.Namespace) -> int:
    from torchhal.core.model.checkpoint import CheckpointError

    try:
        ids = [int(t) for t in args.prompt_ids.split(",")] if args.prompt_ids is not None else None
    except ValueError:
        print(f"torchhal: --prompt-ids {args.prompt_ids!r} must be comma-separated integers, like 1,2,3",
              file=sys.stderr)
        return 2
    try:
        out = generate_from_checkpoint(args.model, args.prompt, ids, args.max_new_tokens, args.dtype, args.graphs)
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
    graphs = out["decode_graphs"]
    if graphs is not None:
        print(f"full-graph decode: {graphs['replays']} replay(s)" if graphs["unavailable"] is None
              else f"full-graph decode unavailable ({graphs['unavailable']}); ran eagerly")
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
    gen.add_argument("--graphs", action="store_true",
                     help="full-graph decode (one graph replay per decode step) where the platform captures graphs")
    gen.add_argument("--json", action="store_true", help="machine-readable output")
    gen.set_defaults(func=cmd_generate)
