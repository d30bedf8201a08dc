"""What an engine decides before it runs: its arguments checked, its device, its model claimed
and sharded, and the settings its defaults leave to the model and the memory."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from torchhal.attention import AttentionSpec
from torchhal.core.devices import check_device_index, model_placement
from torchhal.core.engine.events import EngineEvents, IdleClock
from torchhal.core.engine.execution import StepExecutor
from torchhal.core.engine.kv_pool import BlockAllocator, KVPoolSizing, size_kv_pool
from torchhal.core.engine.model_state import ModelState
from torchhal.core.engine.occupation import occupation_for
from torchhal.core.engine.ranks import (
    agree_on_config,
    agree_on_update,
    agree_on_verdict,
    check_group,
    refuse_with_peers,
)
from torchhal.core.engine.records import (
    PLATFORM_COMPILE,
    DecodeGraphConfig,
    EngineConfig,
    PauseMode,
    PrefillGraphConfig,
    usable_buckets,
)
from torchhal.core.engine.requests import RequestBook
from torchhal.core.engine.runners import EagerRunner, ModelRunner
from torchhal.core.engine.scheduler import Scheduler
from torchhal.core.engine.weights import WeightUpdater
from torchhal.core.graphs.decode import BlockTable, DecodeGraphRunner
from torchhal.core.graphs.runner import GraphRunner
from torchhal.core.model import KVCache, Model, ModelConfig
from torchhal.core.model.linear import use_platform_linear
from torchhal.core.model.protocol import missing_model_members
from torchhal.platforms import CompileSupport, Platform, check_platform_argument, current_platform
from torchhal.values import short_repr

if TYPE_CHECKING:
    from torchhal.attention import AttentionChoice
    from torchhal.core.engine.occupation import Occupation
    from torchhal.core.model.checkpoint import LoadReport
    from torchhal.distributed import DeviceGroup


class EngineParts(ABC):
    """What an engine is made of, set by `build` in the order each needs the one before; the
    engine (`GenerationEngine`) is the lifecycle over them."""

    config: EngineConfig
    group: DeviceGroup | None  # None for one device (a group of one rank is no group)
    platform: Platform
    device_index: int
    device: torch.device
    model: Model
    events: EngineEvents
    occupation: Occupation
    compile_backend: str | Callable[..., Any] | None
    kv_sizing: KVPoolSizing
    max_running_requests: int  # config.max_running, or fewer when the pool has fewer blocks
    longest_request: int  # the most tokens a request holds: max_position, or the pool's slots
    attention: AttentionChoice
    requests: RequestBook
    max_batch_tokens: int
    scheduler: Scheduler
    weights: WeightUpdater
    executor: StepExecutor
    paused: PauseMode | None
    broken: str | None  # tensor parallel: why a failed step ended this engine
    checkpoint: LoadReport | None  # the load report, set by from_checkpoint
    _idle: IdleClock
    _eos: frozenset[int]


    def _new_kv_cache(self, device: torch.device | None = None) -> KVCache:
        # One block more than the allocator hands out: the scratch block.
        return KVCache(self.local_config, self.kv_sizing.num_blocks + 1, self.config.kv_block_size,
                       device or self.device, self.config.dtype)

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    @property
    def local_config(self) -> ModelConfig:
        """The shapes this process computes: a tensor-parallel rank's heads and KV heads (the KV
        cache and attention are sized from them); `model_config` for a model on one device."""
        local: ModelConfig = getattr(self.model, "local_config", self.model.config)
        return local

    @abstractmethod
    def _break(self, error: BaseException) -> None:
        """A step failed under tensor parallel (the engine ends itself)."""


#: An engine (a subclass of `EngineParts`), as `runner_factory` and `from_checkpoint` see it.
Engine = TypeVar("Engine", bound=EngineParts)


def check_engine_arguments(config: object, model: object, runner_factory: object) -> None:
    """The refusals the engine's arguments decide alone, before anything is moved or read."""
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config = {short_repr(config)} is a {type(config).__name__}, not an EngineConfig; pass "
                        "e.g. EngineConfig(dtype=torch.bfloat16)")
    if runner_factory is not None and not callable(runner_factory):
        raise TypeError(f"runner_factory = {short_repr(runner_factory)} must be a function given the engine and "
                        "returning its ModelRunner, or None for the engine's own runner")
    if runner_factory is not None and config.prefill_graphs not in (None, PrefillGraphConfig()):
        raise ValueError("EngineConfig.prefill_graphs and runner_factory both choose the engine's runner; pass one "
                         "(prefill_graphs configures the engine's own GraphRunner, which runner_factory replaces)")
    if model is not None and missing_model_members(model):
        raise TypeError(f"model {type(model).__name__} lacks {', '.join(missing_model_members(model))} of the "
                        "torchhal.core.model.Model protocol")
    explicit = config.compile_layers not in (None, PLATFORM_COMPILE)
    if explicit and model is not None and getattr(model, "compile_layers", None) is None:
        raise TypeError(f"EngineConfig.compile_layers = {config.compile_layers!r}, but model {type(model).__name__} "
                        "has no compile_layers(backend); leave compile_layers None for this model")


def check_eos_tokens(config: EngineConfig, vocab_size: int) -> None:
    """End-of-sequence ids the model can emit: one outside the vocabulary would never stop a request."""
    ids = set(config.eos_tokens) | ({config.eos_token} if config.eos_token is not None else set())
    outside = sorted(token for token in ids if token >= vocab_size)
    if outside:
        raise ValueError(f"EngineConfig end-of-sequence token(s) {outside} are outside the model's vocabulary "
                         f"0..{vocab_size - 1}; no request would ever stop on them")


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
        raise ValueError(f"EngineConfig.device = {config.device} but the group puts rank {placement.rank} on device "
                         f"{index}; leave EngineConfig.device None with a group")
    return index


def compile_choice(config: EngineConfig, model: Model, support: CompileSupport | None) -> tuple[
        str | Callable[..., Any] | None, dict[str, Any] | None, str]:
    """The compile backend the engine uses, the platform's inductor options for it, and why."""
    backend = config.compile_layers
    compile_layers = getattr(model, "compile_layers", None)
    if backend == PLATFORM_COMPILE:
        if support is None:
            return None, None, "layers are not compiled: the platform declares no compile support"
        if compile_layers is None:
            return None, None, f"layers are not compiled: model {type(model).__name__} has no compile_layers"
        backend = "inductor"
    if backend is None:
        return None, None, "layers are not compiled (EngineConfig.compile_layers is None)"
    if support is None:
        return backend, None, "the platform asks for no inductor options (compile_support() is None)"
    if backend != "inductor":
        return backend, None, f"the platform's inductor options do not apply to compile backend {backend!r}"
    assert compile_layers is not None
    if "options" not in inspect.signature(compile_layers).parameters:
        return backend, None, "the model's compile_layers(backend) takes no options"
    return backend, dict(support.inductor_options), support.note or "the platform's inductor options"


def prepared_model(model: Model | None, config: EngineConfig, group: DeviceGroup | None,
                   device: torch.device) -> Model:
    """The engine's model: the caller's (or the reference decoder of `config.model`), as this
    rank's shard under tensor parallel, on the engine's device in `config.dtype`, in eval mode."""
    from torchhal.core.model import ReferenceDecoder

    built: Model = ReferenceDecoder(config.model) if model is None else model
    if group is not None:
        built = shard_for_group(built, group)
    built.to(model_placement(built, device), config.dtype)
    built.eval()
    return built


def speed_up(model: Model, config: EngineConfig, platform: Platform,
             events: EngineEvents) -> str | Callable[..., Any] | None:
    """The platform's linear kernel and compiled layers where they apply (before any graph is
    captured), each recorded with why; returns the compile backend (None: not compiled)."""
    kernel, kernel_why = use_platform_linear(model, platform.linear_support, config.dtype)
    backend, options, why = compile_choice(config, model, platform.compile_support)
    if backend is not None:
        compile_layers = model.compile_layers  # type: ignore[attr-defined]  # compile_choice checked it
        compile_layers(backend, options) if options else compile_layers(backend)
    events.record("linear_kernel", kernel=kernel, why=kernel_why)
    events.record("compile_options", backend=backend, options=options, why=why)
    return backend


def activation_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """About the transient memory one token of a prefill step holds at once in a layer: the
    projections' outputs (q, k, v, the fused gate-up and its product) and the residual stream."""
    element = torch.empty((), dtype=dtype).element_size()
    width = 4 * config.hidden_size + 3 * config.intermediate_size
    width += (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    return 2 * width * element


def default_batch_tokens(longest_request: int, free_after_kv: int, per_token: int) -> int:
    """A whole prompt of the longest request in one step, within a quarter of what the KV pool left."""
    return max(1, min(longest_request, free_after_kv // 4 // per_token))


def captures_decode_graphs(settings: DecodeGraphConfig | None, platform: Platform) -> bool:
    """Decode steps will be captured: the attention backend must then be capturable."""
    return settings is not None and not settings.emulate and platform.graph_support is not None


def free_bytes_everywhere(platform: Platform, index: int, group: DeviceGroup | None, saved: ModelState | None) -> int:
    """The free memory the KV pool is sized from: this device's, or under tensor parallel the
    least of any rank's, so every rank sizes the same pool and schedules alike. On a platform
    without a caching allocator (the host), the originals of a model cast on its own device,
    kept for a restore, count as free: the cast would have freed them."""
    if group is not None:
        return platform.available_memory(group.host)  # on the rank's device: init_group made it current
    info = platform.memory_info(index)
    held = saved.held_bytes(platform.device(index)) if saved is not None and info.reserved is None else 0
    return info.free + held


def make_runner(engine: Engine, runner_factory: Callable[[Engine], ModelRunner] | None) -> ModelRunner:
    """The runner of every step full-graph decode does not take: the caller's, breakable graphs
    for `config.prefill_graphs` (captured here, after the KV cache exists), or eager."""
    if runner_factory is not None:
        return check_runner(runner_factory(engine))
    settings = engine.config.prefill_graphs
    if settings is None:
        return EagerRunner(engine.model)
    # A step has at most max_batch_tokens tokens: larger buckets would only hold memory.
    runner = GraphRunner(engine.model, engine.platform, engine.device_index, dtype=engine.config.dtype,
                         buckets=usable_buckets(settings.token_buckets, engine.max_batch_tokens),
                         emulate=settings.emulate, pool=engine.occupation.graph_pool("prefill_graphs"))
    engine.events.record("prefill_graphs", buckets=list(runner.bucket_sizes), eager_reason=runner.eager_reason)
    return runner


def make_decode_runner(engine: EngineParts, settings: DecodeGraphConfig) -> DecodeGraphRunner:
    """Built after the KV cache exists: capture needs it (and the scratch block in it). Buckets
    no step can use are left out (a context bucket never passes the longest request, a batch
    bucket the most running requests), so none sizes buffers beyond what a step can fill."""
    longest = engine.longest_request
    contexts = settings.context_buckets or _powers_of_four(256, longest)
    context_buckets = usable_buckets(contexts, longest)
    return DecodeGraphRunner(
        engine.model,  # type: ignore[arg-type]  # the Model protocol is satisfied by nn.Modules
        engine.platform, engine.device_index, block_size=engine.config.kv_block_size,
        backend=engine.attention.backend,
        batch_buckets=usable_buckets(settings.batch_buckets, engine.max_running_requests),
        context_buckets=context_buckets, steps_per_sync=min(settings.steps_per_sync, context_buckets[-1]),
        emulate=settings.emulate, pool=engine.occupation.graph_pool("decode_graphs"))


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


def _breaks(engine: EngineParts) -> Callable[[BaseException], None]:
    """`engine._break`, through a weak reference: the executor the engine holds must not hold it
    (a dropped engine would then live until a garbage collection, its model still claimed)."""
    ref = weakref.ref(engine)

    def broken(error: BaseException) -> None:
        alive = ref()
        if alive is not None:
            alive._break(error)

    return broken


def _powers_of_four(first: int, last: int) -> tuple[int, ...]:
    """first, 4 * first, ... up to the first that reaches `last`."""
    sizes = [first]
    while sizes[-1] < last:
        sizes.append(sizes[-1] * 4)
    return tuple(sizes)


#: A model's engine: each engine sets `model.kv` and moves the model, so two would run on one cache.
_OWNER = "_torchhal_engine"
_CLAIMS = threading.Lock()


@contextlib.contextmanager
def claimed(model: Model | None, engine: object) -> Iterator[None]:
    """`model` refused if an open engine (or one being built) serves it, else claimed by `engine`
    until the block fails. An engine that closes or is dropped gives the model up. If the block
    raises, `engine` (half built) also forgets everything it holds: the exception's traceback
    keeps the object alive, so its graphs and KV pool would otherwise stay allocated until the
    traceback goes."""
    if model is not None:
        with _CLAIMS:
            owner = vars(model).get(_OWNER)
            serving = owner() if owner is not None else None
            if serving is not None and not serving.closed:
                doing = ("already serves another GenerationEngine, which set its KV cache" if serving.built else
                         "is being given to another GenerationEngine right now (on another thread, or by a call "
                         "made while that engine is built)")
                raise ValueError(f"model {type(model).__name__} {doing}; give each engine its own model (load the "
                                 "checkpoint again, or copy.deepcopy(model)), or close() the first engine")
            vars(model)[_OWNER] = weakref.ref(engine)
    try:
        yield
    except BaseException:
        if model is not None:
            release_claim(model, engine)
        vars(engine).clear()
        raise


def release_claim(model: Model, engine: object) -> None:
    with _CLAIMS:
        owner = vars(model).get(_OWNER)
        if owner is not None and owner() is engine:
            del vars(model)[_OWNER]


def check_runner(made: object) -> ModelRunner:
    """A `runner_factory`'s answer: the ModelRunner protocol (forward(input_ids, meta, rows),
    release(), resume())."""
    missing = [name for name in ("forward", "release", "resume") if not callable(getattr(made, name, None))]
    if missing:
        raise TypeError(f"runner_factory returned {type(made).__name__}, which lacks {', '.join(missing)} of the "
                        "ModelRunner protocol (forward(input_ids, meta, rows), release(), resume())")
    forward = made.forward  # type: ignore[attr-defined]
    with contextlib.suppress(ValueError):  # a callable without a signature (a C function): taken as it is
        try:
            inspect.signature(forward).bind(None, None, None)
        except TypeError:
            raise TypeError(
                f"runner_factory returned {type(made).__name__}, whose forward{inspect.signature(forward)} does "
                "not take the ModelRunner protocol's (input_ids, meta, rows); rows are the token indices whose "
                "hidden states it returns, in that order (None: every token)") from None
    return made  # type: ignore[return-value]


def shard_for_group(model: Model, group: DeviceGroup) -> Model:
    """`model` as the group's rank's shard, attached to the group's communicator: a whole
    `LlamaDecoder` is sharded here (on its own device, before the move); a shard must be
    this rank's."""
    from torchhal.core.model import LlamaDecoder
    from torchhal.core.model.parallel import TensorParallelPlan

    if not isinstance(model, LlamaDecoder):
        raise TypeError(f"tensor parallel needs a LlamaDecoder (or a checkpoint through from_checkpoint(..., "
                        f"group=)); model {type(model).__name__} cannot be split over {group.world_size} ranks")
    if model.shard is None:
        model = model.shard_for((TensorParallelPlan(model.config, group.world_size), group.rank))
    model.use_communicator(group.comm)
    return model


def engine_from_checkpoint(cls: Callable[..., Engine], path: str | Path, config: EngineConfig | None,
                           platform: Platform | None, runner_factory: Callable[[Engine], ModelRunner] | None,
                           group: DeviceGroup | None) -> Engine:
    """`GenerationEngine.from_checkpoint` (its docstring says what it does)."""
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


def build(self: Engine, config: EngineConfig, platform: Platform | None, model: Model | None,
          runner_factory: Callable[[Engine], ModelRunner] | None, group: DeviceGroup | None,
          saved: ModelState | None) -> None:
    """The engine's parts, in the order each needs the one before: the model on its device, its
    weights and KV cache where the platform's sleep wants them, the kernels, the KV pool sized
    from the free memory, the attention backend, the book, the scheduler and the executor."""
    self.config = config
    self.checkpoint = None  # set by from_checkpoint
    self.group = group if group is not None and group.world_size > 1 else None
    self.platform = platform or (group.platform if group is not None else current_platform())
    self.device_index = engine_device_index(self.platform, config, group)
    self.device = self.platform.device(self.device_index)
    self.model = prepared_model(model, config, self.group, self.device)
    self.events = EngineEvents(self.platform, self.device_index)
    self.occupation = occupation_for(self.platform, self.device, self.model)
    moved = self.occupation.place_weights()
    if moved and saved is not None:
        saved.follow_moves(moved)
    self.events.record("sleep_mode", how=self.occupation.describe())
    self.compile_backend = speed_up(self.model, config, self.platform, self.events)
    local = self.local_config
    free = free_bytes_everywhere(self.platform, self.device_index, self.group, saved)
    self.kv_sizing = size_kv_pool(local, config, free)
    # A running request holds a block; no request holds more tokens than max_position or the pool's slots.
    self.max_running_requests = min(config.max_running, self.kv_sizing.num_blocks)
    self.longest_request = min(self.model_config.max_position, self.kv_sizing.num_slots)
    self.attention = self.platform.choose_attention(AttentionSpec(
        num_q_heads=local.num_heads, num_kv_heads=local.num_kv_heads, head_dim=local.head_dim,
        dtype=config.dtype, block_size=config.kv_block_size, sliding_window=local.sliding_window,
        needs_graph=captures_decode_graphs(config.decode_graphs, self.platform)))
    self.events.record("attention_backend", backend=self.attention.name, why=self.attention.why)
    self.model.kv = self.occupation.place_kv(self._new_kv_cache)
    self.requests = RequestBook(BlockAllocator(self.kv_sizing.num_blocks, config.kv_block_size),
                                self.model_config.vocab_size, self.model_config.max_position,
                                grow_pool=self.kv_sizing.how_to_grow)
    self.max_batch_tokens = config.max_batch_tokens or default_batch_tokens(
        self.longest_request, free - self.kv_sizing.num_blocks * self.kv_sizing.bytes_per_block,
        activation_bytes_per_token(local, config.dtype))
    self.events.record("batch_tokens", max_batch_tokens=self.max_batch_tokens)
    self.scheduler = Scheduler(self.requests, self.max_batch_tokens, config.max_running)
    self.weights = WeightUpdater(
        self.model, check_finite=config.check_finite_weights,
        shard=getattr(self.model, "shard", None) if self.group is not None else None,
        agree=functools.partial(agree_on_update, self.group) if self.group is not None else None)
    self.paused = None
    self._idle = IdleClock(self.events, config.idle_empty_after_s)
    self.broken = None  # tensor parallel: why a failed step ended this engine
    self._eos = frozenset(config.eos_tokens) | frozenset(() if config.eos_token is None else (config.eos_token,))
    # Pure decode steps on the runner read their metadata from here: each request keeps a
    # row whose blocks are uploaded once, so a step's host work does not grow with the context.
    rows = BlockTable(self.max_running_requests, self.longest_request, config.kv_block_size, self.device,
                      pin=self.platform.pin_memory)
    runner = make_runner(self, runner_factory)
    decode = make_decode_runner(self, config.decode_graphs) if config.decode_graphs is not None else None
    self.executor = StepExecutor(self.model, self.platform, self.device_index, self.requests, self.scheduler,
                                 runner, decode, rows, config.kv_block_size, config.dtype,
                                 device_waiter(self.group), self.attention.backend, self._eos, _breaks(self))
    self.requests.on_leave = self.executor.forget

