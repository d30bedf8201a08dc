"""The reference decoder: causal attention through the KV pool, and its metadata."""

import torch

from torchhal.core.model import AttentionMetadata, KVCache, ModelConfig, ReferenceDecoder

CPU = torch.device("cpu")


def fresh_model():
    model = ReferenceDecoder(ModelConfig())
    model.kv = KVCache(model.config, 64, CPU, torch.float32)
    return model


def test_prefill_equals_token_by_token_decode():
    model = fresh_model()
    prefill = model(torch.tensor([1, 2, 3, 4, 5]), AttentionMetadata.build([[0, 1, 2], [3, 4]], [3, 2], CPU))
    stepwise = fresh_model()
    outs = [stepwise(torch.tensor([t]), AttentionMetadata.build([list(range(10, 11 + i))], [1], CPU))
            for i, t in enumerate([1, 2, 3])]
    torch.testing.assert_close(torch.cat(outs), prefill[:3], atol=1e-5, rtol=1e-5)


def test_metadata_for_a_mixed_batch():
    # sequence 0: 2 cached tokens + 1 new (decode); sequence 1: 3 new tokens (prefill)
    meta = AttentionMetadata.build([[7, 8, 9], [20, 21, 22]], [1, 3], CPU)
    assert meta.out_slots.tolist() == [9, 20, 21, 22]
    assert meta.positions.tolist() == [2, 0, 1, 2]
    assert meta.token_seq.tolist() == [0, 1, 1, 1] and meta.token_query.tolist() == [0, 0, 1, 2]
    assert meta.query_index.tolist() == [[0, 0, 0], [1, 2, 3]]
    mask = meta.attn_mask[:, 0].int().tolist()
    assert mask[0][0] == [1, 1, 1]  # the decode token sees its whole context
    assert mask[1] == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]  # causal prefill


def test_weights_are_seeded_and_deterministic():
    a, b = ReferenceDecoder(ModelConfig(seed=3)), ReferenceDecoder(ModelConfig(seed=3))
    c = ReferenceDecoder(ModelConfig(seed=4))
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
