"""What an attention backend is, what it declares, and how one is chosen for a model.

A backend computes attention for a step's queries over the paged KV cache
(`torchhal.attention.layout`). It declares what it can do in an
`AttentionCapability`; `choose_backend` picks the first declared backend that can run
the model's `AttentionSpec`, else the portable reference, and says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from torchhal.attention.layout import PagedMetadata

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionCapability:
    """What one backend supports. A feature it lacks makes `choose_backend` pass it over.

    name:           short name for reports ("triton-paged", "reference").
    dtypes:         query/cache dtypes it computes in.
    head_dims:      head dims it accepts; None = any.
    block_sizes:    KV block sizes it accepts; None = any.
    prefill:        variable-length causal prefill over the paged cache, queries at an
                    offset into a context already cached (chunked prefill).
    sliding_window: a window of the last W positions per query.
    soft_cap:       logits soft-capping (cap * tanh(logits / cap)).
    graph_capture:  `decode` has no host syncs and no data-dependent shapes, so it can be
                    captured in a device graph (checked through the platform's graph support).
    note:           one line for reports.
    """

    name: str
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...] | None = None
    block_sizes: tuple[int, ...] | None = None
    prefill: bool = True
    sliding_window: bool = True
    soft_cap: bool = True
    graph_capture: bool = False
    note: str = ""


@dataclass(frozen=True)
class AttentionSpec:
    """The attention a model needs: shapes, dtype and features (what selection checks)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    sliding_window: int | None = None
    soft_cap: float | None = None
    needs_prefill: bool = True
    needs_graph: bool = False

    def __post_init__(self) -> None:
        for label in ("num_q_heads", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, label)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AttentionSpec.{label} is {value!r}; it must be an int >= 1")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"AttentionSpec: num_q_heads {self.num_q_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}; grouped-query attention needs whole groups")
        if self.dtype not in _DTYPES:
            raise ValueError(f"AttentionSpec.dtype is {self.dtype}; use one of {', '.join(map(str, _DTYPES))}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"AttentionSpec.sliding_window is {self.sliding_window!r}; pass None or an int >= 1")
        if self.soft_cap is not None and not self.soft_cap > 0:
            raise ValueError(f"AttentionSpec.soft_cap is {self.soft_cap!r}; pass None or a number > 0")


@runtime_checkable
class AttentionBackend(Protocol):
    """Attention over the paged KV cache. Every method leaves the cache's other slots alone.

    Shapes: query [num_tokens, num_q_heads, head_dim]; caches [num_blocks, block_size,
    num_kv_heads, head_dim]; output like query. Query head h reads KV head
    h // (num_q_heads // num_kv_heads) (no copies of KV heads). A query at position p
    attends cached positions j <= p, and with a window W only p - j < W. A padded row
    (seq_len 0) outputs zeros. `out`, when given, receives the result (and is returned).
    """

    capability: AttentionCapability

    def write_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store a step's K/V ([num_tokens, num_kv_heads, head_dim]) into their slots."""
        ...

    def decode(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata, *,
        scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query token per row (query [batch, ...]); graph-capturable where declared."""
        ...

    def prefill(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata, *,
        scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Variable-length causal attention: request i's queries are rows
        meta.query_start[i]:meta.query_start[i + 1], its last tokens."""
        ...


@dataclass(frozen=True)
class AttentionChoice:
    """The backend chosen for a model, and one line saying why."""

    backend: AttentionBackend
    why: str

    @property
    def name(self) -> str:
        return self.backend.capability.name


def unsupported_reason(capability: AttentionCapability, spec: AttentionSpec) -> str | None:
    """Why a backend with `capability` cannot run `spec`, or None when it can."""
    if spec.dtype not in capability.dtypes:
        return f"dtype {spec.dtype} is not among {', '.join(map(str, capability.dtypes))}"
    if capability.head_dims is not None and spec.head_dim not in capability.head_dims:
        return f"head_dim {spec.head_dim} is not among {list(capability.head_dims)}"
    if capability.block_sizes is not None and spec.block_size not in capability.block_sizes:
        return f"block_size {spec.block_size} is not among {list(capability.block_sizes)}"
    if spec.needs_prefill and not capability.prefill:
        return "no paged prefill"
    if spec.sliding_window is not None and not capability.sliding_window:
        return "no sliding window"
    if spec.soft_cap is not None and not capability.soft_cap:
        return "no logit soft-capping"
    if spec.needs_graph and not capability.graph_capture:
        return "decode cannot be captured in a graph"
    return None


def choose_backend(declared: tuple[AttentionBackend, ...], spec: AttentionSpec,
                   fallback: AttentionBackend) -> AttentionChoice:
    """The first declared backend that runs `spec`, else `fallback`, with the reason."""
    passed_over = []
    for backend in declared:
        reason = unsupported_reason(backend.capability, spec)
        if reason is None:
            return AttentionChoice(backend, f"{backend.capability.name}: the platform's backend supports this model")
        passed_over.append(f"{backend.capability.name}: {reason}")
    if not declared:
        return AttentionChoice(fallback, f"{fallback.capability.name}: the platform declares no attention backend")
    return AttentionChoice(fallback, f"{fallback.capability.name}: passed over " + "; ".join(passed_over))


def check_call(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata,
               decode: bool, sliding_window: int | None, soft_cap: float | None) -> None:
    """Raise one line naming the bad argument; shared by every backend's entry points."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"attention: k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} must both be "
                         "[num_blocks, block_size, num_kv_heads, head_dim]")
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    if query.dim() != 3 or query.shape[2] != dim or query.shape[1] % kv_heads:
        raise ValueError(f"attention: query {tuple(query.shape)} must be [num_tokens, num_q_heads, {dim}] with "
                         f"num_q_heads a multiple of the cache's {kv_heads} KV heads")
    if query.dtype != k_cache.dtype:
        raise ValueError(f"attention: query is {query.dtype} but the cache is {k_cache.dtype}; cast the query")
    tokens = meta.batch if decode else None
    if decode and query.shape[0] != tokens:
        raise ValueError(f"attention.decode: query has {query.shape[0]} rows for a batch of {tokens}; "
                         "pass one query token per row")
    if meta.query_start.shape[0] != meta.batch + 1:
        raise ValueError(f"attention: query_start has {meta.query_start.shape[0]} entries for a batch of "
                         f"{meta.batch}; pass batch + 1 offsets")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"attention: sliding_window is {sliding_window}; pass None or an int >= 1")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"attention: soft_cap is {soft_cap}; pass None or a number > 0")
