"""Attention over a paged KV cache, through the platform.

Engine code asks the platform for a backend (`Platform.choose_attention(spec)`), never
names a kernel library. Every platform has the portable `ReferenceBackend`; a plugin may
declare faster ones in its `attention_support()`.
"""

from torchhal.attention.backend import (
    AttentionBackend,
    AttentionCapability,
    AttentionChoice,
    AttentionSpec,
    choose_backend,
    unsupported_reason,
)
from torchhal.attention.layout import (
    SCRATCH_BLOCK,
    PagedMetadata,
    PagedWriter,
    build_metadata,
    build_metadata_and_positions,
    decode_metadata_for_rows,
    new_kv_cache,
    write_kv,
)
from torchhal.attention.reference import ReferenceBackend, attend

__all__ = [
    "SCRATCH_BLOCK",
    "AttentionBackend",
    "AttentionCapability",
    "AttentionChoice",
    "AttentionSpec",
    "PagedMetadata",
    "PagedWriter",
    "ReferenceBackend",
    "attend",
    "build_metadata",
    "build_metadata_and_positions",
    "choose_backend",
    "decode_metadata_for_rows",
    "new_kv_cache",
    "unsupported_reason",
    "write_kv",
]
