"""Bad input to the attention surfaces is refused in one line that names the value, where it
is made: the metadata (built from host lists or by hand), the model's spec, a plugin's
capability and support records, and the platform's facts. Each case would otherwise be read
by a backend, which trusts what these admitted: silently wrong, or failing deep inside torch."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

import torchhal
from torchhal.attention import (
    AttentionCapability,
    AttentionSpec,
    PagedMetadata,
    ReferenceBackend,
    build_metadata,
    new_kv_cache,
)
from torchhal.platforms import AttentionSupport, DistributedSupport, PluginContractError
from torchhal.platforms.testing import patched_plugin

CPU = torch.device("cpu")


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
        build_metadata([[torch.tensor(3), torch.tensor(3)]], [20], [20], 16, CPU)  # a torch int hashes by identity
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


# -- the spec -------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("sliding_window", True), ("sliding_window", 2.5), ("soft_cap", math.inf), ("soft_cap", True),
])
def test_the_spec_refuses_window_and_cap_values_that_are_not_numbers_of_their_kind(field, value):
    with pytest.raises(ValueError, match=f"AttentionSpec.{field} is {value!r}"):
        AttentionSpec(4, 2, 8, torch.float32, 4, **{field: value})


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
    # Never chosen (AttentionSpec refuses the dtype), and the conformance run would die with a
    # bare KeyError from its tolerance table.
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
    # Without a backend a bad spec would return the reference quietly; with one, an AttributeError.
    platform = torchhal.get_platform("cpu")
    support = AttentionSupport((ReferenceBackend(),)) if declares_backend else None
    with patched_plugin(platform, attention_support=lambda: support):
        with pytest.raises(TypeError, match=rf"choose_attention: spec is {re.escape(repr(spec))} "
                                            rf"\({type(spec).__name__}\); pass a torchhal.attention.AttentionSpec"):
            platform.choose_attention(spec)


@pytest.mark.parametrize("max_blocks", [2.0, -3, "4", True])
def test_build_metadata_refuses_a_max_blocks_that_is_no_width(max_blocks: object) -> None:
    from torchhal.attention import build_metadata

    with pytest.raises(ValueError, match=rf"build_metadata: max_blocks is {re.escape(repr(max_blocks))}, and the "
                                         r"longest request needs 1 blocks of 2; pass an int >= 1"):
        build_metadata([[1]], [1], [1], 2, torch.device("cpu"), max_blocks=max_blocks)  # type: ignore[arg-type]


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


def decode_step() -> PagedMetadata:
    """One decode row of 3 tokens in blocks 1, 2 of 2 tokens (a 4-token table row)."""
    return build_metadata([[1, 2]], [3], [1], 2, CPU)


def by_hand(meta: PagedMetadata, **fields: object) -> PagedMetadata:
    """`meta` with `fields` replaced and no host copies: built by hand, as a vendor's test or
    another engine would, so the constructor reads the host tensors themselves."""
    return dataclasses.replace(meta, **{"host_seq_lens": None, "host_query_start": None, **fields})  # type: ignore[arg-type]


def int32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# Hand-built metadata unlike what PagedMetadata documents: each would fail deep in torch, or
# give a wrong answer without an error (the tables of a second row ignored, a float length
# truncated, a query row past the metadata's tokens left zero).
@pytest.mark.parametrize("change, message", [
    (lambda m: by_hand(m, block_tables=m.block_tables.repeat(2, 1)),
     r"block_tables has 2 rows and query_start 2 entries for 1 seq_lens; give one table row per request"),
    (lambda m: by_hand(m, block_tables=m.block_tables[0]),
     r"block_tables is \(2,\) torch.int32; it must be a 2-D torch.int32 tensor"),
    (lambda m: by_hand(m, seq_lens=m.seq_lens.float() - 0.5),
     r"seq_lens is \(1,\) torch.float32; it must be a 1-D torch.int32 tensor"),
    (lambda m: by_hand(m, block_tables=m.block_tables.long()),
     r"block_tables is \(1, 2\) torch.int64; it must be a 2-D torch.int32 tensor"),
    (lambda m: by_hand(m, seq_lens=None), r"seq_lens is None; it must be a 1-D torch.int32 tensor"),
    (lambda m: by_hand(m, seq_lens=m.seq_lens.to("meta")),
     r"seq_lens is on meta but slot_mapping on cpu; put the tensors on one device"),
])
def test_metadata_unlike_its_documented_layout_is_refused_where_it_is_made(change, message) -> None:
    with pytest.raises(ValueError, match=rf"^PagedMetadata: {message}"):
        change(decode_step())


# Lengths and offsets that do not fit the tensors they address, each of which a backend would
# read as it is: a context past its table row attends only the tokens the row holds, a
# query_start past the step's rows fails inside torch in the reference prefill, offsets that
# fall back give a request rows of another.
@pytest.mark.parametrize("fields, message", [
    ({"seq_lens": int32(5)}, r"request 0 has seq_len 5 and 1 queries; need 0 <= queries <= seq_len <= 4 "
                             r"\(its table row: 2 blocks of 2\)"),
    ({"host_seq_lens": (5,), "host_query_start": (0, 1)}, "request 0 has seq_len 5 and 1 queries"),
    ({"seq_lens": int32(-1)}, "request 0 has seq_len -1"),
    ({"query_start": int32(0, 3)}, r"query_start is \[0, 3\]; it must rise from 0 to the step's 1 tokens"),
    ({"query_start": int32(-1, 1)}, r"query_start is \[-1, 1\]"),
    ({"seq_lens": int32(3, 3), "block_tables": int32(1, 2, 3, 4).view(2, 2), "query_start": int32(0, 2, 1)},
     r"query_start is \[0, 2, 1\]"),
    ({"max_query_len": 0}, "max_query_len is 0 but a request has 1 queries"),
    ({"seq_lens": int32(0), "query_start": int32(0, 2), "slot_mapping": torch.zeros(2, dtype=torch.int64),
      "max_query_len": 2}, r"request 0 has seq_len 0 and 2 queries; .* or a padded row \(seq_len 0, at most one"),
    ({"block_size": 0}, "block_size is 0; it must be an int >= 1"),
    ({"block_size": True}, "block_size is True; it must be an int >= 1"),
])
def test_lengths_and_offsets_that_do_not_fit_the_metadata_are_refused_where_it_is_made(fields, message) -> None:
    with pytest.raises(ValueError, match=rf"^PagedMetadata: {message}"):
        by_hand(decode_step(), **fields)
    by_hand(decode_step())  # the same metadata, as it was built, is admitted by hand too


def test_metadata_records_the_block_size_its_slots_were_worked_out_for() -> None:
    """Without it a backend cannot know the metadata addresses its cache's blocks: a table
    built for blocks of 2 read with blocks of 4 attends other tokens, without an error."""
    meta = decode_step()
    with pytest.raises(TypeError, match="block_size"):
        PagedMetadata(meta.block_tables, meta.seq_lens, meta.query_start, meta.slot_mapping, 1)  # type: ignore[call-arg]
    assert PagedMetadata(meta.block_tables, meta.seq_lens, meta.query_start, meta.slot_mapping, 1, 2).block_size == 2


def test_device_metadata_is_admitted_without_a_device_read(monkeypatch) -> None:
    """On a device (here `meta`, which holds no values) only the host copies are checked: the
    constructor never reads a device tensor."""
    meta = decode_step()
    on_device = {field: getattr(meta, field).to("meta")
                 for field in ("block_tables", "seq_lens", "query_start", "slot_mapping")}
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("read a tensor on the host"))
    dataclasses.replace(meta, **on_device)  # type: ignore[arg-type]
    by_hand(meta, **on_device)
    with pytest.raises(ValueError, match="request 0 has seq_len 9"):
        dataclasses.replace(meta, **on_device, host_seq_lens=(9,))  # type: ignore[arg-type]


def test_a_flag_of_the_spec_is_a_bool_not_a_truthy_stand_in() -> None:
    with pytest.raises(TypeError, match="AttentionSpec.needs_graph = 'false' must be True or False"):
        AttentionSpec(4, 2, 8, torch.float32, 16, needs_graph="false")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="AttentionSpec.needs_prefill = 1 must be True or False"):
        AttentionSpec(4, 2, 8, torch.float32, 16, needs_prefill=1)  # type: ignore[arg-type]
    assert AttentionSpec(4, 2, 8, torch.float32, 16, needs_graph=True).needs_graph is True


def test_a_length_past_int32_is_named_not_a_torch_overflow() -> None:
    # seq_lens are int32 on the device: 2**31 tokens would fail as "value cannot be converted to type int32".
    with pytest.raises(ValueError, match=r"^build_metadata: request 0 has seq_len 2147483648 and query_len 1; need "
                                         r"ints 0 <= query_len <= seq_len < 2\*\*31"):
        build_metadata([[1]], [2**31], [1], 2**31, CPU)
    assert build_metadata([[1]], [2**31 - 1], [1], 2**31 - 1, CPU).host_seq_lens == (2**31 - 1,)
