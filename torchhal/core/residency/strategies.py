"""How a component's weights reach the device and leave it: the strategy interface and
the three built-in strategies (resident, offload, layerwise).

A strategy object serves one component and keeps that component's state itself
(host copies, device buffers, hooks); the manager keeps only what every strategy
shares (the ComponentState), decides *when* to call it, and has checked every
component it hands a strategy (`check` refused what the strategy cannot serve).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from torchhal.core.residency.declarations import Strategy
from torchhal.core.residency.weights import WeightBlock
from torchhal.platforms import Platform
from torchhal.values import as_index


class StrategyHost(Protocol):
    """What a strategy may use of the manager that drives it (the manager keeps the decisions)."""

    device: torch.device
    platform: Platform
    side_stream: Any

    def event(self, kind: str, component: str | None, **fields: Any) -> None: ...


@dataclass
class ComponentState:
    """One registered component: its module, its strategy and the dtype the current use asks for."""

    name: str
    module: nn.Module
    strategy: ResidencyStrategy
    dtype: torch.dtype | None = None
    #: Each floating buffer's dtype as registered (by dotted name): a use's dtype casts the
    #: buffers with the weights, as module.to(dtype) would, and close casts them back.
    buffer_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    buffers_cast_to: torch.dtype | None = None  # the dtype `cast_buffers` last gave them (None: as registered)

    @property
    def attached(self) -> bool:
        """Between the strategy's attach and its detach: outside that span nothing of the
        component is on the device, whatever the strategy reports."""
        return self.strategy.serving is self

    @property
    def on_device(self) -> bool:
        return self.attached and self.strategy.on_device(self)


class ResidencyStrategy:
    """How one component's weights reach the device and leave it.

    The manager decides *when* (uses, keep rules, prefetch, release points, empties);
    a strategy decides *how*. To add one, subclass this and pass an instance as the
    component's placement; one instance serves one component and keeps its state.
    From the manager a strategy may use `device`, `platform`, `side_stream` and
    `event(kind, component, **fields)` (the `StrategyHost` protocol above, which the manager keeps).
    """

    #: The whole weights can be loaded ahead of a use on the side stream.
    prefetchable: ClassVar[bool] = False
    #: Between uses the component holds a whole device copy that keep rules may keep.
    keepable: ClassVar[bool] = False
    #: The component this strategy serves (the manager sets it from attach to detach); a
    #: strategy serving one is refused for another.
    serving: ComponentState | None = None

    def check(self, component: ComponentState) -> None:
        """Before any component moves: raise ValueError if this strategy cannot serve it."""

    def attach(self, manager: StrategyHost, component: ComponentState) -> None:
        """At registration: place what stays on the device, set up host copies and hooks."""

    def load(self, manager: StrategyHost, component: ComponentState, stream: Any | None) -> int:
        """Make the component ready for a use in `component.dtype` (`stream`: a prefetch on
        the side stream; None: now, in compute order). Bytes moved to the device."""
        return 0

    def wait(self, manager: StrategyHost, component: ComponentState) -> bool:
        """Make compute wait for a prefetch of this component; True if there was one."""
        return False

    def release(self, manager: StrategyHost, component: ComponentState) -> int:
        """The run of uses is over: give device memory back. Bytes that left the device."""
        return 0

    def on_device(self, component: ComponentState) -> bool:
        return True

    def copied_bytes(self) -> int | None:
        """Bytes this strategy has copied host -> device since attach (every copy it issued,
        prefetches included), or None if it does not count them: the manager then counts
        the bytes its `load` calls return."""
        return None

    def detach(self, manager: StrategyHost, component: ComponentState) -> None:
        """close(), and the rollback of a construction that failed: everything back to host
        memory, hooks removed, and this strategy free to serve a component again. Also called
        for the component whose `attach` raised: it must undo whatever part of attach ran,
        without failing on what was never set up."""
        self.release(manager, component)
        component.module.to("cpu")


def _floating_dtypes(module: nn.Module, skip: frozenset[int] = frozenset()) -> dict[int, torch.dtype]:
    """Each floating parameter's dtype by id: what a use with dtype None casts back to."""
    return {id(p): p.dtype for p in module.parameters() if id(p) not in skip and p.dtype.is_floating_point}


def _cast_on_device(module: nn.Module, dtype: torch.dtype | None, registered: dict[int, torch.dtype]) -> None:
    """Cast device-resident floating parameters in place (their storage is the only copy) to
    the use's dtype, or with dtype None back to the dtype each was registered in."""
    for param in module.parameters():
        want = dtype or registered.get(id(param))  # not registered: streamed, or not floating
        if id(param) in registered and param.dtype != want:
            param.data = param.data.to(want)


def _check_one_block(component: str, part: str, params: list[nn.Parameter], if_empty: str) -> None:
    """What WeightBlock needs of its parameters (some, all of one dtype), checked before any
    component is attached, naming the component and the part of it that would be one block."""
    dtypes = sorted({str(p.dtype) for p in params})
    if not dtypes:
        raise ValueError(f"component {component!r}: {part} has no parameters to move; {if_empty}")
    if len(dtypes) > 1:
        raise ValueError(f"component {component!r}: {part} moves as one block of one dtype but holds "
                         f"{' and '.join(dtypes)}; cast the component to one dtype first (module.to(dtype))")


def _set_buffer(module: nn.Module, dotted: str, value: torch.Tensor) -> None:
    *path, last = dotted.split(".")
    module.get_submodule(".".join(path))._buffers[last] = value


def _buffers_to(module: nn.Module, device: torch.device) -> None:
    for dotted, buf in module.named_buffers():
        _set_buffer(module, dotted, buf.to(device))


def cast_buffers(component: ComponentState, dtype: torch.dtype | None) -> None:
    """The component's floating buffers (on the device for every strategy) in `dtype`, or with
    None in the dtypes they were registered in (`component.buffer_dtypes`): a use's dtype
    must reach them too, or a BatchNorm's statistics or a position table meet the weights
    in another dtype. Runs at every use: walks the module only when the dtype changes."""
    if not component.buffer_dtypes or component.buffers_cast_to == dtype:
        return
    for dotted, buf in component.module.named_buffers():
        registered = component.buffer_dtypes.get(dotted)
        if registered is not None and buf.dtype != (dtype or registered):
            _set_buffer(component.module, dotted, buf.to(dtype or registered))
    component.buffers_cast_to = dtype


class ResidentStrategy(ResidencyStrategy):
    """Stays on the device. A use's dtype casts it in place (narrowing loses precision); a use
    with none, and close, cast it back to the dtypes it was registered in."""

    def __init__(self) -> None:
        self.registered: dict[int, torch.dtype] = {}

    def attach(self, manager: StrategyHost, component: ComponentState) -> None:
        self.registered = _floating_dtypes(component.module)
        component.module.to(manager.device)

    def load(self, manager: StrategyHost, component: ComponentState, stream: Any | None) -> int:
        _cast_on_device(component.module, component.dtype, self.registered)
        return 0

    def detach(self, manager: StrategyHost, component: ComponentState) -> None:
        _cast_on_device(component.module, None, self.registered)
        super().detach(manager, component)
        self.registered = {}


class OffloadStrategy(ResidencyStrategy):
    """The whole module moves host <-> device through one pinned buffer (buffers stay on the device;
    on it the parameters are packed by allocator granule, see WeightBlock)."""

    prefetchable = True
    keepable = True

    def __init__(self) -> None:
        self.block: WeightBlock | None = None

    def check(self, component: ComponentState) -> None:
        _check_one_block(component.name, "the offloaded module", list(component.module.parameters()),
                         "leave it resident")

    def attach(self, manager: StrategyHost, component: ComponentState) -> None:
        _buffers_to(component.module, manager.device)
        self.block = WeightBlock(list(component.module.parameters()), manager.platform, manager.device)

    def load(self, manager: StrategyHost, component: ComponentState, stream: Any | None) -> int:
        assert self.block is not None  # attached
        want = component.dtype or self.block.dtype
        if self.block.on_device and self.block.device_dtype == want:
            return 0
        self.block.release()  # loaded in another dtype (e.g. prepared before this request's uses were known)
        self.block.load(stream, dtype=want)
        return self.block.nbytes

    def wait(self, manager: StrategyHost, component: ComponentState) -> bool:
        return self.block is not None and self.block.wait()

    def release(self, manager: StrategyHost, component: ComponentState) -> int:
        return 0 if self.block is None else self.block.release()

    def on_device(self, component: ComponentState) -> bool:
        return self.block is not None and self.block.on_device

    def copied_bytes(self) -> int | None:
        return 0 if self.block is None else self.block.copied_bytes

    def detach(self, manager: StrategyHost, component: ComponentState) -> None:
        super().detach(manager, component)  # the block may not exist: attach failed before it was made
        self.block = None


def attribute_path(module: nn.Module, dotted: str) -> Any:
    """`module.a.b.c` for "a.b.c", or None where a part is missing."""
    owner: Any = module
    for part in dotted.split("."):
        owner = getattr(owner, part, None)
    return owner


class LayerwiseStrategy(ResidencyStrategy):
    """One or more layer stacks streamed block by block; the other weights stay or follow the uses.

    `layers_attr` names the nn.ModuleList(s) to stream (dotted paths allowed), in the
    order they run: e.g. ("transformer_blocks", "single_transformer_blocks"). A hook
    before layer i waits for its copy (or loads it) and prefetches the next p layers on
    the side stream; a hook after layer i releases it.

    `buffers` says where a streamed layer lands on the device:
      - "ring" (default): a ring of p + 1 device buffers, each the size of the largest
        layer, kept while the run of uses lasts; no allocator traffic per layer, so it
        pays off for a component run many times a request (a denoiser).
      - "exact": each layer its own device storage from the caching allocator, given back
        when the layer is released; the device holds only the layers in flight, at their
        own sizes (blocks of very different sizes, a component run once a request), packed
        by granule (WeightBlock: one head of whole allocator granules, not rounded, and own
        tensors for the parameters that do not fit).
    `rest` says where the weights outside the streamed layers live:
      - "resident" (default): on the device from registration on.
      - "on_call": each submodule outside the layers is copied in when it is first called
        in a run of uses, and leaves with the layers at the release; a submodule never
        called (a VAE's encoder while decoding) never reaches the device. Weights owned
        directly by a module that contains streamed layers load at the start of the use.
    """

    MODES = {
        "buffers": {"ring": "p + 1 buffers of the largest layer, kept",
                    "exact": "each layer at its own size, given back at its release"},
        "rest": {"resident": "non-layer weights stay on the device",
                 "on_call": "each non-layer submodule loads when called, leaves at the release"},
    }

    def __init__(self, prefetch_layers: int = 1, layers_attr: str | Sequence[str] = "layers", *,
                 buffers: str = "ring", rest: str = "resident") -> None:
        layers_ahead = as_index(prefetch_layers)
        if layers_ahead is None:
            raise ValueError(f"prefetch_layers must be an int (layers copied ahead of the running one), "
                             f"got {prefetch_layers!r}; use e.g. prefetch_layers=1")
        if layers_ahead < 0:
            raise ValueError(f"prefetch_layers {layers_ahead} must be >= 0 (0: load each layer when it runs)")
        names = (layers_attr,) if isinstance(layers_attr, str) else (
            tuple(layers_attr) if isinstance(layers_attr, Sequence) else ())
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"layers_attr must name the nn.ModuleList(s) to stream (a str or a sequence of str), "
                             f"got {layers_attr!r}")
        for mode, value in (("buffers", buffers), ("rest", rest)):
            if not (isinstance(value, str) and value in self.MODES[mode]):
                choices = " or ".join(f"{name!r} ({what})" for name, what in self.MODES[mode].items())
                raise ValueError(f"{mode}={value!r}: use {choices}")
        self.prefetch_layers, self.layers_attr = layers_ahead, names
        self.buffers, self.rest = buffers, rest
        self._unattached()

    def _unattached(self) -> None:
        """The state of a strategy serving no component (made, detached)."""
        self.blocks: list[WeightBlock] = []  # one per streamed layer, in run order
        self.ring: list[torch.Tensor] = []  # buffers="ring": p + 1 reusable device buffers while in use
        self.slot_layers: list[int | None] = []  # the layer whose weights each ring slot holds
        #: rest="on_call": (dotted name, its blocks) per non-layer submodule; "" holds the weights
        #: owned directly by modules that contain layers (loaded at the start of a use)
        self.rest_blocks: dict[str, list[WeightBlock]] = {}
        self.released_bytes = 0  # bytes streamed out since the run of uses began
        self.hooks: list[Any] = []
        #: rest="resident": the non-layer weights' registered dtypes (uses cast them in place)
        self.registered: dict[int, torch.dtype] = {}

    def _find_layers(self, component: ComponentState) -> list[nn.Module]:
        layers: list[nn.Module] = []
        for name in self.layers_attr:
            stack = attribute_path(component.module, name)
            if not isinstance(stack, nn.ModuleList) or len(stack) == 0:
                raise ValueError(f"component {component.name!r} is layerwise but has no non-empty nn.ModuleList "
                                 f"{name!r}; name its layer list(s) with layers_attr")
            layers.extend(stack)
        return layers

    def check(self, component: ComponentState) -> None:
        layers = self._find_layers(component)
        if self.prefetch_layers >= len(layers):
            raise ValueError(
                f"prefetch_layers={self.prefetch_layers} for {component.name!r}, which streams {len(layers)} layers: "
                f"at most {len(layers) - 1} can be ahead of a running one (each costs a device buffer of one "
                f"layer); use prefetch_layers <= {len(layers) - 1}")
        holder: dict[int, int] = {}  # parameter id -> the first streamed layer holding it
        for index, layer in enumerate(layers):
            params = list(layer.parameters())
            _check_one_block(component.name, f"streamed layer {index}", params,
                             "name only layer lists whose layers hold weights (layers_attr)")
            first = next((holder[id(p)] for p in params if id(p) in holder), None)
            if first is not None:  # two blocks would stream one weight into two buffers, racing
                raise ValueError(
                    f"component {component.name!r}: streamed layers {first} and {index} hold the same weights "
                    f"(layers_attr={self.layers_attr!r} names a layer twice, a list inside another, or a list that "
                    "repeats one layer); name each layer once, or keep a component whose layers share weights "
                    "resident or offloaded")
            holder.update(dict.fromkeys(map(id, params), index))

    def attach(self, manager: StrategyHost, component: ComponentState) -> None:
        module = component.module
        layers = self._find_layers(component)
        layer_params = {id(p) for layer in layers for p in layer.parameters()}
        if self.rest == "on_call":
            self.rest_blocks = _rest_groups(module, layers, layer_params, manager)
        else:
            self.registered = _floating_dtypes(module, skip=frozenset(layer_params))
            for p in module.parameters():  # non-layer parameters stay resident
                if id(p) not in layer_params:
                    p.data = p.data.to(manager.device)
        _buffers_to(module, manager.device)
        self.blocks = [WeightBlock(list(layer.parameters()), manager.platform, manager.device) for layer in layers]
        for index, layer in enumerate(layers):
            self.hooks.append(layer.register_forward_pre_hook(self._before_layer(manager, component, index)))
            self.hooks.append(layer.register_forward_hook(self._after_layer(index)))
        for name in filter(None, self.rest_blocks):
            owner = attribute_path(module, name)
            self.hooks.append(owner.register_forward_pre_hook(self._before_rest(manager, component, name)))

    def load(self, manager: StrategyHost, component: ComponentState, stream: Any | None) -> int:
        if self.rest == "on_call":  # only the weights no submodule call would bring in
            return self._load_rest(manager, component, "")
        _cast_on_device(component.module, component.dtype, self.registered)  # layers: not registered
        return 0  # layers stream in as they run

    def release(self, manager: StrategyHost, component: ComponentState) -> int:
        rest = sum(block.release() for blocks in self.rest_blocks.values() for block in blocks)
        released = self.released_bytes + rest + sum(block.release() for block in self.blocks)
        self.released_bytes = 0
        self.ring, self.slot_layers = [], []  # the next use is another component: give the ring back
        return released

    def on_device(self, component: ComponentState) -> bool:
        return bool(self.blocks) and all(b.on_device for b in self.blocks)

    def copied_bytes(self) -> int | None:
        rest = sum(block.copied_bytes for blocks in self.rest_blocks.values() for block in blocks)
        return rest + sum(block.copied_bytes for block in self.blocks)

    def detach(self, manager: StrategyHost, component: ComponentState) -> None:
        for handle in self.hooks:
            handle.remove()
        _cast_on_device(component.module, None, self.registered)  # rest="resident": back as registered
        super().detach(manager, component)  # releases what attach made, however far it got
        self._unattached()

    def _load_rest(self, manager: StrategyHost, component: ComponentState, name: str) -> int:
        moved = 0
        for block in self.rest_blocks.get(name, ()):
            if block.on_device and block.device_dtype != (component.dtype or block.dtype):
                self.released_bytes += block.release()  # loaded for a use in another dtype
            if not block.on_device:
                block.load(None, None, component.dtype)
                moved += block.nbytes
        if moved and name:
            manager.event("prepare", component.name, part=name, nbytes=moved)
        return moved

    def _before_rest(self, manager: StrategyHost, component: ComponentState, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._load_rest(manager, component, name)

        return hook

    def _before_layer(self, manager: StrategyHost, component: ComponentState, index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            block = self.blocks[index]
            if not block.on_device:
                block.load(None, self._slot(component.dtype, index), component.dtype)
                manager.event("prepare", component.name, layer=index, nbytes=block.nbytes)
            elif block.wait():
                manager.event("wait", component.name, layer=index)
            for ahead in range(index + 1, min(index + 1 + self.prefetch_layers, len(self.blocks))):
                if not self.blocks[ahead].on_device:
                    self.blocks[ahead].load(manager.side_stream, self._slot(component.dtype, ahead), component.dtype)

        return hook

    def _slot(self, dtype: torch.dtype | None, index: int) -> torch.Tensor | None:
        """buffers="ring": layer `index` streams into ring slot index % (p + 1): with layer i
        running and p layers ahead in flight, the slot of layer i - 1 (already released) is
        the free one. buffers="exact": None, the block allocates its own packed storage."""
        if self.buffers == "exact":
            return None
        dtype = dtype or self.blocks[0].dtype
        if not self.ring or self.ring[0].dtype != dtype:
            numel, device = max(b.numel for b in self.blocks), self.blocks[0].device
            self.ring = [torch.empty(numel, dtype=dtype, device=device) for _ in range(self.prefetch_layers + 1)]
            self.slot_layers = [None] * len(self.ring)
        slot = index % len(self.ring)
        holder = self.slot_layers[slot]
        if holder is not None and holder != index:
            # A layer the forward skipped (diffusers' skip_layers, say) ran no after-hook and
            # still points at this slot: release it before another layer's weights overwrite it.
            self.released_bytes += self.blocks[holder].release()
        self.slot_layers[slot] = index
        return self.ring[slot]

    def _after_layer(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.released_bytes += self.blocks[index].release()

        return hook


def _rest_groups(module: nn.Module, layers: list[nn.Module], layer_params: set[int],
                 manager: StrategyHost) -> dict[str, list[WeightBlock]]:
    """Blocks of the weights outside the streamed layers, one group per submodule that holds
    no layer (keyed by its dotted name), and "" for weights owned by modules that hold layers;
    a group's parameters of each dtype make one block."""
    layer_ids = {id(layer) for layer in layers}
    holders = {id(m) for m in module.modules() if any(id(sub) in layer_ids for sub in m.modules())}
    seen = set(layer_params)  # a tied weight belongs to the first group that names it
    groups: dict[str, dict[torch.dtype, list[nn.Parameter]]] = {}

    def take(key: str, params: Any) -> None:
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                groups.setdefault(key, {}).setdefault(p.dtype, []).append(p)

    def walk(owner: nn.Module, prefix: str) -> None:
        take("", owner.parameters(recurse=False))
        for name, child in owner.named_children():
            if id(child) in layer_ids:
                continue
            if id(child) in holders:
                walk(child, f"{prefix}{name}.")
            else:
                take(f"{prefix}{name}", child.parameters())

    walk(module, "")
    return {key: [WeightBlock(ps, manager.platform, manager.device) for ps in by_dtype.values()]
            for key, by_dtype in groups.items()}


_BUILTIN: dict[Strategy, type[ResidencyStrategy]] = {
    Strategy.RESIDENT: ResidentStrategy,
    Strategy.OFFLOAD: OffloadStrategy,
    Strategy.LAYERWISE: LayerwiseStrategy,
}


def strategy_for(name: str, placement: ResidencyStrategy | Strategy | str) -> ResidencyStrategy:
    """The strategy object for one component: an instance as given, or a new built-in by name."""
    if isinstance(placement, ResidencyStrategy):
        return placement
    builtin = next((cls for key, cls in _BUILTIN.items() if placement == key), None)  # a name or the enum
    if builtin is None:
        raise ValueError(f"component {name!r}: unknown strategy {placement!r}; use one of "
                         f"{', '.join(s.value for s in Strategy)} or a ResidencyStrategy instance")
    return builtin()
