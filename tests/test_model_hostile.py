"""The model vocabulary under hostile input: each bad value is refused where it is given,
naming it and the fix, before a layer runs or a cache is written (not a deep torch error,
and never a silently wrong answer)."""

from __future__ import annotations

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