"""What an engine decides before it runs: its arguments checked, its device, its model claimed
and sharded, and the settings its defaults leave to the model and the memory."""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from torchhal.core.devices import check_device_index
from torchhal.core.engine.records import PLATFORM_COMPILE, EngineConfig
from torchhal.core.engine.runners import ModelRunner
from torchhal.core.model import Model, ModelConfig
from torchhal.core.model.protocol import missing_model_members
from torchhal.platforms import CompileSupport, Platform
from torchhal.values import short_repr

if TYPE_CHECKING:
    from torchhal.distributed import DeviceGroup


def check_engine_arguments(config: object, model: object, runner_factory: object) -> None:
    """The refusals the engine's arguments decide alone, before anything is moved or read."""
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config = {short_repr(config)} is a {type(config).__name__}, not an EngineConfig; pass "
                        "e.g. EngineConfig(dtype=torch.bfloat16)")
    if runner_factory is not None and not callable(runner_factory):
        raise TypeError(f"runner_factory = {short_repr(runner_factory)} must be a function given the engine and "
                        "returning its ModelRunner, or None for the engine's own runner")
    if runner_factory is not None and config.prefill_graphs is not None:
        raise ValueError("EngineConfig.prefill_graphs and runner_factory both choose the engine's runner; pass one "
                         "(prefill_graphs builds a GraphRunner with its token buckets)")
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


#: A model's engine: each engine sets `model.kv` and moves the model, so two would run on one cache.
_OWNER = "_torchhal_engine"
_CLAIMS = threading.Lock()


@contextlib.contextmanager
def claimed(model: Model | None, engine: object) -> Iterator[None]:
    """`model` refused if an open engine (or one being built) serves it, else claimed by `engine`
    until the block fails. An engine that closes or is dropped gives the model up."""
    if model is None:
        yield
        return
    with _CLAIMS:
        owner = vars(model).get(_OWNER)
        serving = owner() if owner is not None else None
        if serving is not None and not serving.closed:
            doing = ("already serves another GenerationEngine, which set its KV cache" if serving.built else
                     "is being given to another GenerationEngine right now (on another thread, or by a call made "
                     "while that engine is built)")
            raise ValueError(f"model {type(model).__name__} {doing}; give each engine its own model (load the "
                             "checkpoint again, or copy.deepcopy(model)), or close() the first engine")
        vars(model)[_OWNER] = weakref.ref(engine)
    try:
        yield
    except BaseException:
        release_claim(model, engine)
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


@contextlib.contextmanager
def dropped_on_failure(engine: object) -> Iterator[None]:
    """If the block raises, `engine` (half built) forgets everything it holds: the exception's
    traceback keeps the object alive, so its graphs and KV pool would otherwise stay allocated
    until the traceback goes."""
    try:
        yield
    except BaseException:
        vars(engine).clear()
        raise
