"""`torchhal generate`: greedy generation from a Hugging Face checkpoint through the engine."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchhal.cli.output import emit, refuse
from torchhal.distributed import LaunchError, launch

if TYPE_CHECKING:
    from torchhal.core.engine import GenerationEngine
    from torchhal.core.model.config import ModelConfig
    from torchhal.distributed import DeviceGroup
    from torchhal.platforms import Platform

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
DTYPES = ("float32", "bfloat16", "float16")


#: Exit code of a run that started and failed (a rank died, the ranks disagree).
FAILURE_EXIT = 1


#: The share of the free memory (after the weights) this one-request command gives its KV pool.
KV_FRACTION = 0.9


class GenerateError(ValueError):
    """A request `torchhal generate` refuses (before loading anything, or when the device has no
    room left for its KV cache); the message says the fix."""


class RanksDisagree(RuntimeError):
    """Tensor-parallel ranks generated different tokens: an engine bug, never settled by picking one."""


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request: all a rank needs to load the checkpoint and generate (picklable)."""

    root: Path
    prompt_ids: list[int]
    max_new_tokens: int
    dtype_name: str  # a torch dtype's name: --dtype, else the checkpoint's
    graphs: bool
    tensor_parallel: int = 1


def load_tokenizer(path: Path) -> Any | None:
    """The checkpoint's tokenizer through transformers' AutoTokenizer, or None when it ships none
    or transformers is not installed (the `hf` extra); GenerateError naming the files when they
    do not load."""
    files = [path / name for name in TOKENIZER_FILES if (path / name).is_file()]
    if not files:
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # transformers raises whatever its parsers do (JSON, tokenizers, sentencepiece)
        reason = " ".join(str(exc).split())
        reason = reason if len(reason) <= 400 else reason[:400] + "..."
        raise GenerateError(f"cannot load the tokenizer from {', '.join(map(str, files))}: "
                            f"{type(exc).__name__}: {reason}; fix the file, or give --prompt-ids instead of --prompt"
                            ) from None


def parse_prompt_ids(text: str) -> list[int]:
    """`1,2,3` (spaces after the commas allowed) as token ids; GenerateError naming the bad
    item. Read as the other numeric flags are (`parse_decimal`): "1_0" is no token id."""
    from torchhal.values import parse_decimal, short_repr

    ids = []
    for item in text.split(","):
        token = parse_decimal(item.strip())
        if token is None:
            raise GenerateError(f"--prompt-ids {short_repr(text)} must be comma-separated integers, like "
                                f"1,2,3 ({short_repr(item.strip())} is not one)")
        ids.append(token)
    return ids


def parse_positive(flag: str, text: str) -> int:
    """A numeric flag's text as a positive int, read by `parse_decimal`; GenerateError naming it otherwise."""
    from torchhal.values import parse_decimal, short_repr

    value = parse_decimal(text)
    if value is None or value < 1:
        # as typed where that reads unambiguously on one line, else quoted
        plain = text.isprintable() and text.strip() == text != "" and len(text) <= 40
        raise bad_count(flag, text if plain else short_repr(text))
    return value


def bad_count(flag: str, shown: str) -> GenerateError:
    """`shown`: the bad value as the message shows it (the flag's text, or a Python value's repr)."""
    what = {"--max-new-tokens": "the number of tokens to generate",
            "--tensor-parallel": "the number of ranks (1 runs on one device)"}[flag]
    return GenerateError(f"{flag} {shown} must be a positive integer: {what}")


def generate_from_checkpoint(
    path: str | Path,
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    max_new_tokens: int = 32,
    dtype_name: str | None = None,
    graphs: bool = False,
    tensor_parallel: int = 1,
) -> dict[str, Any]:
    """Load, generate greedily on the current platform, and report what `torchhal generate` prints.

    The request (prompt, length, dtype, tensor-parallel size) is checked against the
    checkpoint's config and the platform before a weight is read, a KV cache sized or a
    rank started. `graphs`: full-graph decode (one graph replay per decode step) where the
    platform can capture graphs; elsewhere every step runs eagerly and the report says why.
    `tensor_parallel` > 1: that many rank processes (`torchhal.distributed.launch`) each hold a
    shard and generate the same request; they must agree on every token, and rank 0's
    report is returned with the size and each rank's device under `tensor_parallel`."""
    request, tokenizer = prepare_generation(path, prompt, prompt_ids, max_new_tokens, dtype_name, graphs,
                                            tensor_parallel)
    if request.tensor_parallel == 1:
        out = run_generation(request)
    else:
        out = agreed_report(launch(generate_on_rank, request.tensor_parallel, (request,)))
    if tokenizer is not None:
        out["text"] = tokenizer.decode(out["output_ids"])
    return out


def prepare_generation(
    path: str | Path,
    prompt: str | None,
    prompt_ids: list[int] | None,
    max_new_tokens: int,
    dtype_name: str | None,
    graphs: bool,
    tensor_parallel: int = 1,
) -> tuple[GenerationRequest, Any | None]:
    """Every check `torchhal generate` makes before it starts anything: the request and the
    tokenizer (None for `prompt_ids`), or GenerateError naming the fix."""
    from torchhal.core.engine.requests import check_prompt
    from torchhal.core.model.checkpoint import check_checkpoint, checkpoint_dtype, config_from_hf, read_hf_config
    from torchhal.platforms import PlatformError
    from torchhal.platforms.selection import current_platform
    from torchhal.values import as_index, short_repr

    root = Path(path)
    if dtype_name is not None and dtype_name not in DTYPES:
        raise GenerateError(f"--dtype {dtype_name!r} is not one of {', '.join(DTYPES)}")
    counts = {}  # any integer but a bool, as the engine takes them; plain ints from here on
    for flag, value in (("--max-new-tokens", max_new_tokens), ("--tensor-parallel", tensor_parallel)):
        count = as_index(value)
        if count is None or count < 1:
            raise bad_count(flag, short_repr(value))
        counts[flag] = count
    max_new_tokens, tensor_parallel = counts["--max-new-tokens"], counts["--tensor-parallel"]
    if not isinstance(graphs, bool):
        raise GenerateError(f"--graphs {graphs!r} must be True or False")
    if prompt is not None and prompt_ids is not None:  # the command line makes them exclusive; so does the call
        raise GenerateError("give a prompt or prompt ids, not both: --prompt TEXT or --prompt-ids 1,2,3")
    try:
        # A bad TORCHHAL_PLATFORM / TORCHHAL_DETECT_TIMEOUT: the same line `torchhal info` refuses with.
        platform = current_platform()
    except PlatformError as exc:
        raise GenerateError(str(exc)) from None
    hf = read_hf_config(path)  # the path as given: an empty one is refused, where Path("") would be "."
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
    except TypeError as exc:  # the ids' types: the caller's, whatever the model
        raise GenerateError(str(exc)) from None
    except ValueError as exc:  # the vocabulary or the context: the limits are the model's
        raise GenerateError(f"{exc} (the model's config.json)") from None
    if tensor_parallel != 1:
        check_tensor_parallel_request(model_config, tensor_parallel, root, platform)
        check_checkpoint(root)  # here, in one line: in a rank it would end the launch with a traceback
    dtype_name = dtype_name or str(checkpoint_dtype(hf, str(root / "config.json"))).removeprefix("torch.")
    return GenerationRequest(root, list(prompt_ids), max_new_tokens, dtype_name, graphs, tensor_parallel), tokenizer


def refuse_what_memory_cannot_hold(request: GenerationRequest, dtype: Any, platform: Platform,
                                   group: DeviceGroup | None) -> None:
    """Before any weight is read: a request whose KV cache alone exceeds the share of the free
    memory the pool may take (weights not even counted) cannot run, and loading would first
    size the pool to all that memory, allocate and fill it."""
    from torchhal.core.model.checkpoint import config_from_hf, read_hf_config
    from torchhal.core.model.kv_cache import KVCache

    config = config_from_hf(read_hf_config(request.root), str(request.root / "config.json"))
    ranks = group.world_size if group is not None else 1  # each rank holds its share of the KV heads
    per_token = max(KVCache.bytes_per_token(config, dtype) // ranks, 1)
    index = (group.device.index or 0) if group is not None else platform.current_device()
    most = int(platform.memory_info(index).free * KV_FRACTION) // per_token
    refuse_beyond(request, most, "the device's free memory holds at most {} tokens of KV cache, before the weights "
                  "are loaded", "free device memory, or split the cache with --tensor-parallel N")


def refuse_beyond(request: GenerationRequest, room: int, has_room: str, other_fixes: str) -> None:
    """GenerateError when the request's prompt and new tokens exceed `room` tokens of KV cache
    (`has_room` says where that figure comes from, `{}` standing for it), naming the most
    --max-new-tokens that fits."""
    context = len(request.prompt_ids) + request.max_new_tokens
    if room < context:
        raise GenerateError(
            f"{has_room.format(room)}; the prompt ({len(request.prompt_ids)} tokens) and --max-new-tokens "
            f"{request.max_new_tokens} need {context}: lower --max-new-tokens to at most "
            f"{max(room - len(request.prompt_ids), 0)}, shorten the prompt, {other_fixes}")


def check_tensor_parallel_request(model_config: ModelConfig, size: int, root: Path, platform: Platform) -> None:
    """Refuse `--tensor-parallel size` when the model cannot be split that way or the
    platform has fewer devices than ranks (on the CPU the ranks share the host's cores)."""
    from torchhal.core.model.parallel import check_tensor_parallel

    try:
        check_tensor_parallel(model_config, size)
    except ValueError as exc:
        raise GenerateError(f"--tensor-parallel {size}: {exc} ({root / 'config.json'})") from None
    if platform.device_type == "cpu":
        cores = os.cpu_count() or 1
        if size > cores:
            raise GenerateError(f"--tensor-parallel {size} needs {size} ranks, but the CPU platform's ranks share "
                                f"this host's {cores} core(s): choose at most {cores}")
        return
    devices = platform.device_count()
    if size > devices:
        shown = ", ".join(f"{var}={os.environ[var]!r}" for var in platform.visible_devices_env if var in os.environ)
        raise GenerateError(f"--tensor-parallel {size} needs {size} {platform.name} devices, but {devices} "
                            f"{'is' if devices == 1 else 'are'} visible{f' ({shown})' if shown else ''}: choose at "
                            f"most {devices}, or make more devices visible")


def generate_on_rank(request: GenerationRequest) -> dict[str, Any]:
    """One tensor-parallel rank (in a process `launch` started): join the group, then load
    this rank's shard and generate the request."""
    import torch

    from torchhal.distributed import init_group
    from torchhal.platforms.selection import current_platform

    platform = current_platform()
    if platform.device_type == "cpu":  # ranks share the host: one thread each would oversubscribe it
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // request.tensor_parallel))
    group = init_group(platform)
    try:
        return run_generation(request, platform, group)
    finally:
        group.close()


def run_generation(request: GenerationRequest, platform: Platform | None = None,
                   group: DeviceGroup | None = None) -> dict[str, Any]:
    """Load the checkpoint (this rank's shard, with a group) and generate; the report
    without the text (the caller holds the tokenizer)."""
    import torch

    from torchhal.core.devices import is_out_of_memory
    from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine
    from torchhal.platforms.selection import current_platform

    root, prompt_ids, max_new_tokens = request.root, request.prompt_ids, request.max_new_tokens
    context = len(prompt_ids) + max_new_tokens
    platform = platform or current_platform()
    decode_graphs = DecodeGraphConfig(batch_buckets=(1,), context_buckets=(context,)) if request.graphs else None
    dtype = getattr(torch, request.dtype_name)
    # Whole blocks for the context (a block's worth more covers the last partial one). One
    # request is all this command runs: its pool may take most of the memory the weights leave.
    config = EngineConfig(dtype=dtype, max_kv_slots=context + EngineConfig.kv_block_size, kv_fraction=KV_FRACTION,
                          decode_graphs=decode_graphs)
    # group= only with a group: one device is the engine's own call, exactly as before.
    sharding: dict[str, Any] = {} if group is None else {"group": group}
    refuse_what_memory_cannot_hold(request, dtype, platform, group)
    try:
        engine = GenerationEngine.from_checkpoint(root, config, platform=platform, **sharding)
    except Exception as exc:
        if not (isinstance(exc, MemoryError) or is_out_of_memory(platform, exc)):
            raise
        # The KV pool's sizing found no block beside the weights, or an allocation failed.
        sizing = str(exc).split(";")[0]  # its fix names engine settings this command sets itself
        raise GenerateError(f"no room for the weights and a KV cache on {platform.name} ({sizing[:200]}); free "
                            "device memory, split the model with --tensor-parallel N, or pick a smaller --dtype"
                            ) from exc
    refuse_beyond(request, engine.kv_sizing.num_slots,
                  "the device has room for {} tokens of KV cache beside the weights", "or free device memory")
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
        "text": None,
        "max_new_tokens": max_new_tokens,
        "new_tokens": len(output),
        "stop": "eos" if stopped_at_eos else "length",
        "seconds": seconds,
        "tokens_per_s": len(output) / seconds if seconds > 0 else None,
        "decode_graphs": _graph_report(engine) if request.graphs else None,
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
    parallel = out.get("tensor_parallel")
    if parallel is not None:
        lines.append(f"tensor parallel: {parallel['size']} ranks on {', '.join(parallel['devices'])}")
    return "\n".join(lines)


def agreed_report(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's report, with the tensor-parallel size and each rank's device, once every
    rank is shown to have generated the same tokens (RanksDisagree naming the first that did not)."""
    expected = reports[0]["output_ids"]
    for rank, report in enumerate(reports[1:], start=1):
        tokens = report["output_ids"]
        if tokens != expected:
            pairs = zip(expected, tokens, strict=False)
            at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(expected), len(tokens)))
            platform = reports[0].get("platform", "<platform>")
            raise RanksDisagree(
                f"tensor-parallel ranks disagree: rank {rank} generated {tokens} but rank 0 {expected} (first "
                f"difference at output token {at}); every rank must generate the same tokens. The platform's "
                f"communicator may be wrong: its collectives (all_reduce, all_gather), under graph capture too; "
                f"check them with `torchhal conformance --platform {platform} --profile full -k test_distributed`. "
                "If that passes, the engine's tensor-parallel path is wrong: report it with this command line"
            )
    return {**reports[0], "tensor_parallel": {"size": len(reports), "devices": [r["device"] for r in reports]}}


def cmd_generate(args: argparse.Namespace) -> int:
    from torchhal.core.model.checkpoint import CheckpointError

    try:
        ids = parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
        new_tokens = parse_positive("--max-new-tokens", args.max_new_tokens)
        size = parse_positive("--tensor-parallel", args.tensor_parallel)
        out = generate_from_checkpoint(args.model, args.prompt, ids, new_tokens, args.dtype, args.graphs, size)
    except (CheckpointError, GenerateError) as exc:
        return refuse("generate", str(exc))
    except (LaunchError, RanksDisagree) as exc:
        print(f"torchhal generate: {exc}", file=sys.stderr)
        return FAILURE_EXIT
    emit(json.dumps(out, indent=2) if args.json else format_generation(out))
    return 0


def add_command(sub: Any) -> None:
    gen = sub.add_parser("generate", help="greedy generation from a Hugging Face checkpoint directory")
    gen.add_argument("--model", required=True, help="checkpoint directory (config.json + *.safetensors)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer: pip install 'torchhal[hf]')")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated: 1,2,3")
    gen.add_argument("--max-new-tokens", default="32", metavar="N", help="tokens to generate (default 32)")
    gen.add_argument("--dtype", choices=DTYPES, help="override the checkpoint's dtype")
    gen.add_argument("--graphs", action="store_true",
                     help="full-graph decode (one graph replay per decode step) where the platform captures graphs")
    gen.add_argument("--tensor-parallel", default="1", metavar="N",
                     help="shard the model over N ranks (processes) of the current platform, one device each "
                          "(default 1)")
    gen.add_argument("--json", action="store_true", help="machine-readable output")
    gen.set_defaults(func=cmd_generate)
