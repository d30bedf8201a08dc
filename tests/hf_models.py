"""Tiny random Hugging Face models of each supported family, and greedy decoding with torchhal's decoder."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from torchhal.core.model import AttentionMetadata, KVCache, LlamaDecoder

transformers = __import__("pytest").importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# family -> (config class, config kwargs); each case covers what its comment says.
FAMILIES: dict[str, tuple[str, dict]] = {
    # GQA (4 query heads, 2 KV heads), untied head, Llama 3 rope scaling
    "llama3": ("LlamaConfig", dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE)),
    # tied embeddings, explicit head_dim != hidden/heads, one KV head (MQA), rope_theta
    "llama_tied": ("LlamaConfig", dict(num_key_value_heads=1, head_dim=24, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    # GQA and a sliding window shorter than prompt + generation
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=12, head_dim=16)),
    # q/k/v biases, GQA
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
    # per-head q/k norms, explicit head_dim, tied
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
}

PROMPTS = [[5, 17, 3], [99, 4, 61, 8, 120, 33, 7], [42], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


def hf_config(family: str, **overrides: object):
    class_name, extra = FAMILIES[family]
    return getattr(transformers, class_name)(**{**TINY, **extra, **overrides})


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with a spread, so greedy decoding is decisive (HF's 0.02 init makes near-ties)
    and every tensor matters (norm weights away from 1, biases away from 0); small embeddings
    so that tied models do not just echo their last input token."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
            elif "embed_tokens" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))  # layers dominate the residual
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1]))


def make_hf_model(family: str, seed: int = 0, **overrides: object):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **overrides), dtype=torch.float32)
    randomize(model, seed)
    return model.eval()


def save_hf_model(family: str, directory: Path, seed: int = 0, max_shard_size: str | None = None,
                  **overrides: object):
    model = make_hf_model(family, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return model


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The oracle: transformers' own greedy generate, one prompt at a time (no padding effects)."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def direct_greedy(model: LlamaDecoder, prompts: list[list[int]], new_tokens: int,
                  block_size: int = 4) -> list[list[int]]:
    """Greedy decoding of a batch through the model's own API (paged metadata + forward +
    logits): one mixed prefill, then batched decode steps; each prompt owns its own blocks."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    need = [-(-(len(p) + new_tokens) // block_size) for p in prompts]
    model.kv = KVCache(model.config, 1 + sum(need), block_size, device, dtype)  # block 0: scratch
    starts = [1 + sum(need[:i]) for i in range(len(prompts))]
    tables = [list(range(start, start + n)) for start, n in zip(starts, need, strict=True)]
    lengths = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    counts = [len(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(new_tokens):
        hidden = model(ids, AttentionMetadata.build(tables, lengths, counts, block_size, device))
        last = torch.tensor(counts, device=device).cumsum(0) - 1
        tokens = model.logits(hidden, last).argmax(-1).tolist()
        for output, token in zip(outputs, tokens, strict=True):
            output.append(token)
        ids = torch.tensor(tokens, device=device)
        counts = [1] * len(prompts)
        lengths = [n + 1 for n in lengths]
    return outputs


Generate = Callable[[LlamaDecoder, list[list[int]], int], list[list[int]]]
