"""Fake vendor device modules that mirror the documented API names and record calls.

They prove a plugin's *mapping* onto a vendor API (which names, which arguments,
what is never called). They prove nothing about the vendor runtime itself.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from typing import Any

import torch

MiB = 1 << 20

#: Device modules that define their own `OutOfMemoryError`. torch.xpu (torch 2.13) and
#: torch.npu (torch_npu 2.13) have none: their allocators raise torch.OutOfMemoryError.
VENDOR_OOM_CLASS = frozenset({"cuda", "musa"})
#: Device modules whose device properties have `major`/`minor`; torch.xpu's (torch 2.13) have none.
VENDOR_CAPABILITY = frozenset({"cuda", "musa", "npu"})


class FakeGraph:
    def __init__(self, log: list[tuple]) -> None:
        self.log = log

    def capture_begin(self, pool: Any = None) -> None:
        self.log.append(("capture_begin", pool))

    def capture_end(self) -> None:
        self.log.append(("capture_end",))

    def replay(self) -> None:
        self.log.append(("replay",))


def make_device_module(
    name: str,
    *,
    count: int = 2,
    graph_class: str | None = None,
    mem_get_info_raises: bool = False,
    peer_access: bool = True,
) -> types.ModuleType:
    """A module named torch.<name> with the CUDA-style API; `module.calls` logs every call."""
    module = types.ModuleType(f"torch.{name}")
    calls: list[tuple] = []
    state = {"reserved": {i: 64 * MiB for i in range(count)}, "allocated": {i: 16 * MiB for i in range(count)}}
    module.calls = calls  # type: ignore[attr-defined]
    module.state = state  # type: ignore[attr-defined]

    def record(fn_name: str, result: Any = None):
        def fn(*args: Any, **kwargs: Any) -> Any:
            calls.append((fn_name, *args, *kwargs.values()))
            return result(*args, **kwargs) if callable(result) else result

        fn.__name__ = fn_name
        setattr(module, fn_name, fn)

    def mem_get_info(index: int) -> tuple[int, int]:
        if mem_get_info_raises:
            raise RuntimeError(f"{name}: device does not support querying free memory")
        return (1000 * MiB - state["reserved"][index], 1000 * MiB)

    def empty_cache() -> None:
        for i in state["reserved"]:
            state["reserved"][i] = state["allocated"][i]

    record("is_available", True)
    record("device_count", count)
    record("current_device", 0)
    record("set_device")
    record("synchronize")
    record("mem_get_info", mem_get_info)
    record("memory_reserved", lambda i: state["reserved"][i])
    record("memory_allocated", lambda i: state["allocated"][i])
    record("empty_cache", empty_cache)
    capability = {"major": 9, "minor": 0} if name in VENDOR_CAPABILITY else {}
    record(
        "get_device_properties",
        lambda i: types.SimpleNamespace(name=f"Fake {name.upper()} {i}", total_memory=1000 * MiB, **capability),
    )
    record("Stream", lambda device=None: ("stream", device))
    record("current_stream", lambda i=None: ("stream", i))
    record("Event", lambda: "event")
    record("can_device_access_peer", peer_access)
    record("max_memory_reserved", lambda i: 2 * state["reserved"][i])
    record("max_memory_allocated", lambda i: 2 * state["allocated"][i])
    record("reset_peak_memory_stats")
    record("is_current_stream_capturing", False)
    record("graph_pool_handle", (0, 7))

    @contextlib.contextmanager
    def ctx(kind: str, arg: Any):
        calls.append((kind + ":enter", arg))
        yield
        calls.append((kind + ":exit", arg))

    module.stream = lambda s: ctx("stream", s)  # type: ignore[attr-defined]
    module.device = lambda d: ctx("device", d)  # type: ignore[attr-defined]
    if name in VENDOR_OOM_CLASS:
        module.OutOfMemoryError = type(f"{name.upper()}OutOfMemoryError", (RuntimeError,), {})  # type: ignore[attr-defined]
    if graph_class:
        graph_type = type(graph_class, (FakeGraph,), {"__init__": lambda self: FakeGraph.__init__(self, calls)})
        setattr(module, graph_class, graph_type)
    return module


def names_called(module: types.ModuleType) -> list[str]:
    return [c[0] for c in module.calls]  # type: ignore[attr-defined]


def install_extension(
    monkeypatch, module_name: str, device_name: str, device_module: types.ModuleType
) -> types.ModuleType:
    """Make `import <module_name>` succeed and expose torch.<device_name>."""
    ext = types.ModuleType(module_name)
    ext.__spec__ = importlib.machinery.ModuleSpec(module_name, None)
    ext.__version__ = "9.9-fake"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module_name, ext)
    monkeypatch.setattr(torch, device_name, device_module, raising=False)
    return ext


class _FailingLoader(importlib.machinery.BuiltinImporter):
    pass


def install_broken_extension(monkeypatch, module_name: str, error: BaseException) -> None:
    """`import <module_name>` is found but raises `error` (e.g. torch_npu without CANN)."""

    class Finder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name != module_name:
                return None
            loader = types.SimpleNamespace(
                create_module=lambda spec: None,
                exec_module=lambda module: (_ for _ in ()).throw(error),
            )
            return importlib.machinery.ModuleSpec(name, loader)

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, module_name, raising=False)


# -- torch_npu's fused infer attention (torchhal.plugins.npu_attention maps onto it) ---------


class FakeContractError(ValueError):
    """A call breaks a constraint the vendor documents for the real op."""


class FakeFusedInferAttention:
    """`torch_npu.npu_fused_infer_attention_score` as torch_npu 2.13.0 documents it, in plain
    torch on the CPU, for its page-attention mode with `input_layout="BSND"` (the part torchhal
    maps onto; anything else raises). Its signature is the op's schema, name for name (the
    surface test compares it with the snapshot). `calls` records each call's arguments.

    Semantics, from the op's documentation: key/value are `(num_blocks, block_size, H)` caches
    addressed through `block_table` (int32, `[B, >= blocks of the longest]`);
    `actual_seq_lengths_kv` (host ints, required) are the per-request KV lengths; a query of
    length 1 attends the whole context (mask, `sparse_mode` and `actual_seq_lengths` ignored);
    longer queries need `sparse_mode=3` (right-down causal: query i of q attends key
    j <= kv_len - q + i) with the 2048 x 2048 upper-triangle mask, `actual_seq_lengths` their
    valid lengths, and block sizes that are multiples of 128 up to 512. Output rows the op does
    not define (past a query's length, or a request of KV length 0) come back NaN here, so a
    mapping that reads them shows.
    """

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, pse_shift: Any = None,
        atten_mask: Any = None, actual_seq_lengths: Any = None, actual_seq_lengths_kv: Any = None,
        dequant_scale1: Any = None, quant_scale1: Any = None, dequant_scale2: Any = None, quant_scale2: Any = None,
        quant_offset2: Any = None, antiquant_scale: Any = None, antiquant_offset: Any = None,
        key_antiquant_scale: Any = None, key_antiquant_offset: Any = None, value_antiquant_scale: Any = None,
        value_antiquant_offset: Any = None, block_table: Any = None, query_padding_size: Any = None,
        kv_padding_size: Any = None, key_shared_prefix: Any = None, value_shared_prefix: Any = None,
        actual_shared_prefix_len: Any = None, query_rope: Any = None, key_rope: Any = None,
        key_rope_antiquant_scale: Any = None, num_heads: int = 1, scale: float = 1.0, pre_tokens: int = 2147483647,
        next_tokens: int = 2147483647, input_layout: str = "BSH", num_key_value_heads: int = 0,
        sparse_mode: int = 0, inner_precise: int = 0, block_size: int = 0, antiquant_mode: int = 0,
        key_antiquant_mode: int = 0, value_antiquant_mode: int = 0, softmax_lse_flag: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append({
            "query": query, "key": key, "value": value, "atten_mask": atten_mask,
            "actual_seq_lengths": actual_seq_lengths, "actual_seq_lengths_kv": actual_seq_lengths_kv,
            "block_table": block_table, "num_heads": num_heads, "scale": scale, "input_layout": input_layout,
            "num_key_value_heads": num_key_value_heads, "sparse_mode": sparse_mode, "block_size": block_size,
        })
        unused = {"pse_shift": pse_shift, "query_padding_size": query_padding_size,
                  "kv_padding_size": kv_padding_size, "key_shared_prefix": key_shared_prefix,
                  "antiquant_scale": antiquant_scale, "query_rope": query_rope, "dequant_scale1": dequant_scale1}
        _require(all(v is None for v in unused.values()), f"unmodelled features passed: {unused}")
        _require(input_layout == "BSND", f"input_layout {input_layout!r}: the fake models BSND only")
        _require(query.dim() == 4 and query.is_contiguous(), f"query {tuple(query.shape)} must be a contiguous BSND")
        batch, q_len, q_heads, dim = query.shape
        _require(query.dtype in (torch.float16, torch.bfloat16), f"query dtype {query.dtype}: float16/bfloat16")
        _require(key.dtype == value.dtype == query.dtype, "key/value dtype must match the query's")
        _require(key.dim() == 3 and key.shape == value.shape, f"key {tuple(key.shape)} / value "
                 f"{tuple(value.shape)} must both be (num_blocks, block_size, H)")
        kv_heads = num_key_value_heads or num_heads
        _require(num_heads == q_heads and q_heads % kv_heads == 0 and q_heads // kv_heads <= 64,
                 f"num_heads {num_heads} / num_key_value_heads {num_key_value_heads} vs query heads {q_heads}")
        _require(key.shape[2] == kv_heads * dim <= 65535, f"H {key.shape[2]} != {kv_heads} KV heads x {dim}")
        _require(block_size == key.shape[1] and 0 < block_size <= 512 and block_size % 16 == 0,
                 f"block_size {block_size} (cache blocks hold {key.shape[1]}): 16-aligned, at most 512")
        _require(q_len == 1 or block_size % 128 == 0, f"block_size {block_size}: queries > 1 need multiples of 128")
        _require(isinstance(block_table, torch.Tensor) and block_table.dtype == torch.int32
                 and block_table.dim() == 2 and block_table.shape[0] == batch, "block_table must be int32 [B, n]")
        _require(isinstance(actual_seq_lengths_kv, list) and len(actual_seq_lengths_kv) == batch
                 and all(isinstance(n, int) and 0 <= n <= block_table.shape[1] * block_size
                         for n in actual_seq_lengths_kv), f"actual_seq_lengths_kv {actual_seq_lengths_kv!r}")
        if q_len == 1:
            query_lens = [1] * batch
        else:
            causal = torch.ones(2048, 2048, dtype=torch.bool).triu_(1)
            _require(sparse_mode == 3 and isinstance(atten_mask, torch.Tensor)
                     and torch.equal(atten_mask.cpu(), causal), "queries > 1: the fake models sparse_mode=3 "
                     "with the 2048 x 2048 upper-triangle bool mask")
            _require(isinstance(actual_seq_lengths, list) and len(actual_seq_lengths) == batch
                     and all(isinstance(n, int) and 0 <= n <= q_len for n in actual_seq_lengths),
                     f"actual_seq_lengths {actual_seq_lengths!r}")
            query_lens = actual_seq_lengths
        out = torch.full_like(query, float("nan"))
        for b, (kv_len, rows) in enumerate(zip(actual_seq_lengths_kv, query_lens, strict=True)):
            if kv_len == 0:
                continue
            blocks = block_table[b, : -(-kv_len // block_size)].long()
            keys = key[blocks].reshape(-1, kv_heads, dim)[:kv_len].float()
            values = value[blocks].reshape(-1, kv_heads, dim)[:kv_len].float()
            group = q_heads // kv_heads  # query head h reads KV head h // group
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
            for i in range(rows):
                last = kv_len - rows + i  # right-down causal
                scores = torch.einsum("lhd,hd->hl", keys[: last + 1], query[b, i].float()) * scale
                weights = torch.softmax(scores, dim=-1)
                out[b, i] = torch.einsum("hl,lhd->hd", weights, values[: last + 1]).to(query.dtype)
        return out, torch.zeros(1)


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise FakeContractError(f"npu_fused_infer_attention_score: {what}")


def install_npu_attention(ext: types.ModuleType) -> FakeFusedInferAttention:
    """Give a fake torch_npu (`install_extension`) its fused infer attention op."""
    fake = FakeFusedInferAttention()
    ext.npu_fused_infer_attention_score = fake  # type: ignore[attr-defined]
    return fake
