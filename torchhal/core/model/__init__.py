"""Models the engine runs; the reference decoder is one of them."""

from torchhal.core.model.reference import AttentionMetadata, KVCache, ModelConfig, ReferenceDecoder

__all__ = ["AttentionMetadata", "KVCache", "ModelConfig", "ReferenceDecoder"]
