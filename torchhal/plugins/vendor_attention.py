"""What the vendor plugins share about attention: saying why a platform runs the reference.

A vendor plugin's `attention_support()` returns None (engines then run torchhal's portable
reference backend) when it has no vendor paged-attention entry point to map; its
`attention_missing()` names why, and `log_reference_only` logs it where an operator looks.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from torchhal.platforms import AttentionSupport, PlatformPlugin

log = logging.getLogger("torchhal.plugins")


def log_reference_only(platform: str, reason: str) -> None:
    """Log why `platform` declares no attention backend (its attention_support() is None)."""
    log.info("%s: no vendor attention backend, the reference runs: %s", platform, reason)


class ReferenceAttentionOnly(PlatformPlugin):
    """Base (listed first) of a vendor plugin that maps no paged-attention entry point: its
    `attention_support()` is None, for the reason `reference_attention_because` gives."""

    reference_attention_because: ClassVar[str]

    def attention_missing(self) -> str | None:
        """Why no vendor attention backend is declared (None: one is)."""
        return self.reference_attention_because

    def attention_support(self) -> AttentionSupport | None:
        log_reference_only(self.name, self.reference_attention_because)
        return None
