"""The model vocabulary under hostile input: each bad value is refused where it is given,
naming it and the fix, before a layer runs or a cache is written (not a deep torch error,
and never a silently wrong answer)."""

from __future__ import annotations

import re

import pytest
import torch

from torchhal.attention import ReferenceBackend
from torchhal.core.model import AttentionMetadata, KVCache, ModelConfig, ReferenceDecoder

CPU = torch.device("cpu")
BLOCK = 4


def cached_model() -> ReferenceDecoder:
    model = ReferenceDecoder(ModelConfig(num_layers=1)).eval()
    model.kv = KVCache(model.config, 16, BLOCK, CPU, torch.float32)
    return model


def prefill_meta() -> AttentionMetadata:
    return AttentionMetadata.build([[1, 2]], [3], [3], BLOCK, CPU)


@pytest.mark.parametrize(("change", "message"), [
    # One position for three tokens broadcast over them all: every token rotated as the first.
    ({"positions": torch.tensor([0])}, r"AttentionMetadata: positions is \(1,\) torch.int64; it must be a 1-D "
                                       r"integer tensor of one position per token \(3, as slot_mapping\)"),
    ({"positions": torch.tensor([[0, 1, 2]])}, r"positions is \(1, 3\) torch.int64; it must be a 1-D"),
    ({"positions": torch.tensor([0.0, 1.0, 2.5])}, r"positions is \(3,\) torch.float32; it must be a 1-D integer"),
    ({"positions": [0, 1, 2]}, r"positions is \[0, 1, 2\]; it must be a 1-D integer tensor"),
    ({"decode": "no"}, r"AttentionMetadata: decode is 'no'; it must be True or False"),
])
def test_hand_built_attention_metadata_is_refused_where_it_is_made(change, message):
    good = prefill_meta()
    fields = {"paged": good.paged, "positions": good.positions, "backend": ReferenceBackend(), "decode": False}
    with pytest.raises(ValueError, match=message):
        AttentionMetadata(**{**fields, **change})
    model = cached_model()
    expected = model.forward(torch.tensor([1, 2, 3]), AttentionMetadata(**fields))  # the same, well formed
    assert expected.shape == (3, model.config.hidden_size)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, "float32"])
def test_a_kv_cache_of_a_non_floating_dtype_is_refused(dtype):
    # An integer cache truncated every K and V written into it: wrong tokens, no error.
    with pytest.raises(ValueError, match=rf"KVCache: dtype is {dtype!r}; pass the floating torch.dtype the model "
                                         r"runs in, e.g. torch.bfloat16"):
        KVCache(ModelConfig(num_layers=1), 4, BLOCK, CPU, dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("config", [{"vocab_size": 64}, None, "llama"])
def test_a_decoder_of_something_else_than_a_model_config_is_refused_naming_it(config):
    from torchhal.core.model import LlamaDecoder

    with pytest.raises(TypeError, match=rf"LlamaDecoder: config is a {type(config).__name__}, not a ModelConfig; "
                                        r"pass ModelConfig\(...\) \(a checkpoint's: load_checkpoint\(path\)\)"):
        LlamaDecoder(config)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=rf"LlamaDecoder: config is a {type(config).__name__}"):
        ReferenceDecoder(config)  # type: ignore[arg-type]


def test_the_plans_type_error_names_a_way_to_a_config_that_exists():
    from torchhal.core.model.parallel import TensorParallelPlan

    with pytest.raises(TypeError) as refused:
        TensorParallelPlan({"num_attention_heads": 4}, 2)  # type: ignore[arg-type]
    assert "ModelConfig.from_hf" not in str(refused.value)  # there is no such method
    assert "config_from_hf" in str(refused.value)
    from torchhal.core.model.checkpoint import config_from_hf  # the one it names

    assert callable(config_from_hf)


@pytest.mark.parametrize("rank", [2, -1, True, 1.0])
def test_a_plans_slices_refuse_a_rank_outside_it(rank):
    from torchhal.core.model.parallel import TensorParallelPlan

    plan = TensorParallelPlan(ModelConfig(num_heads=4, num_kv_heads=2), 2)
    for method in (plan.head_range, plan.kv_head_range, plan.intermediate_range, plan.vocab_range):
        # rank 2 of 2 gave heads 4..5 of a 4-head model, rank -1 negative ones: slices of nothing, no error
        with pytest.raises(ValueError, match=rf"tensor-parallel rank {rank!r} must be an int in 0..1"):
            method(rank)
    assert plan.head_range(1) == range(2, 4) and plan.vocab_range(1) == range(256, 512)


@pytest.mark.parametrize("logits", [torch.zeros(10), torch.zeros(2, 3, 10)], ids=["1-D", "3-D"])
def test_greedy_tokens_name_logits_of_the_wrong_shape(logits):
    from torchhal.core.model.greedy import greedy_tokens

    shape = tuple(logits.shape)
    with pytest.raises(ValueError, match=rf"greedy_tokens: logits are {re.escape(str(shape))}; expected \[rows, "
                                         r"vocab\] \(Model.logits returns one row per index it is given\)"):
        greedy_tokens(logits)


@pytest.mark.parametrize("support", ["triton", 1])
def test_use_linear_refuses_what_is_not_a_linear_support(support):
    model = cached_model()
    with pytest.raises(TypeError, match=rf"linear support {support!r} is not a LinearSupport; pass "
                                        r"platform.linear_support \(None: F.linear everywhere\)"):
        model.use_linear(support)  # type: ignore[arg-type]
