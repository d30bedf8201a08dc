"""The engine: continuous-batching scheduler, request lifecycle, weight updates, sleep/wake."""

from torchhal.core.engine.engine import (
    ContinueReport,
    EagerRunner,
    EngineConfig,
    FlushResult,
    GenerationEngine,
    GenerationResult,
    ModelRunner,
    PauseMode,
    Request,
    RequestState,
    WeightUpdateResult,
)

__all__ = [
    "ContinueReport",
    "EagerRunner",
    "EngineConfig",
    "FlushResult",
    "GenerationEngine",
    "GenerationResult",
    "ModelRunner",
    "PauseMode",
    "Request",
    "RequestState",
    "WeightUpdateResult",
]
