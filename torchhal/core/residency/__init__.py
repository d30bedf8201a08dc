"""Component residency: which weights live on the device, when, and when the cache is emptied.

- declarations: what a pipeline declares (`Stage`, `ComponentUse`, `Strategy` names)
- strategies: how weights reach the device (`ResidencyStrategy` and the built-ins)
- manager: `ResidencyManager`, which decides when
- trace: `ResidencyTrace`, events, export and memory-timeline plots
- diffusers: `manage_pipeline` for an existing diffusers pipeline (needs diffusers only when called)
"""

from torchhal.core.residency.declarations import ComponentUse, RequestFailed, Stage, Strategy, UndeclaredUse
from torchhal.core.residency.manager import PlacementSpec, ResidencyManager
from torchhal.core.residency.strategies import (
    ComponentState,
    LayerwiseStrategy,
    OffloadStrategy,
    ResidencyStrategy,
    ResidentStrategy,
)
from torchhal.core.residency.trace import ResidencyTrace, plot_memory_timelines
from torchhal.core.residency.weights import WeightBlock

__all__ = [
    "ComponentState",
    "ComponentUse",
    "LayerwiseStrategy",
    "OffloadStrategy",
    "PlacementSpec",
    "RequestFailed",
    "ResidencyManager",
    "ResidencyStrategy",
    "ResidencyTrace",
    "ResidentStrategy",
    "Stage",
    "Strategy",
    "UndeclaredUse",
    "WeightBlock",
    "plot_memory_timelines",
]
