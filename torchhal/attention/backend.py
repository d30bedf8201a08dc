"""What an attention backend is, what it declares, and how one is chosen for a model.

A backend computes attention for a step's queries over the paged KV cache
(`torchhal.attention.layout`). It declares what it can do in an
`AttentionCapability`; `choose_backend` picks the first declared backend that can run
the model's `AttentionSpec`, else the portable reference, and says why.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from torchhal.attention.layout import PagedMetadata, outside_on_host
from torchhal.values import as_index, check_bool

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
    step_kv:        `prefill` takes the step's own K/V (`key`, `value`: what `write_kv` just
                    stored at the step's slots) and may read a whole prompt's K/V from them
                    instead of back out of the cache. Engines pass them only to a backend
                    that declares this.
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
    step_kv: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        # A plugin's declaration is checked where it is made, not when selection reads it.
        def bad(field: str, must: str) -> TypeError:
            return TypeError(f"AttentionCapability.{field} is {getattr(self, field)!r}; it must be {must}")

        if not isinstance(self.name, str) or not self.name:
            raise bad("name", "a non-empty str naming the backend (e.g. 'triton-paged')")
        if (not isinstance(self.dtypes, tuple) or not self.dtypes
                or not all(isinstance(d, torch.dtype) for d in self.dtypes)):
            raise bad("dtypes", "a non-empty tuple of torch dtypes, e.g. (torch.bfloat16,)")
        # A dtype no AttentionSpec may ask for could never be chosen, nor checked by the suite.
        unknown = [d for d in self.dtypes if d not in _DTYPES]
        if unknown:
            raise ValueError(f"AttentionCapability.dtypes is {self.dtypes!r}, with {', '.join(map(str, unknown))}, "
                             f"which no AttentionSpec asks for; declare only {', '.join(map(str, _DTYPES))}")
        for field in ("head_dims", "block_sizes"):
            sizes = getattr(self, field)
            if sizes is not None and (not isinstance(sizes, tuple) or not sizes
                                      or not all(as_index(n) is not None and n >= 1 for n in sizes)):
                raise bad(field, "None (any) or a non-empty tuple of ints >= 1")
        for field in ("prefill", "sliding_window", "soft_cap", "graph_capture", "step_kv"):
            if not isinstance(getattr(self, field), bool):
                raise bad(field, "True or False")
        if not isinstance(self.note, str):
            raise bad("note", "a str")


def check_window(label: str, window: object) -> None:
    """A sliding window is None or an int >= 1 (a bool or a float is refused, not truncated)."""
    if window is not None and not (as_index(window) is not None and window >= 1):  # type: ignore[operator]
        raise ValueError(f"{label} is {window!r}; pass None or an int >= 1")


def check_positive(label: str, value: object, optional: bool) -> None:
    """`scale` and `soft_cap` are finite real numbers > 0 (`soft_cap` may be None): an
    infinite or NaN one would turn every output into NaN without an error."""
    if value is None and optional:
        return
    if isinstance(value, numbers.Real) and not isinstance(value, (int, float)):  # numpy's float32, float16
        kind = f"{type(value).__module__.split('.')[0]} {type(value).__name__}"
        name = label.split()[-1]
        raise ValueError(f"{label} is {value!r}, a {kind}; pass a Python float (float({name})): backends hand it "
                         "to their kernels as it is")
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or not value > 0):
        raise ValueError(f"{label} is {value!r}; pass {'None or ' if optional else ''}a finite number > 0")


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
        # Integers of any kind (numpy's too, as the metadata builders take) are kept as plain
        # ints, a real soft_cap as a float: the spec's numbers go to kernels as they are.
        for label in ("num_q_heads", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, label)
            index = as_index(value)
            if index is None or index < 1:
                raise ValueError(f"AttentionSpec.{label} is {value!r}; it must be an int >= 1")
            object.__setattr__(self, label, index)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"AttentionSpec: num_q_heads {self.num_q_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}; grouped-query attention needs whole groups")
        if self.dtype not in _DTYPES:
            raise ValueError(f"AttentionSpec.dtype is {self.dtype}; use one of {', '.join(map(str, _DTYPES))}")
        check_window("AttentionSpec.sliding_window", self.sliding_window)
        if self.sliding_window is not None:
            object.__setattr__(self, "sliding_window", as_index(self.sliding_window))
        if isinstance(self.soft_cap, numbers.Real) and not isinstance(self.soft_cap, bool):
            object.__setattr__(self, "soft_cap", float(self.soft_cap))
        check_positive("AttentionSpec.soft_cap", self.soft_cap, optional=True)
        check_bool("AttentionSpec.needs_prefill", self.needs_prefill)
        check_bool("AttentionSpec.needs_graph", self.needs_graph)


@runtime_checkable
class AttentionBackend(Protocol):
    """Attention over the paged KV cache. Every method leaves the cache's other slots alone.

    Shapes: query [num_tokens, num_q_heads, head_dim]; caches [num_blocks, block_size,
    num_kv_heads, head_dim]; output like query. Query head h reads KV head
    h // (num_q_heads // num_kv_heads) (no copies of KV heads). A query at position p
    attends cached positions j <= p, and with a window W only p - j < W. A padded row
    (seq_len 0) outputs zeros. `out`, when given, receives the result (and is returned);
    without it, a new tensor like the query, which engines use as it is (no copy).
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
        out: torch.Tensor | None = None, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Variable-length causal attention: request i's queries are rows
        meta.query_start[i]:meta.query_start[i + 1], its last tokens. `key`/`value`: the
        step's K/V, row t for query row t, as `write_kv` just stored them (views into the
        projections' outputs, each with its own strides); given only to a backend declaring
        `step_kv`."""
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
    if not isinstance(spec, AttentionSpec):  # a dict or None would pass as "no backend declared"
        raise TypeError(f"choose_attention: spec is {spec!r} ({type(spec).__name__}); pass a "
                        "torchhal.attention.AttentionSpec(num_q_heads, num_kv_heads, head_dim, dtype, block_size)")
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
               decode: bool, sliding_window: int | None, soft_cap: float | None, *,
               scale: object, out: torch.Tensor | None = None,
               key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> None:
    """Raise one line naming the bad argument; shared by every backend's entry points.
    Only what is known on the host is checked (no device sync): shapes, dtypes, the
    metadata's host copies and the scalars."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"attention: k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} must both be "
                         "[num_blocks, block_size, num_kv_heads, head_dim]")
    if not query.device == k_cache.device == v_cache.device:
        raise ValueError(f"attention: query is on {query.device}, k_cache on {k_cache.device}, v_cache on "
                         f"{v_cache.device}; put them on one device")
    if meta.slot_mapping.device != query.device:  # the metadata's own tensors share one device (PagedMetadata)
        raise ValueError(f"attention: the metadata is on {meta.slot_mapping.device} but the query is on "
                         f"{query.device}; build the metadata on the query's device")
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
    if meta.block_size is not None and meta.block_size != k_cache.shape[1]:
        raise ValueError(f"attention: the metadata was built for blocks of {meta.block_size} tokens but the cache's "
                         f"blocks hold {k_cache.shape[1]}; build it with the cache's block size")
    bad = outside_on_host(meta.block_tables, k_cache.shape[0])
    if bad is not None:
        raise ValueError(f"attention: the block tables name block {bad}, but the cache has {k_cache.shape[0]} blocks "
                         f"(0..{k_cache.shape[0] - 1}); build the metadata for this cache")
    rows = meta.host_query_start[-1] if meta.host_query_start else None
    if not decode and rows is not None and query.shape[0] != rows:
        raise ValueError(f"attention.prefill: query has {query.shape[0]} rows but the metadata's requests have "
                         f"{rows} query tokens; pass one query row per token")
    if meta.slot_mapping.shape[0] != query.shape[0]:  # metadata without host copies: its slots count the tokens
        raise ValueError(f"attention: the metadata's slot_mapping has {meta.slot_mapping.shape[0]} entries for "
                         f"{query.shape[0]} query rows; one per query token")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.device != query.device):
        raise ValueError(f"attention: out is {tuple(out.shape)} {out.dtype} on {out.device}; it must match the "
                         f"query, {tuple(query.shape)} {query.dtype} on {query.device}")
    if key is not None or value is not None:
        if decode:
            raise ValueError("attention.decode: key/value given; the step's K/V are prefill's (write_kv stores "
                             "a decode step's), pass them to prefill only")
        check_step_kv(query, k_cache, key, value)
    check_window("attention: sliding_window", sliding_window)
    check_positive("attention: soft_cap", soft_cap, optional=True)
    check_positive("attention: scale", scale, optional=False)


def check_step_kv(query: torch.Tensor, k_cache: torch.Tensor, key: torch.Tensor | None,
                  value: torch.Tensor | None) -> None:
    """A step's K/V handed to `prefill`: both or neither, one row per query row, the cache's
    heads, head dim, dtype and device."""
    if key is None or value is None:
        raise ValueError(f"attention.prefill: key is {'None' if key is None else type(key).__name__} and value is "
                         f"{'None' if value is None else type(value).__name__}; pass both of the step's K/V or neither")
    want = (query.shape[0], k_cache.shape[2], k_cache.shape[3])
    for label, tensor in (("key", key), ("value", value)):
        if (not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != want or tensor.dtype != k_cache.dtype
                or tensor.device != k_cache.device):
            shown = (f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}" if isinstance(tensor, torch.Tensor)
                     else type(tensor).__name__)
            raise ValueError(f"attention.prefill: {label} is {shown}; it must be the step's {label}s, {list(want)} "
                             f"(query rows, KV heads, head dim) {k_cache.dtype} on {k_cache.device}")
