"""Device tensors across processes as plain-data messages, opened on the consumer's device."""

from torchhal.core.transport.transport import (
    BUDGET_SETTING,
    POOL_FLOOR_BYTES,
    Consumer,
    Producer,
    TensorMessage,
    TransportConfig,
    TransportError,
    pool_size,
)

__all__ = [
    "BUDGET_SETTING",
    "POOL_FLOOR_BYTES",
    "Consumer",
    "Producer",
    "TensorMessage",
    "TransportConfig",
    "TransportError",
    "pool_size",
]
