"""Attention core on the CPU: the reference backend against a plain per-token loop, the
paged layout's writer and metadata (built from host lists, and derived for a step's rows),
the capability record and backend selection through the platform."""

from __future__ import annotations

import math
import random

import pytest
import torch

import torchhal
from torchhal.attention import (
    SCRATCH_BLOCK,
    AttentionCapability,
    AttentionSpec,
    ReferenceBackend,
    build_metadata,
    build_metadata_and_positions,
    choose_backend,
    decode_metadata_for_rows,
    new_kv_cache,
    write_kv,
)
from torchhal.platforms import AttentionSupport
from torchhal.platforms.testing import patched_plugin

CPU = torch.device("cpu")


def naive_attention(query, k_cache, v_cache, tables, seq_lens, query_lens, scale, window, soft_cap):
    """Token by token, head by head: what paged attention means, written plainly."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    row = 0
    for blocks, seq_len, query_len in zip(tables, seq_lens, query_lens, strict=True):
        for t in range(query_len):
            position = seq_len - query_len + t
            first = 0 if window is None else max(0, position - window + 1)
            keys = range(first, position + 1)
            for head in range(query.shape[1]):
                kv = head // group
                k = torch.stack([k_cache[blocks[j // block_size], j % block_size, kv] for j in keys]).double()
                v = torch.stack([v_cache[blocks[j // block_size], j % block_size, kv] for j in keys]).double()
                scores = k @ query[row + t, head].double() * scale
                if soft_cap is not None:
                    scores = soft_cap * torch.tanh(scores / soft_cap)
                out[row + t, head] = torch.softmax(scores, 0) @ v
        row += query_len
    return out


def random_case(seq_lens, query_lens, q_heads, kv_heads, head_dim=8, block_size=4, seed=0):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    counts = [-(-n // block_size) for n in seq_lens]
    free = list(range(1, sum(counts) + 3))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(c)] for c in counts]
    k_cache, v_cache = new_kv_cache(sum(counts) + 3, block_size, kv_heads, head_dim, torch.float32, CPU)
    k_cache.normal_()
    v_cache.normal_()
    query = torch.randn(sum(query_lens), q_heads, head_dim)
    meta = build_metadata(tables, seq_lens, query_lens, block_size, CPU, max_blocks=max(counts) + 1)
    return query, k_cache, v_cache, tables, meta


FEATURES = [(None, None), (3, None), (1, None), (None, 2.5), (5, 4.0)]


@pytest.mark.parametrize("window, soft_cap", FEATURES)
@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_reference_decode_equals_the_per_token_loop(window, soft_cap, q_heads, kv_heads):
    seq_lens = [1, 3, 4, 5, 0, 13]
    query, k, v, tables, meta = random_case(seq_lens, [1] * 6, q_heads, kv_heads)
    got = ReferenceBackend().decode(query, k, v, meta, scale=0.3, sliding_window=window, soft_cap=soft_cap)
    live = [i for i, n in enumerate(seq_lens) if n]
    expected = naive_attention(query[live], k, v, [tables[i] for i in live], [seq_lens[i] for i in live],
                               [1] * len(live), 0.3, window, soft_cap)
    torch.testing.assert_close(got[live].double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[4], torch.zeros_like(got[4]))  # the padded row


@pytest.mark.parametrize("window, soft_cap", FEATURES)
@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_reference_prefill_equals_the_per_token_loop_at_chunk_offsets(window, soft_cap, q_heads, kv_heads):
    seq_lens, query_lens = [9, 4, 0, 17], [9, 2, 0, 5]  # a whole prompt, two chunks at offsets, a padded row
    query, k, v, tables, meta = random_case(seq_lens, query_lens, q_heads, kv_heads, seed=1)
    got = ReferenceBackend().prefill(query, k, v, meta, scale=0.3, sliding_window=window, soft_cap=soft_cap)
    expected = naive_attention(query, k, v, tables, seq_lens, query_lens, 0.3, window, soft_cap)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_prefill_chunks_long_requests_without_changing_the_result(monkeypatch):
    from torchhal.attention import reference

    query, k, v, _, meta = random_case([30, 11], [30, 7], 4, 2, seed=2)
    whole = ReferenceBackend().prefill(query, k, v, meta, scale=0.2, sliding_window=6)
    monkeypatch.setattr(reference, "PREFILL_CHUNK", 4)
    torch.testing.assert_close(ReferenceBackend().prefill(query, k, v, meta, scale=0.2, sliding_window=6), whole)


def test_reference_ignores_whatever_lies_in_unwritten_slots():
    query, k, v, tables, meta = random_case([5, 6], [1, 1], 4, 2, seed=3)
    clean = ReferenceBackend().decode(query, k, v, meta, scale=0.5)
    written = torch.zeros(k.shape[:2], dtype=torch.bool)
    for blocks, n in zip(tables, [5, 6], strict=True):
        for p in range(n):
            written[blocks[p // 4], p % 4] = True
    k[~written], v[~written] = float("nan"), float("inf")
    torch.testing.assert_close(ReferenceBackend().decode(query, k, v, meta, scale=0.5), clean)


def test_write_kv_stores_each_token_at_block_times_size_plus_offset():
    k, v = new_kv_cache(4, 4, 2, 3, torch.float32, CPU)
    key = torch.arange(3 * 2 * 3, dtype=torch.float32).view(3, 2, 3)
    write_kv(k, v, key, -key, torch.tensor([2 * 4 + 1, 3 * 4 + 3, 1 * 4 + 0]))
    assert torch.equal(k[2, 1], key[0]) and torch.equal(k[3, 3], key[1]) and torch.equal(k[1, 0], key[2])
    assert torch.equal(v[3, 3], -key[1])
    assert int((k != 0).any(-1).any(-1).sum()) == 3  # nothing else written


def test_build_metadata_addresses_slots_and_pads_rows_to_scratch():
    meta = build_metadata([[5, 2], [], [7]], [6, 0, 3], [2, 1, 3], block_size=4, device=CPU, max_blocks=3)
    assert meta.block_tables.tolist() == [[5, 2, SCRATCH_BLOCK], [SCRATCH_BLOCK] * 3, [7, SCRATCH_BLOCK, SCRATCH_BLOCK]]
    assert meta.slot_mapping.tolist() == [2 * 4 + 0, 2 * 4 + 1, SCRATCH_BLOCK * 4, 7 * 4 + 0, 7 * 4 + 1, 7 * 4 + 2]
    assert meta.query_start.tolist() == [0, 2, 3, 6] and meta.seq_lens.tolist() == [6, 0, 3]
    assert meta.block_tables.dtype == meta.seq_lens.dtype == meta.query_start.dtype == torch.int32
    assert meta.max_query_len == 3


def test_build_metadata_slots_and_positions_equal_a_per_token_walk():
    """Slots and positions are worked out on the device from the tables and offsets; they
    equal walking every query token of every request on the host (mixed chunk lengths,
    cached tokens before a chunk, padded decode rows, empty prefill rows, block edges)."""
    rng = random.Random(11)
    block_size = 4
    for _ in range(30):
        tables, seq_lens, query_lens = [], [], []
        free = rng.sample(range(1, 64), 63)  # each request's blocks its own, as the engine gives them
        for _ in range(rng.randint(1, 6)):
            kind = rng.random()
            if kind < 0.15:  # a padded row: a decode row writes scratch, a prefill row writes nothing
                tables.append([]), seq_lens.append(0), query_lens.append(rng.choice([0, 1]))
                continue
            seq_len = rng.randint(1, 23)
            blocks = [free.pop() for _ in range(math.ceil(seq_len / block_size))]
            tables.append(blocks), seq_lens.append(seq_len), query_lens.append(rng.randint(1, seq_len))
        meta, given = build_metadata_and_positions(tables, seq_lens, query_lens, block_size, CPU)
        slots, positions = [], []
        for blocks, seq_len, query_len in zip(tables, seq_lens, query_lens, strict=True):
            for position in range(seq_len - query_len, seq_len):
                positions.append(position)
                slots.append(SCRATCH_BLOCK * block_size if seq_len == 0 else
                             blocks[position // block_size] * block_size + position % block_size)
        assert meta.slot_mapping.tolist() == slots and meta.slot_mapping.dtype == torch.int64
        assert given.tolist() == positions


@pytest.mark.parametrize("args, message", [
    (([[1]], [5], [1]), "request 0 \\(5 tokens\\) needs 2 blocks"),
    (([[0, 3]], [5], [1]), "request 0 has block id 0; a block id is an int from 1 .* \\(block 0 is scratch\\)"),
    (([[1]], [2], [3]), "PagedMetadata: request 0 has seq_len 2 and 3 queries"),
    (([[1], [2]], [2], [1]), "2 block tables, 1 seq_lens and 1 query_lens"),
])
def test_build_metadata_refuses_bad_tables_in_one_line(args, message):
    with pytest.raises(ValueError, match=message):
        build_metadata(*args, block_size=4, device=CPU)
    with pytest.raises(ValueError, match="max_blocks is 1, and the longest request needs 3 blocks of 4"):
        build_metadata([[1, 2, 3]], [9], [1], block_size=4, device=CPU, max_blocks=1)


def test_spec_refuses_impossible_models_in_one_line():
    with pytest.raises(ValueError, match="num_q_heads 6 is not a multiple of num_kv_heads 4"):
        AttentionSpec(6, 4, 64, torch.bfloat16, 16)
    with pytest.raises(ValueError, match="AttentionSpec.dtype is torch.int8"):
        AttentionSpec(4, 4, 64, torch.int8, 16)
    with pytest.raises(ValueError, match="AttentionSpec.sliding_window is 0"):
        AttentionSpec(4, 4, 64, torch.float16, 16, sliding_window=0)
    with pytest.raises(ValueError, match="AttentionSpec.head_dim is 0"):
        AttentionSpec(4, 4, 0, torch.float16, 16)


class Declared(ReferenceBackend):
    def __init__(self, **capability) -> None:
        base = {"name": "fast", "dtypes": (torch.bfloat16,), "head_dims": (128,), "graph_capture": False}
        self.capability = AttentionCapability(**{**base, **capability})


SPEC = AttentionSpec(32, 8, 128, torch.bfloat16, 16)


@pytest.mark.parametrize("capability, spec, chosen, why", [
    ({}, SPEC, "fast", "fast: the platform's backend supports this model"),
    ({}, AttentionSpec(32, 8, 128, torch.float16, 16), "reference",
     "reference: passed over fast: dtype torch.float16 is not among torch.bfloat16"),
    ({}, AttentionSpec(32, 8, 64, torch.bfloat16, 16), "reference", "head_dim 64 is not among [128]"),
    ({"block_sizes": (32,)}, SPEC, "reference", "block_size 16 is not among [32]"),
    ({"sliding_window": False}, AttentionSpec(32, 8, 128, torch.bfloat16, 16, sliding_window=4096), "reference",
     "fast: no sliding window"),
    ({"soft_cap": False}, AttentionSpec(32, 8, 128, torch.bfloat16, 16, soft_cap=50.0), "reference",
     "fast: no logit soft-capping"),
    ({"prefill": False}, SPEC, "reference", "fast: no paged prefill"),
    ({}, AttentionSpec(32, 8, 128, torch.bfloat16, 16, needs_graph=True), "reference",
     "fast: decode cannot be captured in a graph"),
])
def test_selection_takes_a_backend_only_for_what_it_declares(capability, spec, chosen, why):
    choice = choose_backend((Declared(**capability),), spec, ReferenceBackend())
    assert choice.name == chosen and why in choice.why


def test_selection_takes_the_first_backend_that_fits():
    narrow, wide = Declared(name="narrow", head_dims=(64,)), Declared(name="wide", head_dims=None)
    choice = choose_backend((narrow, wide), SPEC, ReferenceBackend())
    assert choice.backend is wide


def test_the_platform_asks_its_plugin_once_and_falls_back_on_the_reference():
    platform = torchhal.get_platform("cpu")
    assert platform.attention_support is None
    [reference] = platform.attention_backends
    assert reference.capability.name == "reference"
    assert platform.choose_attention(SPEC).why == "reference: the platform declares no attention backend"
    fast = Declared()
    calls = []

    def attention_support():
        calls.append(1)
        return AttentionSupport(backends=(fast,))

    with patched_plugin(platform, attention_support=attention_support):
        assert platform.choose_attention(SPEC).backend is fast
        assert platform.attention_backends[0] is fast and platform.attention_backends[-1].capability.name == "reference"
        assert platform.choose_attention(AttentionSpec(32, 8, 128, torch.float32, 16)).name == "reference"
        assert len(calls) == 1  # a fact: asked once


def test_reference_decode_is_the_reference_prefill_of_one_token():
    query, k, v, _, meta = random_case([7, 12, 1], [1, 1, 1], 6, 3, seed=9)
    reference = ReferenceBackend()
    torch.testing.assert_close(reference.decode(query, k, v, meta, scale=0.4, soft_cap=3.0),
                               reference.prefill(query, k, v, meta, scale=0.4, soft_cap=3.0))
    assert math.isfinite(float(reference.decode(query, k, v, meta, scale=0.4).sum()))


@pytest.mark.parametrize("window, soft_cap", FEATURES)
@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_decode_over_chosen_rows_equals_those_rows_of_the_prefill(window, soft_cap, q_heads, kv_heads):
    """The last layer attends from the sampled rows alone: decode over their derived metadata must
    give those rows of the whole step's prefill: whole prompts, chunks at offsets (ending inside and
    on a block's edge), decode rows, rows of one request, rows out of order."""
    seq_lens, query_lens = [9, 8, 17, 6, 12], [9, 3, 5, 1, 4]
    query, k, v, tables, meta = random_case(seq_lens, query_lens, q_heads, kv_heads, seed=4)
    reference = ReferenceBackend()
    full = reference.prefill(query, k, v, meta, scale=0.3, sliding_window=window, soft_cap=soft_cap)
    for chosen in ([8, 11, 16, 17, 21], [0, 4, 8], [21, 9, 17], [], [20, 21]):
        rows = torch.tensor(chosen, dtype=torch.int64)
        sub = decode_metadata_for_rows(meta, rows)
        assert sub.max_query_len == 1 and sub.batch == len(chosen) and sub.host_query_start == tuple(
            range(len(chosen) + 1))
        got = reference.decode(query[rows], k, v, sub, scale=0.3, sliding_window=window, soft_cap=soft_cap)
        torch.testing.assert_close(got, full[rows], atol=1e-6, rtol=1e-6)
    # Row 11 is request 1's last query (position 7, one past the first block of 4): context 8.
    sub = decode_metadata_for_rows(meta, torch.tensor([11, 0]))
    assert sub.seq_lens.tolist() == [8, 1] and sub.block_tables[0].tolist() == meta.block_tables[1].tolist()
    assert sub.slot_mapping.tolist() == [meta.slot_mapping[11].item(), meta.slot_mapping[0].item()]


class SpyingBackend(ReferenceBackend):
    """Records the K/V `write_kv` stores and what `prefill` receives, in order; `step_kv`
    declared or not, and with or without `key`/`value` parameters (a backend not declaring
    `step_kv` need not take them)."""

    def __init__(self, step_kv: bool, without_kv: bool) -> None:
        self.capability = AttentionCapability(name="spy", dtypes=(torch.float32,), step_kv=step_kv)
        self.calls: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = []
        if without_kv:
            self.prefill = self.prefill_without_kv  # type: ignore[method-assign]

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping):  # noqa: ANN001
        self.calls.append(("write", key, value))
        super().write_kv(k_cache, v_cache, key, value, slot_mapping)

    def prefill(self, query, k_cache, v_cache, meta, *, key=None, value=None, **kwargs):  # noqa: ANN001
        self.calls.append(("prefill", key, value))
        return super().prefill(query, k_cache, v_cache, meta, key=key, value=value, **kwargs)

    def prefill_without_kv(self, query, k_cache, v_cache, meta, *, scale, sliding_window=None, soft_cap=None,  # noqa: ANN001
                    out=None):
        self.calls.append(("prefill", None, None))
        return super().prefill(query, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window,
                               soft_cap=soft_cap, out=out)


@pytest.mark.parametrize("step_kv, without_kv", [(True, False), (False, False), (False, True)])
def test_the_engine_hands_the_steps_kv_only_to_a_backend_declaring_step_kv(step_kv, without_kv):
    from torchhal.core.engine import EngineConfig, GenerationEngine
    from torchhal.core.model import ModelConfig

    config = EngineConfig(model=ModelConfig(num_heads=4, num_kv_heads=2), max_kv_slots=512, max_batch_tokens=16)
    prompts = [[1, 2, 3], list(range(5, 30))]  # the long one prefills in chunks, the second after cached tokens
    expected = [r.output for r in GenerationEngine(config).generate(prompts, 4)]
    spy = SpyingBackend(step_kv, without_kv)
    platform = torchhal.get_platform("cpu")
    with patched_plugin(platform, attention_support=lambda: AttentionSupport(backends=(spy,))):
        engine = GenerationEngine(config, platform=platform)
        assert engine.attention.backend is spy
        assert [r.output for r in engine.generate(prompts, 4)] == expected
    prefills = [i for i, (kind, _, _) in enumerate(spy.calls) if kind == "prefill"]
    assert len(prefills) >= 2
    for i in prefills:
        _, key, value = spy.calls[i]
        if not step_kv:
            assert key is None and value is None
            continue
        kind, written_key, written_value = spy.calls[i - 1]  # the layer's write, just before
        assert kind == "write" and key is not None and value is not None
        for given, written in ((key, written_key), (value, written_value)):  # the same memory, not a copy
            assert (given.data_ptr(), given.shape, given.stride()) == (written.data_ptr(), written.shape,
                                                                       written.stride())
