"""A small reference decoder (RMSNorm, rotary positions, attention, MLP) with a KV pool.

Weights are seeded and deterministic, so tests, examples and benchmarks run
anywhere without downloading anything. The layer stack is exposed explicitly
(`layer_program()`), with attention marked as a breakable op, for the graph runner.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchhal.core.graphs.program import BreakStep, GraphStep, StackState, Step, run_eager

_SHAPE_FREE_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 344
    max_position: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class AttentionMetadata:
    """Per-batch facts attention needs, built once on the host for the live batch
    and shared by every layer.

    out_slots:   [T] KV slot written by each token.
    kv_slots:    [B, Lmax] slots of each sequence's context (padded with 0).
    query_index: [B, Qmax] token index of each sequence's queries (padded with 0).
    attn_mask:   [B, 1, Qmax, Lmax] causal mask over each sequence's real context.
    positions:   [T] absolute positions (also the rotary positions).
    token_seq, token_query: [T] the (sequence, query) slot of each token, in token order,
        so attention scatters its output back without boolean indexing (which would sync).
    """

    out_slots: torch.Tensor
    kv_slots: torch.Tensor
    query_index: torch.Tensor
    attn_mask: torch.Tensor
    positions: torch.Tensor
    token_seq: torch.Tensor
    token_query: torch.Tensor

    @classmethod
    def build(
        cls, seq_slots: list[list[int]], query_counts: list[int], device: torch.device
    ) -> AttentionMetadata:
        """`seq_slots[i]`: all KV slots of sequence i after this step; its last
        `query_counts[i]` tokens are this step's queries."""
        batch = len(seq_slots)
        lmax = max(len(s) for s in seq_slots)
        qmax = max(query_counts)
        kv_slots = torch.zeros(batch, lmax, dtype=torch.long)
        query_index = torch.zeros(batch, qmax, dtype=torch.long)
        mask = torch.zeros(batch, 1, qmax, lmax, dtype=torch.bool)
        kv_pos = torch.arange(lmax)
        out_slots: list[int] = []
        positions: list[int] = []
        token_seq: list[int] = []
        token_query: list[int] = []
        token = 0
        for i, (slots, count) in enumerate(zip(seq_slots, query_counts, strict=True)):
            length = len(slots)
            kv_slots[i, :length] = torch.tensor(slots)
            query_index[i, :count] = torch.arange(token, token + count)
            query_pos = torch.arange(length - count, length)
            mask[i, 0, :count] = (kv_pos[None, :] <= query_pos[:, None]) & (kv_pos[None, :] < length)
            out_slots.extend(slots[length - count :])
            positions.extend(range(length - count, length))
            token_seq.extend([i] * count)
            token_query.extend(range(count))
            token += count
        mask[:, 0, :, 0] |= ~mask.any(-1)[:, 0]  # padded query rows: attend to one slot, never to nothing

        def to_device(values: list[int] | torch.Tensor) -> torch.Tensor:
            tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
            return tensor.to(device, non_blocking=True)

        return cls(
            out_slots=to_device(out_slots),
            kv_slots=to_device(kv_slots),
            query_index=to_device(query_index),
            attn_mask=to_device(mask),
            positions=to_device(positions),
            token_seq=to_device(token_seq),
            token_query=to_device(token_query),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.out_slots.numel())


class KVCache:
    """Token-slot KV storage for every layer, preallocated once on the device."""

    def __init__(self, config: ModelConfig, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (config.num_layers, num_slots, config.num_heads, config.head_dim)
        self.num_slots = num_slots
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_heads * config.head_dim * element


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.float() * scale).to(x.dtype) * self.weight


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.config = config
        self.input_norm = RMSNorm(h, config.rms_eps)
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.post_norm = RMSNorm(h, config.rms_eps)
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        # Fused QKV, derived from q/k/v by `process_weights()` (as engines fuse after loading).
        self.qkv_weight: torch.Tensor
        self.register_buffer("qkv_weight", torch.empty(3 * h, h), persistent=False)

    def process_weights(self) -> None:
        """Post-load processing: rebuild derived weights *in place* (graph addresses stay valid)."""
        with torch.no_grad():
            fused = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight], dim=0)
            self.qkv_weight.copy_(fused)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on [T, H, D] with per-token cos/sin [T, D/2]."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = torch.empty_like(x)
    out[..., ::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


class ReferenceDecoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(config.seed)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=1.0 / math.sqrt(module.in_features))
        torch.random.set_rng_state(generator_state)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        angles = torch.outer(torch.arange(config.max_position).float(), inv_freq)
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.kv: KVCache | None = None
        self.process_weights()

    def process_weights(self) -> None:
        for layer in self.layers:
            layer.process_weights()  # type: ignore[operator]  # ModuleList items are typed Module

    # -- the layer stack, as a program for runners --------------------------------
    def layer_program(self) -> list[Step]:
        """Graph-safe steps and breakable attention ops for the whole layer stack.

        Inputs in the state: "hidden" [T, H] (embedded tokens), "positions" [T].
        Output: "hidden" [T, H] after the final norm.
        """
        steps: list[Step] = []
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        for index, layer in enumerate(layers):
            steps.append(GraphStep(f"layer{index}.pre_attention", self._pre_attention(layer, first=index == 0)))
            steps.append(BreakStep(f"layer{index}.attention", self._attention(index)))
            last = index == len(layers) - 1
            steps.append(GraphStep(f"layer{index}.post_attention", self._post_attention(layer, last)))
        return steps

    def _pre_attention(self, layer: DecoderLayer, first: bool) -> Callable[[StackState], None]:
        config = self.config

        def run(state: StackState) -> None:
            if first:
                state["residual"] = state["hidden"]
            x = layer.input_norm(state["residual"])
            qkv = x @ layer.qkv_weight.t()
            t = qkv.shape[0]
            q, k, v = qkv.view(t, 3, config.num_heads, config.head_dim).unbind(1)
            cos = self.rope_cos.index_select(0, state["positions"])
            sin = self.rope_sin.index_select(0, state["positions"])
            state["q"], state["k"], state["v"] = rotate(q, cos, sin), rotate(k, cos, sin), v.contiguous()
            state["attn_out"] = torch.empty_like(state["q"])  # written in place by attention

        return run

    def _attention(self, index: int) -> Callable[[StackState, int, AttentionMetadata], None]:
        def run(state: StackState, num_tokens: int, meta: AttentionMetadata) -> None:
            assert self.kv is not None, "allocate the KV cache before running the model"
            k_cache, v_cache = self.kv.k[index], self.kv.v[index]
            k_cache.index_copy_(0, meta.out_slots, state["k"][:num_tokens])
            v_cache.index_copy_(0, meta.out_slots, state["v"][:num_tokens])
            q = state["q"][meta.query_index]  # [B, Qmax, H, D]
            keys, values = k_cache[meta.kv_slots], v_cache[meta.kv_slots]  # [B, L, H, D]
            # Backends that do not build a plan per shape: decode grows the context every
            # step, and a per-shape plan build (measured: 13 ms a call on an H100) dominates.
            with sdpa_kernel(_SHAPE_FREE_SDPA):
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=meta.attn_mask
                ).transpose(1, 2)  # [B, Qmax, H, D]
            state["attn_out"][:num_tokens].copy_(out[meta.token_seq, meta.token_query])

        return run

    def _post_attention(self, layer: DecoderLayer, last: bool) -> Callable[[StackState], None]:
        def run(state: StackState) -> None:
            t = state["attn_out"].shape[0]
            residual = state["residual"] + layer.o_proj(state["attn_out"].reshape(t, -1))
            residual = residual + layer.mlp(layer.post_norm(residual))
            state["residual"] = residual
            if last:
                state["hidden"] = self.norm(residual)

        return run

    # -- eager forward ------------------------------------------------------------------
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def logits(self, hidden: torch.Tensor, last_token_index: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden.index_select(0, last_token_index)).float()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        state: StackState = {"hidden": self.embed_tokens(input_ids), "positions": meta.positions}
        run_eager(self.layer_program(), state, input_ids.numel(), meta)
        return state["hidden"]
