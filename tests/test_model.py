"""The Llama-family decoder (seeded reference instance): attention through the paged KV cache, its metadata,
its variants (GQA, head_dim, biases, q/k norms, sliding window, llama3 rope) and HF parameter names."""

import pytest
import torch

from torchhal.core.model import AttentionMetadata, KVCache, Llama3RopeScaling, ModelConfig, ReferenceDecoder

CPU = torch.device("cpu")
BLOCK = 4


def meta(tables, seq_lens, query_lens):
    return AttentionMetadata.build(tables, seq_lens, query_lens, BLOCK, CPU)


def fresh_model(config=None):
    model = ReferenceDecoder(config or ModelConfig())
    model.kv = KVCache(model.config, 16, BLOCK, CPU, torch.float32)
    return model


def test_prefill_equals_token_by_token_decode():
    model = fresh_model()
    prefill = model(torch.tensor([1, 2, 3, 4, 5]), meta([[1], [2]], [3, 2], [3, 2]))
    stepwise = fresh_model()
    outs = [stepwise(torch.tensor([t]), meta([[5]], [i + 1], [1])) for i, t in enumerate([1, 2, 3])]
    torch.testing.assert_close(torch.cat(outs), prefill[:3], atol=1e-5, rtol=1e-5)


def test_chunked_prefill_over_several_blocks_equals_one_prefill():
    """Chunks of 3 (never aligned to the blocks of 4) each attend to the chunks before them in the cache."""
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    whole = fresh_model()(torch.tensor(tokens), meta([[1, 2, 3]], [11], [11]))
    chunked_model = fresh_model()
    pieces = [chunked_model(torch.tensor(tokens[start : start + 3]),
                            meta([[7, 9, 8]], [min(start + 3, 11)], [min(3, 11 - start)]))
              for start in range(0, 11, 3)]
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-5)


def test_metadata_for_a_mixed_batch():
    # sequence 0: 2 cached tokens + 1 new (decode) in block 3; sequence 1: 3 new tokens (prefill) in block 5
    mixed = meta([[3], [5]], [3, 3], [1, 3])
    assert mixed.paged.slot_mapping.tolist() == [3 * BLOCK + 2, 5 * BLOCK, 5 * BLOCK + 1, 5 * BLOCK + 2]
    assert mixed.positions.tolist() == [2, 0, 1, 2]
    assert mixed.paged.query_start.tolist() == [0, 1, 4] and mixed.paged.seq_lens.tolist() == [3, 3]
    assert not mixed.decode and mixed.positions.numel() == 4
    assert meta([[3], [5, 6]], [3, 5], [1, 1]).decode  # one query per row: the backend's decode


def test_weights_are_seeded_and_deterministic():
    a, b = ReferenceDecoder(ModelConfig(seed=3)), ReferenceDecoder(ModelConfig(seed=3))
    c = ReferenceDecoder(ModelConfig(seed=4))
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_parameter_names_mirror_hugging_face():
    names = set(dict(ReferenceDecoder(ModelConfig(num_layers=1, attention_bias=True, qk_norm=True)).named_parameters()))
    assert names == {
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
        "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
        *(f"model.layers.0.self_attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")),
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
        *(f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    }
    # derived weights are buffers, not in the state dict: a checkpoint never carries them
    assert not any("fused" in k for k in ReferenceDecoder(ModelConfig()).state_dict())


def test_kv_cache_sizes_by_kv_heads_and_head_dim():
    gqa = ModelConfig(hidden_size=128, num_heads=8, num_kv_heads=2, head_dim=24)
    assert KVCache.bytes_per_token(gqa, torch.float32) == 2 * gqa.num_layers * 2 * 24 * 4
    assert KVCache.bytes_per_block(gqa, torch.float32, 16) == 16 * KVCache.bytes_per_token(gqa, torch.float32)
    cache = KVCache(gqa, 10, 16, CPU, torch.bfloat16)
    assert cache.k.shape == (gqa.num_layers, 10, 16, 2, 24) and cache.v.dtype == torch.bfloat16
    model = ReferenceDecoder(gqa)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (8 * 24, 128)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 24, 128)


def test_config_defaults_and_refusals():
    plain = ModelConfig(hidden_size=64, num_heads=4)
    assert (plain.head_dim, plain.num_kv_heads) == (16, 4)
    with pytest.raises(ValueError, match="hidden_size 100 is not divisible by num_heads 8; give head_dim"):
        ModelConfig(hidden_size=100, num_heads=8)
    assert ModelConfig(hidden_size=100, num_heads=8, head_dim=16).head_dim == 16
    with pytest.raises(ValueError, match="num_heads 6 is not a multiple of num_kv_heads 4"):
        ModelConfig(hidden_size=96, num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="head_dim = 15 must be a positive even int"):
        ModelConfig(head_dim=15)


@pytest.mark.parametrize("config", [
    ModelConfig(num_heads=4, num_kv_heads=2, head_dim=24, attention_bias=True, qk_norm=True),
    ModelConfig(sliding_window=3, tie_word_embeddings=True, rope_scaling=Llama3RopeScaling(original_max_position=8)),
], ids=["gqa-bias-qknorm", "window-tied-llama3"])
def test_prefill_equals_decode_for_every_variant(config):
    model = fresh_model(config)
    tokens = [3, 1, 4, 1, 5, 9, 2]
    prefill = model(torch.tensor(tokens), meta([[1, 2]], [len(tokens)], [len(tokens)]))
    stepwise = [model(torch.tensor([t]), meta([[6, 4][: i // BLOCK + 1]], [i + 1], [1])) for i, t in enumerate(tokens)]
    torch.testing.assert_close(torch.cat(stepwise), prefill, atol=1e-5, rtol=1e-5)


def test_sliding_window_limits_what_a_query_sees():
    windowed = ReferenceDecoder(ModelConfig(sliding_window=2))
    full = ReferenceDecoder(ModelConfig())
    out = []
    for model in (windowed, full):
        model.kv = KVCache(model.config, 4, BLOCK, CPU, torch.float32)
        out.append(model(torch.tensor([7, 8, 9, 10]), meta([[1]], [4], [4])))
    torch.testing.assert_close(out[0][:2], out[1][:2])  # the first two positions see all they would anyway
    assert not torch.allclose(out[0][2:], out[1][2:])  # later ones no longer see position 0


def test_hf_named_projections_are_views_of_the_fused_weights():
    """Writing q/k/v or gate/up by name is writing the fused weight: no second copy, no re-fusion,
    fused addresses unchanged (graph-safe); moves and casts keep the views."""
    model = ReferenceDecoder(ModelConfig(attention_bias=True)).to(torch.float64)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    addresses = [attn.fused_weight.data_ptr(), attn.fused_bias.data_ptr(), mlp.fused_weight.data_ptr()]
    with torch.no_grad():
        attn.v_proj.bias.fill_(2.0)
        mlp.up_proj.weight.fill_(3.0)
    assert [attn.fused_weight.data_ptr(), attn.fused_bias.data_ptr(), mlp.fused_weight.data_ptr()] == addresses
    assert attn.fused_weight.dtype == attn.q_proj.weight.dtype == torch.float64
    assert torch.all(attn.fused_bias[-attn.v_proj.bias.numel():] == 2.0)
    assert torch.all(mlp.fused_weight[mlp.gate_proj.weight.shape[0]:] == 3.0)
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.fused_weight.untyped_storage().data_ptr()
    params = sum(p.numel() for p in model.parameters())
    stored = sum(t.untyped_storage().nbytes() for t in {p.untyped_storage().data_ptr(): p for p in
                                                        [*model.parameters(), *model.buffers()]}.values())
    assert stored <= params * 8 + model.model.rotary_emb.inv_freq.numel() * 4  # nothing held twice


def test_rotary_frequencies_stay_fp32_when_the_model_is_cast():
    model = ReferenceDecoder(ModelConfig()).to(torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    fp32 = ReferenceDecoder(ModelConfig())
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, fp32.model.rotary_emb.inv_freq)


def test_seeding_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    ReferenceDecoder(ModelConfig(seed=5))
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_rms_norm_equal_hugging_faces_bit_for_bit(dtype):
    """The fewer-kernel forms (roll with a signed sin table, fused rms_norm) are HF's numbers."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from torchhal.core.model.decoder import RMSNorm, apply_rotary, signed_sin

    generator = torch.Generator().manual_seed(0)
    tokens, heads, dim = 5, 3, 16
    q = torch.randn(tokens, heads, dim, generator=generator).to(dtype)
    angles = torch.randn(tokens, dim // 2, generator=generator)
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    expected, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(apply_rotary(q, cos, signed_sin(sin)), expected[0].transpose(0, 1))
    # As the layer passes q and k: a strided view into the fused projection's output, head_dim 128.
    fused = torch.randn(tokens, (heads + 1) * 128, generator=generator).to(dtype)
    q = fused[:, : heads * 128].reshape(tokens, heads, 128)
    angles = torch.randn(tokens, 64, generator=generator)
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    expected, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(apply_rotary(q, cos, signed_sin(sin)), expected[0].transpose(0, 1))

    x = torch.randn(tokens, 32, generator=generator).to(dtype)
    ours, theirs = RMSNorm(32, 1e-6), LlamaRMSNorm(32, eps=1e-6)
    weight = torch.randn(32, generator=generator).to(dtype)
    ours.weight.data, theirs.weight.data = weight.clone(), weight.clone()
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("config", [
    ModelConfig(num_layers=3),
    ModelConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=24, attention_bias=True, qk_norm=True),
    ModelConfig(num_layers=2, sliding_window=3, rope_scaling=Llama3RopeScaling(original_max_position=8)),
], ids=["plain", "gqa-bias-qknorm", "window-llama3"])
def test_output_rows_narrow_the_last_layer_and_equal_those_rows_of_every_row(config):
    """A mixed step (a chunk after 3 cached tokens, a decode row, a whole prompt): asking for some
    rows gives exactly those rows of the full output, in the order asked, while the last layer's
    MLP and final norm run on those rows only; the KV every layer writes is the same either way."""
    tables, seq_lens, query_lens = [[1, 2], [3], [5, 6]], [7, 3, 6], [4, 1, 6]
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])
    history = torch.tensor([2, 7, 1, 8, 2])  # request 0's first 3 tokens and request 1's first 2
    full_model, narrowed = fresh_model(config), fresh_model(config)
    for model in (full_model, narrowed):
        model(history, meta([[1], [3]], [3, 2], [3, 2]))
    step = meta(tables, seq_lens, query_lens)
    every_row = full_model(tokens, step)
    mlp_rows: list[int] = []
    real_mlp = narrowed.layer_math.mlp

    def counting_mlp(residual, *args):
        mlp_rows.append(residual.shape[0])
        return real_mlp(residual, *args)

    narrowed.layer_math.mlp = counting_mlp
    for rows in ([3, 4, 10], [10, 0, 4], [4]):
        mlp_rows.clear()
        got = narrowed(tokens, step, torch.tensor(rows))
        torch.testing.assert_close(got, every_row[rows], atol=1e-5, rtol=1e-5)
        assert mlp_rows == [11] * (config.num_layers - 1) + [len(rows)]
    assert torch.equal(narrowed.kv.k, full_model.kv.k) and torch.equal(narrowed.kv.v, full_model.kv.v)
    # No rows (chunks short of their prompts' ends): every row runs, no kernel sees an empty input.
    mlp_rows.clear()
    assert narrowed(tokens, step, torch.tensor([], dtype=torch.int64)).shape == (0, config.hidden_size)
    assert mlp_rows == [11] * config.num_layers
    # A pure decode step attends every row through decode anyway: the rows are taken at the end.
    decode = meta([[1, 2], [3]], [8, 4], [1, 1])
    mlp_rows.clear()
    got = narrowed(torch.tensor([7, 7]), decode, torch.tensor([1, 0]))
    torch.testing.assert_close(got, full_model(torch.tensor([7, 7]), decode)[[1, 0]], atol=1e-5, rtol=1e-5)
    assert mlp_rows == [2] * config.num_layers


def test_the_kept_layer_program_follows_moves_and_each_copy_runs_its_own_weights():
    """The program is built once: its steps must read the weights when they run (a cast made
    new tensors, the o_proj bias included), and a deepcopy must not run the original's weights."""
    import copy

    config = ModelConfig(num_layers=2, attention_bias=True, o_proj_bias=True)
    tokens, step = torch.tensor([3, 1, 4, 1]), meta([[1]], [4], [4])
    model = fresh_model(config)
    program = model.layer_program()
    assert [s.name for s in program] == [s.name for s in model.layer_program()]
    model.to(torch.float64)
    model.kv = KVCache(config, 16, BLOCK, CPU, torch.float64)
    expected = fresh_model(config).to(torch.float64)
    expected.kv = KVCache(config, 16, BLOCK, CPU, torch.float64)
    torch.testing.assert_close(model(tokens, step), expected(tokens, step))
    expected = fresh_model(config).to(torch.float64)  # its program is built after the change below
    expected.kv = KVCache(config, 16, BLOCK, CPU, torch.float64)
    for decoder in (model, expected):  # a new Parameter object, not new data in the old one
        decoder.model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.full((config.hidden_size,), 0.5,
                                                                                      dtype=torch.float64))
    torch.testing.assert_close(model(tokens, step), expected(tokens, step))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.layers[1].self_attn.o_proj.bias.add_(1.0)
    assert not torch.allclose(twin(tokens, step), model(tokens, step))
    torch.testing.assert_close(model(tokens, step), expected(tokens, step))  # the original is untouched


@pytest.mark.parametrize("rows, message", [
    (torch.tensor([0, 4]), r"row 4 is outside the step's 4 tokens \(0\.\.3\)"),
    (torch.tensor([-1]), r"row -1 is outside the step's 4 tokens"),
    (torch.tensor([[0, 1]]), r"rows is \(1, 2\) torch\.int64; pass a 1-D int64 tensor of token indices"),
    (torch.tensor([0.0, 1.0]), r"rows is \(2,\) torch\.float32; pass a 1-D int64 tensor"),
    (torch.tensor([True, False]), r"rows is \(2,\) torch\.bool; pass a 1-D int64 tensor"),
    ([0, 1], r"rows is \[0, 1\]; pass a 1-D int64 tensor"),
    (torch.tensor([0], device="meta"), r"rows is on meta but the step's tensors are on cpu; move it there"),
])
def test_bad_output_rows_are_refused_naming_them_before_any_layer_runs(rows, message):
    """Host-checkable faults in `rows` are refused before the program runs: no K/V is written
    and the model can run the step again."""
    model = fresh_model(ModelConfig(num_layers=2))
    step, tokens = meta([[1]], [4], [4]), torch.tensor([3, 1, 4, 1])
    before = model.kv.k.clone()
    with pytest.raises(ValueError, match="forward: " + message):
        model(tokens, step, rows)
    assert torch.equal(model.kv.k, before)
    torch.testing.assert_close(model(tokens, step, torch.tensor([3])), model(tokens, step)[3:])


def test_repeated_rows_and_swapped_layers():
    model = fresh_model(ModelConfig(num_layers=2))
    step, tokens = meta([[1]], [4], [4]), torch.tensor([3, 1, 4, 1])
    every_row = model(tokens, step)
    # More rows than tokens (a row asked for again and again) narrow as well as fewer.
    torch.testing.assert_close(model(tokens, step, torch.tensor([3] * 6)), every_row[[3] * 6], atol=1e-5, rtol=1e-5)
    # A layer replaced by another module builds the program anew: the new layer runs.
    other = fresh_model(ModelConfig(num_layers=2, seed=9))
    model.model.layers[1] = other.model.layers[1]
    assert not torch.allclose(model(tokens, step), every_row)


def test_compiled_layers_of_more_model_shapes_than_dynamo_caches_for_one_function():
    """Dynamo keeps at most 8 compiled graphs on a code object and, under fullgraph=True, fails
    the ninth: every model compiles its layer methods over code of its own, so a process that
    builds engines for nine model shapes runs them all compiled."""
    from torchhal.core.engine import EngineConfig, GenerationEngine

    for width in range(1, 10):
        config = ModelConfig(vocab_size=64, hidden_size=16 * width, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=32)
        engine = GenerationEngine(EngineConfig(max_kv_slots=64, compile_layers="eager", decode_graphs=None,
                                               prefill_graphs=None), model=ReferenceDecoder(config))
        assert len(engine.generate([[1, 2, 3]], 2)[0].output) == 2
        engine.close()
