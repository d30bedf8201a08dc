"""attention (if declared): every backend the platform supplies equals torchhal's reference
on randomized paged layouts, and replays from a device graph where it says it can (contract 6).

Layouts mix lengths around block boundaries, GQA ratios, padded rows and chunked-prefill
offsets; blocks are shuffled, and every cache slot no request has written (the scratch
block included) holds NaN, as does the output buffer, so reading past a length, from the
wrong block, or leaving a row unwritten shows up as NaN or a mismatch. A backend declaring
`step_kv` is also given the step's K/V (views into the projections' outputs, as engines
pass them) and must still equal the reference.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from torchhal.attention import (
    SCRATCH_BLOCK,
    AttentionBackend,
    AttentionCapability,
    PagedMetadata,
    ReferenceBackend,
    build_metadata,
    write_kv,
)
from torchhal.platforms import Platform

from ._helpers import capture

pytestmark = pytest.mark.conformance("attention")

#: (atol, rtol) per dtype: a float32-accumulating kernel against the float32 reference.
TOLERANCE = {torch.float32: (2e-4, 2e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Case:
    """One randomized layout: per-request context and query lengths, heads, features."""

    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]  # decode: all 1
    q_heads: int = 8
    kv_heads: int = 2
    window: int | None = None
    soft_cap: float | None = None
    spare_columns: int = 2  # block-table width beyond the longest request (a graph bucket's capacity)


# Lengths straddle block boundaries (bs-1, bs, bs+1), one row is long enough to be split
# across programs, and 0 marks a padded row.
_B = BLOCK_SIZE
DECODE_CASES = {
    "mixed_lengths_gqa4": Case((1, _B - 1, 0, _B, _B + 1, 3 * _B + 5, 1500, 0), (1,) * 8),
    "mha": Case((7, _B, 2 * _B + 1, 600), (1,) * 4, q_heads=4, kv_heads=4),
    "mqa": Case((_B + 3, 1, 900), (1,) * 3, q_heads=8, kv_heads=1),
    "gqa8_long": Case((2100, 33), (1,) * 2, q_heads=16, kv_heads=2),
    "window": Case((5, _B + 2, 700, 0), (1,) * 4, window=_B + 3),
    "window_one": Case((3, 2 * _B), (1,) * 2, window=1),
    "soft_cap": Case((9, 300), (1,) * 2, soft_cap=5.0),
    "window_and_soft_cap_gqa": Case((40, 1200), (1,) * 2, q_heads=8, kv_heads=2, window=100, soft_cap=3.0),
}
PREFILL_CASES = {
    "full_prompts": Case((5, _B, 70, 1), (5, _B, 70, 1)),
    "chunked_offsets": Case((40, 3 * _B + 1, 300), (7, _B, 129)),
    # Chunks starting one and two tokens before a multiple of 64 (kernels' usual tile edges).
    "offsets_near_tile_edges": Case((102, 191, 64, 257), (40, 65, 1, 130)),
    "padded_rows": Case((0, 21, 0, 2 * _B), (0, 21, 0, 1)),
    "mha_chunked": Case((50, 33), (20, 33), q_heads=4, kv_heads=4),
    "mqa_chunked": Case((90, 17), (45, 2), q_heads=8, kv_heads=1),
    "window_chunked": Case((200, 37), (150, 37), window=_B + 5),
    "soft_cap_chunked": Case((64, 31), (30, 31), soft_cap=4.0),
}


@dataclass
class Layout:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: PagedMetadata
    scale: float


def paged_layout(case: Case, dtype: torch.dtype, capability: AttentionCapability, device: torch.device,
                 seed: int) -> Layout:
    """Shuffled blocks of a size the backend declares, random values where written, NaN everywhere else."""
    head_dim, block_size = head_dim_for(capability), block_size_for(capability)
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in case.seq_lens]
    num_blocks = sum(counts) + 4
    free = list(range(num_blocks))
    free.remove(SCRATCH_BLOCK)
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(count)] for count in counts]
    shape = (num_blocks, block_size, case.kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    written = build_metadata(tables, case.seq_lens, case.seq_lens, block_size, torch.device("cpu")).slot_mapping
    for cache in (k_cache, v_cache):
        cache.view(-1, case.kv_heads, head_dim)[written] = torch.randn(
            len(written), case.kv_heads, head_dim, generator=generator).to(dtype)
    meta = build_metadata(tables, case.seq_lens, case.query_lens, block_size, device,
                          max_blocks=max(counts) + case.spare_columns)
    query = torch.randn(sum(case.query_lens), case.q_heads, head_dim, generator=generator).to(dtype)
    return Layout(query.to(device), k_cache.to(device), v_cache.to(device), meta, head_dim**-0.5)


def declared_backends(platform: Platform) -> tuple[AttentionBackend, ...]:
    support = platform.attention_support
    # Platform refuses an answer that is not an AttentionSupport; the group runs only where one is declared.
    assert support is not None
    return support.backends


def block_size_for(capability: AttentionCapability) -> int:
    """The cases' block size (16: lengths straddle its boundaries), or the first the backend declares."""
    sizes = capability.block_sizes
    return BLOCK_SIZE if sizes is None or BLOCK_SIZE in sizes else sizes[0]


def head_dim_for(capability: AttentionCapability) -> int:
    dims = capability.head_dims
    return 128 if dims is None or 128 in dims else dims[0]


def applicable(capability: AttentionCapability, case: Case) -> bool:
    """The backend declares the features the case needs."""
    return (case.window is None or capability.sliding_window) and (case.soft_cap is None or capability.soft_cap)


def check_against_reference(platform: Platform, device_index: int, case: Case, name: str, mode: str) -> None:
    device = platform.device(device_index)
    reference = ReferenceBackend()
    ran = 0
    for backend in declared_backends(platform):
        capability = backend.capability
        if (mode == "prefill" and not capability.prefill) or not applicable(capability, case):
            continue
        for dtype in capability.dtypes:
            layout = paged_layout(case, dtype, capability, device, seed=zlib.crc32(f"{name} {dtype}".encode()))
            kwargs: dict[str, Any] = {"scale": layout.scale, "sliding_window": case.window, "soft_cap": case.soft_cap}
            expected = getattr(reference, mode)(layout.query, layout.k_cache, layout.v_cache, layout.meta, **kwargs)
            calls: list[tuple[str, dict[str, Any]]] = [("", {"out": torch.full_like(layout.query, float("nan"))})]
            if mode == "prefill":
                # Engines also take the tensor it returns without `out` (no copy), and hand a
                # backend declaring `step_kv` the step's K/V.
                calls.append((" without `out`", {}))
                if capability.step_kv:
                    key, value = step_kv_views(layout)
                    calls += [(" given the step's K/V", {"key": key, "value": value,
                                                         "out": torch.full_like(layout.query, float("nan"))}),
                              (" given the step's K/V, without `out`", {"key": key, "value": value})]
            for label, extra in calls:
                got = getattr(backend, mode)(layout.query, layout.k_cache, layout.v_cache, layout.meta, **kwargs,
                                             **extra)
                platform.synchronize(device_index)
                check_result(f"{capability.name}.{mode}{label}", got, extra.get("out"), expected, layout,
                             f"{name} ({dtype})")
            ran += 1
    if ran == 0:
        pytest.skip(f"not applicable: no declared backend covers {name} ({mode})")


def check_result(call: str, got: object, out: torch.Tensor | None, expected: torch.Tensor, layout: Layout,
                 where: str) -> None:
    """`got` is the `out` given (if one was), a tensor like the query, and the reference's values."""
    like = (layout.query.shape, layout.query.dtype, layout.query.device)
    assert out is None or got is out, f"{call} did not return the `out` it was given"
    assert isinstance(got, torch.Tensor) and (got.shape, got.dtype, got.device) == like, (
        f"{call} returned {type(got).__name__} {tuple(getattr(got, 'shape', ()))}; return a tensor like the query, "
        f"{like}")
    atol, rtol = TOLERANCE[layout.query.dtype]
    bad = ~torch.isclose(got.float(), expected.float(), atol=atol, rtol=rtol)
    error = float((got.float() - expected.float()).nan_to_num(1e9).abs().max())
    assert not bad.any(), (
        f"{call} differs from the reference on {where}: {int(bad.sum())} of {bad.numel()} values, e.g. token/head "
        f"{bad.nonzero()[0].tolist()[:2]}, max error {error:.3g}"
    )


def projection_views(tokens: int, q_heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as engines pass them: K a view into the rotary output ([tokens, q + kv heads,
    dim]), V a view into the fused QKV projection ([tokens, q + 2 kv heads, dim]). Two
    storages, two row strides, each wider than a K row: a kernel must honour each tensor's
    own strides. Filled with NaN."""
    rotated = torch.full((tokens, q_heads + kv_heads, dim), float("nan"), dtype=dtype, device=device)
    projected = torch.full((tokens, q_heads + 2 * kv_heads, dim), float("nan"), dtype=dtype, device=device)
    return rotated[:, q_heads:], projected[:, q_heads + kv_heads :]


def step_kv_views(layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's K/V for a backend declaring `step_kv`: row t is what `write_kv` stored at
    slot_mapping[t], in the engine's layout (`projection_views`)."""
    (tokens, q_heads, dim), kv_heads = layout.query.shape, layout.k_cache.shape[2]
    key, value = projection_views(tokens, q_heads, kv_heads, dim, layout.k_cache.dtype, layout.k_cache.device)
    slots = layout.meta.slot_mapping.long()
    key.copy_(layout.k_cache.view(-1, kv_heads, dim)[slots])
    value.copy_(layout.v_cache.view(-1, kv_heads, dim)[slots])
    return key, value


@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_matches_the_reference(platform, device_index, name):
    check_against_reference(platform, device_index, DECODE_CASES[name], name, "decode")


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_matches_the_reference(platform, device_index, name):
    check_against_reference(platform, device_index, PREFILL_CASES[name], name, "prefill")


def test_write_kv_stores_each_token_in_its_slot(platform, device_index):
    writes_each_slot(platform, device_index, lambda tokens, heads, dim, dtype, device: (
        torch.randn(tokens, heads, dim).to(dtype=dtype, device=device),
        torch.randn(tokens, heads, dim).to(dtype=dtype, device=device)))


def test_write_kv_reads_views_into_the_projections(platform, device_index):
    """Engines pass K and V as views into the projections' outputs (`projection_views`): a
    token's row stride is wider than its K row, and K's differs from V's, so a writer must
    honour each tensor's strides."""
    def views(tokens: int, heads: int, dim: int, dtype: torch.dtype,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key, value = projection_views(tokens, PREFILL_CASES["padded_rows"].q_heads, heads, dim, dtype, device)
        key.copy_(torch.randn(key.shape)), value.copy_(torch.randn(value.shape))
        return key, value

    writes_each_slot(platform, device_index, views)


def writes_each_slot(platform, device_index, make_kv) -> None:  # noqa: ANN001
    device = platform.device(device_index)
    case = PREFILL_CASES["padded_rows"]
    for backend in declared_backends(platform):
        capability = backend.capability
        dtype = capability.dtypes[0]
        layout = paged_layout(case, dtype, capability, device, seed=7)
        tokens = layout.meta.slot_mapping.shape[0]
        key, value = make_kv(tokens, case.kv_heads, layout.query.shape[2], dtype, device)
        expected_k, expected_v = layout.k_cache.clone(), layout.v_cache.clone()
        write_kv(expected_k, expected_v, key, value, layout.meta.slot_mapping)
        backend.write_kv(layout.k_cache, layout.v_cache, key, value, layout.meta.slot_mapping)
        platform.synchronize(device_index)
        keep = torch.ones(layout.k_cache.shape[0], dtype=torch.bool)
        keep[SCRATCH_BLOCK] = False  # padded rows race on the scratch slot: any of them may win
        for got, want, label in ((layout.k_cache, expected_k, "K"), (layout.v_cache, expected_v, "V")):
            assert torch.equal(got[keep.to(device)].nan_to_num(7.0), want[keep.to(device)].nan_to_num(7.0)), (
                f"{capability.name}.write_kv stored {label} elsewhere than slot_mapping says"
            )


def test_decode_replays_from_a_graph(platform, device_index):
    """Capture decode once; change the query, the cache and the lengths in place; replay."""
    graphs = platform.graph_support
    capturable = [b for b in declared_backends(platform) if b.capability.graph_capture]
    if not capturable:
        pytest.skip("undeclared: no backend declares graph_capture")
    if graphs is None:
        pytest.skip("undeclared: the platform declares no graph support")
    for backend in capturable:
        replay_and_compare(platform, device_index, backend)


def replay_and_compare(platform: Platform, device_index: int, backend: AttentionBackend) -> None:
    capability = backend.capability
    dtype = torch.bfloat16 if torch.bfloat16 in capability.dtypes else capability.dtypes[0]
    layout = paged_layout(DECODE_CASES["mixed_lengths_gqa4"], dtype, capability,
                          platform.device(device_index), seed=11)
    k_cache, v_cache = layout.k_cache.nan_to_num(0.0), layout.v_cache.nan_to_num(0.0)
    # The lengths grow on the device below, as a decode graph's do: no host copies.
    meta = replace(layout.meta, host_seq_lens=None, host_query_start=None)
    query = layout.query.clone()
    out = torch.empty_like(query)

    def step() -> torch.Tensor:
        return backend.decode(query, k_cache, v_cache, meta, scale=layout.scale, out=out)

    graph, _ = capture(platform, device_index, step)
    for _ in range(3):
        query.copy_(torch.randn_like(query))
        k_cache.normal_()
        v_cache.normal_()
        # Every live row not at a block's end grows by one token, inside its last block.
        grows = (meta.seq_lens > 0) & (meta.seq_lens % layout.k_cache.shape[1] != 0)
        meta.seq_lens.add_(grows.to(torch.int32))
        graph.replay()
        platform.synchronize(device_index)
        expected = ReferenceBackend().decode(query, k_cache, v_cache, meta, scale=layout.scale)
        atol, rtol = TOLERANCE[dtype]
        assert torch.allclose(out.float(), expected.float(), atol=atol, rtol=rtol), (
            f"{capability.name}.decode replayed from a graph differs from the reference after the inputs changed"
        )


def test_padded_rows_output_zeros(platform, device_index):
    device = platform.device(device_index)
    case = DECODE_CASES["mixed_lengths_gqa4"]
    padded = [i for i, n in enumerate(case.seq_lens) if n == 0]
    for backend in declared_backends(platform):
        capability = backend.capability
        layout = paged_layout(case, capability.dtypes[0], capability, device, seed=3)
        out = torch.full_like(layout.query, float("nan"))
        backend.decode(layout.query, layout.k_cache, layout.v_cache, layout.meta, scale=layout.scale, out=out)
        platform.synchronize(device_index)
        assert torch.equal(out[padded], torch.zeros_like(out[padded])), (
            f"{capability.name}.decode: padded rows (seq_len 0) must output zeros, got {out[padded].flatten()[:4]}"
        )
