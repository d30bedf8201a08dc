"""Device tensors across processes as plain-data messages, opened on the consumer's device.

`producer` (pool, slices, host fallback), `consumer` (untrusted-message receive),
`messages` (the plain-data message and its decoder). `reclaim_orphans()` removes the
shared-memory files of producers that died without closing (also
`python -m torchhal.core.transport reclaim`).
"""

from torchhal.core.transport._shm import reclaim_orphans
from torchhal.core.transport.consumer import MAX_OPEN_PRODUCERS, Consumer
from torchhal.core.transport.messages import TensorMessage, TransportError
from torchhal.core.transport.producer import (
    BUDGET_SETTING,
    POOL_FLOOR_BYTES,
    Producer,
    TransportConfig,
    pool_size,
)

__all__ = [
    "BUDGET_SETTING",
    "MAX_OPEN_PRODUCERS",
    "POOL_FLOOR_BYTES",
    "Consumer",
    "Producer",
    "TensorMessage",
    "TransportConfig",
    "TransportError",
    "pool_size",
    "reclaim_orphans",
]
