"""The vocabulary of the Llama-family decoder: its shape and numerics (`ModelConfig`) and
Llama 3.1 rotary scaling. The decoder, the KV cache and the checkpoint loader speak it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent rotary scaling (HF `rope_type: llama3`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    `num_kv_heads` 0 means one KV head per query head (no GQA); `head_dim` 0 means
    `hidden_size // num_heads`. `attention_bias` puts biases on q/k/v (Qwen2),
    `o_proj_bias` on the output projection; `qk_norm` adds per-head RMSNorms on q and k
    (Qwen3); `sliding_window` limits every layer's attention to the last N positions (Mistral).
    `seed` only matters for the seeded reference weights.
    """

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 344
    max_position: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    rope_scaling: Llama3RopeScaling | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} = {value!r} must be a positive int")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                    "give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim = {self.head_dim} must be a positive even int (rotary pairs)")
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads} (GQA groups)"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelConfig.sliding_window = {self.sliding_window!r} must be >= 1 or None")
