"""The engine: continuous-batching scheduler, request lifecycle, weight updates, sleep/wake.

`GenerationEngine` is the public face; each of its parts has one job:
`RequestBook` (requests and results), `Scheduler` (batches and their rollback),
`StepExecutor` (a plan on the device, and its tokens back), `WeightUpdater`,
`Occupation` (sleep/wake) and a `ModelRunner`.
"""

from torchhal.core.engine.engine import GenerationEngine
from torchhal.core.engine.records import (
    ContinueReport,
    DecodeGraphConfig,
    EngineConfig,
    FlushResult,
    GenerationResult,
    PauseMode,
    PrefillGraphConfig,
    Request,
    RequestState,
    WeightUpdateIncomplete,
    WeightUpdateRejected,
    WeightUpdateResult,
)
from torchhal.core.engine.runners import EagerRunner, ModelRunner

__all__ = [
    "ContinueReport",
    "DecodeGraphConfig",
    "EagerRunner",
    "EngineConfig",
    "FlushResult",
    "GenerationEngine",
    "GenerationResult",
    "ModelRunner",
    "PauseMode",
    "PrefillGraphConfig",
    "Request",
    "RequestState",
    "WeightUpdateIncomplete",
    "WeightUpdateRejected",
    "WeightUpdateResult",
]
