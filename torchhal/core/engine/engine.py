"""A small but real generation engine whose scheduler gets the memory lifecycle right.

Continuous batching over a token-slot KV pool, greedy decoding, and the
lifecycle operations RL loops and servers need: flush, pause/continue, weight
updates, sleep/wake. The device cache is emptied only at named release points:
continue (resume_generation), weight-update flush (weight_update), sleep,
out-of-memory (oom), an idle interval (idle), or a user flush (user).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from torchhal.core.engine.kv_pool import KVPoolSizing, SlotAllocator, size_kv_pool
from torchhal.core.model.reference import AttentionMetadata, KVCache, ModelConfig, ReferenceDecoder
from torchhal.platforms import Platform, ReleasePoint, current_platform


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


class ModelRunner(Protocol):
    """Runs the model's layer stack for one batch: eager, or replayed graphs."""

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...

    def release(self) -> None: ...

    def resume(self) -> None: ...


class EagerRunner:
    def __init__(self, model: ReferenceDecoder) -> None:
        self.model = model

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, meta)

    def release(self) -> None:
        return None

    def resume(self) -> None:
        return None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    dtype: torch.dtype = torch.float32
    device: int | None = None
    kv_fraction: float = 0.3  # of free device memory, observed by memory_info
    max_kv_slots: int = 1 << 16
    max_batch_tokens: int = 4096
    max_running: int = 256
    idle_empty_after_s: float | None = None
    eos_token: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_kv_slots", "max_batch_tokens", "max_running"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} = {value!r} must be a positive int")
        if self.idle_empty_after_s is not None and self.idle_empty_after_s < 0:
            raise ValueError(f"EngineConfig.idle_empty_after_s = {self.idle_empty_after_s!r} must be >= 0 or None")


class GenerationEngine:
    def __init__(
        self,
        config: EngineConfig = EngineConfig(),
        platform: Platform | None = None,
        runner_factory: Callable[[GenerationEngine], ModelRunner] | None = None,
    ) -> None:
        self.config = config
        self.platform = platform or current_platform()
        self.device_index = self.platform.current_device() if config.device is None else config.device
        self.device = self.platform.device(self.device_index)
        self.model = ReferenceDecoder(config.model).to(self.device, config.dtype).eval()
        self.kv_sizing: KVPoolSizing = size_kv_pool(
            self.platform, self.device_index, config.model, config.dtype, config.kv_fraction, config.max_kv_slots
        )
        self.model.kv = KVCache(config.model, self.kv_sizing.num_slots, self.device, config.dtype)
        self.slots = SlotAllocator(self.kv_sizing.num_slots)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.results: dict[int, GenerationResult] = {}
        self.paused: PauseMode | None = None
        self.asleep = False
        self.weight_version = 0
        self.trace: list[dict[str, Any]] = []
        self._next_rid = 0
        self._steps = 0
        self._idle_since: float | None = None
        self._idle_emptied = False
        self._host_weights: dict[str, torch.Tensor] | None = None
        self.runner: ModelRunner = runner_factory(self) if runner_factory else EagerRunner(self.model)

    # -- requests -----------------------------------------------------------------------
    def add_request(self, prompt: list[int], max_new_tokens: int) -> int:
        """Queue a prompt; raises ValueError naming a bad token or length (nothing queued)."""
        vocab = self.config.model.vocab_size
        if not prompt:
            raise ValueError("prompt is empty; pass at least one token id")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary 0..{vocab - 1}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {max_new_tokens!r} must be a positive int")
        needed = len(prompt) + max_new_tokens
        if needed > self.config.model.max_position:
            raise ValueError(
                f"prompt + max_new_tokens = {needed} exceeds max_position {self.config.model.max_position}"
            )
        rid = self._next_rid
        self._next_rid += 1
        self.waiting.append(Request(rid, list(prompt), max_new_tokens))
        return rid

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[GenerationResult]:
        """Run prompts to completion. A bad prompt yields a failed result; others still run."""
        if self.paused is not None:
            raise RuntimeError(f"the engine is paused ({self.paused.value}); call continue_generation() first")
        rids = []
        for prompt in prompts:
            try:
                rids.append(self.add_request(prompt, max_new_tokens))
            except ValueError as exc:
                rid = self._next_rid
                self._next_rid += 1
                self.results[rid] = GenerationResult(rid, tuple(prompt), (), RequestState.FAILED, str(exc))
                rids.append(rid)
        while any(rid not in self.results for rid in rids):
            self.step()
        return [self.results.pop(rid) for rid in rids]

    # -- scheduling -------------------------------------------------------------------------
    def step(self) -> list[GenerationResult]:
        """One continuous-batching step: decode the running batch, admit prefills."""
        if self.paused is not None:
            return []
        if self.asleep:
            raise RuntimeError("the engine is asleep; call resume_memory_occupation() first")
        decodes = self._reserve_decode_slots()
        prefills = self._admit(budget=self.config.max_batch_tokens - len(decodes))
        batch = decodes + prefills
        if not batch:
            self._idle_tick()
            return self._fail_unservable()
        self._idle_since, self._idle_emptied = None, False
        ids: list[int] = []
        counts: list[int] = []
        for request in batch:
            fresh = request.tokens if request in prefills else request.tokens[-1:]
            ids.extend(fresh)
            counts.append(len(fresh))
        meta = AttentionMetadata.build([r.slots for r in batch], counts, self.device)
        last_index = torch.tensor(
            [sum(counts[: i + 1]) - 1 for i in range(len(batch))], dtype=torch.long, device=self.device
        )
        try:
            hidden = self.runner.forward(torch.tensor(ids, dtype=torch.long, device=self.device), meta)
            next_tokens = self.model.logits(hidden, last_index).argmax(-1).tolist()
        except Exception as exc:
            if not self.platform.is_out_of_memory(exc):
                raise
            return self._handle_oom(batch, exc)
        self._steps += 1
        done = []
        for request, token in zip(batch, next_tokens, strict=True):
            request.output.append(int(token))
            if len(request.output) >= request.max_new_tokens or token == self.config.eos_token:
                done.append(self._finish(request, RequestState.FINISHED))
        return done

    def _reserve_decode_slots(self) -> list[Request]:
        """One new slot per running request; retract the newest ones if the pool is short."""
        while self.running and self.slots.available < len(self.running):
            self._retract(self.running[-1])
        for request in self.running:
            slot = self.slots.allocate(1)
            assert slot is not None
            request.slots.extend(slot)
        return list(self.running)

    def _admit(self, budget: int) -> list[Request]:
        admitted: list[Request] = []
        while self.waiting and len(self.running) < self.config.max_running:
            request = self.waiting[0]
            need = len(request.tokens)
            if need > budget and (admitted or self.running):
                break
            slots = self.slots.allocate(need)
            if slots is None:
                break
            self.waiting.popleft()
            request.slots, request.state = slots, RequestState.RUNNING
            self.running.append(request)
            admitted.append(request)
            budget -= need
        return admitted

    def _fail_unservable(self) -> list[GenerationResult]:
        """With nothing running, a waiting request that still cannot be admitted never will be."""
        if self.running or not self.waiting:
            return []
        request = self.waiting.popleft()
        request.error = (
            f"request {request.rid} needs {len(request.tokens)} KV slots but the pool has "
            f"{self.slots.num_slots}; raise kv_fraction or shorten the prompt"
        )
        return [self._finish(request, RequestState.FAILED)]

    def _retract(self, request: Request) -> None:
        self.slots.free(request.slots)
        request.slots, request.state = [], RequestState.WAITING
        self.running.remove(request)
        self.waiting.appendleft(request)

    def _finish(self, request: Request, state: RequestState) -> GenerationResult:
        self.slots.free(request.slots)
        request.slots, request.state = [], state
        if request in self.running:
            self.running.remove(request)
        result = GenerationResult(request.rid, tuple(request.prompt), tuple(request.output), state, request.error)
        self.results[request.rid] = result
        return result

    def _handle_oom(self, batch: list[Request], error: BaseException) -> list[GenerationResult]:
        self.platform.report_out_of_memory(error, f"scheduler step {self._steps}", self.device_index)
        failed = []
        for request in reversed(batch):
            request.oom_retries += 1
            if request.oom_retries > 1:
                request.error = f"out of memory twice while running a batch of {len(batch)} request(s): {error}"
                failed.append(self._finish(request, RequestState.FAILED))
            else:
                self._retract(request)
        self._empty(ReleasePoint.OOM)
        return failed

    def _idle_tick(self) -> None:
        interval = self.config.idle_empty_after_s
        if interval is None or self._idle_emptied or self.waiting:
            return
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= interval:
            self._empty(ReleasePoint.IDLE)
            self._idle_emptied = True

    # -- lifecycle ------------------------------------------------------------------------------
    def pending(self) -> str | None:
        """What keeps the engine from being idle, in words; None when idle."""
        parts = []
        if self.running:
            parts.append(f"{len(self.running)} running")
        if self.waiting:
            parts.append(f"{len(self.waiting)} waiting")
        if not parts:
            return None
        paused = f" (paused {self.paused.value})" if self.paused else ""
        return ", ".join(parts) + f" request(s){paused}"

    def flush_cache(self, empty_cache: bool = True, reason: ReleasePoint = ReleasePoint.USER) -> FlushResult:
        """Clear the KV pool (there is no prefix cache), only when fully idle."""
        pending = self.pending()
        if pending:
            return FlushResult(False, f"cannot flush while busy: {pending} still pending")
        self.slots.reset()
        released = self._empty(reason) if empty_cache else None
        return FlushResult(True, "KV pool cleared", released)

    def pause_generation(self, mode: PauseMode | str) -> list[GenerationResult]:
        """Pause. Returns the requests ended by an abort (empty for retract / in_place)."""
        mode = PauseMode(mode)
        if self.paused is not None:
            raise RuntimeError(f"already paused ({self.paused.value}); call continue_generation() first")
        ended: list[GenerationResult] = []
        if mode is PauseMode.ABORT:
            for request in [*self.running, *self.waiting]:
                request.error = "aborted by pause_generation(abort)"
                ended.append(self._finish(request, RequestState.ABORTED))
            self.waiting.clear()
        elif mode is PauseMode.RETRACT:
            for request in reversed(list(self.running)):
                self._retract(request)
        self.paused = mode
        self._record("pause", mode=mode.value, ended=len(ended))
        return ended

    def continue_generation(self, empty_cache: bool = True) -> ContinueReport:
        """Resume. Empties the cache first, while still paused: the fragmentation release point."""
        if self.paused is None:
            raise RuntimeError("the engine is not paused; nothing to continue")
        before = self.platform.memory_info(self.device_index).reserved
        released = self._empty(ReleasePoint.RESUME_GENERATION) if empty_cache else None
        after = self.platform.memory_info(self.device_index).reserved
        self._record("continue", reserved_before=before, reserved_after=after)
        self.paused = None
        return ContinueReport(before, after, released)

    def update_weights_from_tensors(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], flush_cache: bool = False
    ) -> WeightUpdateResult:
        """Validate every name, shape and dtype first; apply all or nothing; post-process."""
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        params = dict(self.model.named_parameters())
        problems = []
        seen: set[str] = set()
        for name, tensor in items:
            if name in seen:
                problems.append(f"{name!r} given twice")
            seen.add(name)
            target = params.get(name)
            if target is None:
                problems.append(f"unknown weight {name!r}")
            elif not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(target.shape):
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                problems.append(f"{name!r} has shape {shape}, expected {tuple(target.shape)}")
            elif not tensor.dtype.is_floating_point:
                problems.append(f"{name!r} has dtype {tensor.dtype}, expected a floating dtype like {target.dtype}")
        if problems:
            raise ValueError("weight update rejected, nothing applied: " + "; ".join(problems))
        staged = [(params[name], self._stage(tensor, params[name])) for name, tensor in items]
        with torch.no_grad():  # nothing below allocates on the device: the update cannot fail halfway
            for param, value in staged:
                param.copy_(value)
        del staged
        self.model.process_weights()
        self.weight_version += 1
        self._record("weights_updated", count=len(items), version=self.weight_version)
        return WeightUpdateResult(len(items), self.weight_version, self.flush_cache_after_weight_update(flush_cache))

    @staticmethod
    def _stage(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """The source in the parameter's dtype, without a device copy of the whole model.

        Host tensors are converted on the host and copied straight into the parameter;
        tensors already on the parameter's device are used as they are (converted there
        only when their dtype differs). Staging every weight on the device first would
        add a model-sized transient to every update.
        """
        if tensor.device == param.device or tensor.device.type == "cpu":
            return tensor if tensor.dtype == param.dtype else tensor.to(param.dtype)
        return tensor.to(param.device, param.dtype)

    def update_weights_from_disk(self, path: str, flush_cache: bool = False) -> WeightUpdateResult:
        try:
            from safetensors.torch import load_file
        except ImportError as exc:  # pragma: no cover - safetensors is in the test extra
            raise RuntimeError("update_weights_from_disk needs safetensors: pip install safetensors") from exc
        return self.update_weights_from_tensors(load_file(path, device="cpu"), flush_cache)

    def flush_cache_after_weight_update(self, requested: bool) -> FlushResult | None:
        """The one place every weight-update path flushes, when the caller asked."""
        if not requested:
            return None
        return self.flush_cache(empty_cache=True, reason=ReleasePoint.WEIGHT_UPDATE)

    def release_memory_occupation(self) -> int | None:
        """Sleep: weights and KV pool leave the device. Only when idle."""
        pending = self.pending()
        if pending or self.asleep:
            raise RuntimeError(f"cannot sleep: {pending or 'already asleep'}")
        self.runner.release()
        self._host_weights = {
            name: self.platform.pin_memory(t.detach().to("cpu")) for name, t in self.model.state_dict().items()
        }
        self.model.to("cpu")
        self.model.kv = None
        self.asleep = True
        return self._empty(ReleasePoint.SLEEP)

    def resume_memory_occupation(self) -> None:
        if not self.asleep or self._host_weights is None:
            raise RuntimeError("the engine is not asleep")
        self.model.to(self.device)
        self.model.load_state_dict(self._host_weights, strict=False)
        self.model.process_weights()
        self.model.kv = KVCache(self.config.model, self.slots.num_slots, self.device, self.config.dtype)
        self.slots.reset()
        self._host_weights = None
        self.asleep = False
        self.runner.resume()

    # -- helpers ------------------------------------------------------------------------------------
    def _empty(self, reason: ReleasePoint) -> int | None:
        released = self.platform.empty_cache(reason, self.device_index)
        self._record("empty_cache", reason=reason.value, bytes_released=released)
        return released

    def _record(self, kind: str, **fields: Any) -> None:
        event = {"kind": kind, "t": time.monotonic(), **fields}
        self.trace.append(event)
        self.platform.emit_event(event)
