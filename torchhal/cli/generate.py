"""`torchhal generate`: greedy generation from a Hugging Face checkpoint through the engine."""

from __future__ import annotations

import argparse
import json
import math
import operator
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchhal.cli.output import emit, refuse

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

#: A CPU thread per this many parameters of a rank's weights: below it a token's work is too
#: small to share, and the threads' hand-offs cost more than the split saves (a model of a
#: few million parameters decodes many times faster on one thread of a busy host than on all).
PARAMETERS_PER_THREAD = 1 << 24


class GenerateError(ValueError):
    """A request `torchhal generate` refuses (before loading anything, or when the device has no
    room left for its KV cache); the message says the fix."""


class RanksDisagree(RuntimeError):
    """Tensor-parallel ranks generated different tokens: an engine bug, never settled by picking one."""


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request: all a rank needs to load the checkpoint and generate (picklable)."""

    root: Path
    config: ModelConfig  # the checkpoint's, from its config.json
    prompt_ids: list[int]
    max_new_tokens: int
    dtype_name: str  # a torch dtype's name: --dtype, else the checkpoint's
    graphs: bool | None  # None: where the platform captures graphs
    tensor_parallel: int = 1
    check_finite: bool = True
    threads: int | None = None  # the CPU threads each rank runs on (None: torch's own count)


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


def parse_count(flag: str, text: str) -> int:
    """A numeric flag's text as a positive int, read by `parse_decimal`; GenerateError naming it otherwise."""
    from torchhal.values import parse_decimal, short_repr

    value = parse_decimal(text)
    if value is None or value < 1:
        # as typed where that reads unambiguously on one line, else quoted
        shown = text if text.isprintable() and text.strip() == text != "" and len(text) <= 40 else short_repr(text)
        what = {"--max-new-tokens": "the number of tokens to generate",
                "--tensor-parallel": "the number of ranks (1 runs on one device)"}[flag]
        raise GenerateError(f"{flag} {shown} must be a positive integer: {what}")
    return value


def cpu_threads(config: ModelConfig, ranks: int) -> int:
    """The threads each of `ranks` processes generating with `config` runs on this host: one per
    `PARAMETERS_PER_THREAD` of a rank's share of the weights, at least one, at most its share
    of the host's cores."""
    from torchhal.core.model.checkpoint import expected_layout

    parameters = sum(math.prod(shape) for shape in expected_layout(config).values())
    return max(1, min((os.cpu_count() or 1) // ranks, parameters // ranks // PARAMETERS_PER_THREAD))


def generate_from_checkpoint(
    path: str | Path,
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    max_new_tokens: int = 32,
    dtype_name: str | None = None,
    graphs: bool | None = None,
    tensor_parallel: int = 1,
    check_finite: bool = True,
) -> dict[str, Any]:
    """Load, generate greedily on the current platform, and report what `torchhal generate` prints.

    The request (prompt, length, dtype, tensor-parallel size) is checked against the
    checkpoint's config and the platform before a weight is read, a KV cache sized or a
    rank started. `graphs`: full-graph decode (one graph replay per decode step) and the
    engine's prefill graphs (prompts of up to 256 tokens); None (the
    engine's default): where the platform captures graphs; True where it cannot: every step runs
    eagerly and the report says why.
    `tensor_parallel` > 1: that many rank processes (`torchhal.distributed.launch`) each hold a
    shard and generate the same request; they must agree on every token, and rank 0's
    report is returned with the size and each rank's device under `tensor_parallel`.
    `check_finite`: refuse weights holding NaN or infinite values (in the dtype they run in).
    On the CPU the run uses `cpu_threads` threads unless OMP_NUM_THREADS sets the count."""
    request, tokenizer = prepare_generation(path, prompt, prompt_ids, max_new_tokens, dtype_name, graphs,
                                            tensor_parallel, check_finite)
    if request.tensor_parallel == 1:
        out = run_generation(request)
    else:
        from torchhal.distributed import launch  # imports torch: not for `torchhal --help`

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
    graphs: bool | None,
    tensor_parallel: int = 1,
    check_finite: bool = True,
) -> tuple[GenerationRequest, Any | None]:
    """Every check `torchhal generate` makes before it starts anything: the request and the
    tokenizer (None for `prompt_ids`), or GenerateError naming the fix."""
    from torchhal.core.engine.requests import check_prompt
    from torchhal.core.model.checkpoint import check_checkpoint, checkpoint_dtype, config_from_hf, read_hf_config
    from torchhal.core.model.parallel import check_tensor_parallel
    from torchhal.platforms.selection import current_platform

    for flag, value in (("--graphs", graphs), ("check_finite", check_finite)):
        if not isinstance(value, bool) and (value is not None or flag != "--graphs"):  # "no" is truthy
            raise GenerateError(f"{flag} {value!r} must be True or False")
    if prompt is not None and prompt_ids is not None:  # the command line makes them exclusive; so does the call
        raise GenerateError("give a prompt or prompt ids, not both: --prompt TEXT or --prompt-ids 1,2,3")
    platform = current_platform()  # a bad TORCHHAL_PLATFORM: the line `torchhal info` refuses with
    root, hf = Path(path), read_hf_config(path)  # the path as given: an empty one is refused, where Path("") is "."
    where = str(root / "config.json")
    model_config = config_from_hf(hf, where)
    dtype = checkpoint_dtype(hf, where) if dtype_name is None else checkpoint_dtype({"dtype": dtype_name}, "--dtype")
    tokenizer = None
    if prompt is not None:
        tokenizer = load_tokenizer(root)
        if tokenizer is None:
            raise GenerateError(f"{root} ships no tokenizer, or transformers is missing (pip install "
                                "'torchhal[hf]'); give --prompt-ids instead of --prompt")
        prompt_ids = list(tokenizer(prompt)["input_ids"])
    try:  # the caller's values, read by the engine's own rules (any integer but a bool)
        prompt_ids = check_prompt(prompt_ids, max_new_tokens, model_config.vocab_size, model_config.max_position)
        tensor_parallel = check_tensor_parallel(model_config, tensor_parallel)
    except (TypeError, ValueError) as exc:
        raise GenerateError(str(exc)) from None
    max_new_tokens = operator.index(max_new_tokens)  # as a plain int (numpy's, too)
    if tensor_parallel > 1:
        cpu = platform.device_type == "cpu"
        devices = (os.cpu_count() or 1) if cpu else platform.device_count()
        if tensor_parallel > devices:
            shown = ", ".join(f"{var}={os.environ[var]!r}" for var in platform.visible_devices_env
                              if var in os.environ) if not cpu else ""
            raise GenerateError(
                f"--tensor-parallel {tensor_parallel} needs {tensor_parallel} ranks, but the CPU platform's ranks "
                f"share this host's {devices} core(s): choose at most {devices}" if cpu else
                f"--tensor-parallel {tensor_parallel} needs {tensor_parallel} {platform.name} devices, but {devices} "
                f"{'is' if devices == 1 else 'are'} visible{f' ({shown})' if shown else ''}: choose at most "
                f"{devices}, or make more devices visible")
        check_checkpoint(root, tensor_parallel)  # here, in one line: in a rank it would end the launch with a traceback
    threads = None
    if platform.device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        threads = cpu_threads(model_config, tensor_parallel)
    return GenerationRequest(root, model_config, prompt_ids, max_new_tokens, str(dtype).removeprefix("torch."), graphs,
                             tensor_parallel, check_finite, threads), tokenizer


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


def generate_on_rank(request: GenerationRequest) -> dict[str, Any]:
    """One tensor-parallel rank (in a process `launch` started): join the group, then load
    this rank's shard and generate the request."""
    from torchhal.distributed import init_group
    from torchhal.platforms.selection import current_platform

    platform = current_platform()
    group = init_group(platform)
    try:
        return run_generation(request, platform, group)
    finally:
        group.close()


@contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `count` while the run lasts (None: left as they are)."""
    import torch

    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_generation(request: GenerationRequest, platform: Platform | None = None,
                   group: DeviceGroup | None = None) -> dict[str, Any]:
    """Load the checkpoint (this rank's shard, with a group) and generate; the report
    without the text (the caller holds the tokenizer)."""
    import torch

    from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine
    from torchhal.core.model.kv_cache import KVCache
    from torchhal.platforms.selection import current_platform

    root, prompt_ids, max_new_tokens = request.root, request.prompt_ids, request.max_new_tokens
    context = len(prompt_ids) + max_new_tokens
    platform = platform or current_platform()
    dtype = getattr(torch, request.dtype_name)
    # The platform's answer first: without graph support the model's program (one device or a
    # rank's, whose all-reduces break it) does not matter.
    no_graphs = None if platform.graph_support is not None else f"platform {platform.name!r} declares no graph support"
    wanted = request.graphs is not False and (request.graphs or no_graphs is None)
    decode_graphs = DecodeGraphConfig(batch_buckets=(1,), context_buckets=(context,)) \
        if wanted and no_graphs is None else None
    # Whole blocks for the context (a block's worth more covers the last partial one). One
    # request is all this command runs: its pool may take most of the memory the weights leave.
    config = EngineConfig(dtype=dtype, max_kv_slots=context + EngineConfig.kv_block_size, kv_fraction=KV_FRACTION,
                          decode_graphs=decode_graphs, check_finite_weights=request.check_finite,
                          prefill_graphs=EngineConfig.prefill_graphs if decode_graphs is not None else None)
    # Before any weight is read: a KV cache that alone exceeds the pool's share of the free
    # memory cannot run, and loading would first size the pool to all that memory and fill it.
    ranks = group.world_size if group is not None else 1  # each rank holds its share of the KV heads
    per_token = max(KVCache.bytes_per_token(request.config, dtype) // ranks, 1)
    index = (group.device.index or 0) if group is not None else platform.current_device()
    refuse_beyond(request, int(platform.memory_info(index).free * KV_FRACTION) // per_token,
                  "the device's free memory holds at most {} tokens of KV cache, before the weights are loaded",
                  "free device memory, or split the cache with --tensor-parallel N")
    with _threads(request.threads):
        try:
            engine = GenerationEngine.from_checkpoint(root, config, platform=platform, group=group)
        except (MemoryError, *platform.oom_error_types) as exc:  # type: ignore[misc]  # the weights, or no KV block
            sizing = str(exc).split(";")[0]  # its fix names settings this command sets itself
            raise GenerateError(f"no room for the weights and a KV cache on {platform.name} ({sizing[:300]}); free "
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
        threads = torch.get_num_threads() if platform.device_type == "cpu" else None
    if result.error:
        raise GenerateError(result.error)
    output = list(result.output)
    stopped_at_eos = len(output) < max_new_tokens and bool(output) and output[-1] in set(engine.config.eos_tokens)
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
        "threads": threads,
        "decode_graphs": _graph_report(engine, no_graphs) if wanted else None,
        "attention": {"backend": engine.attention.name, "why": engine.attention.why},
    }


def _graph_report(engine: GenerationEngine, unavailable: str | None) -> dict[str, Any]:
    runner = engine.decode_runner
    if runner is None:
        return {"replays": 0, "unavailable": unavailable, "capture_seconds": None}
    return {"replays": runner.steps, "unavailable": runner.unsupported,
            "capture_seconds": runner.report.seconds if runner.report is not None else None}


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
    from torchhal.distributed import LaunchError
    from torchhal.platforms import PlatformError

    try:
        ids = parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
        new_tokens = parse_count("--max-new-tokens", args.max_new_tokens)
        size = parse_count("--tensor-parallel", args.tensor_parallel)
        out = generate_from_checkpoint(args.model, args.prompt, ids, new_tokens, args.dtype, args.graphs, size,
                                       not args.no_check_finite)
    except (CheckpointError, GenerateError, PlatformError) as exc:
        return refuse("generate", str(exc))
    except (LaunchError, RanksDisagree) as exc:
        print(f"torchhal generate: {exc}", file=sys.stderr)
        return FAILURE_EXIT
    emit(json.dumps(out, indent=2) if args.json else format_generation(out))
    return 0


def add_command(sub: Any) -> None:
    gen = sub.add_parser("generate", help="greedy generation from a Hugging Face checkpoint directory",
                         epilog="On the CPU a run uses one thread per 16M parameters of a rank's weights (at least "
                                "one, at most its share of the cores); OMP_NUM_THREADS=N sets the count instead.")
    gen.add_argument("--model", required=True, help="checkpoint directory (config.json + *.safetensors)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer: pip install 'torchhal[hf]')")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated: 1,2,3")
    gen.add_argument("--max-new-tokens", default="32", metavar="N", help="tokens to generate (default 32)")
    gen.add_argument("--dtype", choices=DTYPES, help="override the checkpoint's dtype")
    gen.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                     help="full-graph decode, one graph replay per decode step (default: where the platform "
                          "captures graphs; --no-graphs runs every step eagerly)")
    gen.add_argument("--tensor-parallel", default="1", metavar="N",
                     help="shard the model over N ranks (processes) of the current platform, one device each "
                          "(default 1)")
    gen.add_argument("--no-check-finite", action="store_true",
                     help="load weights holding NaN or infinite values (refused by default)")
    gen.add_argument("--json", action="store_true", help="machine-readable output")
    gen.set_defaults(func=cmd_generate)
