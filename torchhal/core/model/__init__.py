"""Models the engine runs; the reference decoder is one of them."""

from torchhal.core.model.protocol import Model
from torchhal.core.model.reference import AttentionMetadata, KVCache, ModelConfig, ReferenceDecoder

__all__ = ["AttentionMetadata", "KVCache", "Model", "ModelConfig", "ReferenceDecoder"]
