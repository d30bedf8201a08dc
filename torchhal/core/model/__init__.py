"""Models the engine runs: the Model protocol, the Llama-family decoder, its seeded
reference instance, and Hugging Face checkpoint loading (`torchhal.core.model.checkpoint`)."""

from torchhal.core.model.decoder import Llama3RopeScaling, LlamaDecoder
from torchhal.core.model.protocol import Model
from torchhal.core.model.reference import AttentionMetadata, KVCache, ModelConfig, ReferenceDecoder

__all__ = [
    "AttentionMetadata",
    "KVCache",
    "Llama3RopeScaling",
    "LlamaDecoder",
    "Model",
    "ModelConfig",
    "ReferenceDecoder",
]
