"""The reference decoder: the Llama-family decoder with seeded, deterministic weights.

Tests, examples and benchmarks run it anywhere without downloading anything.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from torchhal.core.model.config import ModelConfig
from torchhal.core.model.decoder import FusedSlice, LlamaDecoder


def host_memory_bytes() -> int | None:
    """This host's physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_host_room(config: ModelConfig) -> None:
    """Refuse a config whose weights cannot fit in this host's memory at all, before drawing
    them: past it torch's allocator fails (or the host swaps) with nothing naming the config.
    Counted on the meta device, where building the model allocates nothing."""
    with torch.device("meta"):
        parameters = sum(p.numel() for p in LlamaDecoder(config).parameters())
    needed, host = parameters * torch.get_default_dtype().itemsize, host_memory_bytes()
    if host is not None and needed > host:
        raise ValueError(
            f"ReferenceDecoder: this ModelConfig has {parameters:,} parameters, {needed / 2**30:,.1f} GiB of "
            f"{torch.get_default_dtype()} weights, more than this host's {host / 2**30:,.1f} GiB of memory "
            f"(vocab_size={config.vocab_size}, hidden_size={config.hidden_size}, num_layers={config.num_layers}, "
            f"intermediate_size={config.intermediate_size}): choose a smaller ModelConfig")


class ReferenceDecoder(LlamaDecoder):
    """`LlamaDecoder` whose weights are drawn from `config.seed` (the global RNG is left as it was)."""

    def __init__(self, config: ModelConfig) -> None:
        check_host_room(config)
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
