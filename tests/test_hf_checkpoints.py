"""Hugging Face checkpoints: loaded by name, token-exact against transformers' greedy generate (fp32, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.hf_models import FAMILIES, PROMPTS, Generate, direct_greedy, hf_greedy, make_hf_model, save_hf_model
from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine
from torchhal.core.model import LlamaDecoder
from torchhal.core.model.checkpoint import (
    CheckpointError,
    checkpoint_files,
    eos_token_ids,
    iter_checkpoint_tensors,
    load_checkpoint,
)

NEW_TOKENS = 32


def engine_greedy(model: LlamaDecoder, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Through the engine's continuous batching: the prompts join one step apart, mid-flight."""
    engine = GenerationEngine(EngineConfig(max_kv_slots=1024), model=model)
    rids = []
    for prompt in prompts:
        rids.append(engine.add_request(prompt, new_tokens))
        engine.step()
    while any(rid not in engine.results for rid in rids):
        engine.step()
    return [list(engine.results[rid].output) for rid in rids]


def engine_decode_graphs_greedy(model: LlamaDecoder, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The engine with full-graph decode (emulated on CPU: the same padded static step, eagerly)."""
    graphs = DecodeGraphConfig(batch_buckets=(1, 2, 4), context_buckets=(16, 64), emulate=True)
    engine = GenerationEngine(EngineConfig(max_kv_slots=1024, decode_graphs=graphs), model=model)
    rids = []
    for prompt in prompts:
        rids.append(engine.add_request(prompt, new_tokens))
        engine.step()
    while any(rid not in engine.results for rid in rids):
        engine.step()
    assert engine.decode_runner is not None and engine.decode_runner.steps >= new_tokens - len(prompts)
    return [list(engine.results[rid].output) for rid in rids]


GENERATORS: dict[str, Generate] = {
    "direct": direct_greedy, "engine": engine_greedy, "engine_decode_graphs": engine_decode_graphs_greedy,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[list[int]]]]:
    """Each family saved once (llama3 sharded), with transformers' greedy outputs."""
    out = {}
    for family in FAMILIES:
        directory = tmp_path_factory.mktemp(family)
        hf = save_hf_model(family, directory, max_shard_size="100KB" if family == "llama3" else None)
        out[family] = (directory, hf_greedy(hf, PROMPTS, NEW_TOKENS))
    return out


@pytest.mark.parametrize("how", GENERATORS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers(saved, family, how):
    directory, expected = saved[family]
    model, report = load_checkpoint(directory)
    assert report.tensors == len(list(model.named_parameters())) and report.bytes_read > 0
    # the oracle's outputs are not degenerate: decoding depends on the prompt and does not stall
    assert len({tuple(e) for e in expected}) == len(PROMPTS)
    assert sum(len(set(e)) > 4 for e in expected) >= 3
    assert GENERATORS[how](model, PROMPTS, NEW_TOKENS) == expected


def test_sharded_checkpoint_reads_every_shard(saved):
    directory = saved["llama3"][0]
    files = checkpoint_files(directory)
    assert (directory / "model.safetensors.index.json").is_file() and len(files) > 1
    _, report = load_checkpoint(directory)
    assert len(report.files) == len(files)


def test_first_step_logits_match_transformers(saved):
    directory = saved["qwen3"][0]
    hf = transformers_model(directory)
    model, _ = load_checkpoint(directory)
    prompt = PROMPTS[1]
    expected = hf(torch.tensor([prompt])).logits[0, -1]
    from torchhal.core.model import AttentionMetadata, KVCache

    model.kv = KVCache(model.config, 8, 4, torch.device("cpu"), torch.float32)  # blocks of 4: several per prompt
    blocks = list(range(1, 1 + -(-len(prompt) // 4)))
    hidden = model(torch.tensor(prompt), AttentionMetadata.build([blocks], [len(prompt)], [len(prompt)], 4,
                                                                  torch.device("cpu")))
    torch.testing.assert_close(model.logits(hidden, torch.tensor([len(prompt) - 1]))[0], expected,
                               atol=1e-4, rtol=1e-4)


def transformers_model(directory: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def test_config_and_override_dtype(saved):
    directory = saved["qwen2"][0]
    model, report = load_checkpoint(directory, dtype=torch.bfloat16)
    assert report.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # angles stay exact in bf16 models
    c = model.config
    assert (c.num_kv_heads, c.attention_bias, c.o_proj_bias, c.qk_norm) == (2, True, False, False)
    qwen3, _ = load_checkpoint(saved["qwen3"][0])
    assert qwen3.config.head_dim == 32 and qwen3.config.qk_norm and qwen3.config.tie_word_embeddings
    assert qwen3.lm_head.weight is qwen3.model.embed_tokens.weight
    llama3, _ = load_checkpoint(saved["llama3"][0])
    assert llama3.config.rope_scaling is not None and llama3.config.rope_scaling.original_max_position == 32
    mistral, _ = load_checkpoint(saved["mistral"][0])
    assert mistral.config.sliding_window == 12


def test_weights_from_another_checkpoint_by_hf_name(saved, tmp_path):
    """The (name, tensor) pairs of a second checkpoint update the model by HF name: same outputs
    as loading that checkpoint directly."""
    second = tmp_path / "second"
    hf = save_hf_model("qwen2", second, seed=1)
    model, _ = load_checkpoint(saved["qwen2"][0])
    params = dict(model.named_parameters())
    pairs = list(iter_checkpoint_tensors(second))
    assert {name for name, _ in pairs} == set(params)
    with torch.no_grad():
        for name, tensor in pairs:
            params[name].copy_(tensor)
    model.process_weights()
    assert direct_greedy(model, PROMPTS[:2], 8) == hf_greedy(hf, PROMPTS[:2], 8)


def test_iter_skips_tied_head_and_rotary_frequencies(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "tied"
    directory.mkdir()
    source = saved["llama_tied"][0]
    (directory / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, directory / "model.safetensors")
    names = {name for name, _ in iter_checkpoint_tensors(directory)}
    assert "lm_head.weight" not in names and not any("inv_freq" in n for n in names)
    model, _ = load_checkpoint(directory)  # both ignored by the loader too
    assert model.lm_head.weight is model.model.embed_tokens.weight


# -- refusals: clear, naming file and tensor, nothing loaded ------------------------------------------


def copy_checkpoint(source: Path, target: Path, edit=None, config_edit=None) -> Path:
    from safetensors.torch import load_file, save_file

    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (target / "config.json").write_text(json.dumps(config))
    tensors = load_file(source / "model.safetensors")
    if edit:
        edit(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


def test_unknown_architecture_names_the_supported_ones(saved, tmp_path):
    bad = copy_checkpoint(saved["qwen2"][0], tmp_path / "bad",
                          config_edit=lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(CheckpointError, match="'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM, "
                                              "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load_checkpoint(bad)


def test_unsupported_rope_type_is_refused(saved, tmp_path):
    bad = copy_checkpoint(saved["qwen2"][0], tmp_path / "bad", config_edit=lambda c: c.update(
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}))
    with pytest.raises(CheckpointError, match="rope type 'yarn' is not supported; supported: default, llama3"):
        load_checkpoint(bad)


def test_missing_shard_names_the_shard(saved, tmp_path):
    import shutil

    sharded = tmp_path / "sharded"
    shutil.copytree(saved["llama3"][0], sharded)
    victim = checkpoint_files(sharded)[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name}: cannot be opened \\(No such file or directory\\)"):
        load_checkpoint(sharded)


def test_bad_tensors_are_all_named_and_nothing_is_loaded(saved, tmp_path, monkeypatch):
    def edit(tensors):
        tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
        tensors["model.layers.0.self_attn.q_norm.weight"] = tensors["model.layers.0.self_attn.q_norm.weight"].long()
        del tensors["model.norm.weight"]
        tensors["model.layers.0.extra.weight"] = torch.zeros(2)

    bad = copy_checkpoint(saved["qwen3"][0], tmp_path / "bad", edit=edit)
    allocated = []
    monkeypatch.setattr(LlamaDecoder, "materialize", lambda *a: allocated.append(1))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(bad)
    message = str(info.value)
    assert "nothing loaded" in message
    assert "model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' has shape (3, 3), expected (96, 64)" \
        in message
    assert "model.safetensors: tensor 'model.layers.0.self_attn.q_norm.weight' has dtype I64" in message
    assert "missing weight 'model.norm.weight' (not in model.safetensors)" in message
    assert "model.safetensors: unexpected tensor 'model.layers.0.extra.weight'" in message
    assert allocated == []  # refused from the headers, before any device allocation


def test_missing_config_and_missing_weights_dir(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: cannot be opened"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        load_checkpoint(tmp_path)


# -- the command --------------------------------------------------------------------------------


def save_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer "w0 w1 ..." -> [0, 1, ...], built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(directory)


def test_generate_command_with_text_and_ids(saved, generate):
    directory, expected = saved["mistral"]
    by_ids = generate("--model", str(directory), "--prompt-ids", ",".join(map(str, PROMPTS[1])), "--json")
    assert by_ids.returncode == 0, by_ids.stderr
    out = json.loads(by_ids.stdout)
    assert out["output_ids"] == expected[1] and out["architecture"] == "MistralForCausalLM"
    assert out["tokens_per_s"] > 0 and out["load"]["bytes_read"] > 0
    assert out["attention"] == {"backend": "reference", "why": "reference: the platform declares no attention backend"}
    no_tokenizer = generate("--model", str(directory), "--prompt", "w1 w2")
    assert no_tokenizer.returncode == 2 and "ships no tokenizer" in no_tokenizer.stderr

    save_word_tokenizer(directory, 128)
    by_text = generate("--model", str(directory), "--prompt", " ".join(f"w{t}" for t in PROMPTS[1]),
                      "--max-new-tokens", "8")
    assert by_text.returncode == 0, by_text.stderr
    lines = by_text.stdout.splitlines()
    assert lines[1] == " ".join(f"w{t}" for t in expected[1][:8])
    assert lines[2].startswith("8 tokens in ") and lines[2].endswith(" tokens/s")
    assert lines[3] == "attention: reference (reference: the platform declares no attention backend)"


def test_generate_command_graphs_flag(saved, generate):
    directory, expected = saved["llama3"]
    ran = generate("--model", str(directory), "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--graphs", "--json")
    assert ran.returncode == 0, ran.stderr
    out = json.loads(ran.stdout)
    assert out["output_ids"] == expected[0]
    graphs = out["decode_graphs"]
    assert "declares no graph support" in graphs["unavailable"] and graphs["replays"] == 0  # CPU: eager
    plain = generate("--model", str(directory), "--prompt-ids", "1,2", "--max-new-tokens", "3", "--graphs")
    assert plain.returncode == 0 and "full-graph decode unavailable" in plain.stdout


def test_every_eos_id_of_the_config_ends_generation():
    assert eos_token_ids({"eos_token_id": [128001, 128008, 128009]}) == (128001, 128008, 128009)
    assert eos_token_ids({"eos_token_id": 2}) == (2,) and eos_token_ids({}) == ()


def test_generate_command_refuses_bad_ids(saved, generate):
    bad = generate("--model", str(saved["mistral"][0]), "--prompt-ids", "1,x")
    assert bad.returncode == 2 and "--prompt-ids '1,x' must be comma-separated integers" in bad.stderr


def test_make_hf_model_is_seeded():
    a, b = make_hf_model("qwen2", seed=3), make_hf_model("qwen2", seed=3)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
