"""Models the engine runs: the Model protocol, the Llama-family decoder, its seeded
reference instance, and Hugging Face checkpoint loading (`torchhal.core.model.checkpoint`).

Vocabulary: `config` (ModelConfig, Llama3RopeScaling), `kv_cache` (the paged KVCache and
the per-step AttentionMetadata); `decoder` holds the decoder; `greedy` picks each row's token."""

from torchhal.core.model.config import Llama3RopeScaling, ModelConfig
from torchhal.core.model.decoder import LlamaDecoder
from torchhal.core.model.kv_cache import SCRATCH_BLOCK, AttentionMetadata, KVCache
from torchhal.core.model.protocol import Model
from torchhal.core.model.reference import ReferenceDecoder

__all__ = [
    "SCRATCH_BLOCK",
    "AttentionMetadata",
    "KVCache",
    "Llama3RopeScaling",
    "LlamaDecoder",
    "Model",
    "ModelConfig",
    "ReferenceDecoder",
]
