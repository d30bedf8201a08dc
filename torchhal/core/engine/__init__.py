"""The engine: continuous-batching scheduler, request lifecycle, weight updates, sleep/wake.

`GenerationEngine` is the public face; each of its parts has one job:
`RequestBook` (requests and results), `Scheduler` (batches and their rollback),
`StepExecutor` (a plan on the device, and its tokens back), `WeightUpdater`,
`Occupation` (sleep/wake) and a `ModelRunner`.
"""

from torchhal.core.engine.engine import GenerationEngine
from torchhal.core.engine.execution import InFlight, StepExecutor
from torchhal.core.engine.occupation import Occupation
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
from torchhal.core.engine.requests import RequestBook
from torchhal.core.engine.runners import EagerRunner, ModelRunner
from torchhal.core.engine.scheduler import Scheduler, StepPlan
from torchhal.core.engine.weights import WeightUpdater

__all__ = [
    "ContinueReport",
    "DecodeGraphConfig",
    "EagerRunner",
    "EngineConfig",
    "FlushResult",
    "GenerationEngine",
    "GenerationResult",
    "InFlight",
    "Occupation",
    "ModelRunner",
    "PauseMode",
    "PrefillGraphConfig",
    "Request",
    "RequestBook",
    "RequestState",
    "Scheduler",
    "StepExecutor",
    "StepPlan",
    "WeightUpdateIncomplete",
    "WeightUpdateRejected",
    "WeightUpdateResult",
    "WeightUpdater",
]
