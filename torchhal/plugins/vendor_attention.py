"""What the vendor plugins share about attention: saying why a platform runs the reference.

A vendor plugin's `attention_support()` returns None (engines then run torchhal's portable
reference backend) when its vendor's paged-attention entry point is missing; the plugin's
`attention_missing()` names why, and `log_reference_only` logs it where an operator looks.
"""

from __future__ import annotations

import logging

log = logging.getLogger("torchhal.plugins")


def log_reference_only(platform: str, reason: str) -> None:
    """Log why `platform` declares no attention backend (its attention_support() is None)."""
    log.info("%s: no vendor attention backend, the reference runs: %s", platform, reason)
