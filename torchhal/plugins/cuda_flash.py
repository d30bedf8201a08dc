"""Whole-prompt causal attention for the CUDA plugin: FlashAttention-4 where it is installed
and was measured faster, else torch's SDPA (cuDNN's kernel on an H200 with torch 2.11).

A prefill step's whole prompts (a request whose queries are its whole context: nothing
cached before them, no window cutting into them) are split from its other requests
(`split_whole_prompts`), grouped into runs of adjacent, equally long prompts, and each run
attends as one batch through a dense causal kernel (`dense_causal`), on the step's own K/V
when the engine passed them, else on K/V read back out of the cache (`prompt_kv`). The
paged kernel takes the rest.

FlashAttention-4 (the `flash-attn-4` package: CuTe DSL kernels) is an optional extra,
`pip install 'torchhal[fa4]'`. On an H200 at the Llama-3.1-8B shape (32/8 heads, dim 128,
bf16) its causal kernel took a 16000-token prompt's attention in 3.43 ms a layer against
cuDNN's 4.13, in a layer stack running at the power limit (benchmarks/README.md). It is used
only where all of these hold (the conditions it was measured and checked under), SDPA
everywhere else:

- compute capability 9.x, bfloat16, head dim 128, prompts of at least 3968 tokens (below it the
  prefill gains at most 1.8%, inside a lease's spread, and each FA4 call costs more host time
  than SDPA's);
- not while a graph is being captured (its first call per configuration compiles);
- `TORCHHAL_CUDA_FA4` is not `0` (read at every call: to measure against SDPA, or to rule it out).

Importing it takes seconds (it loads the CuTe compiler), so that happens at the first call
that would use it, not at plugin load. An import or a call that fails (other than running out
of memory, which the engine handles) warns once, naming the error, and SDPA serves from then
on. `KERNEL_CALLS` counts the calls each kernel served.
"""

from __future__ import annotations

import collections
import functools
import importlib
import importlib.metadata
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Any

import torch
import torch.nn.functional as F

from torchhal.attention import PagedMetadata

DISTRIBUTION = "flash-attn-4"
#: Where FA4 was measured faster than SDPA's pick and checked against the reference (H200,
#: Llama-3.1-8B's attention): compute capability majors, head dims, dtypes, shortest prompt.
MEASURED_CAPABILITIES = (9,)
MEASURED_HEAD_DIMS = (128,)
DTYPES = (torch.bfloat16,)
#: Measured from 1024 tokens up; the first prompt that reaches it pays FA4's 7 s import.
MIN_LENGTH = 3968
#: How many dense calls each kernel served in this process ("fa4", "sdpa").
KERNEL_CALLS: collections.Counter[str] = collections.Counter()
#: The error that turned FA4 off for this process, if one did.
_failure: list[str] = []


@dataclass(frozen=True)
class PromptSplit:
    """A prefill step's requests in two kinds (`split_whole_prompts`).

    runs:  the whole prompts, as maximal runs of prompts adjacent in the step's query rows and
           equally long: (first row, prompts, length) each, in row order.
    rest:  the metadata of every other request (chunks after cached tokens, decode rows
           sharing the step), its query rows gathered in `rest_tokens` order; None when
           there is none. `rest_tokens` indexes the step's query rows (device, int64); None
           when `rest` is the step's metadata as it is.
    """

    runs: list[tuple[int, int, int]]
    rest: PagedMetadata | None
    rest_tokens: torch.Tensor | None


def split_whole_prompts(meta: PagedMetadata, sliding_window: int | None) -> PromptSplit | None:
    """The step's whole prompts apart from its other requests, from the metadata's host
    copies (no device sync); None without host copies."""
    if meta.host_seq_lens is None or meta.host_query_start is None:
        return None
    starts = meta.host_query_start
    runs: list[tuple[int, int, int]] = []
    rest: list[int] = []
    for row, seq_len in enumerate(meta.host_seq_lens):
        first, last = starts[row], starts[row + 1]
        if last == first:
            continue  # a padded row: nothing to write
        if seq_len != last - first or (sliding_window is not None and sliding_window < seq_len):
            rest.append(row)
        elif runs and runs[-1][2] == seq_len and first == runs[-1][0] + runs[-1][1] * seq_len:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, seq_len)
        else:
            runs.append((first, 1, seq_len))
    if not rest or not runs:
        return PromptSplit(runs, meta if rest else None, None)  # the metadata as it is, or no rest
    device = meta.seq_lens.device
    query_start = [0, *accumulate(starts[row + 1] - starts[row] for row in rest)]
    rows = torch.tensor(rest, dtype=torch.int64).to(device, non_blocking=True)
    rest_tokens = torch.cat([torch.arange(starts[row], starts[row + 1]) for row in rest]).to(device, non_blocking=True)
    sub = PagedMetadata(
        block_tables=meta.block_tables.index_select(0, rows),
        seq_lens=meta.seq_lens.index_select(0, rows),
        query_start=torch.tensor(query_start, dtype=torch.int32).to(device, non_blocking=True),
        slot_mapping=meta.slot_mapping.index_select(0, rest_tokens),
        max_query_len=max(b - a for a, b in pairwise(query_start)),
        block_size=meta.block_size,
        host_seq_lens=tuple(meta.host_seq_lens[row] for row in rest),
        host_query_start=tuple(query_start),
    )
    return PromptSplit(runs, sub, rest_tokens)


def prompt_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, first: int, last: int,
              key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V of query rows first:last when they are whole prompts ([last - first, Hk, D]):
    the step's own `key`/`value` rows when the engine passed them (views, no copy), else read
    back out of the cache at the rows' slots (a gather: one copy of the prompts' K/V)."""
    if key is not None and value is not None:
        return key[first:last], value[first:last]
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping[first:last]
    return k_cache.view(-1, heads, dim).index_select(0, slots), v_cache.view(-1, heads, dim).index_select(0, slots)


def switched_off() -> bool:
    return os.environ.get("TORCHHAL_CUDA_FA4", "1") == "0"


@functools.cache
def fa4_version() -> tuple[str | None, str]:
    """(version, why): the installed flash-attn-4's version, or None and why it is not used."""
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None, "flash-attn-4 is not installed: pip install 'torchhal[fa4]' on sm_90"
    return version, f"flash-attn-4 {version}"


def describe() -> str:
    """One line for `torchhal info`: which kernel whole prompts take, and why."""
    version, why = fa4_version()
    if switched_off():
        return "whole prompts through SDPA (TORCHHAL_CUDA_FA4=0)"
    if version is None:
        return f"whole prompts through SDPA ({why})"
    if _failure:
        return f"whole prompts through SDPA (FlashAttention-4 failed: {_failure[0]})"
    return (f"whole prompts through FlashAttention-4 ({why}) on sm_90, bf16, head dim 128, prompts of "
            f">= {MIN_LENGTH} tokens; SDPA elsewhere")


def _turn_off(error: BaseException, what: str) -> None:
    """Warn once and serve every later call through SDPA."""
    if _failure:
        return
    _failure.append(f"{what}: {type(error).__name__}: {error}")
    warnings.warn(f"FlashAttention-4 {what} failed ({type(error).__name__}: {error}); whole prompts use SDPA "
                  "from now on. Reinstall it (pip install 'torchhal[fa4]') or set TORCHHAL_CUDA_FA4=0 to silence "
                  "this.", RuntimeWarning, stacklevel=2)


@functools.cache
def _fa4_function() -> Callable[..., Any] | None:
    try:
        return importlib.import_module("flash_attn.cute").flash_attn_func  # type: ignore[no-any-return]
    except Exception as exc:  # a broken install: say so once, keep serving through SDPA
        _turn_off(exc, "import (`import flash_attn.cute`)")
        return None


@functools.cache
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def fa4_takes(query: torch.Tensor) -> bool:
    """FA4 runs this call (the conditions in the module's docstring)."""
    return (not switched_off() and not _failure and fa4_version()[0] is not None and query.dtype in DTYPES
            and query.shape[-1] in MEASURED_HEAD_DIMS and query.shape[1] >= MIN_LENGTH
            and _capability_major(query.device.index or 0) in MEASURED_CAPABILITIES
            and not torch.cuda.is_current_stream_capturing() and _fa4_function() is not None)


def dense_causal(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention over `count` equally long prompts, nothing cached before them.

    query [count, L, Hq, D]; keys, values [count, L, Hk, D] with Hq a multiple of Hk (grouped
    heads read in place, no copies); any strides with the last dim contiguous, so views into
    the projections' outputs need no copy. Returns [count, L, Hq, D] (FA4's output is
    contiguous; SDPA's a transposed view of its own).
    """
    if fa4_takes(query):
        try:
            out = fa4_causal(query, keys, values, scale)
            KERNEL_CALLS["fa4"] += 1
            return out
        except torch.OutOfMemoryError:
            raise  # the engine's to handle, as from any kernel
        except Exception as exc:  # a compile or launch that fails: SDPA from now on
            _turn_off(exc, "call")
    KERNEL_CALLS["sdpa"] += 1
    return sdpa_causal(query, keys, values, scale)


def fa4_causal(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """FA4's kernel alone, as `dense_causal` calls it (the import must have succeeded)."""
    function = _fa4_function()
    assert function is not None, "flash-attn-4 does not import: pip install 'torchhal[fa4]'"
    with torch.cuda.device(query.device):  # FA4 reads the architecture of the current device
        out = function(query, keys, values, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]


def sdpa_causal(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA alone, as `dense_causal` calls it: [count, L, H, D] in and out."""
    attended = F.scaled_dot_product_attention(query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                              is_causal=True, scale=scale, enable_gqa=True)
    return attended.transpose(1, 2)
