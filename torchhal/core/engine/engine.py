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

import numbers
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchhal.core.devices import is_out_of_memory
from torchhal.core.engine.construction import (
    EngineParts,
    build,
    check_engine_arguments,
    check_eos_tokens,
    claimed,
    engine_from_checkpoint,
    release_claim,
)
from torchhal.core.engine.kv_pool import BlockAllocator
from torchhal.core.engine.model_state import restored_on_failure
from torchhal.core.engine.occupation import WEIGHTS, Releasable, check_level
from torchhal.core.engine.ranks import (
    agree_on_call,
    agree_on_config,
    check_group,
    refuse_broken,
    shard_problem,
)
from torchhal.core.engine.records import (
    ContinueReport,
    EngineConfig,
    FlushResult,
    GenerationResult,
    PauseMode,
    Request,
    RequestState,
    WeightUpdateIncomplete,
    WeightUpdateResult,
)
from torchhal.core.engine.requests import check_max_new_tokens
from torchhal.core.engine.runners import ModelRunner
from torchhal.core.engine.serial import Serialized, serialized
from torchhal.core.engine.weights import NamedTensors
from torchhal.core.graphs.decode import DecodeGraphRunner
from torchhal.core.model import Model
from torchhal.platforms import Platform, ReleasePoint, check_platform_argument
from torchhal.values import check_bool, short_repr

if TYPE_CHECKING:
    from torchhal.distributed import DeviceGroup


class GenerationEngine(Serialized, EngineParts):
    def __init__(
        self,
        config: EngineConfig = EngineConfig(),
        platform: Platform | None = None,
        model: Model | None = None,
        runner_factory: Callable[[GenerationEngine], ModelRunner] | None = None,
        group: DeviceGroup | None = None,
    ) -> None:
        """`model`: any `Model`, moved to the engine's device and `config.dtype` (None: the
        reference decoder of `config.model`). `group` (`torchhal.distributed.init_group`): the
        engine holds this rank's shard; every rank makes the same calls with the same arguments,
        and a step that fails ends the engine (`broken`): see docs/tensor-parallel.md."""
        # Every refusal the arguments alone decide comes before the model is moved or changed.
        check_engine_arguments(config, model, runner_factory)
        check_platform_argument(platform, "GenerationEngine")
        check_group(group)
        check_eos_tokens(config, (model.config if model is not None else config.model).vocab_size)
        agree_on_config(config, group, shard_problem(model, group))
        super().__init__()
        self.closed, self.built = False, False
        # Past this point the caller's model is moved, cast and given a cache; if anything
        # fails, it is put back as it was and this half-built engine drops what it built.
        with claimed(model, self), restored_on_failure(model) as saved:
            build(self, config, platform, model, runner_factory, group, saved)
        self.built = True
        if group is not None:  # a group of one rank too: closing it ends the engine at any world size
            group.release_on_close(self._group_closing)

    # -- views of the parts ---------------------------------------------------------------
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

    # -- serialization (see `Serialized`) ---------------------------------------------------
    def _inconsistencies(self) -> list[str]:
        flight = self.executor.in_flight
        return self.requests.inconsistencies(self._eos, flight.requests if flight is not None else ())

    def _recover(self, error: BaseException) -> None:
        """The tokens in flight are dropped (their requests compute them again); under tensor
        parallel the other ranks' books differ now, so the engine is broken as by a failed step."""
        self._break(error)
        self.executor.take()
        self.requests.recover(self._eos)

    # -- requests -----------------------------------------------------------------------
    @serialized
    def add_request(self, prompt: list[int], max_new_tokens: int) -> int:
        """Queue a prompt; raises TypeError/ValueError naming a bad token or length (nothing queued)."""
        agree_on_call(self.group, self.broken, "add_request", prompt, max_new_tokens)
        return self.requests.add(prompt, max_new_tokens)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[GenerationResult]:
        """Run prompts to completion. A bad prompt yields a failed result, others still run; a
        bad `max_new_tokens` is the call's (TypeError/ValueError, nothing queued). Refused while
        paused, asleep or after an incomplete weight update. If a step raises, this call's
        requests are withdrawn. Safe from several threads at once: the calls share the batch,
        each returns its own results, and one paused by another thread waits for
        continue_generation()."""
        # Read before the lock: a lazy iterable (a tokenizer, another thread's queue) would
        # otherwise hold every other caller's steps, or wait for a thread waiting for the lock.
        listed = listed_prompts(prompts)
        agree_on_call(self.group, self.broken, "generate", listed, max_new_tokens)
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        rids: list[int] = []
        try:  # from the first prompt queued: interrupted anywhere (Ctrl-C, say), nothing of the call stays
            with self.exclusive("generate"):
                if self.paused is not None:
                    raise RuntimeError(f"the engine is paused ({self.paused.value}); call continue_generation() first")
                self._check_can_run()
                self.requests.add_all(listed, max_new_tokens, rids)
            while True:
                with self.exclusive("generate"):
                    if all(rid in self.results for rid in rids):
                        return [self.results.pop(rid) for rid in rids]
                    if self.paused is not None:
                        self._resumed.wait()  # releases the lock until continue_generation()
                        continue
                    self.step()
                time.sleep(0)  # let a thread waiting for the lock take it: fair turns between callers
        except BaseException:
            if rids:  # a refusal before any prompt was queued leaves other callers' work alone
                with self._lock, self.recovering():
                    self.executor.drop()  # its rows may include this call's requests: recomputed, not lost
                    self.requests.discard(rids)
            raise

    # -- a step: plan -> execute -> append ---------------------------------------------------
    @serialized
    def step(self) -> list[GenerationResult]:
        """One continuous-batching step: plan, execute, append; returns the requests it finished.
        Tokens may land at the next step, so the device runs on while the host works. All or
        nothing: a step that raises gives back what it reserved; out of memory retracts the
        batch and empties the cache once (ReleasePoint.OOM)."""
        self._stepping = True
        try:
            return self._step()
        finally:
            self._stepping = False
            self._idle.stopped()

    def _step(self) -> list[GenerationResult]:
        if self.paused is not None:
            return []
        self._check_can_run()
        executor, done = self.executor, []
        flight = executor.in_flight
        if flight is not None and flight.window:  # a decode window: the next is queued, then it lands
            self._idle.working()
            try:
                done = executor.advance()
            except Exception as exc:  # both windows' KV is back: an OOM retracts as in a step
                if self.broken is None and is_out_of_memory(self.platform, exc):
                    return self._handle_oom([r for r in flight.requests if r.state is RequestState.RUNNING], exc)
                raise
            if executor.in_flight is not None:  # the next window is already on the device
                return done
        # A step's tokens still on their way land after this step is planned and launched.
        landing = executor.take()
        plan = self.scheduler.plan()
        if not plan.batch and landing is not None:  # the blocks the plan lacked may be the landing's
            done += executor.land(landing)
            landing, plan = None, self.scheduler.plan()
        if not plan.batch:
            self._idle.tick(bool(self.waiting))
            return done + self.requests.fail_unservable()
        self._idle.working()
        try:
            with torch.no_grad():  # not inference_mode: the KV pool and graph buffers persist across steps
                tokens = executor.run(plan)
        except BaseException as exc:
            for request in plan.batch:  # rows this step touched are rewritten next time
                executor.forget(request.rid)
            self._break(exc)
            if self.broken is None and isinstance(exc, Exception) and is_out_of_memory(self.platform, exc):
                return done + self._handle_oom(plan.batch, exc) + executor.land_or_drop(landing)
            self.scheduler.rollback(plan)
            executor.land_or_drop(landing)
            raise
        if landing is not None:
            try:
                done += executor.land(landing)
            except BaseException:
                if tokens is not None:  # this step's own tokens are read: append them, or its requests stall
                    executor.append(plan.batch, tokens)
                raise
        return done if tokens is None else done + executor.append(plan.batch, tokens)

    @serialized
    def drain(self) -> None:
        """Land the tokens still on their way (a decode window's, or a step's): they are
        appended and the requests they finished go to `results`. `step()` does this itself;
        pause, weight updates, flush and sleep drain first."""
        self.executor.drain()

    @serialized
    def _group_closing(self) -> None:
        """The group is closing (`DeviceGroup.close`): drop the graphs that captured its
        collectives, which NCCL cannot outlive, and run no more steps."""
        for runner in self._graph_holders():
            runner.release()
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
        refuse_broken(self.broken)
        if self.asleep:
            raise RuntimeError(f"the engine is asleep ({', '.join(self.asleep_tags)}); call "
                               "resume_memory_occupation() first")
        refusal = self.weights.refusal()
        if refusal:
            raise WeightUpdateIncomplete(refusal)

    def _handle_oom(self, batch: list[Request], error: BaseException) -> list[GenerationResult]:
        self.platform.report_out_of_memory(error, f"scheduler step {self.requests.steps}", self.device_index)
        failed = self.requests.after_out_of_memory(batch, error)
        self.events.empty(ReleasePoint.OOM)
        return failed

    # -- lifecycle ------------------------------------------------------------------------------
    @serialized
    def pending(self) -> str | None:
        """What keeps the engine from being idle, in words; None when idle."""
        pending = self.requests.pending()
        return None if pending is None else pending + " request(s)" + (f" (paused {self.paused.value})"
                                                                        if self.paused else "")

    @serialized
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

    @serialized
    def pause_generation(self, mode: PauseMode | str) -> list[GenerationResult]:
        """Pause. Returns the requests ended by an abort (empty for retract / in_place)."""
        mode = PauseMode.named(mode)
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

    @serialized
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

    @serialized
    def update_weights_from_tensors(self, named_tensors: NamedTensors, flush_cache: bool = False) -> WeightUpdateResult:
        """Validate every name, shape, dtype and layout first, then apply all or nothing
        (WeightUpdateRejected, a ValueError: nothing applied). Allowed while paused and while
        asleep at level 1 (the update is what wake brings back); after a level-2 sleep, wake
        the weights first."""
        check_bool("update_weights_from_tensors(flush_cache)", flush_cache)
        if self.occupation.level == 2 and WEIGHTS in self.asleep_tags:
            raise RuntimeError("the weights were discarded by a level-2 sleep: call "
                               "resume_memory_occupation(tags=('weights',)) first, then update them")
        self.drain()  # every token launched with the old weights lands first
        count = self.weights.apply(named_tensors)
        self.events.record("weights_updated", count=count, version=self.weight_version)
        flushed = self.flush_cache(empty_cache=True, reason=ReleasePoint.WEIGHT_UPDATE) if flush_cache else None
        return WeightUpdateResult(count, self.weight_version, flushed)

    @serialized
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

    @serialized
    def release_memory_occupation(self, level: int = 1) -> int | None:
        """Sleep, only when idle: level 1 backs the weights up to host memory, level 2 discards
        them (an update brings them back after `resume_memory_occupation(tags=("weights",))`);
        the KV cache is discarded at both. Returns the device bytes given back (None: unknown).
        `trace` says how this platform sleeps (`sleep_mode`): its virtual-memory regions keep
        every graph, host offload captures them again on wake."""
        check_level(level)
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

    @serialized
    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Wake `tags` ("weights", "kv_cache"; None: whatever is asleep), the weights before the
        KV cache, so an RL loop can wake the weights, take the trainer's update, and only then
        wake the KV cache. A failed wake leaves what it was waking asleep, and can be retried."""
        order = self.occupation.wake_order(tags)
        refuse_broken(self.broken)  # waking may capture graphs: on a failed or closed group, for nothing
        level = self.occupation.level
        self.occupation.wake(order, self._graph_holders(), self._new_kv_cache)
        if WEIGHTS in order and level == 2:
            self.weights.mark_unset("the weights were discarded by a level-2 sleep; update them "
                                    "(update_weights_from_tensors or update_weights_from_disk) before generating")
        self.events.record("wake", tags=order)

    def _graph_holders(self) -> list[Releasable]:
        """The runners, whose graphs host offload releases at sleep and captures again at wake."""
        decode = self.executor.decode
        return [self.executor.runner] + ([decode] if decode is not None else [])

    @serialized
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
        """An engine serving the Hugging Face checkpoint at `path` (`load_checkpoint` says what
        is accepted; a refused one raises CheckpointError, nothing allocated), its weights read
        once, straight onto the engine's device in `config.dtype` (no config: the checkpoint's
        dtype and the defaults). A config naming no end-of-sequence token gets the checkpoint's
        `eos_token_id`s, as transformers picks them. `group`: each rank reads only its slices;
        a rank refused alone raises its error and its peers one naming it. The load report is
        `engine.checkpoint`."""
        return engine_from_checkpoint(cls, path, config, platform, runner_factory, group)


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
