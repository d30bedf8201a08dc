"""An existing diffusers pipeline under the residency manager, without editing diffusers.

    managed = ManagedPipeline(pipe, {"text_encoder": "offload", "text_encoder_2": "offload",
                                     "transformer": "layerwise", "vae": "offload"})
    image = managed(prompt="...", num_inference_steps=28).images[0]
    managed.close()

The pipeline's own `__call__` runs. Each component's entry points (`forward`, and
`encode`/`decode` where the class defines them) are wrapped on the instance, so every
call the pipeline makes is one declared use; the uses of a call are derived from the
pipeline's `model_cpu_offload_seq` (the component order diffusers itself declares), as
stages that do not fix how often each component runs, or given as `stages=`. Written
against the pipeline's duck-typed surface only: importing this module does not import
diffusers.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from torchhal.core.residency.declarations import ComponentUse, Stage, Strategy, UndeclaredUse
from torchhal.core.residency.manager import PlacementSpec, ResidencyManager, check_placements
from torchhal.core.residency.strategies import LayerwiseStrategy, ResidentStrategy, attribute_path
from torchhal.platforms import Platform
from torchhal.values import check_bool

#: Attribute paths of block lists in common diffusers / transformers models, in run order.
BLOCK_LIST_CANDIDATES = (
    "transformer_blocks",  # Flux (double-stream), SD3, PixArt, Sana, ...
    "single_transformer_blocks",  # Flux (single-stream, run after the double-stream blocks)
    "blocks",  # Wan, LTX, ...
    "layers",
    "encoder.block",  # T5 encoders
    "text_model.encoder.layers",  # CLIP text encoders
    "encoder.layers",
    "decoder.up_blocks",  # AutoencoderKL and other VAEs: the decoder's up blocks (decode runs them)
)
_ENTRY_METHODS = ("forward", "encode", "decode")
#: What a ManagedPipeline sets on each component instance (and `close` restores).
_PATCHED = (*_ENTRY_METHODS, "_hf_hook")
_ABSENT = object()  # the instance had no attribute of its own by that name


def guess_block_lists(module: nn.Module, name: str = "component") -> tuple[str, ...]:
    """The module's block lists to stream, guessed from BLOCK_LIST_CANDIDATES, with a warning
    (shown once per module and name, as the warnings filters show a repeated one)."""
    found: list[str] = []
    claimed: set[int] = set()
    for path in BLOCK_LIST_CANDIDATES:
        stack = attribute_path(module, path)
        # (its own modules include the list itself: one already chosen, or inside one, is skipped)
        if isinstance(stack, nn.ModuleList) and len(stack) and not any(id(m) in claimed for m in stack.modules()):
            found.append(path)
            claimed.update(id(m) for m in stack.modules())
    if not found:
        raise ValueError(
            f"no block list found in {type(module).__name__} {name!r} (tried {', '.join(BLOCK_LIST_CANDIDATES)}); "
            "pass LayerwiseStrategy(layers_attr=...) naming its nn.ModuleList(s) in the order they run"
        )
    warnings.warn(f"residency guessed the block lists of {type(module).__name__} {name!r}: {', '.join(found)}; "
                  "pass LayerwiseStrategy(layers_attr=...) to name them and silence this", stacklevel=3)
    return tuple(found)


class _ExecutionDevice:
    """Where a component computes, in the attribute diffusers reads for offloaded modules
    (`_hf_hook.execution_device`): its weights may sit on the host between uses, and the
    pipeline must still put latents and inputs on the device. Its presence on a module
    also marks the module as managed by a live ManagedPipeline."""

    def __init__(self, device: Any) -> None:
        self.execution_device = device


class ManagedPipeline:
    """A diffusers pipeline whose components the residency manager places and moves.

    `placements` maps component names (as in `pipeline.components`) to a strategy name
    or object; unnamed components are resident. A bare "layerwise" streams the block
    lists guessed by `guess_block_lists`, with the weights outside them loaded as their
    submodules are called and released with the component (rest="on_call"), the denoiser
    through a ring of buffers (its blocks stream every step), any other component through
    buffers of each block's own size (buffers="exact": it runs once a request, and its
    blocks differ in size, as a VAE decoder's do). `denoiser` is the component called every
    step (default: "transformer" or "unet", whichever the pipeline has).

    No use is a release point by default: a component that leaves the device gives its
    memory back to the allocator's cache, from which the next component and its
    activations are served, and the cache is emptied only after an out-of-memory error.
    Every use is memory-intensive (the next one is prefetched); `empty_on_release=True`
    makes their releases release points, emptying after every component that left: the
    device holds less between stages, at the cost of an empty (tens of ms for GBs) at each
    stage boundary.

    Every argument is checked before anything is attached. A pipeline whose components
    another ManagedPipeline manages is refused until that one is closed; `close()` restores
    exactly what each component instance had of its own.
    """

    def __init__(
        self,
        pipeline: Any,
        placements: Mapping[str, PlacementSpec],
        *,
        denoiser: str | None = None,
        prefetch: bool = True,
        empty_on_release: bool = False,
        platform: Platform | None = None,
        device_index: int | None = None,
        record_trace: bool = True,
        log: Any = None,
    ) -> None:
        modules = _modules_of(pipeline)
        check_placements(placements)
        denoiser = _check_denoiser(pipeline, modules, denoiser)
        check_bool("prefetch", prefetch)  # the manager checks its own flags before it attaches anything
        managed = [name for name, m in modules.items() if isinstance(m.__dict__.get("_hf_hook"), _ExecutionDevice)]
        if managed:  # wrapping the other's wrappers: closing both would leave them behind
            raise ValueError(
                f"{type(pipeline).__name__} components {managed} are already managed by another ManagedPipeline; "
                "close() that one first (it leaves the pipeline as it found it)"
            )
        strategies = {name: LayerwiseStrategy(1, guess_block_lists(modules[name], name), rest="on_call",
                                              buffers="ring" if name == denoiser else "exact")
                      if isinstance(spec, str) and spec == Strategy.LAYERWISE and name in modules else spec
                      for name, spec in placements.items()}
        # (module, attribute, what the instance had of its own before anything is attached, or _ABSENT)
        self._wrapped: list[tuple[nn.Module, str, Any]] = [
            (module, attribute, module.__dict__.get(attribute, _ABSENT))
            for module in modules.values() for attribute in _PATCHED
        ]
        self.pipeline, self.denoiser, self.prefetch = pipeline, denoiser, prefetch
        self._declared: set[str] = set()  # the components the running call's stages name
        self.manager = ResidencyManager(modules, strategies, platform, device_index, empty_on_release=empty_on_release,
                                        record_trace=record_trace, log=log)
        marker = _ExecutionDevice(self.manager.device)
        for name, module in modules.items():
            self._wrap(name, module)
            module.__dict__["_hf_hook"] = marker
        self._closed = False

    # -- declared uses ------------------------------------------------------------------------
    def stages(self, **call_kwargs: Any) -> list[Stage]:
        """The uses one `pipeline(**call_kwargs)` may make, as stages that do not fix how often
        each component runs (`Stage(exact=False)`: the count depends on the scheduler, the
        guidance and `strength`, which only the pipeline's own call works out): the components
        `model_cpu_offload_seq` lists before the denoiser (the text encoders, a second time for
        a negative prompt, none with `prompt_embeds`), then the denoiser, then the components
        after it (unless latents are asked for). Those may also run before the denoiser (the
        VAE encodes an img2img image, a Flux control image): declared there as uses that are
        not memory-intensive, so that nothing is prefetched for a use that may not come."""
        before, after = self._around_denoiser()
        prefetch = self.prefetch

        def uses(names: list[str], memory_intensive: bool = True) -> tuple[ComponentUse, ...]:
            return tuple(ComponentUse(n, memory_intensive=memory_intensive, allow_prefetch=prefetch) for n in names)

        early = uses([n for n in after if n not in before], memory_intensive=False)
        if call_kwargs.get("output_type") == "latent":
            after = []
        encode = [Stage("encode", uses(before) + early, exact=False)] if before or early else []
        decode = [Stage("decode", uses(after), exact=False)] if after else []
        return [*encode, Stage("denoise", uses([self.denoiser]), exact=False), *decode]

    def __call__(self, *args: Any, stages: Sequence[Stage] | None = None, **kwargs: Any) -> Any:
        """Run the pipeline's own `__call__` as one request of the manager. The uses are
        derived from its arguments, positional ones included, unless `stages=` declares them."""
        if self._closed:
            raise RuntimeError("this ManagedPipeline is closed; the pipeline is a plain pipeline again")
        # the caller's stages as given: the manager checks them and names the fix
        declared = stages if stages is not None else self.stages(**self._named_arguments(args, kwargs))
        try:
            with self.manager.request(declared):
                self._declared = {use.component for stage in declared for use in stage.uses}
                return self.pipeline(*args, **kwargs)
        except UndeclaredUse as departed:
            if stages is not None:  # the caller's own declaration: the manager's message says it all
                raise
            raise UndeclaredUse(self._departure(departed, declared), departed.component, departed.expected,
                                departed.allowed) from departed

    def close(self) -> int | None:
        """Give the device back (see ResidencyManager.close) and restore exactly what each
        component instance had of its own before (entry methods, `_hf_hook`). A second
        close does nothing and returns None."""
        released = self.manager.close()
        for module, attribute, before in self._wrapped:
            if before is _ABSENT:
                module.__dict__.pop(attribute, None)
            else:
                module.__dict__[attribute] = before
        self._wrapped, self._closed = [], True
        return released

    # -- internals ------------------------------------------------------------------------------
    def _around_denoiser(self) -> tuple[list[str], list[str]]:
        """The managed components `model_cpu_offload_seq` lists before and after the denoiser."""
        sequence = getattr(self.pipeline, "model_cpu_offload_seq", None)
        # DiffusionPipeline itself sets it to None; a subclass that declares no order names nothing
        order = [n for n in (sequence if isinstance(sequence, str) else "").split("->")
                 if n in self.manager.components]
        if self.denoiser not in order:
            raise ValueError(
                f"{type(self.pipeline).__name__}.model_cpu_offload_seq does not name {self.denoiser!r}; "
                "pass stages= to the call to declare its uses"
            )
        split = order.index(self.denoiser)
        return order[:split], order[split + 1 :]

    def _departure(self, departed: UndeclaredUse, declared: Sequence[Stage]) -> str:
        """What the pipeline did otherwise than the uses derived for its call, and the fix."""
        pipeline = type(self.pipeline).__name__
        called = departed.component
        if called not in self._declared:
            return (f"{pipeline} called {called!r}, which the uses derived for this call do not name (they follow "
                    f"{pipeline}.model_cpu_offload_seq = {getattr(self.pipeline, 'model_cpu_offload_seq', None)!r}); "
                    f"leave {called!r} resident (a resident component the uses do not name runs as it is), or pass "
                    "stages= to the call declaring the uses it makes")
        allowed = " or ".join(map(repr, departed.allowed)) or "nothing more"
        return (f"{pipeline} called {called!r} where the uses derived for this call allow {allowed} next (their "
                f"stages, {', '.join(s.name for s in declared)}, run in that order); pass stages= to the call "
                "declaring the uses it makes")

    def _named_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by parameter name (`pipe(prompt, 30)` gives num_inference_steps=30),
        the ones that bind to `**kwargs` included; as given when they do not bind (the pipeline's
        own call then raises its TypeError)."""
        if not args:
            return kwargs
        try:
            signature = inspect.signature(self.pipeline.__call__)
            bound = signature.bind_partial(*args, **kwargs)
        except (TypeError, ValueError):
            return kwargs
        named: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            elif kind is not inspect.Parameter.VAR_POSITIONAL:
                named[name] = value
        return named

    def _wrap(self, name: str, module: nn.Module) -> None:
        for attribute in _ENTRY_METHODS:
            if callable(getattr(type(module), attribute, None)):
                module.__dict__[attribute] = self._entry(name, getattr(module, attribute))

    def _entry(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        manager = self.manager

        def entry(*args: Any, **kwargs: Any) -> Any:
            if manager.in_use == name:  # e.g. AutoencoderKL.forward calling its own decode
                return original(*args, **kwargs)
            if not manager.in_request:  # e.g. pipe.vae.decode(latents), pipe.encode_prompt(...)
                own = ComponentUse(name, memory_intensive=True, allow_prefetch=False)
                with manager.request([Stage(f"{name} outside a pipeline call", (own,))]):
                    return entry(*args, **kwargs)
            if name not in self._declared and isinstance(manager.components[name].strategy, ResidentStrategy):
                return original(*args, **kwargs)  # named by no use (a safety checker) and never moves
            with manager.use_component(name):
                return original(*args, **kwargs)

        return entry


def _modules_of(pipeline: Any) -> dict[str, nn.Module]:
    """The pipeline's `nn.Module` components by name; TypeError for anything not a pipeline."""
    components = getattr(pipeline, "components", None)
    if not isinstance(components, Mapping) or not callable(pipeline):
        raise TypeError(
            f"pipeline must be a diffusers pipeline (callable, with a .components dict of its modules), "
            f"got {type(pipeline).__name__}"
        )
    modules = {name: m for name, m in components.items() if isinstance(m, nn.Module)}
    first_name: dict[int, str] = {}
    for name, module in modules.items():
        earlier = first_name.setdefault(id(module), name)
        if earlier != name:  # its calls could not say which component's use they are
            raise ValueError(
                f"{type(pipeline).__name__} components {earlier!r} and {name!r} are the same module; a managed "
                f"pipeline tells uses apart by the component instance called: give {name!r} a module of its own, "
                "or manage the shared one with a ResidencyManager and declared uses"
            )
    return modules


def _takes_timestep(module: nn.Module) -> bool | None:
    """Whether the module's class forward takes a timestep, as diffusers denoisers' do
    (`timestep`, `timesteps`, `timestep_ratio`, `t`); None when its signature names no
    parameter (only *args / **kwargs) or cannot be read."""
    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]  # after self
    except (TypeError, ValueError):
        return None
    named = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not named:
        return None
    return any(name.startswith("timestep") or name == "t" for name in named)


def _check_denoiser(pipeline: Any, modules: Mapping[str, nn.Module], denoiser: object) -> str:
    """The denoiser's name: the one given, or "transformer" / "unet". Refused, naming the valid
    choices, unless it is a module of the pipeline; and when some module takes a timestep,
    unless it is one that may (a VAE or a text encoder is never called once per step)."""
    takes = {name: _takes_timestep(m) for name, m in modules.items()}
    choices = sorted(name for name, t in takes.items() if t) or sorted(modules)
    if denoiser is None:
        denoiser = next((n for n in ("transformer", "unet") if n in modules), None)
    if not isinstance(denoiser, str) or denoiser not in modules:  # None: neither "transformer" nor "unet"
        raise ValueError(f"denoiser {denoiser!r} is not a module of {type(pipeline).__name__}; pass denoiser= "
                         f"naming the component called once per step, one of {choices}")
    if takes[denoiser] is False and any(takes.values()):
        raise ValueError(
            f"denoiser {denoiser!r} ({type(modules[denoiser]).__name__}) takes no timestep, so it is not the "
            f"component called once per step; name one of {choices}"
        )
    return denoiser

