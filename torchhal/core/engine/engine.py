"""A small but real generation engine whose scheduler gets the memory lifecycle right.

Continuous batching with chunked prefill over a paged KV cache (attention through the backend
the platform chooses), greedy decoding, and the lifecycle operations RL loops and servers need:
flush, pause/continue, weight updates, sleep/wake. The device cache is emptied only at named
release points: continue (resume_generation), weight-update flush (weight_update), sleep,
out-of-memory (oom), an idle interval (idle), or a user flush (user).

`GenerationEngine` is the lifecycle facade. A step reads plan -> execute -> append: the
`Scheduler` plans (batches and their rollback over the `RequestBook`), the `StepExecutor` runs
the plan on the device and brings the tokens back, and the engine appends them to their
requests. `WeightUpdater` writes weights, the `Occupation` sleeps and wakes.

Threads: one reentrant engine lock serializes every public method that reads or changes engine
state; `generate` takes it per step, so concurrent calls share the continuous batch and each
returns exactly its own results (`_serialized`).
"""

from __future__ import annotations

import functools
import numbers
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import torch

from torchhal.attention import AttentionChoice, AttentionSpec
from torchhal.core.devices import is_out_of_memory, model_placement
from torchhal.core.engine.construction import (
    activation_bytes_per_token,
    check_engine_arguments,
    check_eos_tokens,
    check_runner,
    claimed,
    compile_choice,
    default_batch_tokens,
    dropped_on_failure,
    engine_device_index,
    release_claim,
    shard_for_group,
)
from torchhal.core.engine.events import EngineEvents
from torchhal.core.engine.execution import StepExecutor
from torchhal.core.engine.kv_pool import BlockAllocator, KVPoolSizing, size_kv_pool
from torchhal.core.engine.model_state import ModelState, restored_on_failure
from torchhal.core.engine.occupation import KV_CACHE, TAGS, WEIGHTS, Occupation, Releasable, occupation_for
from torchhal.core.engine.ranks import (
    agree_on_call,
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
from torchhal.core.engine.scheduler import Scheduler
from torchhal.core.engine.weights import NamedTensors, WeightUpdater
from torchhal.core.graphs.decode import BlockTable, DecodeGraphRunner
from torchhal.core.graphs.runner import GraphRunner
from torchhal.core.model import KVCache, Model, ModelConfig, ReferenceDecoder
from torchhal.core.model.linear import use_platform_linear
from torchhal.platforms import Platform, ReleasePoint, check_platform_argument, current_platform
from torchhal.values import check_bool, short_repr

if TYPE_CHECKING:
    from torchhal.core.model.checkpoint import LoadReport
    from torchhal.distributed import DeviceGroup

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
        rank makes the same engine calls in the same order (SPMD) and gets the same tokens;
        calls whose arguments differ between the ranks are refused on every rank. A group of
        one rank is no group: today's engine on `group.device` (closing it still ends the
        engine, as at any size). Under tensor parallel an error in a step (out-of-memory on one
        rank, a peer that died, ...) is final: the ranks cannot know they failed alike, so
        instead of retracting and retrying (which could leave the ranks' batches apart) the step
        raises and the engine refuses every later step (`broken`); a rank whose peer failed
        raises within the group's timeout, then refuses likewise. Make a new group and engines
        to go on."""
        # Every refusal the arguments alone decide comes before the model is moved or changed.
        check_engine_arguments(config, model, runner_factory)
        check_platform_argument(platform, "GenerationEngine")
        check_group(group)
        check_eos_tokens(config, (model.config if model is not None else config.model).vocab_size)
        agree_on_config(config, group, shard_problem(model, group))
        self.closed, self.built = False, False
        # Past this point the caller's model is moved, cast and given a cache; if anything
        # fails (graph capture out of memory, say), it is put back as it was, and this
        # half-built engine drops what it built (graphs, the KV pool) at once.
        with claimed(model, self), dropped_on_failure(self), restored_on_failure(model) as saved:
            self._build(config, platform, model, runner_factory, group, saved)
        self.built = True
        if group is not None:  # a group of one rank too: closing it ends the engine at any world size
            group.release_on_close(self._group_closing)

    def _build(self, config: EngineConfig, platform: Platform | None, model: Model | None,
               runner_factory: Callable[[GenerationEngine], ModelRunner] | None, group: DeviceGroup | None,
               saved: ModelState | None) -> None:
        self.config = config
        self.group = group if group is not None and group.world_size > 1 else None
        self.platform = platform or (group.platform if group is not None else current_platform())
        self.device_index = engine_device_index(self.platform, config, group)
        self.device = self.platform.device(self.device_index)
        built: Model = ReferenceDecoder(config.model) if model is None else model
        if self.group is not None:
            built = shard_for_group(built, self.group)
        built.to(model_placement(built, self.device), config.dtype)
        built.eval()
        self.model: Model = built
        self.events = EngineEvents(self.platform, self.device_index)
        self.occupation: Occupation = occupation_for(self.platform, self.device, built)
        self.occupation.place_weights()
        self.events.record("sleep_mode", how=self.occupation.describe())
        linear_kernel, linear_why = use_platform_linear(built, self.platform.linear_support, config.dtype)
        backend, options, compile_why = compile_choice(config, built, self.platform.compile_support)
        if backend is not None:  # before any graph is captured
            compile_layers = built.compile_layers  # type: ignore[attr-defined]  # compile_choice checked it
            compile_layers(backend, options) if options else compile_layers(backend)
        self.compile_backend = backend
        local = self.local_config
        cap = config.max_kv_slots if config.max_kv_slots is not None else config.max_running * local.max_position
        free = self._free_bytes_everywhere(saved)
        self.kv_sizing: KVPoolSizing = size_kv_pool(
            self.platform, self.device_index, local, config.dtype, config.kv_fraction, cap, config.kv_block_size,
            free_bytes=free, cap="max_kv_slots" if config.max_kv_slots is not None else "max_running")
        self.attention: AttentionChoice = self.platform.choose_attention(AttentionSpec(
            num_q_heads=local.num_heads, num_kv_heads=local.num_kv_heads, head_dim=local.head_dim,
            dtype=config.dtype, block_size=config.kv_block_size, sliding_window=local.sliding_window,
            needs_graph=self._captures_decode_graphs))
        self.model.kv = self.occupation.place_kv(self._new_kv_cache)
        model_config = self.model_config
        self.requests = RequestBook(BlockAllocator(self.kv_sizing.num_blocks, config.kv_block_size),
                                    model_config.vocab_size, model_config.max_position,
                                    grow_pool=self.kv_sizing.how_to_grow)
        pool_bytes = self.kv_sizing.num_blocks * self.kv_sizing.bytes_per_block
        self.max_batch_tokens = config.max_batch_tokens or default_batch_tokens(
            self.longest_request, free - pool_bytes, activation_bytes_per_token(local, config.dtype))
        self.scheduler = Scheduler(self.requests, self.max_batch_tokens, config.max_running)
        self.weights = WeightUpdater(
            self.model, check_finite=config.check_finite_weights,
            shard=getattr(self.model, "shard", None) if self.group is not None else None,
            agree=functools.partial(agree_on_verdict, self.group) if self.group is not None else None)
        for kind, fields in (("attention_backend", {"backend": self.attention.name, "why": self.attention.why}),
                             ("linear_kernel", {"kernel": linear_kernel, "why": linear_why}),
                             ("compile_options", {"backend": backend, "options": options, "why": compile_why}),
                             ("batch_tokens", {"max_batch_tokens": self.max_batch_tokens})):
            self.events.record(kind, **fields)
        self.paused: PauseMode | None = None
        # Reentrant: public methods call each other (flush_cache drains, pause drains, ...).
        self._lock = threading.RLock()
        self._resumed = threading.Condition(self._lock)  # notified by continue_generation
        self._stepping = False  # a step is running (on the thread holding the lock)
        self._steps = 0
        self._idle_since: float | None = time.monotonic()  # None while a step works
        self._idle_emptied = False
        self.broken: str | None = None  # tensor parallel: why a failed step ended this engine
        eos = set(config.eos_tokens) | ({config.eos_token} if config.eos_token is not None else set())
        self._eos: frozenset[int] = frozenset(eos)
        self.checkpoint: LoadReport | None = None  # set by from_checkpoint
        # Pure decode steps on the runner read their metadata from here: each request keeps a
        # row whose blocks are uploaded once, so a step's host work does not grow with the context.
        rows = BlockTable(self.max_running_requests, self.longest_request, config.kv_block_size, self.device,
                          pin=self.platform.pin_memory)
        runner = self._new_runner(runner_factory)
        decode = self._new_decode_runner(config.decode_graphs) if config.decode_graphs is not None else None
        self.executor = StepExecutor(self.model, self.platform, self.device_index, self.requests, self.scheduler,
                                     runner, decode, rows, config.kv_block_size, config.dtype,
                                     device_waiter(self.group), self.attention.backend)
        self.requests.on_leave = self.executor.forget

    @property
    def _captures_decode_graphs(self) -> bool:
        """Decode steps will be captured: the attention backend must then be capturable."""
        graphs = self.config.decode_graphs
        return graphs is not None and not graphs.emulate and self.platform.graph_support is not None

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
            return check_runner(runner_factory(self))
        settings = self.config.prefill_graphs
        if settings is None:
            return EagerRunner(self.model)
        # A step has at most max_batch_tokens tokens: larger buckets would only hold memory.
        runner = GraphRunner(self.model, self.platform, self.device_index, dtype=self.config.dtype,
                             buckets=usable_buckets(settings.token_buckets, self.max_batch_tokens),
                             emulate=settings.emulate, pool=self.occupation.graph_pool("prefill_graphs"))
        self.events.record("prefill_graphs", buckets=list(runner.bucket_sizes), eager_reason=runner.eager_reason)
        return runner

    def _new_decode_runner(self, settings: DecodeGraphConfig) -> DecodeGraphRunner:
        """Built after the KV cache exists: capture needs it (and the scratch block in it).
        Buckets no step can use are left out, and a window never runs past the largest
        context bucket, so neither sizes buffers beyond what a step can fill."""
        longest = self.longest_request
        contexts = settings.context_buckets or _powers_of_four(256, longest)
        context_buckets = usable_buckets(contexts, longest)
        return DecodeGraphRunner(
            self.model,  # type: ignore[arg-type]  # the Model protocol is satisfied by nn.Modules
            self.platform, self.device_index, block_size=self.config.kv_block_size, backend=self.attention.backend,
            batch_buckets=usable_buckets(settings.batch_buckets, self.max_running_requests),
            context_buckets=context_buckets, steps_per_sync=min(settings.steps_per_sync, context_buckets[-1]),
            emulate=settings.emulate, pool=self.occupation.graph_pool("decode_graphs"))

    def _new_kv_cache(self, device: torch.device | None = None) -> KVCache:
        # One block more than the allocator hands out: the scratch block.
        return KVCache(self.local_config, self.kv_sizing.num_blocks + 1, self.config.kv_block_size,
                       device or self.device, self.config.dtype)

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
    def runner(self) -> ModelRunner:
        return self.executor.runner

    @property
    def decode_runner(self) -> DecodeGraphRunner | None:
        return self.executor.decode

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
        return bool(self.occupation.asleep)

    @property
    def asleep_tags(self) -> tuple[str, ...]:
        """What is asleep and waits for `resume_memory_occupation`: "weights", "kv_cache"."""
        return self.occupation.asleep

    @property
    def weight_version(self) -> int:
        return self.weights.version

    @property
    def trace(self) -> list[dict[str, Any]]:
        """The latest events (at most `EngineEvents.KEPT`), oldest first."""
        return list(self.events.trace)

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
            if self.closed and call not in _CALLS_AFTER_CLOSE:
                raise RuntimeError(f"{call}() on a closed engine (close() gave its KV cache and graphs back); "
                                   "build a new engine")
            if self._stepping:
                raise RuntimeError(f"{call}() called from inside a step on the same thread (a model, runner or hook "
                                   "calling back into the engine); the engine is not re-entrant there: call it "
                                   "after step() returns")
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

    def _inconsistencies(self) -> list[str]:
        flight = self.executor.in_flight
        return self.requests.inconsistencies(self._eos, flight.requests if flight is not None else ())

    def _recover(self, error: BaseException) -> None:
        """Bring a book a cut-short call left inconsistent back to one that is. The tokens in
        flight are dropped: their requests compute them again. Under tensor parallel the other
        ranks' books differ now, so the engine is broken as by a failed step."""
        self._break(error)
        self.executor.take()
        self.requests.recover(self._eos)

    def check_consistent(self) -> None:
        """Raise RuntimeError naming what is inconsistent in the engine's requests and KV blocks
        (see `RequestBook.inconsistencies`); for tests and debugging, it walks every block."""
        with self._lock:  # not `_exclusive`: its error path would recover what this reports
            problems = self._inconsistencies()
        if problems:
            raise RuntimeError("the engine's request book is inconsistent: " + "; ".join(problems))

    # -- requests -----------------------------------------------------------------------
    @_serialized
    def add_request(self, prompt: list[int], max_new_tokens: int) -> int:
        """Queue a prompt; raises TypeError/ValueError naming a bad token or length (nothing queued)."""
        agree_on_call(self.group, "add_request", prompt, max_new_tokens)
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
        # Read before the lock: a lazy iterable (a tokenizer, another thread's queue) would
        # otherwise hold every other caller's steps, or wait for a thread waiting for the lock.
        listed = listed_prompts(prompts)
        agree_on_call(self.group, "generate", listed, max_new_tokens)
        max_new_tokens = check_max_new_tokens(max_new_tokens)
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
            if rids:  # a refusal before any prompt was queued leaves other callers' work alone
                with self._lock, self._recovering():
                    self._drop_in_flight()  # its rows may include this call's requests: recomputed, not lost
                    self.requests.discard(rids)
            raise

    # -- a step: plan -> execute -> append ---------------------------------------------------
    @_serialized
    def step(self) -> list[GenerationResult]:
        """One continuous-batching step: decode the running batch, admit prefills.

        With full-graph decode, a decode window is launched and its tokens land at the
        next step (which first queues the following window on the device when the same
        requests continue): the host's work overlaps the device's, and a step may return
        requests finished by the window before it. A step whose every emitting request ends
        with its token (one new token each, say) lands them the same way, after the next
        step is launched.

        All or nothing: if anything in the step raises, the KV it reserved is given back
        and admitted requests wait again, so the next step computes what this one would
        have. An out-of-memory error anywhere in the step retracts the batch and empties the
        cache once (ReleasePoint.OOM); other errors propagate. An interrupt in the step's own
        bookkeeping recovers the book (see `_exclusive`)."""
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
        executor, done = self.executor, []
        flight = executor.in_flight
        if flight is not None and flight.window:  # a decode window: the next is queued, then it lands
            self._idle_since, self._idle_emptied = None, False
            try:
                done = self._append(*executor.advance())
            except Exception as exc:  # both windows' KV is back: an OOM retracts as in a step
                self._break(exc)
                if self.broken is None and is_out_of_memory(self.platform, exc):
                    return self._handle_oom([r for r in flight.requests if r.state is RequestState.RUNNING], exc)
                raise
            except BaseException as exc:
                self._break(exc)
                raise
            if executor.in_flight is not None:  # the next window is already on the device
                return done
        # A step's tokens still on their way land after this step is planned and launched.
        landing = executor.take()
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
                tokens = executor.run(plan)
        except BaseException as exc:
            for request in plan.batch:  # rows this step touched are rewritten next time
                executor.forget(request.rid)
            self._break(exc)
            if self.broken is None and isinstance(exc, Exception) and is_out_of_memory(self.platform, exc):
                return done + self._handle_oom(plan.batch, exc) + self._land_or_drop(landing)
            self.scheduler.rollback(plan)
            self._land_or_drop(landing)
            raise
        if landing is not None:
            try:
                done += self._land(landing)
            except BaseException:
                if tokens is not None:  # this step's own tokens are read: append them, or its requests stall
                    self._append(plan.batch, tokens)
                raise
        if tokens is None:  # a decode window or this step's tokens are on their way; they land next step
            return done
        return done + self._append(plan.batch, tokens)

    def _append(self, batch: list[Request], next_tokens: list[list[int]]) -> list[GenerationResult]:
        """Give each request its new tokens; finish those that reach a stop."""
        self._steps += 1
        done = []
        for request, tokens in zip(batch, next_tokens, strict=True):
            if request.state is not RequestState.RUNNING:
                continue  # ended by an earlier window's stop while this window was in flight
            output = request.output
            for token in tokens:  # a window's tokens past a stop are dropped (their KV goes with the request)
                output.append(token)
                if output_complete(request, self._eos):
                    done.append(self.requests.finish(request, RequestState.FINISHED))
                    break
        return done

    def _land(self, flight: Any) -> list[GenerationResult]:
        try:
            return self._append(*self.executor.land(flight))
        except BaseException as exc:
            self._break(exc)  # tensor parallel: the ranks may now disagree, as after a failed step
            raise

    def _land_or_drop(self, flight: Any) -> list[GenerationResult]:
        """Land tokens on an error path: a second error there drops them instead (their
        requests compute them again), so the first error is the one raised."""
        if flight is None:
            return []
        try:
            return self._land(flight)
        except BaseException:
            return []

    def _drop_in_flight(self) -> None:
        """A launched window gives back its KV without its tokens (they are computed again); a
        step's tokens on their way land (or, if that fails, are computed again)."""
        flight = self.executor.take()
        if flight is not None and flight.window:
            self.executor.give_back(flight)
        elif flight is not None:
            self._land_or_drop(flight)

    @_serialized
    def drain(self) -> None:
        """Land the tokens still on their way (a decode window's, or a step's): they are
        appended and the requests they finished go to `results`. `step()` does this itself;
        call it before timing or inspecting requests between steps. Pause, weight updates,
        flush and sleep drain first."""
        flight = self.executor.take()
        if flight is not None:
            self._land(flight)

    @_serialized
    def _group_closing(self) -> None:
        """The group is closing (`DeviceGroup.close`): drop the graphs that captured its
        collectives, which NCCL cannot outlive, and run no more steps."""
        self.executor.release()
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
            raise RuntimeError(f"the engine is asleep ({', '.join(self.asleep_tags)}); call "
                               "resume_memory_occupation() first")
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
            elif request.state is RequestState.RUNNING:
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
        if not isinstance(reason, ReleasePoint):  # before anything is cleared
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

        Raises WeightUpdateRejected (a ValueError) with nothing applied. Allowed while paused
        and while asleep at level 1 (the update is what wake brings back); after a level-2
        sleep, wake the weights first (`resume_memory_occupation(tags=("weights",))`)."""
        check_bool("update_weights_from_tensors(flush_cache)", flush_cache)
        if self.occupation.level == 2 and WEIGHTS in self.asleep_tags:
            raise RuntimeError("the weights were discarded by a level-2 sleep: call "
                               "resume_memory_occupation(tags=('weights',)) first, then update them")
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
    def release_memory_occupation(self, level: int = 1) -> int | None:
        """Sleep, only when idle: level 1 backs the weights up to host memory, level 2 discards
        them (an update brings them back after `resume_memory_occupation(tags=("weights",))`);
        the KV cache is discarded at both. Returns the device bytes given back (None: unknown).
        `trace` says how this platform sleeps (`sleep_mode`): its virtual-memory regions keep
        every graph, host offload captures them again on wake."""
        if type(level) is not int or level not in (1, 2):
            raise ValueError(f"release_memory_occupation(level={short_repr(level)}): pass 1 (weights backed up to "
                             "host) or 2 (weights discarded)")
        self.drain()
        pending = self.pending()
        if pending or self.asleep:
            raise RuntimeError(f"cannot sleep: {pending or 'already asleep'}")
        released = self.occupation.sleep(level, self._graph_holders())
        self.executor.reset_rows()
        self.blocks.reset()
        emptied = self.events.empty(ReleasePoint.SLEEP)
        self.events.record("sleep", level=level, released=released)
        return released + emptied if emptied is not None else (released or None)

    @_serialized
    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Wake `tags` ("weights", "kv_cache"; None: whatever is asleep), the weights before the
        KV cache, so an RL loop can wake the weights, take the trainer's update, and only then
        wake the KV cache. A failed wake leaves what it was waking asleep, and can be retried."""
        if not self.asleep:
            raise RuntimeError("the engine is not asleep")
        wanted = set(TAGS if tags is None else _checked_tags(tags))
        if self.broken is not None:  # waking may capture graphs: on a failed or closed group, for nothing
            raise RuntimeError(self.broken)
        if KV_CACHE in wanted and WEIGHTS in self.asleep_tags and WEIGHTS not in wanted:
            raise ValueError("resume_memory_occupation(tags=('kv_cache',)) while the weights sleep: wake the weights "
                             "first (tags=('weights',)), or both (tags=None)")
        level = self.occupation.level
        order = [tag for tag in TAGS if tag in wanted and tag in self.asleep_tags]
        self.occupation.wake(order, self._graph_holders(), self._new_kv_cache)
        if WEIGHTS in order and level == 2:
            self.weights.mark_unset("the weights were discarded by a level-2 sleep; update them "
                                    "(update_weights_from_tensors or update_weights_from_disk) before generating")
        self.events.record("wake", tags=order)

    def _graph_holders(self) -> list[Releasable]:
        """The runners, whose graphs host offload releases at sleep and captures again at wake."""
        decode = self.executor.decode
        return [self.executor.runner] + ([decode] if decode is not None else [])

    @_serialized
    def close(self) -> list[GenerationResult]:
        """Give the device memory back now: the KV cache and the runners' graphs. Requests
        still queued or running are aborted and returned; the model may then serve a new
        engine. Every later call but `close` and `pending` is refused."""
        if self.closed:
            return []
        self.drain()  # tokens already computed are kept in the aborted results
        ended = self.requests.abort_all("aborted by close()")
        self.occupation.close(self._graph_holders())
        self.blocks.reset()
        release_claim(self.model, self)
        self.closed = True
        self._resumed.notify_all()  # generate calls waiting out a pause: refused now, not waiting for ever
        return ended

    def __enter__(self) -> GenerationEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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
            check_engine_arguments(config, None, runner_factory)  # before any weight is read
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


def device_waiter(group: DeviceGroup | None) -> Callable[[Any, str], None]:
    """How the engine waits for device work it launched: where it replays the group's collectives
    from graphs, within the group's timeout (`DeviceGroup.wait_for`), as no backend times those
    out; else the event's own wait. (A function of the group, not a method: the executor holding
    the engine would keep a dropped engine alive.)"""
    if group is not None and group.comm.graph_capturable:
        return group.wait_for

    def wait(event: Any, what: str) -> None:
        event.synchronize()

    return wait


def _powers_of_four(first: int, last: int) -> tuple[int, ...]:
    """first, 4 * first, ... up to the first that reaches `last`."""
    sizes = [first]
    while sizes[-1] < last:
        sizes.append(sizes[-1] * 4)
    return tuple(sizes)


def _checked_tags(tags: object) -> tuple[str, ...]:
    if isinstance(tags, str) or not isinstance(tags, Iterable):
        raise TypeError(f"resume_memory_occupation(tags={short_repr(tags)}): pass a tuple of tags, e.g. "
                        "('weights',), or None for everything asleep")
    listed = tuple(tags)
    unknown = [tag for tag in listed if tag not in TAGS]
    if unknown or not listed:
        raise ValueError(f"resume_memory_occupation(tags={short_repr(tags)}): the tags are "
                         f"{', '.join(map(repr, TAGS))}")
    return listed


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
