"""A small but real generation engine whose scheduler gets the memory lifecycle right.

Continuous batching with chunked prefill over a paged KV cache (attention through the
backend the platform chooses), greedy decoding, and the
lifecycle operations RL loops and servers need: flush, pause/continue, weight
updates, sleep/wake. The device cache is emptied only at named release points:
continue (resume_generation), weight-update flush (weight_update), sleep,
out-of-memory (oom), an idle interval (idle), or a user flush (user).

`GenerationEngine` composes one part per job: `RequestBook` (request lifecycle and
results), `Scheduler` (batch building and its rollback), `WeightUpdater`,
`MemoryOccupation` (sleep/wake) and a `ModelRunner`, over any `Model`.

Threads: one reentrant engine lock serializes every public method that reads or
changes engine state; `generate` takes it per step, so concurrent calls share the
continuous batch and each returns exactly its own results (`_serialized`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import numbers
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import torch

from torchhal.attention import AttentionChoice, AttentionSpec
from torchhal.core.devices import check_device_index, is_out_of_memory, model_placement
from torchhal.core.engine.events import EngineEvents
from torchhal.core.engine.kv_pool import BlockAllocator, KVPoolSizing, size_kv_pool
from torchhal.core.engine.model_state import ModelState, restored_on_failure
from torchhal.core.engine.occupation import MemoryOccupation, Releasable
from torchhal.core.engine.ranks import (
    agree_on_config,
    agree_on_verdict,
    check_group,
    refuse_with_peers,
    shard_problem,
)
from torchhal.core.engine.records import (
    ContinueReport,
    DecodeGraphConfig,
    EngineConfig,
    FlushResult,
    GenerationResult,
    PauseMode,
    Request,
    RequestState,
    WeightUpdateIncomplete,
    WeightUpdateResult,
    usable_buckets,
)
from torchhal.core.engine.requests import RequestBook, check_max_new_tokens, output_complete
from torchhal.core.engine.runners import EagerRunner, ModelRunner
from torchhal.core.engine.scheduler import Scheduler, StepInputs, StepPlan
from torchhal.core.engine.weights import NamedTensors, WeightUpdater
from torchhal.core.graphs.decode import BlockTable, DecodeGraphRunner, DecodeWindow
from torchhal.core.graphs.runner import GraphRunner
from torchhal.core.model import AttentionMetadata, KVCache, Model, ModelConfig, ReferenceDecoder
from torchhal.core.model.greedy import greedy_tokens
from torchhal.core.model.linear import use_platform_linear
from torchhal.core.model.protocol import missing_model_members
from torchhal.platforms import CompileSupport, Platform, ReleasePoint, check_platform_argument, current_platform
from torchhal.values import check_bool, short_repr

if TYPE_CHECKING:
    from torchhal.core.model.checkpoint import LoadReport
    from torchhal.distributed import DeviceGroup


@dataclass
class _Window:
    """A decode window on the device: its requests, the tokens each reserved (= tokens it
    wants), and the runner's handle to read the tokens back."""

    requests: list[Request]
    new: list[int]
    window: DecodeWindow | None  # None only while it is being launched

    @property
    def launched(self) -> DecodeWindow:
        assert self.window is not None
        return self.window


@dataclass
class _Landing:
    """A step's sampled tokens on their way to the host, read at the next `step()`: its
    batch, which requests emit, the tokens' page-locked host copy and the platform event
    recorded after the copy."""

    batch: list[Request]
    emits: list[bool]
    tokens: torch.Tensor  # [emitting requests], valid once `done` has completed
    done: Any


_P = ParamSpec("_P")
_R = TypeVar("_R")


#: What a closed engine still answers: closing again, and whether anything is pending (nothing).
_CALLS_AFTER_CLOSE = frozenset({"close", "pending", "_group_closing"})


def _serialized(
    method: Callable[Concatenate[GenerationEngine, _P], _R],
) -> Callable[Concatenate[GenerationEngine, _P], _R]:
    """Run an engine method holding the engine lock (see `GenerationEngine._exclusive`)."""

    @functools.wraps(method)
    def serialized(self: GenerationEngine, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._exclusive(method.__name__):
            return method(self, *args, **kwargs)

    return serialized


class GenerationEngine:
    def __init__(
        self,
        config: EngineConfig = EngineConfig(),
        platform: Platform | None = None,
        model: Model | None = None,
        runner_factory: Callable[[GenerationEngine], ModelRunner] | None = None,
        group: DeviceGroup | None = None,
    ) -> None:
        """`model`: any `Model` (moved to the engine's device and `config.dtype`); None builds
        `ReferenceDecoder(config.model)`. Model facts always come from `model.config`.

        The KV cache is paged (`config.kv_block_size` tokens a block) and holds one block
        more than the allocator hands out: the scratch block, where padded rows write.
        The attention backend is chosen once, here (`self.attention`, also in `trace`).

        `group` (tensor parallel, `torchhal.distributed.init_group`): the engine runs on
        `group.device` and holds this rank's shard of a `LlamaDecoder` (a whole one, or None,
        is sharded here; `from_checkpoint(..., group=)` reads only the rank's slices). Every
        rank makes the same engine calls in the same order (SPMD) and gets the same tokens.
        A group of one rank is no group: today's engine on `group.device` (closing it
        still ends the engine, as at any size). Under tensor
        parallel an error in a step (out-of-memory on one rank, a peer that died, ...)
        is final: the ranks cannot know they failed alike, so instead of retracting and
        retrying (which could leave the ranks' batches apart) the step raises and the engine
        refuses every later step (`broken`); a rank whose peer failed raises within the group's
        timeout (gloo: from the collective; NCCL: from the bounded wait for its device work,
        unless NCCL's watchdog ends the process first), then refuses likewise. Make a new group and
        engines to go on."""
        if model is not None and missing_model_members(model):
            raise TypeError(
                f"model {type(model).__name__} lacks {', '.join(missing_model_members(model))} of the "
                "torchhal.core.model.Model protocol"
            )
        if model is not None:
            check_model_unowned(model)
        # Every refusal the config alone decides comes before the model is moved or changed.
        check_platform_argument(platform, "GenerationEngine")
        check_engine_config(config, runner_factory)
        check_group(group)
        check_eos_tokens(config, (model.config if model is not None else config.model).vocab_size)
        agree_on_config(config, group, shard_problem(model, group))
        if config.compile_layers is not None and model is not None and getattr(model, "compile_layers", None) is None:
            raise TypeError(
                f"EngineConfig.compile_layers = {config.compile_layers!r}, but model {type(model).__name__} "
                "has no compile_layers(backend); leave compile_layers None for this model"
            )
        # Past this point the caller's model is moved, cast and given a cache; if anything
        # fails (graph capture out of memory, say), it is put back as it was, and this
        # half-built engine drops what it built (graphs, the KV pool) at once.
        with _claimed(model), _dropped_on_failure(self), restored_on_failure(model) as saved:
            self.config = config
            self.group = group if group is not None and group.world_size > 1 else None
            self.platform = platform or (group.platform if group is not None else current_platform())
            self.device_index = engine_device_index(self.platform, config, group)
            self.device = self.platform.device(self.device_index)
            built: Model = ReferenceDecoder(config.model) if model is None else model
            if self.group is not None:
                built = _rank_model(built, self.group)
            built.to(model_placement(built, self.device), config.dtype)
            built.eval()
            linear_kernel, linear_why = use_platform_linear(built, self.platform.linear_support, config.dtype)
            compile_options: dict[str, Any] | None = None
            compile_why = "layers are not compiled (EngineConfig.compile_layers is None)"
            if config.compile_layers is not None:
                compile_layers = built.compile_layers  # type: ignore[attr-defined]  # checked above
                compile_options, compile_why = platform_compile_options(
                    compile_layers, config.compile_layers, self.platform.compile_support)
                if compile_options:  # before any graph is captured
                    compile_layers(config.compile_layers, compile_options)
                else:
                    compile_layers(config.compile_layers)
            self.model: Model = built
            model_config, local = self.model_config, self.local_config
            self.kv_sizing: KVPoolSizing = size_kv_pool(
                self.platform, self.device_index, local, config.dtype, config.kv_fraction, config.max_kv_slots,
                config.kv_block_size, free_bytes=self._free_bytes_everywhere(saved),
            )
            self.attention: AttentionChoice = self.platform.choose_attention(AttentionSpec(
                num_q_heads=local.num_heads, num_kv_heads=local.num_kv_heads,
                head_dim=local.head_dim, dtype=config.dtype, block_size=config.kv_block_size,
                sliding_window=local.sliding_window, needs_graph=config.decode_graphs is not None,
            ))
            self.model.kv = self._new_kv_cache()
            self.requests = RequestBook(
                BlockAllocator(self.kv_sizing.num_blocks, config.kv_block_size), model_config.vocab_size,
                model_config.max_position, grow_pool=self.kv_sizing.how_to_grow,
            )
            self.scheduler = Scheduler(self.requests, config.max_batch_tokens, config.max_running)
            self.weights = WeightUpdater(
                self.model, check_finite=config.check_finite_weights,
                shard=getattr(self.model, "shard", None) if self.group is not None else None,
                agree=functools.partial(agree_on_verdict, self.group) if self.group is not None else None,
            )
            self.occupation = MemoryOccupation(self.platform, self.device)
            self.events = EngineEvents(self.platform, self.device_index)
            self.events.record("attention_backend", backend=self.attention.name, why=self.attention.why)
            self.events.record("linear_kernel", kernel=linear_kernel, why=linear_why)
            self.events.record("compile_options", options=compile_options, why=compile_why)
            self.paused: PauseMode | None = None
            # Reentrant: public methods call each other (flush_cache drains, pause drains, ...).
            self._lock = threading.RLock()
            self._resumed = threading.Condition(self._lock)  # notified by continue_generation
            self._stepping = False  # a step is running (on the thread holding the lock)
            self._steps = 0
            self._idle_since: float | None = time.monotonic()  # None while a step works
            self._idle_emptied = False
            self.broken: str | None = None  # tensor parallel: why a failed step ended this engine
            self._closed = False
            self.runner: ModelRunner = self._new_runner(runner_factory)
            eos = set(config.eos_tokens) | ({config.eos_token} if config.eos_token is not None else set())
            self._eos: frozenset[int] = frozenset(eos)
            # Pure decode steps on the runner read their metadata from here: each request keeps a
            # row whose blocks are uploaded once, so a step's host work does not grow with the context.
            self.decode_rows = BlockTable(self.max_running_requests, self.longest_request, config.kv_block_size,
                                          self.device, pin=self.platform.pin_memory)
            self.requests.on_leave = self._forget_rows
            self.decode_runner: DecodeGraphRunner | None = None
            self.checkpoint: LoadReport | None = None  # set by from_checkpoint
            self._in_flight: _Window | None = None  # a launched decode window whose tokens have not landed
            self._landing: _Landing | None = None  # a step's tokens still on their way to the host
            if config.decode_graphs is not None:
                self.decode_runner = self._new_decode_runner(config.decode_graphs)
            _ENGINE_OF_MODEL[id(self.model)] = self  # the model now holds this engine's KV cache
        if group is not None:  # a group of one rank too: closing it ends the engine at any world size
            group.release_on_close(self._group_closing)

    def _free_bytes_everywhere(self, saved: ModelState | None) -> int:
        """The free memory the KV pool is sized from: this device's, or under tensor parallel
        the least of any rank's, so every rank sizes the same pool and schedules alike. On a
        platform without a caching allocator (the host), the originals of a model cast on its
        own device, kept for a restore, count as free: the cast would have freed them."""
        if self.group is not None:
            return self.platform.available_memory(self.group.host)  # on the rank's device: init_group made it current
        info = self.platform.memory_info(self.device_index)
        held = saved.held_bytes(self.device) if saved is not None and info.reserved is None else 0
        return info.free + held

    def _new_runner(self, runner_factory: Callable[[GenerationEngine], ModelRunner] | None) -> ModelRunner:
        """The runner of every step full-graph decode does not take: the caller's, breakable
        graphs for `config.prefill_graphs` (captured here, after the KV cache exists), or eager."""
        if runner_factory is not None:
            made = runner_factory(self)
            missing = [name for name in ("forward", "release", "resume") if not callable(getattr(made, name, None))]
            if missing:
                raise TypeError(f"runner_factory returned {type(made).__name__}, which lacks {', '.join(missing)} of "
                                "the ModelRunner protocol (forward(input_ids, meta, rows), release(), resume())")
            try:  # a runner written before `rows` would fail at the first step instead
                inspect.signature(made.forward).bind(None, None, None)
            except TypeError:
                raise TypeError(
                    f"runner_factory returned {type(made).__name__}, whose forward{inspect.signature(made.forward)} "
                    "does not take the ModelRunner protocol's (input_ids, meta, rows); rows are the token indices "
                    "whose hidden states it returns, in that order (None: every token)") from None
            except ValueError:  # a callable without a signature (a C function): taken as it is
                pass
            return made
        settings = self.config.prefill_graphs
        if settings is None:
            return EagerRunner(self.model)
        # A step has at most max_batch_tokens tokens: larger buckets would only hold memory.
        runner = GraphRunner(self.model, self.platform, self.device_index, dtype=self.config.dtype,
                             buckets=usable_buckets(settings.token_buckets, self.config.max_batch_tokens),
                             emulate=settings.emulate)
        self.events.record("prefill_graphs", buckets=list(runner.bucket_sizes), eager_reason=runner.eager_reason)
        return runner

    def _new_decode_runner(self, settings: DecodeGraphConfig) -> DecodeGraphRunner:
        """Built after the KV cache exists: capture needs it (and the scratch block in it).
        Buckets no step can use are left out, and a window never runs past the largest
        context bucket, so neither sizes buffers beyond what a step can fill."""
        context_buckets = usable_buckets(settings.context_buckets, self.longest_request)
        return DecodeGraphRunner(
            self.model,  # type: ignore[arg-type]  # the Model protocol is satisfied by nn.Modules
            self.platform,
            self.device_index,
            block_size=self.config.kv_block_size,
            backend=self.attention.backend,
            batch_buckets=usable_buckets(settings.batch_buckets, self.max_running_requests),
            context_buckets=context_buckets,
            steps_per_sync=min(settings.steps_per_sync, context_buckets[-1]),
            emulate=settings.emulate,
        )

    # -- views of the parts ---------------------------------------------------------------
    @property
    def max_running_requests(self) -> int:
        """`config.max_running`, or fewer when the pool has fewer blocks (a running request holds one)."""
        return min(self.config.max_running, self.kv_sizing.num_blocks)

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    @property
    def longest_request(self) -> int:
        """The most tokens a request can hold: max_position, or fewer when the KV pool has fewer slots."""
        return min(self.model_config.max_position, self.kv_sizing.num_slots)

    @property
    def local_config(self) -> ModelConfig:
        """The shapes this process computes: a tensor-parallel rank's heads and KV heads (the KV
        cache and attention are sized from them); `model_config` for a model on one device."""
        local: ModelConfig = getattr(self.model, "local_config", self.model.config)
        return local

    @property
    def blocks(self) -> BlockAllocator:
        return self.requests.blocks

    @property
    def waiting(self) -> deque[Request]:
        return self.requests.waiting

    @property
    def running(self) -> list[Request]:
        return self.requests.running

    @property
    def results(self) -> dict[int, GenerationResult]:
        return self.requests.results

    @property
    def asleep(self) -> bool:
        return self.occupation.asleep

    @property
    def weight_version(self) -> int:
        return self.weights.version

    @property
    def trace(self) -> list[dict[str, Any]]:
        return self.events.trace

    # -- threads ----------------------------------------------------------------------------
    @contextmanager
    def _exclusive(self, call: str) -> Iterator[None]:
        """Hold the engine lock for `call`. Refused on the stepping thread inside a step (a
        model, runner or hook calling back into the engine): the step's state is half-built,
        and a plain lock would deadlock there instead of saying so.

        An interrupt (Ctrl-C) can arrive between any two lines of the call's bookkeeping: if
        the call raises and leaves the requests' book inconsistent (a reservation, admission,
        retraction or token half-done), every request waits again and is prefilled with what
        it has generated so far (`RequestBook.recover`): nothing is lost or left stuck."""
        with self._lock:
            if self._closed and call not in _CALLS_AFTER_CLOSE:
                raise RuntimeError(f"{call}() on a closed engine (close() gave its KV cache and graphs back); "
                                   "build a new engine")
            if self._stepping:
                raise RuntimeError(
                    f"{call}() called from inside a step on the same thread (a model, runner or hook "
                    "calling back into the engine); the engine is not re-entrant there: call it after step() returns"
                )
            with self._recovering():
                yield

    @contextmanager
    def _recovering(self) -> Iterator[None]:
        """If the block raises leaving the book inconsistent, recover it (see `_exclusive`)."""
        try:
            yield
        except BaseException as exc:
            if self._inconsistencies():
                self._recover(exc)
            raise

    # -- requests -----------------------------------------------------------------------
    @_serialized
    def add_request(self, prompt: list[int], max_new_tokens: int) -> int:
        """Queue a prompt; raises TypeError/ValueError naming a bad token or length (nothing queued)."""
        return self.requests.add(prompt, max_new_tokens)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[GenerationResult]:
        """Run prompts to completion. A bad prompt yields a failed result; others still run.
        A bad `max_new_tokens` is the call's: TypeError/ValueError, nothing queued.

        Refused (RuntimeError) while paused, asleep or after an incomplete weight update,
        with nothing queued. If a step raises, this call's requests are withdrawn and the
        error propagates: nothing of the call is left behind.

        Safe from several threads at once: the engine lock is taken per step, so the calls
        share the continuous batch and each returns exactly its own results. Paused by
        another thread mid-call, it waits (without stepping) for continue_generation();
        requests that pause ended (abort) are returned as they are."""
        # Read and checked before the lock: a lazy iterable (a tokenizer, another thread's queue)
        # would otherwise hold every other caller's steps, or wait for a thread waiting for the lock.
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        listed = listed_prompts(prompts)
        rids: list[int] = []
        try:  # from the first prompt queued: interrupted anywhere (Ctrl-C, say), nothing of the call stays
            with self._exclusive("generate"):
                if self.paused is not None:
                    raise RuntimeError(f"the engine is paused ({self.paused.value}); call continue_generation() first")
                self._check_can_run()
                for prompt in listed:
                    try:
                        rids.append(self.requests.add(prompt, max_new_tokens))
                    except (TypeError, ValueError) as exc:
                        rids.append(self.requests.fail_unqueued(prompt, str(exc)))
            while True:
                with self._exclusive("generate"):
                    if all(rid in self.results for rid in rids):
                        return [self.results.pop(rid) for rid in rids]
                    if self.paused is not None:
                        self._resumed.wait()  # releases the lock until continue_generation()
                        continue
                    self.step()
                time.sleep(0)  # let a thread waiting for the lock take it: fair turns between callers
        except BaseException:
            if rids:  # a refusal before any prompt was queued leaves other callers' windows alone
                with self._lock, self._recovering():
                    self._drop_in_flight()  # its rows may include this call's requests: recomputed, not lost
                    self.requests.discard(rids)
            raise

    # -- scheduling -------------------------------------------------------------------------
    @_serialized
    def step(self) -> list[GenerationResult]:
        """One continuous-batching step: decode the running batch, admit prefills.

        With full-graph decode, a decode window is launched and its tokens land at the
        next step (which first queues the following window on the device when the same
        requests continue): the host's work overlaps the device's, and a step may return
        requests finished by the window before it. A step whose every emitting request ends
        with its token (one new token each, say) lands them the same way, after the next
        step is launched.

        All or nothing: if anything in the step raises, the KV it reserved is given
        back and admitted requests wait again, so the next step computes what this one
        would have. An out-of-memory error anywhere in the step retracts the batch and
        empties the cache once (ReleasePoint.OOM); other errors propagate. An interrupt in the
        step's own bookkeeping recovers the book (see `_exclusive`)."""
        self._stepping = True
        try:
            return self._step()
        finally:
            self._stepping = False
            if self._idle_since is None:  # a step that worked: the idle clock starts when it ends
                self._idle_since = time.monotonic()

    def _step(self) -> list[GenerationResult]:
        if self.paused is not None:
            return []
        self._check_can_run()
        done: list[GenerationResult] = []
        if self._in_flight is not None:
            flight = self._in_flight
            self._idle_since, self._idle_emptied = None, False
            try:
                done = self._advance(flight)
            except Exception as exc:  # both windows' KV is back: an OOM retracts as in a step
                if self.broken is None and is_out_of_memory(self.platform, exc):
                    return self._handle_oom([r for r in flight.requests if r.state is RequestState.RUNNING], exc)
                raise
            if self._in_flight is not None:  # the next window is already on the device
                return done
        # The step before left its tokens on their way (`_lands_later`): this step is planned
        # and launched first, so the device runs on while the host works; then they land.
        landing, self._landing = self._landing, None
        plan = self.scheduler.plan()
        if not plan.batch and landing is not None:  # the blocks the plan lacked may be the landing's
            done += self._land(landing)
            landing, plan = None, self.scheduler.plan()
        if not plan.batch:
            self._idle_tick()
            return done + self.requests.fail_unservable()
        self._idle_since, self._idle_emptied = None, False
        try:
            with torch.no_grad():  # not inference_mode: the KV pool and graph buffers persist across steps
                next_tokens = self._run(plan)
        except BaseException as exc:
            for request in plan.batch:  # rows this step touched are rewritten next time
                self._forget_rows(request.rid)
            self._break(exc)
            # This step is undone first: dropping the landing may retract a request this step continued.
            if self.broken is None and isinstance(exc, Exception) and is_out_of_memory(self.platform, exc):
                failed = self._handle_oom(plan.batch, exc)
                return done + failed + self._land_or_drop(landing)
            self.scheduler.rollback(plan)
            self._land_or_drop(landing)
            raise
        if landing is not None:
            try:
                done += self._land(landing)
            except BaseException:
                if next_tokens is not None:  # this step's own tokens are read: append them, or its requests stall
                    self._steps += 1
                    self._append(plan.batch, next_tokens)
                raise
        if next_tokens is None:  # a decode window or this step's tokens are on their way; they land next step
            return done
        self._steps += 1
        return done + self._append(plan.batch, next_tokens)

    def _inconsistencies(self) -> list[str]:
        flying: list[Request] = []
        if self._in_flight is not None:
            flying += self._in_flight.requests
        if self._landing is not None:
            flying += self._landing.batch
        return self.requests.inconsistencies(self._eos, flying)

    def _recover(self, error: BaseException) -> None:
        """Bring a book a cut-short call left inconsistent back to one that is (see `_exclusive`). The
        window or tokens on their way are dropped: their requests compute them again. Under
        tensor parallel the other ranks' books differ now, so the engine is broken as by a
        failed step."""
        self._break(error)
        self._in_flight = self._landing = None
        self.requests.recover(self._eos)

    def check_consistent(self) -> None:
        """Raise RuntimeError naming what is inconsistent in the engine's requests and KV blocks
        (see `RequestBook.inconsistencies`); for tests and debugging, it walks every block."""
        with self._lock:  # not `_exclusive`: its error path would recover what this reports
            problems = self._inconsistencies()
        if problems:
            raise RuntimeError("the engine's request book is inconsistent: " + "; ".join(problems))

    def _append(self, batch: list[Request], next_tokens: list[list[int]]) -> list[GenerationResult]:
        """Give each request its new tokens; finish those that reach a stop."""
        done = []
        eos = self._eos
        for request, tokens in zip(batch, next_tokens, strict=True):
            if request.state is not RequestState.RUNNING:
                continue  # ended by an earlier window's stop while this window was in flight
            output = request.output
            for token in tokens:  # a window's tokens past a stop are dropped (their KV goes with the request)
                output.append(token)
                if output_complete(request, eos):
                    done.append(self.requests.finish(request, RequestState.FINISHED))
                    break
        return done

    def _run(self, plan: StepPlan) -> list[list[int]] | None:
        """This step's new tokens per request, one each from the engine's runner; or None
        when a pure decode batch that fits the buckets was launched as a decode window
        (its tokens land at the next step)."""
        decode = self.decode_runner
        if decode is not None and not plan.prefills:
            longest = max(r.kv_tokens for r in plan.decodes)  # this step's token included
            if decode.can_run(len(plan.decodes), longest):
                # Waiting requests are admitted between steps: run single steps until they are.
                steps = 1 if self.requests.waiting else decode.window_for(longest)
                new = self.scheduler.widen(plan, steps)
                rows = [(r.rid, r.last_token, r.blocks, r.kv_tokens, n) for r, n in zip(plan.decodes, new, strict=True)]
                self._in_flight = _Window(list(plan.decodes), list(new), decode.launch(rows, max(new)))
                return None
        if plan.prefills:
            inputs = self.scheduler.build_inputs(plan, self.config.kv_block_size, self.device, self.attention.backend)
        else:
            inputs = self._decode_inputs(plan.decodes)
        # The runner returns the sampled rows' hidden states only (in order): the model may
        # skip the rest of its last layer for the others.
        hidden = self.runner.forward(inputs.input_ids, inputs.meta, inputs.sample_rows)
        wanted = int(inputs.sample_rows.shape[0])
        expected = (wanted, self.model_config.hidden_size)
        if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape) != expected or hidden.dtype != self.config.dtype:
            got = (f"hidden states {tuple(hidden.shape)} {hidden.dtype}" if isinstance(hidden, torch.Tensor)
                   else f"a {type(hidden).__name__}")
            raise TypeError(f"{type(self.runner).__name__}.forward returned {got} for {wanted} rows; a runner returns "
                            f"[len(rows), hidden_size] = {list(expected)} {self.config.dtype}, the rows it is given in "
                            "their order")
        sampled: list[int] = []
        if wanted:
            every_row = torch.arange(wanted, device=hidden.device)
            on_device = greedy_tokens(self.model.logits(hidden, every_row))
            if self._lands_later(plan.batch, inputs.emits):
                host = self.platform.pin_memory(torch.empty(wanted, dtype=torch.long))
                host.copy_(on_device, non_blocking=True)
                copied = self.platform.new_event()
                copied.record(self.platform.current_stream(self.device_index))
                self._landing = _Landing(list(plan.batch), list(inputs.emits), host, copied)
                return None
            if self._replays_collectives:
                computed = self.platform.new_event()
                computed.record(self.platform.current_stream(self.device_index))
                self._wait_for_device(computed, "a step's sampled tokens")
            sampled = on_device.tolist()
        return self._per_request(sampled, inputs.emits)

    @staticmethod
    def _per_request(sampled: list[int], emits: list[bool]) -> list[list[int]]:
        """Each request's new tokens: the next sampled one for a request that emits, none else."""
        tokens = iter(sampled)
        return [[next(tokens)] if emitting else [] for emitting in emits]

    def _lands_later(self, batch: list[Request], emits: list[bool]) -> bool:
        """Whether a step's tokens may be read after the next step is launched: nothing that
        step does depends on them. Every request that emits ends with this token (by length,
        whatever the token), so none of them is in the next plan, and no running request
        decodes next, so planning it retracts nobody (a request retracted before its token
        landed would be prefilled again for nothing)."""
        return (all(r.max_new_tokens - len(r.output) == 1 for r, emitting in zip(batch, emits, strict=True)
                    if emitting)
                and all(r.pending != 1 for r in self.requests.running))

    def _land(self, landing: _Landing) -> list[GenerationResult]:
        """Wait for a step's tokens and append them. If that fails, its requests are computed
        again (retracted), a tensor-parallel engine is broken (as by a failed step) and the
        error propagates."""
        try:
            self._wait_for_device(landing.done, "a step's tokens landing")
            sampled = landing.tokens.tolist()
        except BaseException as exc:
            self._break(exc)  # tensor parallel: the ranks may now disagree, as after a failed step
            self._drop_landing(landing)
            raise
        self._steps += 1
        return self._append(landing.batch, self._per_request(sampled, landing.emits))

    def _land_or_drop(self, landing: _Landing | None) -> list[GenerationResult]:
        """Land a step's tokens on an error path: a second error there drops them instead
        (their requests are computed again), so the first error is the one raised."""
        if landing is None:
            return []
        try:
            return self._land(landing)
        except BaseException:
            return []

    def _drop_landing(self, landing: _Landing) -> None:
        for request in reversed(landing.batch):
            if request.state is RequestState.RUNNING:
                self.requests.retract(request)

    def _decode_inputs(self, decodes: list[Request]) -> StepInputs:
        """A pure decode step's inputs and metadata from the device rows (`decode_rows`): the
        host writes each row's token, position and slot and the blocks it newly started."""
        table = self.decode_rows
        rows = table.prepare([(r.rid, r.last_token, r.blocks, r.kv_tokens, 1) for r in decodes], len(decodes))
        count = len(decodes)
        meta = AttentionMetadata(table.metadata(count, max(r.kv_tokens for r in decodes)),
                                 table.step_inputs[1, :count], self.attention.backend, decode=True)
        sample_rows = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return StepInputs(table.step_inputs[0, :count], meta, sample_rows, [True] * count)

    def _forget_rows(self, rid: int) -> None:
        """The request left the running batch (or its step failed): its device rows go."""
        self.decode_rows.forget(rid)
        if self.decode_runner is not None:
            self.decode_runner.forget(rid)

    def _advance(self, flight: _Window) -> list[GenerationResult]:
        """Queue the window after `flight` when the same requests all continue, then land
        `flight`'s tokens. If either fails, both windows' KV is given back (the
        tokens are computed again) and the error propagates."""
        decode = self.decode_runner
        assert decode is not None
        self._in_flight = chained = None
        try:
            with torch.no_grad():
                chained = self._chain(flight)
            self._wait_for_device(flight.launched.done, "a decode window's tokens")
            tokens = decode.collect(flight.launched)
        except BaseException as exc:
            self._break(exc)
            for window in (chained, flight):
                if window is not None:
                    self._give_back(window)
            raise
        self._in_flight = chained
        self._steps += 1
        return self._append(flight.requests, tokens)

    def _chain(self, flight: _Window) -> _Window | None:
        """The next window of `flight`'s requests, queued behind it before its tokens are
        read; None when that cannot be right or useful: a request waits for admission,
        the running batch changed, a request ends by length within `flight` (its row's
        last token is not its next input), or KV blocks or context run out."""
        decode = self.decode_runner
        requests = flight.requests
        running = self.requests.running
        if (decode is None or self.requests.waiting or len(running) != len(requests)
                or any(a is not b for a, b in zip(running, requests, strict=True))):
            return None
        remaining = [r.max_new_tokens - len(r.output) - n for r, n in zip(requests, flight.new, strict=True)]
        if min(remaining) < 1:
            return None
        steps = decode.window_for(max(r.kv_tokens for r in requests) + 1)
        if steps < 1:
            return None
        want = [min(steps, left) for left in remaining]
        if not self.scheduler.reserve(requests, want):
            return None
        window = _Window(requests, want, None)
        # The input token (0 here) is ignored: each row's is on the device, left by `flight`.
        rows = [(r.rid, 0, r.blocks, r.kv_tokens, n) for r, n in zip(requests, want, strict=True)]
        try:
            window.window = decode.launch(rows, max(want), chained=True)
        except BaseException:
            self._give_back(window)
            raise
        return window

    def _give_back(self, window: _Window) -> None:
        """Free the KV a window reserved and drop its rows (they are rewritten next time)."""
        decode = self.decode_runner
        for request, count in zip(reversed(window.requests), reversed(window.new), strict=True):
            if request.state is RequestState.RUNNING and count:
                self.blocks.shrink(request, count)
            if decode is not None:
                decode.forget(request.rid)

    def _drop_in_flight(self) -> None:
        """Give back a launched window's KV without its tokens (they are computed again); a
        step's tokens on their way land (or, if that fails, are computed again)."""
        if self._in_flight is not None:
            flight, self._in_flight = self._in_flight, None
            self._give_back(flight)
        landing, self._landing = self._landing, None
        self._land_or_drop(landing)

    @_serialized
    def drain(self) -> None:
        """Land a decode window still on the device, or a step's tokens still on their way:
        they are appended and the requests they finished go to `results`. `step()` does
        this itself; call it before timing or inspecting requests between steps. Pause,
        weight updates, flush and sleep drain first."""
        if self._landing is not None:
            landing, self._landing = self._landing, None
            self._land(landing)
        if self._in_flight is not None:
            flight, self._in_flight = self._in_flight, None
            assert self.decode_runner is not None
            try:
                self._wait_for_device(flight.launched.done, "a decode window's tokens")
                tokens = self.decode_runner.collect(flight.launched)
            except BaseException as exc:
                self._break(exc)
                self._give_back(flight)
                raise
            self._steps += 1
            self._append(flight.requests, tokens)

    @property
    def _replays_collectives(self) -> bool:
        """Tensor parallel with the group's collectives inside the graphs the engine replays."""
        return self.group is not None and self.group.comm.graph_capturable

    def _wait_for_device(self, event: Any, what: str) -> None:
        """Wait for device work the engine launched; where it replays collectives from graphs,
        within the group's timeout (`DeviceGroup.wait_for`), as no backend times those out."""
        if self._replays_collectives:
            assert self.group is not None
            self.group.wait_for(event, what)
        else:
            event.synchronize()

    @_serialized
    def _group_closing(self) -> None:
        """The group is closing (`DeviceGroup.close`): drop the graphs that captured its
        collectives, which NCCL cannot outlive, and run no more steps."""
        self.runner.release()
        if self.decode_runner is not None:
            self.decode_runner.release()
        if self.broken is None:
            self.broken = ("this engine's group was closed (DeviceGroup.close), so it runs no more steps: make a "
                           "new group and engine")

    def _break(self, error: BaseException) -> None:
        """Tensor parallel: a step that failed ends the engine (see `__init__`); its batch is
        still rolled back by the caller, so `pending()` and results stay truthful."""
        if self.group is None or self.broken is not None:
            return
        self.broken = (f"a step failed on rank {self.group.rank} ({type(error).__name__}: {error}); under tensor "
                       "parallel the ranks may now disagree, so this engine runs no more steps: make a new group "
                       "and engines")
        self.events.record("tensor_parallel_broken", error=type(error).__name__)

    def _check_can_run(self) -> None:
        if self.broken is not None:
            raise RuntimeError(self.broken)
        if self.asleep:
            raise RuntimeError("the engine is asleep; call resume_memory_occupation() first")
        refusal = self.weights.refusal()
        if refusal:
            raise WeightUpdateIncomplete(refusal)

    def _handle_oom(self, batch: list[Request], error: BaseException) -> list[GenerationResult]:
        self.platform.report_out_of_memory(error, f"scheduler step {self._steps}", self.device_index)
        failed = []
        for request in reversed(batch):
            request.oom_retries += 1
            if request.oom_retries > 1:
                request.error = f"out of memory twice while running a batch of {len(batch)} request(s): {error}"
                failed.append(self.requests.finish(request, RequestState.FAILED))
            else:
                self.requests.retract(request)
        self.events.empty(ReleasePoint.OOM)
        return failed

    def _idle_tick(self) -> None:
        """A step with nothing to run: empty the cache once the engine has sat idle for the
        interval since its last working step ended (or since it was built)."""
        interval, since = self.config.idle_empty_after_s, self._idle_since
        if interval is None or since is None or self._idle_emptied or self.waiting:  # None: this step worked
            return
        if time.monotonic() - since >= interval:
            self.events.empty(ReleasePoint.IDLE)
            self._idle_emptied = True

    # -- lifecycle ------------------------------------------------------------------------------
    @_serialized
    def pending(self) -> str | None:
        """What keeps the engine from being idle, in words; None when idle."""
        pending = self.requests.pending()
        if pending is None:
            return None
        paused = f" (paused {self.paused.value})" if self.paused else ""
        return pending + f" request(s){paused}"

    @_serialized
    def flush_cache(self, empty_cache: bool = True, reason: ReleasePoint = ReleasePoint.USER) -> FlushResult:
        """Clear the KV pool (there is no prefix cache), only when fully idle."""
        check_bool("flush_cache(empty_cache)", empty_cache)
        # Checked before anything is cleared: the platform would refuse it only after the pool was reset.
        if not isinstance(reason, ReleasePoint):
            raise TypeError(f"flush_cache(reason={short_repr(reason)}): pass a ReleasePoint, e.g. ReleasePoint.USER")
        self.drain()
        pending = self.pending()
        if pending:
            return FlushResult(False, f"cannot flush while busy: {pending} still pending")
        self.blocks.reset()
        released = self.events.empty(reason) if empty_cache else None
        return FlushResult(True, "KV pool cleared", released)

    @_serialized
    def pause_generation(self, mode: PauseMode | str) -> list[GenerationResult]:
        """Pause. Returns the requests ended by an abort (empty for retract / in_place)."""
        try:
            mode = PauseMode(mode)
        except ValueError:
            raise ValueError(f"pause_generation(mode={mode!r}): choose one of "
                             f"{', '.join(repr(m.value) for m in PauseMode)} (or a PauseMode)") from None
        if self.paused is not None:
            raise RuntimeError(f"already paused ({self.paused.value}); call continue_generation() first")
        self.drain()  # tokens already computed are kept, whatever the mode
        ended: list[GenerationResult] = []
        if mode is PauseMode.ABORT:
            ended = self.requests.abort_all("aborted by pause_generation(abort)")
        elif mode is PauseMode.RETRACT:
            self.requests.retract_all()
        self.paused = mode
        self.events.record("pause", mode=mode.value, ended=len(ended))
        return ended

    @_serialized
    def continue_generation(self, empty_cache: bool = True) -> ContinueReport:
        """Resume. Empties the cache first, while still paused: the fragmentation release point."""
        check_bool("continue_generation(empty_cache)", empty_cache)
        if self.paused is None:
            raise RuntimeError("the engine is not paused; nothing to continue")
        before = self.platform.memory_info(self.device_index).reserved
        released = self.events.empty(ReleasePoint.RESUME_GENERATION) if empty_cache else None
        after = self.platform.memory_info(self.device_index).reserved
        self.events.record("continue", reserved_before=before, reserved_after=after)
        self.paused = None
        self._resumed.notify_all()  # generate calls waiting out the pause step again
        return ContinueReport(before, after, released)

    @_serialized
    def update_weights_from_tensors(self, named_tensors: NamedTensors, flush_cache: bool = False) -> WeightUpdateResult:
        """Validate every name, shape, dtype and layout first; apply all or nothing; post-process.

        Raises WeightUpdateRejected (a ValueError) with nothing applied. Allowed while
        paused and while asleep (the update is what wake brings back)."""
        check_bool("update_weights_from_tensors(flush_cache)", flush_cache)
        self.drain()  # every token launched with the old weights lands first
        count = self.weights.apply(named_tensors)
        self.events.record("weights_updated", count=count, version=self.weight_version)
        return WeightUpdateResult(count, self.weight_version, self.flush_cache_after_weight_update(flush_cache))

    @_serialized
    def update_weights_from_disk(self, path: str, flush_cache: bool = False) -> WeightUpdateResult:
        """Weights by Hugging Face name from a checkpoint directory (single or sharded
        safetensors) or one safetensors file; validated and applied like
        `update_weights_from_tensors` (all or nothing)."""
        from torchhal.core.model.checkpoint import iter_checkpoint_tensors

        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"update_weights_from_disk(path={short_repr(path)}): pass the checkpoint's directory or "
                            "safetensors file as a str or Path")
        check_bool("update_weights_from_disk(flush_cache)", flush_cache)
        return self.update_weights_from_tensors(iter_checkpoint_tensors(path), flush_cache)

    @_serialized
    def flush_cache_after_weight_update(self, requested: bool) -> FlushResult | None:
        """The one place every weight-update path flushes, when the caller asked."""
        check_bool("flush_cache_after_weight_update(requested)", requested)
        if not requested:
            return None
        return self.flush_cache(empty_cache=True, reason=ReleasePoint.WEIGHT_UPDATE)

    @_serialized
    def release_memory_occupation(self) -> int | None:
        """Sleep: weights and KV pool leave the device. Only when idle."""
        self.drain()
        pending = self.pending()
        if pending or self.asleep:
            raise RuntimeError(f"cannot sleep: {pending or 'already asleep'}")
        self.occupation.sleep(self.model, self._graph_holders())
        return self.events.empty(ReleasePoint.SLEEP)

    @_serialized
    def resume_memory_occupation(self) -> None:
        if not self.asleep:
            raise RuntimeError("the engine is not asleep")
        if self.broken is not None:  # waking recaptures graphs: on a failed or closed group, for nothing
            raise RuntimeError(self.broken)
        self.occupation.wake(self.model, self._graph_holders(), self._new_kv_cache)
        self.blocks.reset()

    def _graph_holders(self) -> list[Releasable]:
        """The runners, whose graphs are released at sleep and recaptured on the new KV pool at wake."""
        return [self.runner] + ([self.decode_runner] if self.decode_runner is not None else [])

    @_serialized
    def close(self) -> list[GenerationResult]:
        """Give the device memory back now: the KV cache and the runners' graphs (engine and model
        hold each other in reference cycles, so dropping the engine frees them only at a full
        garbage collection). Requests still queued or running are aborted and returned; the model
        may then serve a new engine. Every later call but `close` and `pending` is refused."""
        if self._closed:
            return []
        self.drain()  # tokens already computed are kept in the aborted results
        ended = self.requests.abort_all("aborted by close()")
        self.occupation.drop_device_state(self.model, self._graph_holders())
        self.blocks.reset()
        if _ENGINE_OF_MODEL.get(id(self.model)) is self:
            del _ENGINE_OF_MODEL[id(self.model)]
        self._closed = True
        self._resumed.notify_all()  # generate calls waiting out a pause: refused now, not waiting for ever
        return ended

    def __enter__(self) -> GenerationEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _new_kv_cache(self) -> KVCache:
        # One block more than the allocator hands out: the scratch block.
        return KVCache(self.local_config, self.kv_sizing.num_blocks + 1, self.config.kv_block_size, self.device,
                       self.config.dtype)

    # -- construction from a checkpoint ----------------------------------------------------
    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        config: EngineConfig | None = None,
        *,
        platform: Platform | None = None,
        runner_factory: Callable[[GenerationEngine], ModelRunner] | None = None,
        group: DeviceGroup | None = None,
    ) -> GenerationEngine:
        """An engine serving the Hugging Face checkpoint at `path` (`load_checkpoint` says
        what is accepted; a refused checkpoint raises CheckpointError, nothing allocated).

        The weights are read once, straight onto the engine's device in `config.dtype`
        (no config: the checkpoint's own dtype and EngineConfig's defaults), so the engine's
        move is a no-op. A config that names no end-of-sequence token gets the checkpoint's
        `eos_token_id`s: `generation_config.json`'s where it names any, else `config.json`'s,
        as transformers' `generate` picks them. `config.model` is not used: the checkpoint is the model. The load
        report is kept as `engine.checkpoint`.

        `group`: each rank reads only its shard's slices, onto `group.device` (see `__init__`);
        a model that cannot be split over the group is refused before any weight is read. A
        rank refused alone (its arguments, or its load) raises its error and its peers a
        ValueError naming it, together, so none waits out the group's timeout."""
        from torchhal.core.model.checkpoint import (
            checkpoint_dtype,
            checkpoint_eos_token_ids,
            load_checkpoint,
            read_hf_config,
        )

        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"GenerationEngine.from_checkpoint(path={short_repr(path)}): pass the checkpoint's "
                            "directory as a str or Path")
        check_platform_argument(platform, "GenerationEngine.from_checkpoint")
        check_group(group)
        try:  # a rank refusing alone tells its peers (refuse_with_peers), who would wait out the timeout
            hf, where = read_hf_config(path), f"{Path(path) / 'config.json'}"
            config = EngineConfig(dtype=checkpoint_dtype(hf, where)) if config is None else config
            check_engine_config(config, runner_factory)  # before any weight is read
            if not config.eos_tokens and config.eos_token is None:
                config = replace(config, eos_tokens=checkpoint_eos_token_ids(path, hf))
            platform = platform or (group.platform if group is not None else current_platform())
            index = engine_device_index(platform, config, group)  # a bad device is refused before any read
            vocab = hf.get("vocab_size")  # and end tokens the model cannot emit (a bad size: the loader's to refuse)
            if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab >= 1:
                check_eos_tokens(config, vocab)
        except Exception as exc:
            refuse_with_peers(group, exc)
            raise
        agree_on_config(config, group)  # and configs that differ between ranks, or a closed group
        split = (group.world_size, group.rank) if group is not None else None
        failure: Exception | None = None
        try:
            model, report = load_checkpoint(path, dtype=config.dtype, device=platform.device(index),
                                            tensor_parallel=split, check_finite=config.check_finite_weights)
        except Exception as exc:  # e.g. a shard file damaged on one host only
            failure = exc
        if group is not None and group.world_size > 1:
            refused = agree_on_verdict(group, failure is not None)
            if refused and failure is None:
                raise ValueError(f"rank(s) {refused} of the group could not load the checkpoint (their error says "
                                 "why); every rank refuses alike")
        if failure is not None:
            raise failure
        engine = cls(config, platform=platform, model=model, runner_factory=runner_factory, group=group)
        engine.checkpoint = report
        return engine


def listed_prompts(prompts: object) -> list[object]:
    """`generate`'s prompts as a list, read whole before anything is queued (an iterator that
    raises part-way leaves nothing behind); each prompt is checked by its own result."""
    if isinstance(prompts, (Mapping, set, frozenset)):  # iterating gives keys, or no order to answer in
        raise TypeError(f"generate(prompts={short_repr(prompts)}) is a {type(prompts).__name__}; pass a list of "
                        "prompts (results come back in its order), e.g. list(prompts.values()) for a dict")
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Iterable):
        raise TypeError(f"generate(prompts={short_repr(prompts)}): pass a list of prompts, each a list of int token "
                        "ids, e.g. [[1, 2, 3]]")
    listed = list(prompts)
    # Integers of any kind (numpy's too, a flat array's items): one prompt, not prompts of one token each.
    if listed and all(isinstance(token, numbers.Integral) and not isinstance(token, bool) for token in listed):
        plain = "" if all(type(token) is int for token in listed) else " of plain ints (array.tolist())"
        raise TypeError(f"generate(prompts={short_repr(listed)}) is one prompt; pass a list of prompts{plain}: "
                        f"[{short_repr(listed)}]")
    return listed


def check_eos_tokens(config: EngineConfig, vocab_size: int) -> None:
    """End-of-sequence ids the model can emit: one outside the vocabulary would never stop a request."""
    ids = set(config.eos_tokens) | ({config.eos_token} if config.eos_token is not None else set())
    outside = sorted(token for token in ids if token >= vocab_size)
    if outside:
        raise ValueError(f"EngineConfig end-of-sequence token(s) {outside} are outside the model's vocabulary "
                         f"0..{vocab_size - 1}; no request would ever stop on them")


#: The engine each model serves, by the model's id: an engine holds its model (so the id is
#: not reused while the entry lives) and the entry goes with the engine.
_ENGINE_OF_MODEL: weakref.WeakValueDictionary[int, GenerationEngine] = weakref.WeakValueDictionary()


#: Models an engine is being built around (by id), and the lock that makes checking a model
#: unowned and claiming it one step: two threads building engines around one model would
#: otherwise both pass the check and share its KV cache.
_MODELS_BEING_BUILT: set[int] = set()
_MODEL_CLAIMS = threading.Lock()


@contextlib.contextmanager
def _claimed(model: Model | None) -> Iterator[None]:
    """`model` refused if it serves an engine or one is being built around it, else held as
    being built until the block ends (which registers it in `_ENGINE_OF_MODEL` on success)."""
    if model is None:
        yield
        return
    with _MODEL_CLAIMS:
        check_model_unowned(model)
        _MODELS_BEING_BUILT.add(id(model))
    try:
        yield
    finally:
        with _MODEL_CLAIMS:
            _MODELS_BEING_BUILT.discard(id(model))


def check_model_unowned(model: Model) -> None:
    """A model serves one engine: the engine sets its KV cache (`model.kv`) and moves it, so a
    second engine would run the first one's requests on its own cache."""
    if id(model) in _MODELS_BEING_BUILT:
        raise ValueError(
            f"model {type(model).__name__} is being given to another GenerationEngine right now (on another "
            "thread, or by a call made while that engine is built); give each engine its own model (load the "
            "checkpoint again, or copy.deepcopy(model))"
        )
    if id(model) in _ENGINE_OF_MODEL:
        gc.collect()  # an engine dropped inside a reference cycle is gone only after a collection
    if id(model) in _ENGINE_OF_MODEL:
        raise ValueError(
            f"model {type(model).__name__} already serves another GenerationEngine, which set its KV cache; give "
            "each engine its own model (load the checkpoint again, or copy.deepcopy(model)), or drop the first "
            "engine"
        )


def check_engine_config(config: EngineConfig,
                        runner_factory: Callable[[GenerationEngine], ModelRunner] | None) -> None:
    """The refusals the engine's arguments decide alone, before anything is moved or read."""
    if runner_factory is not None and not callable(runner_factory):
        raise TypeError(f"runner_factory = {short_repr(runner_factory)} must be a function given the engine and "
                        "returning its ModelRunner, or None for the engine's own runner")
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config = {short_repr(config)} is a {type(config).__name__}, not an EngineConfig; pass "
                        "e.g. EngineConfig(dtype=torch.bfloat16)")
    if runner_factory is not None and config.prefill_graphs is not None:
        raise ValueError(
            "EngineConfig.prefill_graphs and runner_factory both choose the engine's runner; pass one "
            "(prefill_graphs builds a GraphRunner with its token buckets)"
        )


def engine_device_index(platform: Platform, config: EngineConfig, group: DeviceGroup | None) -> int:
    """The engine's device: the config's, else the group's (its rank's), else the current one.
    A config device the platform does not have, or one that contradicts the group's, is refused."""
    if config.device is not None:
        check_device_index(platform, config.device, "EngineConfig.device")
    if group is None:
        return platform.current_device() if config.device is None else config.device
    placement = group.placement
    index = platform.device_for_rank(placement.local_rank, placement.local_world_size)
    if config.device is not None and config.device != index:
        raise ValueError(
            f"EngineConfig.device = {config.device} but the group puts rank {placement.rank} on device {index}; "
            "leave EngineConfig.device None with a group"
        )
    return index


def platform_compile_options(compile_layers: Callable[..., None], backend: str | Callable[..., Any],
                             support: CompileSupport | None) -> tuple[dict[str, Any] | None, str]:
    """The platform's inductor options for `compile_layers(backend, options)`, and why (or why
    none): only the inductor backend takes them, and only a model whose `compile_layers` has an
    `options` parameter."""
    if support is None:
        return None, "the platform asks for no inductor options (compile_support() is None)"
    if backend != "inductor":
        return None, f"the platform's inductor options do not apply to compile backend {backend!r}"
    if "options" not in inspect.signature(compile_layers).parameters:
        return None, "the model's compile_layers(backend) takes no options"
    return dict(support.inductor_options), support.note or "the platform's inductor options"


@contextlib.contextmanager
def _dropped_on_failure(engine: GenerationEngine) -> Iterator[None]:
    """If the block raises, `engine` (half built) forgets everything it holds: the exception's
    traceback keeps the object alive, and its request book points back at it, so its graphs
    and KV pool would otherwise stay allocated until the garbage collector runs."""
    try:
        yield
    except BaseException:
        vars(engine).clear()
        raise


def _rank_model(model: Model, group: DeviceGroup) -> Model:
    """`model` as the group's rank's shard, attached to the group's communicator: a whole
    `LlamaDecoder` is sharded here (on its own device, before the move); a shard must be
    this rank's."""
    from torchhal.core.model import LlamaDecoder
    from torchhal.core.model.parallel import TensorParallelPlan

    if not isinstance(model, LlamaDecoder):
        raise TypeError(
            f"tensor parallel needs a LlamaDecoder (or a checkpoint through from_checkpoint(..., group=)); "
            f"model {type(model).__name__} cannot be split over {group.world_size} ranks"
        )
    if model.shard is None:
        model = model.shard_for((TensorParallelPlan(model.config, group.world_size), group.rank))
    model.use_communicator(group.comm)
    return model
