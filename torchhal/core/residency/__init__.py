"""Component residency: which weights live on the device, when, and when the cache is emptied."""

from torchhal.core.residency.manager import (
    ComponentState,
    ComponentUse,
    LayerwiseStrategy,
    OffloadStrategy,
    Placement,
    RequestFailed,
    ResidencyManager,
    ResidencyStrategy,
    ResidentStrategy,
    Stage,
    Strategy,
    WeightBlock,
)

__all__ = [
    "ComponentState",
    "ComponentUse",
    "LayerwiseStrategy",
    "OffloadStrategy",
    "Placement",
    "RequestFailed",
    "ResidencyManager",
    "ResidencyStrategy",
    "ResidentStrategy",
    "Stage",
    "Strategy",
    "WeightBlock",
]
