"""The reference decoder: the Llama-family decoder with seeded, deterministic weights.

Tests, examples and benchmarks run it anywhere without downloading anything.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from torchhal.core.model.config import ModelConfig
from torchhal.core.model.decoder import FusedSlice, LlamaDecoder
from torchhal.core.model.kv_cache import AttentionMetadata, KVCache

__all__ = ["AttentionMetadata", "KVCache", "ModelConfig", "ReferenceDecoder"]


class ReferenceDecoder(LlamaDecoder):
    """`LlamaDecoder` whose weights are drawn from `config.seed` (the global RNG is left as it was)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        generator = torch.Generator().manual_seed(config.seed)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Embedding):
                    module.weight.normal_(generator=generator)
                elif isinstance(module, (nn.Linear, FusedSlice)) and not (
                    module is self.lm_head and config.tie_word_embeddings
                ):
                    module.weight.normal_(std=1.0 / math.sqrt(module.weight.shape[1]), generator=generator)
                    if module.bias is not None:
                        module.bias.normal_(std=0.02, generator=generator)
        self.process_weights()
