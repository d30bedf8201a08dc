"""Bad input to the attention surfaces is refused in one line that names the value, before
anything is written: K/V writes, metadata builders, backend calls, a plugin's capability and
support records, and the platform's facts. Each case here was accepted (silently wrong, or
failing deep inside torch) before these checks."""

from __future__ import annotations

import math
import re

import pytest
import torch

import torchhal
from torchhal.attention import (
    AttentionCapability,
    AttentionSpec,
    ReferenceBackend,
    build_metadata,
    new_kv_cache,
    write_kv,
)
from torchhal.platforms import AttentionSupport, DistributedSupport, PluginContractError
from torchhal.platforms.testing import patched_plugin

CPU = torch.device("cpu")


def caches(blocks: int = 4, block_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    return new_kv_cache(blocks, block_size, 1, 2, torch.float32, CPU)


# -- K/V writes -----------------------------------------------------------------------------

@pytest.mark.parametrize("slots, message", [
    (torch.tensor([2, 99]), r"slot 99 is outside the cache's 8 slots \(0..7\)"),
    (torch.tensor([2, -1]), "slot -1 is outside the cache's 8 slots"),
    (torch.tensor([2, 3], dtype=torch.int32), r"slot_mapping is \(2,\) torch.int32; it needs one int64 slot"),
])
def test_a_bad_slot_is_refused_before_either_cache_is_written(slots, message):
    k, v = caches()
    with pytest.raises(ValueError, match=message):
        write_kv(k, v, torch.ones(2, 1, 2), torch.ones(2, 1, 2), slots)
    assert not k.any() and not v.any()  # neither half of the pair was written
    write_kv(k, v, torch.ones(2, 1, 2), torch.ones(2, 1, 2), torch.tensor([2, 3]))  # a good call still works
    assert k.view(-1, 1, 2)[2:4].eq(1).all() and v.view(-1, 1, 2)[2:4].eq(1).all()


def test_a_cache_of_the_wrong_rank_is_named_not_indexed():
    k, v = caches()
    with pytest.raises(ValueError, match=r"k_cache \(8, 1, 2\) / v_cache \(8, 1, 2\) must be one layer's pair"):
        write_kv(k.flatten(0, 1), v.flatten(0, 1), torch.ones(1, 1, 2), torch.ones(1, 1, 2), torch.tensor([0]))


# -- metadata -------------------------------------------------------------------------------

@pytest.mark.parametrize("tables, seq_lens, query_lens, message", [
    ([[1, -1]], [3], [1], "request 0 has block id -1; a block id is an int from 1"),
    ([[1, 1.7]], [3], [1], "request 0 has block id 1.7"),
    ([[1, 2**40]], [3], [1], "request 0 has block id 1099511627776"),
    ([[1, 1]], [3], [3], "request 0 names block 1 twice"),
    ([[1, 2], [2, 3]], [4, 4], [1, 1], "request 0 writes block 2 this step, and another request's table has it"),
    ([[2, 3], [1, 2]], [4, 4], [1, 1], "request 1 writes block 2 this step, and another request's table has it"),
    ([[1]], [2.5], [1], "request 0 has seq_len 2.5 and query_len 1; need ints"),
    ([[1]], [2], [True], "request 0 has seq_len 2 and query_len True"),
])
def test_build_metadata_refuses_tables_that_would_alias_slots(tables, seq_lens, query_lens, message):
    with pytest.raises(ValueError, match=message):
        build_metadata(tables, seq_lens, query_lens, 2, CPU)


def test_integer_ids_of_any_kind_are_checked_by_value():
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match="request 0 names block 3 twice"):
        build_metadata([[torch.tensor(3), torch.tensor(3)]], [20], [20], 16, CPU)  # hashed by identity before
    with pytest.raises(ValueError, match="request 0 writes block 3 this step"):
        build_metadata([[np.int64(3)], [torch.tensor(3)]], [5, 5], [5, 5], 16, CPU)
    with pytest.raises(ValueError, match="request 0 has block id 2.5"):  # the bad one named, not the numpy int
        build_metadata([[np.int64(3), 2.5]], [32], [32], 16, CPU)
    meta = build_metadata([[np.int64(3)]], [np.int64(5)], [torch.tensor(1)], np.int64(16), CPU)
    assert meta.slot_mapping.tolist() == [3 * 16 + 4] and meta.host_seq_lens == (5,)


def test_requests_may_share_the_blocks_they_only_read():
    # Both rows decode their third token into their own block; block 1 (positions 0-1) is a
    # prefix both only read, as a shared-prefix cache would give them.
    meta = build_metadata([[1, 2], [1, 3]], [3, 3], [1, 1], 2, CPU)
    assert meta.slot_mapping.tolist() == [4, 6]


@pytest.mark.parametrize("block_size", [0, -4, 2.0, True])
def test_build_metadata_refuses_a_block_size_that_is_not_a_positive_int(block_size):
    with pytest.raises(ValueError, match=f"block_size is {block_size!r}; pass the cache's block size"):
        build_metadata([[1]], [1], [1], block_size, CPU)


# -- backend calls --------------------------------------------------------------------------

def decode_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    k, v = new_kv_cache(4, 2, 1, 4, torch.float32, CPU)
    torch.manual_seed(0)
    k.normal_(), v.normal_()
    return torch.randn(1, 2, 4), k, v, build_metadata([[1, 2]], [3], [1], 2, CPU)


@pytest.mark.parametrize("keywords, message", [
    ({"scale": math.nan}, "scale is nan; pass a finite number > 0"),
    ({"scale": math.inf}, "scale is inf"),
    ({"scale": None}, "scale is None; pass a finite number > 0"),
    ({"scale": 1.0, "soft_cap": math.inf}, "soft_cap is inf; pass None or a finite number > 0"),
    ({"scale": 1.0, "soft_cap": "5"}, "soft_cap is '5'"),
    ({"scale": 1.0, "sliding_window": True}, "sliding_window is True; pass None or an int >= 1"),
    ({"scale": 1.0, "sliding_window": 2.5}, "sliding_window is 2.5"),
    ({"scale": 1.0, "out": torch.zeros(3, 1, 2, 4)}, r"out is \(3, 1, 2, 4\) torch.float32 on cpu; it must match"),
    ({"scale": 1.0, "out": torch.zeros(1, 2, 4, dtype=torch.int32)}, "out is .* torch.int32"),
])
def test_decode_refuses_scalars_that_would_give_nan_or_a_torch_error(keywords, message):
    query, k, v, meta = decode_case()
    with pytest.raises(ValueError, match=message):
        ReferenceBackend().decode(query, k, v, meta, **keywords)
    assert torch.isfinite(ReferenceBackend().decode(query, k, v, meta, scale=0.5)).all()


def test_prefill_refuses_a_query_whose_rows_do_not_match_the_metadata():
    k, v = new_kv_cache(4, 4, 1, 8, torch.float32, CPU)
    meta = build_metadata([[1, 2]], [5], [3], 4, CPU)
    with pytest.raises(ValueError, match="query has 5 rows but the metadata's requests have 3 query tokens"):
        ReferenceBackend().prefill(torch.randn(5, 4, 8), k, v, meta, scale=1.0)
    assert ReferenceBackend().prefill(torch.randn(3, 4, 8), k, v, meta, scale=1.0).shape == (3, 4, 8)


def test_metadata_built_for_another_block_size_is_refused():
    k, v = new_kv_cache(8, 4, 1, 8, torch.float32, CPU)
    query = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="built for blocks of 2 tokens but the cache's blocks hold 4"):
        ReferenceBackend().decode(query, k, v, build_metadata([[1, 2]], [3], [1], 2, CPU), scale=1.0)
    ReferenceBackend().decode(query, k, v, build_metadata([[1]], [3], [1], 4, CPU), scale=1.0)


@pytest.mark.parametrize("field, value", [
    ("sliding_window", True), ("sliding_window", 2.5), ("soft_cap", math.inf), ("soft_cap", True),
])
def test_the_spec_refuses_window_and_cap_values_that_are_not_numbers_of_their_kind(field, value):
    with pytest.raises(ValueError, match=f"AttentionSpec.{field} is {value!r}"):
        AttentionSpec(4, 2, 8, torch.float32, 4, **{field: value})


def test_a_flag_of_the_spec_is_a_bool_not_a_truthy_stand_in() -> None:
    with pytest.raises(TypeError, match="AttentionSpec.needs_graph = 'false' must be True or False"):
        AttentionSpec(4, 2, 8, torch.float32, 16, needs_graph="false")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="AttentionSpec.needs_prefill = 1 must be True or False"):
        AttentionSpec(4, 2, 8, torch.float32, 16, needs_prefill=1)  # type: ignore[arg-type]
    assert AttentionSpec(4, 2, 8, torch.float32, 16, needs_graph=True).needs_graph is True


# -- a plugin's declarations ----------------------------------------------------------------

@pytest.mark.parametrize("field, value, must", [
    ("name", "", "a non-empty str"),
    ("dtypes", torch.float32, "a non-empty tuple of torch dtypes"),
    ("dtypes", (), "a non-empty tuple of torch dtypes"),
    ("head_dims", 128, r"None \(any\) or a non-empty tuple of ints >= 1"),
    ("head_dims", (), r"None \(any\) or a non-empty tuple"),
    ("block_sizes", (16, 0), r"None \(any\) or a non-empty tuple of ints >= 1"),
    ("graph_capture", "false", "True or False"),
    ("note", None, "a str"),
])
def test_a_capability_is_checked_where_the_plugin_declares_it(field, value, must):
    base: dict[str, object] = {"name": "fast", "dtypes": (torch.bfloat16,)}
    with pytest.raises(TypeError, match=f"AttentionCapability.{field} is .*; it must be {must}"):
        AttentionCapability(**{**base, field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("dtypes, named", [
    ((torch.float32, torch.float64), "torch.float64"),
    ((torch.int8,), "torch.int8"),
    ((torch.float8_e4m3fn, torch.bfloat16, torch.float64), "torch.float8_e4m3fn, torch.float64"),
])
def test_a_capability_refuses_dtypes_no_spec_can_ask_for(dtypes, named):
    # Was accepted: never chosen (AttentionSpec refuses the dtype), and the conformance run
    # died with a bare KeyError from its tolerance table.
    with pytest.raises(ValueError, match=rf"AttentionCapability.dtypes is .*, with {named}, which no AttentionSpec "
                                         r"asks for; declare only torch.float32, torch.float16, torch.bfloat16$"):
        AttentionCapability(name="wide", dtypes=dtypes)


def test_every_dtype_a_capability_may_declare_has_a_spec_and_a_conformance_tolerance():
    from torchhal.conformance_tests.test_attention import TOLERANCE

    declarable = []
    for dtype in {value for value in vars(torch).values() if isinstance(value, torch.dtype)}:
        try:
            AttentionCapability(name="one", dtypes=(dtype,))
        except ValueError:
            continue
        declarable.append(dtype)
        AttentionSpec(4, 2, 8, dtype, 4)  # a model can ask for it
        assert dtype in TOLERANCE, f"{dtype} may be declared but the attention conformance clause has no tolerance"
    assert sorted(map(str, declarable)) == ["torch.bfloat16", "torch.float16", "torch.float32"]


class NoWrite:
    capability = AttentionCapability(name="nowrite", dtypes=(torch.float32,))

    def decode(self) -> None: ...

    def prefill(self) -> None: ...


@pytest.mark.parametrize("backends, message", [
    ([ReferenceBackend()], r"AttentionSupport.backends is \[.*\]; it must be a tuple of backends"),
    ((object(),), r"backends\[0\] is <object .*>; a backend needs a `capability`"),
    ((NoWrite(),), r"backends\[0\] is .*NoWrite.* \(missing: write_kv\)"),
])
def test_support_names_the_backend_that_is_not_one(backends, message):
    with pytest.raises(TypeError, match=message):
        AttentionSupport(backends=backends)


@pytest.mark.parametrize("spi, answer", [
    ("attention_support", [ReferenceBackend()]), ("linear_support", "triton"), ("graph_support", 1),
    ("distributed_support", None),
])
def test_a_fact_of_the_wrong_type_is_a_contract_error_at_its_first_read(spi, answer):
    platform = torchhal.get_platform("cpu")
    with patched_plugin(platform, **{spi: lambda: answer}):
        with pytest.raises(PluginContractError, match=f"platform 'cpu': {spi}\\(\\) returned .*; it must return a"):
            getattr(platform, spi)
    restored = getattr(platform, spi)  # the plugin's own answer again, once the patch is gone
    assert isinstance(restored, DistributedSupport) if spi == "distributed_support" else restored is None


@pytest.mark.parametrize("spec", [None, {"num_q_heads": 4, "head_dim": 64}, "llama"], ids=["none", "dict", "str"])
@pytest.mark.parametrize("declares_backend", [False, True], ids=["reference-only", "with-backend"])
def test_choose_attention_refuses_what_is_not_an_attention_spec(spec, declares_backend):
    # Without a backend a bad spec used to return the reference quietly; with one, an AttributeError.
    platform = torchhal.get_platform("cpu")
    support = AttentionSupport((ReferenceBackend(),)) if declares_backend else None
    with patched_plugin(platform, attention_support=lambda: support):
        with pytest.raises(TypeError, match=rf"choose_attention: spec is {re.escape(repr(spec))} "
                                            rf"\({type(spec).__name__}\); pass a torchhal.attention.AttentionSpec"):
            platform.choose_attention(spec)


@pytest.mark.parametrize("max_blocks", [2.0, -3, "4", True])
def test_build_metadata_refuses_a_max_blocks_that_is_no_width(max_blocks: object) -> None:
    from torchhal.attention import build_metadata

    with pytest.raises(ValueError, match=rf"build_metadata: max_blocks is {re.escape(repr(max_blocks))}; pass an int"):
        build_metadata([[1]], [1], [1], 2, torch.device("cpu"), max_blocks=max_blocks)  # type: ignore[arg-type]


def test_write_kv_refuses_a_slice_of_a_cache_naming_it() -> None:
    from torchhal.attention import write_kv

    cache = torch.zeros(4, 4, 2, 8)
    with pytest.raises(ValueError, match=r"write_kv: k_cache / v_cache must be contiguous"):
        write_kv(cache[:, :2], torch.zeros(4, 2, 2, 8), torch.ones(1, 2, 8), torch.ones(1, 2, 8), torch.tensor([3]))
    assert not cache.any()


@pytest.mark.parametrize("call", ["decode", "prefill"])
def test_block_tables_naming_a_block_past_the_cache_are_refused_on_the_host(call: str) -> None:
    from torchhal.attention import ReferenceBackend, build_metadata, new_kv_cache

    k, v = new_kv_cache(4, 2, 1, 4, torch.float32, torch.device("cpu"))  # blocks 0..3
    meta = build_metadata([[1, 9]], [3], [1], 2, torch.device("cpu"))  # block 9: not in this cache
    with pytest.raises(ValueError, match=r"the block tables name block 9, but the cache has 4 blocks \(0..3\)"):
        getattr(ReferenceBackend(), call)(torch.randn(1, 2, 4), k, v, meta, scale=1.0)


def test_numpy_integers_build_a_spec_and_a_cache_as_they_build_metadata() -> None:
    # build_metadata takes numpy ints: so do AttentionSpec and new_kv_cache.
    import numpy

    spec = AttentionSpec(numpy.int64(4), numpy.int32(2), numpy.int64(8), torch.float32, numpy.int64(16),
                         sliding_window=numpy.int64(32), soft_cap=numpy.float32(30.0))
    assert spec == AttentionSpec(4, 2, 8, torch.float32, 16, sliding_window=32, soft_cap=30.0)
    assert all(type(getattr(spec, field)) is int
               for field in ("num_q_heads", "num_kv_heads", "head_dim", "block_size", "sliding_window"))
    assert type(spec.soft_cap) is float  # a kernel is handed plain Python numbers
    k, v = new_kv_cache(numpy.int64(4), numpy.int64(2), 1, numpy.int32(8), torch.float32, CPU)
    assert k.shape == v.shape == (4, 2, 1, 8)
    with pytest.raises(ValueError, match=r"AttentionSpec.head_dim is True; it must be an int >= 1"):
        AttentionSpec(4, 2, True, torch.float32, 16)
    with pytest.raises(ValueError, match=r"new_kv_cache: head_dim is 8.0; pass an int >= 1"):
        new_kv_cache(4, 2, 1, 8.0, torch.float32, CPU)  # type: ignore[arg-type]


@pytest.mark.parametrize("keyword", ["scale", "soft_cap"])
def test_a_numpy_float32_scale_is_refused_with_the_conversion_that_fixes_it(keyword) -> None:
    # It said "scale is np.float32(0.5); pass a finite number > 0" of a finite number > 0.
    import numpy

    query, k, v, meta = decode_case()
    keywords: dict[str, object] = {"scale": 0.5, keyword: numpy.float32(0.5)}
    with pytest.raises(ValueError, match=rf"attention: {keyword} is np.float32\(0.5\), a numpy float32; pass a "
                                         rf"Python float \(float\({keyword}\)\): backends hand it to their kernels"):
        ReferenceBackend().decode(query, k, v, meta, **keywords)  # type: ignore[arg-type]
    ReferenceBackend().decode(query, k, v, meta, **{**keywords, keyword: float(numpy.float32(0.5))})


def _replaced(meta: object, **fields: object) -> object:
    import dataclasses

    return dataclasses.replace(meta, **fields)  # type: ignore[type-var]


# Hand-built metadata unlike what PagedMetadata documents: each failed deep in torch, or gave
# a wrong answer without an error (the tables of a second row ignored, a float length truncated,
# a query row past the metadata's tokens left zero).
@pytest.mark.parametrize("change, message", [
    (lambda m: _replaced(m, block_tables=m.block_tables.repeat(2, 1)),
     r"block_tables has 2 rows but seq_lens 1; give one table row per request"),
    (lambda m: _replaced(m, block_tables=m.block_tables[0]),
     r"block_tables is \(2,\) torch.int32; it must be a 2-D torch.int32 tensor"),
    (lambda m: _replaced(m, seq_lens=m.seq_lens.float() - 0.5),
     r"seq_lens is \(1,\) torch.float32; it must be a 1-D torch.int32 tensor"),
    (lambda m: _replaced(m, block_tables=m.block_tables.long()),
     r"block_tables is \(1, 2\) torch.int64; it must be a 2-D torch.int32 tensor"),
    (lambda m: _replaced(m, seq_lens=None), r"seq_lens is None; it must be a 1-D torch.int32 tensor"),
    (lambda m: _replaced(m, seq_lens=m.seq_lens.to("meta")),
     r"seq_lens is on meta but slot_mapping on cpu; put the metadata's tensors on one device"),
])
def test_metadata_unlike_its_documented_layout_is_refused_where_it_is_made(change, message) -> None:
    *_, meta = decode_case()
    with pytest.raises(ValueError, match=rf"^PagedMetadata: {message}"):
        change(meta)


@pytest.mark.parametrize("call", ["decode", "prefill"])
def test_metadata_for_other_rows_or_another_device_is_refused_at_the_call(call) -> None:
    query, k, v, meta = decode_case()
    hand_built = _replaced(meta, host_seq_lens=None, host_query_start=None)  # no host copy of the token count
    with pytest.raises(ValueError, match=r"^attention: the metadata's slot_mapping has 3 entries for 1 query rows; "
                                         r"one per query token"):
        getattr(ReferenceBackend(), call)(query, k, v, _replaced(hand_built, slot_mapping=meta.slot_mapping.repeat(3)),
                                          scale=1.0)
    on_meta = _replaced(meta, **{field: getattr(meta, field).to("meta")
                                 for field in ("block_tables", "seq_lens", "query_start", "slot_mapping")})
    with pytest.raises(ValueError, match=r"^attention: the metadata is on meta but the query is on cpu; build the "
                                         r"metadata on the query's device"):
        getattr(ReferenceBackend(), call)(query, k, v, on_meta, scale=1.0)
    getattr(ReferenceBackend(), call)(query, k, v, hand_built, scale=1.0)


def test_a_query_on_another_device_than_the_cache_is_named() -> None:
    query, k, v, meta = decode_case()
    with pytest.raises(ValueError, match=r"^attention: query is on meta, k_cache on cpu, v_cache on cpu; put them "
                                         r"on one device"):
        ReferenceBackend().decode(query.to("meta"), k, v, meta, scale=1.0)


def test_a_length_past_int32_is_named_not_a_torch_overflow() -> None:
    # seq_lens are int32 on the device: 2**31 tokens would fail as "value cannot be converted to type int32".
    with pytest.raises(ValueError, match=r"^build_metadata: request 0 has seq_len 2147483648 and query_len 1; need "
                                         r"ints 0 <= query_len <= seq_len < 2\*\*31"):
        build_metadata([[1]], [2**31], [1], 2**31, CPU)
    assert build_metadata([[1]], [2**31 - 1], [1], 2**31 - 1, CPU).host_seq_lens == (2**31 - 1,)
