"""The CUDA plugin's whole-prompt path (torchhal/plugins/cuda_flash.py), on the CPU: a step's
whole prompts apart from its other requests, their dense call over the step's own K/V or the
cache, and the choice of kernel. FlashAttention-4 is a fake here that computes the real answer,
and its call is checked against flash-attn-4's own signature. The real FA4 runs in tests/test_attention_gpu.py and
the conformance clause on a GPU with the `fa4` extra installed."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import inspect
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from torchhal.attention import ReferenceBackend, build_metadata, new_kv_cache
from torchhal.plugins import cuda_flash

#: flash-attn-4 4.0.0b36's `flash_attn.cute.flash_attn_func` parameters, in order (read from its
#: wheel with `ast`); tests/test_attention_gpu.py checks the installed package against them.
FA4_PARAMETERS = ("q", "k", "v", "qv", "gather_kv_indices", "softmax_scale", "causal", "window_size",
                  "learnable_sink", "softcap", "num_splits", "pack_gqa", "deterministic", "score_mod",
                  "score_mod_bwd", "mask_mod", "aux_tensors", "aux_scalars", "block_sparse_tensors",
                  "block_sparse_tensors_bwd", "return_lse", "gather_bwd_recompute_p", "gather_bwd_token_chunk")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float32 with the KV heads repeated: [count, L, H, D] in and out."""
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.float().transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qt, kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1),
                                         is_causal=True, scale=scale)
    return out.transpose(1, 2).to(q.dtype)


class FakeFa4:
    """`flash_attn.cute` as far as torchhal calls it: records each call, returns (out, lse)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

        def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qv: Any = None,
                            gather_kv_indices: Any = None, softmax_scale: float | None = None,
                            causal: bool = False, **rest: Any) -> tuple[torch.Tensor, None]:
            self.calls.append({"shapes": (q.shape, k.shape, v.shape), "softmax_scale": softmax_scale,
                               "causal": causal, "rest": rest})
            assert causal and softmax_scale is not None
            return reference(q, k, v, softmax_scale).contiguous(), None

        self.module = types.ModuleType("flash_attn.cute")
        self.module.flash_attn_func = flash_attn_func  # type: ignore[attr-defined]


@pytest.fixture
def fa4(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeFa4]:
    """flash-attn-4 "installed" (the fake), an sm_90 device, no capture under way."""
    fake = FakeFa4()
    monkeypatch.delenv("TORCHHAL_CUDA_FA4", raising=False)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake.module)
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "4.0.0b36" if name == cuda_flash.DISTRIBUTION else real_version(name))
    monkeypatch.setattr(cuda_flash, "_capability_major", lambda index: 9)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # CPU tensors here
    monkeypatch.setattr(cuda_flash, "MIN_LENGTH", 32)  # the rule, at lengths the CPU computes quickly
    clear_caches()
    yield fake
    clear_caches()


def clear_caches() -> None:
    cuda_flash.fa4_version.cache_clear()
    cuda_flash._fa4_function.cache_clear()
    cuda_flash._failure.clear()
    cuda_flash.KERNEL_CALLS.clear()


def prompts(count: int = 2, length: int = 37, q_heads: int = 8, kv_heads: int = 2, dim: int = 128,
            dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q as the engine passes it: a view into the rotated [T, Hq + Hk, D] projection."""
    torch.manual_seed(0)
    qk = torch.randn(count * length, q_heads + kv_heads, dim, dtype=dtype)
    q = qk[:, :q_heads].view(count, length, q_heads, dim)
    k = qk[:, q_heads:].view(count, length, kv_heads, dim)
    v = torch.randn(count, length, kv_heads, dim, dtype=dtype)
    return q, k, v


def test_fa4_takes_a_bf16_sm90_call_in_the_engines_layout_and_its_output_is_returned(fa4: FakeFa4) -> None:
    q, k, v = prompts()
    out = cuda_flash.dense_causal(q, k, v, 0.125)
    assert len(fa4.calls) == 1
    assert fa4.calls[0]["shapes"] == (q.shape, k.shape, v.shape)  # [count, L, H, D]: no transposes, no copies
    assert fa4.calls[0]["softmax_scale"] == 0.125 and fa4.calls[0]["rest"] == {}
    torch.testing.assert_close(out, reference(q, k, v, 0.125))
    assert cuda_flash.KERNEL_CALLS == {"fa4": 1}


@pytest.mark.parametrize("case", ["float32", "float16", "sm_80", "head_dim_64", "head_dim_256", "short",
                                  "capturing", "env_off"])
def test_every_other_call_keeps_sdpa(fa4: FakeFa4, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Each condition alone sends the call to SDPA, whose answer is the same attention."""
    dtype, dim, length = torch.bfloat16, 128, 37
    if case in ("float32", "float16"):
        dtype = getattr(torch, case)
    elif case == "short":
        length = 31
    elif case == "sm_80":
        monkeypatch.setattr(cuda_flash, "_capability_major", lambda index: 8)
    elif case == "head_dim_64":
        dim = 64
    elif case == "head_dim_256":
        dim = 256
    elif case == "capturing":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    else:
        cuda_flash.dense_causal(*prompts(), 0.125)  # on, then switched off mid-process: read at every call
        fa4.calls.clear()
        monkeypatch.setenv("TORCHHAL_CUDA_FA4", "0")
    q, k, v = prompts(dim=dim, dtype=dtype, length=length)
    out = cuda_flash.dense_causal(q, k, v, dim**-0.5)
    assert fa4.calls == [] and cuda_flash.KERNEL_CALLS["sdpa"] == 1
    assert out.shape == q.shape
    torch.testing.assert_close(out, reference(q, k, v, dim**-0.5), atol=2e-2, rtol=2e-2)


def test_describe_says_which_kernel_and_why(fa4: FakeFa4, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cuda_flash.describe() == ("whole prompts through FlashAttention-4 (flash-attn-4 4.0.0b36) on sm_90, "
                                     "bf16, head dim 128, prompts of >= 32 tokens; SDPA elsewhere")
    monkeypatch.setenv("TORCHHAL_CUDA_FA4", "0")
    assert cuda_flash.describe() == "whole prompts through SDPA (TORCHHAL_CUDA_FA4=0)"
    monkeypatch.delenv("TORCHHAL_CUDA_FA4")

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    clear_caches()
    assert "pip install 'torchhal[fa4]'" in cuda_flash.describe()
    q, k, v = prompts()
    cuda_flash.dense_causal(q, k, v, 0.125)
    assert fa4.calls == []  # not installed: SDPA, and nothing imported


def test_a_broken_install_warns_once_and_sdpa_serves(fa4: FakeFa4, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # `import flash_attn.cute` raises ImportError
    q, k, v = prompts()
    with pytest.warns(RuntimeWarning, match=r"import flash_attn\.cute`\) failed.*TORCHHAL_CUDA_FA4=0"):
        first = cuda_flash.dense_causal(q, k, v, 0.125)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = cuda_flash.dense_causal(q, k, v, 0.125)
    torch.testing.assert_close(first, second)
    torch.testing.assert_close(first, reference(q, k, v, 0.125), atol=2e-2, rtol=2e-2)


def test_a_failing_call_warns_once_and_sdpa_serves_but_out_of_memory_is_raised(fa4: FakeFa4,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile or launch that fails turns FA4 off for the process (a broken toolchain fails
    every call alike); running out of memory is the engine's to handle, as from any kernel."""
    q, k, v = prompts()
    real = fa4.module.flash_attn_func

    def out_of_memory(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(fa4.module, "flash_attn_func", out_of_memory)
    clear_caches()
    with pytest.raises(torch.OutOfMemoryError):
        cuda_flash.dense_causal(q, k, v, 0.125)
    assert not cuda_flash._failure

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("ptxas exited with 255")

    monkeypatch.setattr(fa4.module, "flash_attn_func", fails)
    clear_caches()
    with pytest.warns(RuntimeWarning, match="FlashAttention-4 call failed .*ptxas exited with 255"):
        out = cuda_flash.dense_causal(q, k, v, 0.125)
    torch.testing.assert_close(out, reference(q, k, v, 0.125), atol=2e-2, rtol=2e-2)
    monkeypatch.setattr(fa4.module, "flash_attn_func", real)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cuda_flash.dense_causal(q, k, v, 0.125)
    assert fa4.calls == [] and cuda_flash.KERNEL_CALLS == {"sdpa": 2}
    assert "FlashAttention-4 failed: call: RuntimeError: ptxas exited with 255" in cuda_flash.describe()


def test_the_fakes_parameters_are_flash_attn_4s() -> None:
    """The fake names FA4's parameters in FA4's order and takes anything else into `rest`,
    which the first test finds empty: torchhal passes only names FA4 has."""
    fake = list(inspect.signature(FakeFa4().module.flash_attn_func).parameters)
    assert fake[-1] == "rest" and tuple(fake[:-1]) == FA4_PARAMETERS[: len(fake) - 1]
    assert {"softmax_scale", "causal"} <= set(fake)


# -- whole prompts apart from the rest of a step, and their dense call ---------------------------
CPU = torch.device("cpu")


def whole_prompt_runs(seq_lens: list[int], query_lens: list[int], window: int | None = None) -> list[tuple[int, ...]]:
    blocks = iter(range(1, 1000))
    tables = [[next(blocks) for _ in range(-(-n // 4))] for n in seq_lens]
    split = cuda_flash.split_whole_prompts(build_metadata(tables, seq_lens, query_lens, 4, CPU), window)
    assert split is not None
    return split.runs


def test_whole_prompts_run_together_only_when_adjacent_and_equally_long() -> None:
    """A dense kernel takes each run as one batch (a reshape of its rows): only prompts that sit
    back to back in the step's rows and are equally long may share one."""
    assert whole_prompt_runs([32, 32, 32], [32, 32, 32]) == [(0, 3, 32)]
    # a shorter prompt ends a run; the equal ones after it start a new one
    assert whole_prompt_runs([4, 4, 3, 3, 4], [4, 4, 3, 3, 4]) == [(0, 2, 4), (8, 2, 3), (14, 1, 4)]
    # rows 8..11 belong to a chunk after cached tokens: the prompts around it stay apart
    assert whole_prompt_runs([4, 4, 8, 4, 4], [4, 4, 4, 4, 4]) == [(0, 2, 4), (12, 2, 4)]
    assert whole_prompt_runs([4, 0, 4], [4, 0, 4]) == [(0, 2, 4)]  # a padded row has no rows to break a run
    assert whole_prompt_runs([4, 9], [4, 9], window=8) == [(0, 1, 4)]  # a window shorter than a prompt cuts into it


def test_split_whole_prompts_parts_a_step_and_the_rest_attends_as_before() -> None:
    """Whole prompts apart; the rest's gathered metadata gives the reference's own numbers."""
    tables, seq_lens, query_lens = [[1], [2, 3], [], [4, 5], [6]], [5, 20, 0, 30, 9], [5, 20, 0, 4, 1]
    meta = build_metadata(tables, seq_lens, query_lens, 16, CPU)
    split = cuda_flash.split_whole_prompts(meta, None)
    assert split is not None and split.runs == [(0, 1, 5), (5, 1, 20)]  # the padded row has no queries
    assert split.rest is not None and split.rest_tokens is not None
    assert split.rest_tokens.tolist() == [25, 26, 27, 28, 29]  # the chunk after 26 cached tokens, the decode row
    expected = build_metadata([[4, 5], [6]], [30, 9], [4, 1], 16, CPU, max_blocks=meta.max_blocks)
    for field in ("block_tables", "seq_lens", "query_start", "slot_mapping"):
        assert torch.equal(getattr(split.rest, field), getattr(expected, field)), field
    k_cache, v_cache = new_kv_cache(8, 16, 2, 32, torch.float32, CPU)
    k_cache.normal_(), v_cache.normal_()
    query = torch.randn(30, 4, 32)
    full = ReferenceBackend().prefill(query, k_cache, v_cache, meta, scale=0.2)
    part = ReferenceBackend().prefill(query[split.rest_tokens], k_cache, v_cache, split.rest, scale=0.2)
    assert torch.allclose(part, full[split.rest_tokens])

    decode_only = build_metadata([[1], [2]], [5, 9], [1, 1], 16, CPU)
    decode_split = cuda_flash.split_whole_prompts(decode_only, None)
    assert decode_split is not None and decode_split.rest is decode_only  # nothing whole: the metadata as it is
    device_built = dataclasses.replace(meta, host_seq_lens=None, host_query_start=None)
    assert cuda_flash.split_whole_prompts(device_built, None) is None  # no host copies: never a device sync


def test_prompt_kv_takes_the_steps_rows_when_given_else_reads_the_cache() -> None:
    meta = build_metadata([[1, 2], [3]], [5, 3], [5, 3], 4, CPU)
    k_cache, v_cache = new_kv_cache(4, 4, 2, 8, torch.float32, CPU)
    k_cache.normal_(), v_cache.normal_()
    key, value = torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    got_k, got_v = cuda_flash.prompt_kv(k_cache, v_cache, meta.slot_mapping, 5, 8, key, value)
    assert got_k.data_ptr() == key[5].data_ptr() and torch.equal(got_v, value[5:8])  # views, not copies
    cached_k, cached_v = cuda_flash.prompt_kv(k_cache, v_cache, meta.slot_mapping, 5, 8)
    slots = meta.slot_mapping[5:8]
    assert torch.equal(cached_k, k_cache.view(-1, 2, 8)[slots]) and torch.equal(cached_v, v_cache.view(-1, 2, 8)[slots])
