"""Models the engine runs: the Llama-family decoder, its seeded reference instance, and HF loading."""

from torchhal.core.model.decoder import Llama3RopeScaling, LlamaDecoder
from torchhal.core.model.reference import AttentionMetadata, KVCache, ModelConfig, ReferenceDecoder

__all__ = ["AttentionMetadata", "KVCache", "Llama3RopeScaling", "LlamaDecoder", "ModelConfig", "ReferenceDecoder"]
