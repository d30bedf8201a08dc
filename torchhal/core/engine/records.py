"""The engine's configuration, requests and the records its calls return."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchhal.core.model import ModelConfig
from torchhal.core.model.config import check_int, check_number
from torchhal.core.model.decoder import check_compile_backend
from torchhal.values import as_index, as_indices, check_bool, check_buckets, short_repr


class PauseMode(str, enum.Enum):
    ABORT = "abort"  # in-flight requests end as aborted
    RETRACT = "retract"  # in-flight requests free their KV and wait again
    IN_PLACE = "in_place"  # freeze; KV kept

    @classmethod
    def named(cls, mode: object) -> PauseMode:
        try:
            return cls(mode)
        except ValueError:
            raise ValueError(f"pause_generation(mode={mode!r}): choose one of "
                             f"{', '.join(repr(m.value) for m in cls)} (or a PauseMode)") from None


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
    blocks: list[int] = field(default_factory=list)  # the KV blocks it owns, in position order
    kv_tokens: int = 0  # tokens whose KV it has reserved (written, or being written this step)
    error: str | None = None
    oom_retries: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def pending(self) -> int:
        """Tokens whose KV is not reserved yet: 1 for a decode, more while prefilling."""
        return len(self.prompt) + len(self.output) - self.kv_tokens

    @property
    def last_token(self) -> int:
        """The newest token (what a decode step feeds), without building `tokens`."""
        return self.output[-1] if self.output else self.prompt[-1]


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


def usable_buckets(buckets: tuple[int, ...], limit: int) -> tuple[int, ...]:
    """The buckets with each one above `limit` lowered to it. No step exceeds its limit (a
    context max_position, a batch max_running, a prefill max_batch_tokens), so a larger
    bucket would only size buffers no step fills (and a huge one would fail allocating them)."""
    return tuple(sorted({min(bucket, limit) for bucket in buckets}))


@dataclass(frozen=True)
class DecodeGraphConfig:
    """Full-graph decode: a pure decode step (no prefill in the batch) whose batch and
    longest context fit a bucket runs as one graph replay; every other step runs on the
    engine's runner. One graph is captured per (batch, context) bucket pair, at engine
    construction (and again after a wake where the platform has no virtual memory).
    `context_buckets` None: powers of 4 from 256 up to the longest request the engine holds.
    `emulate` runs the same padded static step eagerly (platforms without graph support, CPU
    tests); without it, a platform that cannot capture graphs runs every step on the engine's
    runner.

    `steps_per_sync`: while no request waits for admission, one engine step runs a
    window of up to this many decode steps back to back on the device (each step's
    token feeds the next) and reads the tokens back once, so the host's per-step work is
    paid once per window. Tokens are identical to single steps; a request that stops
    early (EOS) costs up to `steps_per_sync - 1` discarded steps of its row. 1 reads back
    every step."""

    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    context_buckets: tuple[int, ...] | None = None
    steps_per_sync: int = 8
    emulate: bool = False

    def __post_init__(self) -> None:
        for name in ("batch_buckets", "context_buckets"):
            if name == "context_buckets" and self.context_buckets is None:
                continue
            buckets = check_buckets(f"DecodeGraphConfig.{name}", getattr(self, name), "(1, 8, 32)", tuple)
            object.__setattr__(self, name, buckets)
        steps = as_index(self.steps_per_sync)
        if steps is None or steps < 1:
            raise ValueError(f"DecodeGraphConfig.steps_per_sync = {short_repr(self.steps_per_sync)} must be a positive "
                             "int; 1 reads tokens back every step")
        object.__setattr__(self, "steps_per_sync", steps)
        check_bool("DecodeGraphConfig.emulate", self.emulate)


@dataclass(frozen=True)
class PrefillGraphConfig:
    """Breakable graphs for the steps full-graph decode does not run (prefills, mixed
    steps, decode batches past its buckets) of at most `token_buckets[-1]` tokens: the
    layer stack outside attention replays as graphs captured per token bucket (the step's
    tokens padded to the smallest that fits), attention runs eagerly between them with the
    step's metadata (`torchhal.core.graphs.GraphRunner`). Short prompts are bound by the
    host's per-layer launches; this takes them off it. Larger steps run eagerly, unchanged.

    Every bucket holds its own activations for every layer in the graph pool (about
    `bucket x layers x 5 x hidden_size` elements), so the largest bucket sets the memory
    cost. `emulate` runs the padded path eagerly (platforms without graph support, CPU
    tests); without it, a platform that cannot capture graphs runs every step eagerly."""

    token_buckets: tuple[int, ...] = (16, 32, 64, 128, 256)
    emulate: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_buckets",
                           check_buckets("PrefillGraphConfig.token_buckets", self.token_buckets, "(16, 64, 256)",
                                         tuple))
        check_bool("PrefillGraphConfig.emulate", self.emulate)


#: What the KV cache and every attention backend compute in (`AttentionSpec` takes no other).
ENGINE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


#: `EngineConfig.compile_layers` default: the platform's choice (inductor where the platform
#: declares compile support, `Platform.compile_support`; no compile elsewhere).
PLATFORM_COMPILE = "platform"


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings. The defaults are the fast configuration where it is safe:

    - `max_batch_tokens` None: sized at construction so that a whole prompt of the longest
      request the engine holds prefills in one step, within a quarter of the memory the KV
      pool leaves;
    - `max_kv_slots` None: the KV pool is what `kv_fraction` of free memory holds, at most
      `max_running` requests of the model's `max_position` tokens;
    - `compile_layers` "platform": the model's per-layer arithmetic outside attention is
      compiled with inductor where the platform declares compile support (start-up: the first
      engine of a process compiles, about a minute for an 8B model on an H100/H200; inductor's
      cache makes later ones faster); None is the way off;
    - `decode_graphs`: full-graph decode where the platform captures graphs (start-up: one
      capture per bucket pair); None is the way off;
    - `prefill_graphs`: prefills and mixed steps of up to 256 tokens replay as graphs where the
      platform captures them (their activations: about 0.65 GB at the 8B shape; start-up: one
      capture per bucket); None is the way off;
    - `check_finite_weights`: weight updates holding NaN or inf are refused (one device sync
      per tensor); False is the way off.
    """

    model: ModelConfig = ModelConfig()  # used only when the engine builds its own ReferenceDecoder
    dtype: torch.dtype = torch.float32
    device: int | None = None
    kv_fraction: float = 0.3  # of free device memory, observed by memory_info
    max_kv_slots: int | None = None  # at most this many tokens' KV (whole blocks); None: see above
    kv_block_size: int = 16  # tokens per KV block: requests own whole blocks
    max_batch_tokens: int | None = None  # tokens one step computes at most; None: see above
    max_running: int = 256
    idle_empty_after_s: float | None = None
    eos_token: int | None = None  # a request ends on this token or on any of eos_tokens
    eos_tokens: tuple[int, ...] = ()  # Hugging Face configs often list several (Llama 3)
    check_finite_weights: bool = True
    decode_graphs: DecodeGraphConfig | None = DecodeGraphConfig()
    prefill_graphs: PrefillGraphConfig | None = PrefillGraphConfig()
    #: a `torch.compile` backend ("inductor", or a backend callable) for the model's per-layer
    #: arithmetic outside attention (`model.compile_layers`): fused kernels, the same for eager
    #: and graph paths; numbers differ from uncompiled ones in the last bits. None: not compiled.
    compile_layers: str | Callable[..., Any] | None = PLATFORM_COMPILE

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            raise TypeError(f"EngineConfig.model = {short_repr(self.model)} must be a ModelConfig (the model the "
                            "engine builds when given none), e.g. ModelConfig(vocab_size=32000, ...)")
        check_number(self, "kv_fraction", self.kv_fraction, "a fraction of free memory in (0, 1], e.g. 0.3",
                     above=0.0, maximum=1.0)
        for name in ("max_running", "kv_block_size"):
            check_int(self, name, 1, None, "a positive int")
        for name in ("max_kv_slots", "max_batch_tokens"):
            if getattr(self, name) is not None:
                check_int(self, name, 1, None, "a positive int, or None to size it from the model and memory")
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"EngineConfig.dtype = {self.dtype!r} must be one of "
                             f"{', '.join(map(str, ENGINE_DTYPES))}, e.g. dtype=torch.bfloat16")
        if self.device is not None:
            check_int(self, "device", 0, None, "a device index (an int >= 0, e.g. 0) or None for the current device")
        eos = as_indices(self.eos_tokens, 0) if isinstance(self.eos_tokens, tuple) else None
        if eos is None:
            raise ValueError(f"EngineConfig.eos_tokens = {short_repr(self.eos_tokens)} must be a tuple of token ids "
                             "(ints >= 0), e.g. (2,)")
        object.__setattr__(self, "eos_tokens", eos)
        if self.eos_token is not None:
            check_int(self, "eos_token", 0, None, "a token id (an int >= 0) or None")
        check_bool("EngineConfig.check_finite_weights", self.check_finite_weights)
        if self.max_kv_slots is not None and self.max_kv_slots < self.kv_block_size:
            raise ValueError(f"EngineConfig.max_kv_slots = {self.max_kv_slots} holds no block of kv_block_size = "
                             f"{self.kv_block_size} tokens; raise max_kv_slots or lower kv_block_size")
        for name, kind, use in (("decode_graphs", DecodeGraphConfig, "to turn full-graph decode on"),
                                ("prefill_graphs", PrefillGraphConfig, "to run short prefills as graphs")):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"EngineConfig.{name} = {value!r} must be a {kind.__name__} or None; "
                                f"e.g. {name}={kind.__name__}() {use}")
        if self.compile_layers is not None and self.compile_layers != PLATFORM_COMPILE:
            check_compile_backend(self.compile_layers, "EngineConfig.compile_layers")
        if self.idle_empty_after_s is not None:
            check_number(self, "idle_empty_after_s", self.idle_empty_after_s,
                         "a finite number of seconds >= 0, or None", minimum=0.0)
