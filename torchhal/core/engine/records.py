"""The engine's configuration, requests and the records its calls return."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from torchhal.core.model import ModelConfig


class PauseMode(str, enum.Enum):
    ABORT = "abort"  # in-flight requests end as aborted
    RETRACT = "retract"  # in-flight requests free their KV and wait again
    IN_PLACE = "in_place"  # freeze; KV kept


class RequestState(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    slots: list[int] = field(default_factory=list)
    error: str | None = None
    oom_retries: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass(frozen=True)
class GenerationResult:
    rid: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    state: RequestState
    error: str | None = None


@dataclass(frozen=True)
class FlushResult:
    flushed: bool
    message: str
    bytes_released: int | None = None


@dataclass(frozen=True)
class ContinueReport:
    reserved_before: int | None
    reserved_after: int | None
    bytes_released: int | None


@dataclass(frozen=True)
class WeightUpdateResult:
    updated: int
    weight_version: int
    flush: FlushResult | None


class WeightUpdateRejected(ValueError):
    """A weight update was refused before anything was written: the old weights stand."""


class WeightUpdateIncomplete(RuntimeError):
    """Writing validated weights failed part-way (a device fault); the engine refuses to
    generate until an update covering the named weights succeeds."""


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()  # used only when the engine builds its own ReferenceDecoder
    dtype: torch.dtype = torch.float32
    device: int | None = None
    kv_fraction: float = 0.3  # of free device memory, observed by memory_info
    max_kv_slots: int = 1 << 16
    max_batch_tokens: int = 4096
    max_running: int = 256
    idle_empty_after_s: float | None = None
    eos_token: int | None = None
    check_finite_weights: bool = False  # reject weight updates holding NaN/inf (one device sync per tensor)

    def __post_init__(self) -> None:
        for name in ("max_kv_slots", "max_batch_tokens", "max_running"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} = {value!r} must be a positive int")
        if self.idle_empty_after_s is not None and self.idle_empty_after_s < 0:
            raise ValueError(f"EngineConfig.idle_empty_after_s = {self.idle_empty_after_s!r} must be >= 0 or None")
