"""Mapping tests of the vendor plugins' attention backends (no vendor hardware here).

The NPU backend runs against a fake `torch_npu.npu_fused_infer_attention_score`
(tests/fakes.py) that checks the op's documented constraints, records the call and computes
the documented result on the CPU, so the layout conversions are checked numerically against
torchhal's reference on the attention clause's cases. Nothing here says the kernels run on
Ascend, ROCm, XPU or MUSA devices.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import zlib

import pytest
import torch

from torchhal.attention import AttentionSpec, ReferenceBackend, build_metadata, choose_backend
from torchhal.conformance_tests import test_attention as clause
from torchhal.plugins.musa import MusaPlatform
from torchhal.plugins.npu import NpuPlatform
from torchhal.plugins.npu_attention import NpuFusedAttention
from torchhal.plugins.rocm import RocmPlatform
from torchhal.plugins.xpu import XpuPlatform

from .fakes import (
    FakeContractError,
    install_broken_extension,
    install_extension,
    install_npu_attention,
    make_device_module,
)

NPU_BLOCK = 128  # FIA's page attention takes multiples of 128 once a query is longer than 1


@pytest.fixture
def npu(monkeypatch):
    ext = install_extension(monkeypatch, "torch_npu", "npu", make_device_module("npu", graph_class="NPUGraph"))
    return types.SimpleNamespace(ext=ext, op=install_npu_attention(ext), plugin=NpuPlatform())


def spec(**overrides) -> AttentionSpec:
    fields = {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 128, "dtype": torch.bfloat16, "block_size": NPU_BLOCK}
    return AttentionSpec(**{**fields, **overrides})


# -- declaration and selection ------------------------------------------------------------


def test_npu_declares_fused_attention_when_torch_npu_has_the_op(npu):
    support = npu.plugin.attention_support()
    assert [type(b) for b in support.backends] == [NpuFusedAttention]
    choice = choose_backend(support.backends, spec(), ReferenceBackend())
    assert choice.name == "npu-fused-infer-attention"


@pytest.mark.parametrize("overrides, reason", [
    ({"dtype": torch.float32}, "dtype torch.float32"),
    ({"block_size": 16}, "block_size 16"),
    ({"head_dim": 72}, "head_dim 72"),
    ({"sliding_window": 4096}, "no sliding window"),
    ({"soft_cap": 30.0}, "no logit soft-capping"),
    ({"needs_graph": True}, "decode cannot be captured"),
])
def test_models_fia_cannot_run_get_the_reference_and_say_why(npu, overrides, reason):
    choice = choose_backend(npu.plugin.attention_support().backends, spec(**overrides), ReferenceBackend())
    assert choice.name == "reference" and reason in choice.why


def test_npu_without_the_op_runs_the_reference_and_says_why(monkeypatch, caplog):
    ext = install_extension(monkeypatch, "torch_npu", "npu", make_device_module("npu"))
    plugin = NpuPlatform()
    with caplog.at_level(logging.INFO, logger="torchhal.plugins"):
        assert plugin.attention_support() is None
    why = f"torch_npu {ext.__version__} has no npu_fused_infer_attention_score"
    assert why in plugin.attention_missing() and why in caplog.text


def test_npu_attention_missing_names_an_absent_or_broken_torch_npu(monkeypatch):
    monkeypatch.setattr("torchhal.plugins.npu.module_installed", lambda name: False)
    assert NpuPlatform().attention_missing() == "torch_npu is not installed"
    monkeypatch.undo()
    install_broken_extension(monkeypatch, "torch_npu", RuntimeError("libascendcl.so: cannot open"))
    assert NpuPlatform().attention_missing() == (
        "torch_npu failed to import: RuntimeError: libascendcl.so: cannot open")


# -- the call: names, layouts, dtypes -----------------------------------------------------


def small_layout(query_lens, seq_lens=(5, 0, 130), q_heads=8, kv_heads=2, dim=64, dtype=torch.float16):
    tables = [[3], [], [1, 4]]
    meta = build_metadata(tables, list(seq_lens), list(query_lens), NPU_BLOCK, torch.device("cpu"), max_blocks=3)
    k_cache = torch.randn(5, NPU_BLOCK, kv_heads, dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    query = torch.randn(sum(query_lens), q_heads, dim).to(dtype)
    return query, k_cache, v_cache, meta


def test_decode_passes_the_cache_as_a_view_and_the_metadata_as_fia_wants_it(npu):
    query, k_cache, v_cache, meta = small_layout((1, 1, 1), seq_lens=(5, 0, 130))
    NpuFusedAttention().decode(query, k_cache, v_cache, meta, scale=0.125)
    (call,) = npu.op.calls
    assert call["key"].shape == (5, NPU_BLOCK, 2 * 64) and call["key"].data_ptr() == k_cache.data_ptr()
    assert call["value"].data_ptr() == v_cache.data_ptr()  # views of the paged cache: no copy
    assert call["block_table"] is meta.block_tables and call["block_table"].dtype == torch.int32
    assert call["actual_seq_lengths_kv"] == [5, 0, 130]
    assert call["query"].shape == (3, 1, 8, 64) and call["input_layout"] == "BSND"
    assert (call["num_heads"], call["num_key_value_heads"], call["block_size"]) == (8, 2, NPU_BLOCK)
    assert call["scale"] == 0.125 and call["atten_mask"] is None and call["actual_seq_lengths"] is None


def test_prefill_pads_queries_per_request_and_asks_for_right_down_causal(npu):
    query, k_cache, v_cache, meta = small_layout((5, 0, 3), seq_lens=(5, 0, 130))
    NpuFusedAttention().prefill(query, k_cache, v_cache, meta, scale=0.125)
    (call,) = npu.op.calls
    assert call["query"].shape == (3, 5, 8, 64)
    assert torch.equal(call["query"][2, :3], query[5:8])  # request 2's rows at its own positions
    assert call["actual_seq_lengths"] == [5, 0, 3] and call["sparse_mode"] == 3
    assert call["atten_mask"].shape == (2048, 2048) and call["atten_mask"].dtype == torch.bool


def test_lengths_come_from_the_host_copy_without_a_device_read(npu, monkeypatch):
    query, k_cache, v_cache, meta = small_layout((1, 1, 1))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("read lengths from the device"))
    NpuFusedAttention().decode(query, k_cache, v_cache, meta, scale=0.125)
    assert npu.op.calls[0]["actual_seq_lengths_kv"] == list(meta.host_seq_lens)


def test_metadata_worked_out_on_the_device_gives_fia_its_lengths_read_back(npu):
    """Metadata with no host copy (as the decode graph's, worked out on the device): the lengths
    FIA takes on the host are read from the device."""
    query, k_cache, v_cache, meta = small_layout((1, 1, 1))
    device_built = dataclasses.replace(meta, host_seq_lens=None, host_query_start=None)
    NpuFusedAttention().decode(query, k_cache, v_cache, device_built, scale=0.125)
    assert npu.op.calls[0]["actual_seq_lengths_kv"] == [5, 0, 130]


def test_the_fake_refuses_what_the_op_documents_as_invalid(npu):
    """The fake is only as good as its checks: a mapping error it must catch."""
    query, k_cache, v_cache, meta = small_layout((5, 0, 3))
    with pytest.raises(FakeContractError, match="sparse_mode=3"):
        npu.op(query.new_zeros(3, 5, 8, 64), k_cache.flatten(2), v_cache.flatten(2), block_table=meta.block_tables,
               actual_seq_lengths=[5, 0, 3], actual_seq_lengths_kv=[5, 0, 130], num_heads=8,
               num_key_value_heads=2, input_layout="BSND", block_size=NPU_BLOCK, sparse_mode=2)


# -- numbers: the mapping equals torchhal's reference on the attention clause's cases -------


def clause_cases():
    for mode, cases in (("decode", clause.DECODE_CASES), ("prefill", clause.PREFILL_CASES)):
        for name, case in cases.items():
            if case.window is None and case.soft_cap is None:  # FIA: neither declared
                yield pytest.param(mode, name, case, id=f"{mode}-{name}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode, name, case", list(clause_cases()))
def test_npu_mapping_equals_the_reference_on_the_clause_cases(npu, monkeypatch, mode, name, case, dtype):
    capability = NpuFusedAttention.capability  # the clause lays out blocks of a size it declares
    assert clause.block_size_for(capability) == NPU_BLOCK
    layout = clause.paged_layout(case, dtype, capability, torch.device("cpu"),
                                 seed=zlib.crc32(f"{name} {dtype}".encode()))
    kwargs = {"scale": layout.scale}
    expected = getattr(ReferenceBackend(), mode)(layout.query, layout.k_cache, layout.v_cache, layout.meta, **kwargs)
    out = torch.full_like(layout.query, float("nan"))
    got = getattr(NpuFusedAttention(), mode)(layout.query, layout.k_cache, layout.v_cache, layout.meta, out=out,
                                             **kwargs)
    assert got is out and len(npu.op.calls) == 1
    atol, rtol = clause.TOLERANCE[dtype]
    bad = ~torch.isclose(got.float(), expected.float(), atol=atol, rtol=rtol)
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} values differ, e.g. {bad.nonzero()[0].tolist()}"



# -- ROCm, XPU, MUSA: no vendor entry point mapped, the reference runs, and they say why ----


@pytest.mark.parametrize("plugin_class, because", [
    (RocmPlatform, "Triton kernels are tuned for NVIDIA GPUs and not verified on AMD hardware"),
    (XpuPlatform, "intel_extension_for_pytorch's PagedAttention is not mapped (IPEX is retired"),
    (MusaPlatform, "torch_musa has no public paged-attention entry point"),
])
def test_reference_only_platforms_declare_nothing_and_say_why(monkeypatch, caplog, plugin_class, because):
    # Triton "installed": ROCm must still not inherit the CUDA plugin's Triton declaration.
    monkeypatch.setattr("torchhal.plugins.cuda.importlib.util.find_spec", lambda name: object())
    plugin = plugin_class()
    with caplog.at_level(logging.INFO, logger="torchhal.plugins"):
        assert plugin.attention_support() is None
    assert because in plugin.attention_missing() and because in caplog.text
    assert f"{plugin.name}: no vendor attention backend" in caplog.text
