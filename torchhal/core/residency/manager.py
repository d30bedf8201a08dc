"""Component residency manager with explicit cache release points.

Pipelines declare which components each stage uses; the manager decides what
sits on the device, moves weights (whole modules or layer by layer) through
pinned host buffers on a side stream, and empties the device cache only where
memory was actually given back: after a memory-intensive component left the
device or a layerwise release happened (ReleasePoint.COMPONENT_RELEASE), and
after an out-of-memory error (ReleasePoint.OOM). Never at stage boundaries,
never inside a memory query.
"""

from __future__ import annotations

import contextlib
import enum
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from torchhal.platforms import Platform, ReleasePoint, current_platform


class Strategy(str, enum.Enum):
    """Names of the built-in strategies (a Placement also takes a ResidencyStrategy)."""

    RESIDENT = "resident"
    OFFLOAD = "offload"
    LAYERWISE = "layerwise"


@dataclass(frozen=True)
class ComponentUse:
    component: str
    phase: str | None = None
    memory_intensive: bool = False
    allow_prefetch: bool = True
    keep_ready_after_warmup: bool = False
    preferred_ready_after_request: bool = False
    #: dtype of the component's device weights during this use (None: as registered)
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class Stage:
    name: str
    uses: tuple[ComponentUse, ...]


@dataclass(frozen=True)
class Placement:
    strategy: Strategy | ResidencyStrategy = Strategy.RESIDENT
    prefetch_layers: int = 1  # layerwise: layers copied ahead of the one running
    layers_attr: str = "layers"  # layerwise: the nn.ModuleList to stream


class RequestFailed(RuntimeError):
    """A request ended by an error at the request boundary; the manager stays consistent."""


class WeightBlock:
    """Parameters consolidated into one pinned host buffer; loaded into one device buffer."""

    def __init__(self, params: list[nn.Parameter], platform: Platform, device: torch.device) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            found = sorted(map(str, dtypes))
            raise ValueError(f"a weight block needs one dtype, got {found}; cast the component first")
        self.params, self.platform, self.device = params, platform, device
        self.numel = sum(p.numel() for p in params)
        self.dtype = params[0].dtype
        host = torch.empty(self.numel, dtype=self.dtype)
        self._views(host, copy_from_params=True)
        self.host = platform.pin_memory(host)
        self._views(self.host, copy_from_params=False)
        self.device_buffer: torch.Tensor | None = None
        self.ready: Any = None  # event recorded after the copy, or None when loaded synchronously

    @property
    def nbytes(self) -> int:
        """Bytes of the device copy while loaded, else of the host copy."""
        source = self.device_buffer if self.device_buffer is not None else self.host
        return self.numel * source.element_size()

    @property
    def on_device(self) -> bool:
        return self.device_buffer is not None

    @property
    def device_dtype(self) -> torch.dtype | None:
        return None if self.device_buffer is None else self.device_buffer.dtype

    def _views(self, flat: torch.Tensor, copy_from_params: bool) -> None:
        offset = 0
        for p in self.params:
            view = flat[offset : offset + p.numel()].view_as(p)
            if copy_from_params:
                view.copy_(p.data)
            p.data = view
            offset += p.numel()

    def load(self, stream: Any | None, into: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> None:
        """Copy to the device (converting to `dtype` when given); on `stream` with an event
        when given (prefetch), else in order. The host copy keeps its dtype, so a converted
        use never loses precision for the next one.

        `into` is a device buffer of that dtype to reuse (a layerwise ring slot); else one is allocated.
        """
        if self.device_buffer is not None:
            return
        dtype = dtype or self.dtype
        compute = self.platform.current_stream(self.device.index)
        # Allocated (or last used) in compute order, so waiting on compute makes it safe to overwrite.
        if into is None:
            into = torch.empty(self.numel, dtype=dtype, device=self.device)
        buffer = into[: self.numel]
        if stream is None:
            buffer.copy_(self.host, non_blocking=True)
            self.ready = None
        else:
            stream.wait_stream(compute)  # the block may still be read by queued compute work
            with self.platform.use_stream(stream):
                buffer.copy_(self.host, non_blocking=True)
                self.ready = self.platform.new_event()
                self.ready.record(stream)
        self.device_buffer = buffer
        self._views(buffer, copy_from_params=False)

    def wait(self) -> bool:
        """Make compute wait for a prefetch; True if there was one to wait for."""
        if self.ready is None:
            return False
        self.ready.wait(self.platform.current_stream(self.device.index))
        self.ready = None
        return True

    def release(self) -> int:
        """Point the parameters back at host memory and drop the device copy; bytes dropped."""
        if self.device_buffer is None:
            return 0
        nbytes = self.nbytes
        self._views(self.host, copy_from_params=False)
        self.device_buffer, self.ready = None, None
        return nbytes


@dataclass
class ComponentState:
    """One registered component and what its strategy keeps for it."""

    name: str
    module: nn.Module
    placement: Placement
    strategy: ResidencyStrategy
    blocks: list[WeightBlock] = field(default_factory=list)  # offload: 1; layerwise: one per layer
    ring: list[torch.Tensor] = field(default_factory=list)  # layerwise: p + 1 reusable device buffers
    released_bytes: int = 0  # layerwise: bytes streamed out since the run of uses began
    hooks: list[Any] = field(default_factory=list)  # removed by close()
    dtype: torch.dtype | None = None  # the device dtype the current use asked for

    @property
    def on_device(self) -> bool:
        return self.strategy.on_device(self)


class ResidencyStrategy:
    """How one component's weights reach the device and leave it.

    The manager decides *when* (uses, keep rules, prefetch, release points, empties);
    a strategy decides *how*. To add one, subclass this and pass an instance as
    `Placement(strategy=...)`. Per-component state lives on the ComponentState.
    """

    #: The whole weights can be loaded ahead of a use on the side stream.
    prefetchable: ClassVar[bool] = False
    #: Between uses the component holds a whole device copy that keep rules may keep.
    keepable: ClassVar[bool] = False

    def attach(self, manager: ResidencyManager, component: ComponentState) -> None:
        """At registration: place what stays on the device, set up host copies and hooks."""

    def load(self, manager: ResidencyManager, component: ComponentState, stream: Any | None) -> int:
        """Make the component ready for a use in `component.dtype` (`stream`: a prefetch on
        the side stream; None: now, in compute order). Bytes moved to the device."""
        return 0

    def wait(self, manager: ResidencyManager, component: ComponentState) -> bool:
        """Make compute wait for a prefetch of this component; True if there was one."""
        return False

    def release(self, manager: ResidencyManager, component: ComponentState) -> int:
        """The run of uses is over: give device memory back. Bytes that left the device."""
        return 0

    def on_device(self, component: ComponentState) -> bool:
        return True

    def detach(self, manager: ResidencyManager, component: ComponentState) -> None:
        """close(): everything back to host memory, hooks removed."""
        self.release(manager, component)
        for handle in component.hooks:
            handle.remove()
        component.hooks = []
        component.module.to("cpu")


def _cast_on_device(module: nn.Module, dtype: torch.dtype | None, skip: frozenset[int] = frozenset()) -> None:
    """Cast device-resident floating parameters in place (their storage is the only copy)."""
    if dtype is None:
        return
    for param in module.parameters():
        if id(param) not in skip and param.dtype.is_floating_point and param.dtype != dtype:
            param.data = param.data.to(dtype)


class ResidentStrategy(ResidencyStrategy):
    """Stays on the device. A use's dtype casts it in place (narrowing loses precision)."""

    def attach(self, manager: ResidencyManager, component: ComponentState) -> None:
        component.module.to(manager.device)

    def load(self, manager: ResidencyManager, component: ComponentState, stream: Any | None) -> int:
        _cast_on_device(component.module, component.dtype)
        return 0


class OffloadStrategy(ResidencyStrategy):
    """The whole module moves host <-> device through one pinned buffer."""

    prefetchable = True
    keepable = True

    def attach(self, manager: ResidencyManager, component: ComponentState) -> None:
        module = component.module
        for buf_name, buf in module.named_buffers():
            _set_buffer(module, buf_name, buf.to(manager.device))
        component.blocks = [WeightBlock(list(module.parameters()), manager.platform, manager.device)]

    def load(self, manager: ResidencyManager, component: ComponentState, stream: Any | None) -> int:
        block = component.blocks[0]
        want = component.dtype or block.dtype
        if block.on_device and block.device_dtype == want:
            return 0
        block.release()  # loaded in another dtype (e.g. prepared before this request's uses were known)
        block.load(stream, dtype=want)
        return block.nbytes

    def wait(self, manager: ResidencyManager, component: ComponentState) -> bool:
        return component.blocks[0].wait()

    def release(self, manager: ResidencyManager, component: ComponentState) -> int:
        return component.blocks[0].release()

    def on_device(self, component: ComponentState) -> bool:
        return component.blocks[0].on_device


class LayerwiseStrategy(ResidencyStrategy):
    """A layer stack streamed through a ring of p + 1 device buffers; other weights stay.

    A hook before layer i waits for its copy (or loads it) and prefetches the next p
    layers on the side stream; a hook after layer i releases it.
    """

    def attach(self, manager: ResidencyManager, component: ComponentState) -> None:
        module, placement = component.module, component.placement
        layers = getattr(module, placement.layers_attr, None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise ValueError(
                f"component {component.name!r} is layerwise but has no non-empty nn.ModuleList "
                f"{placement.layers_attr!r}"
            )
        if placement.prefetch_layers < 0:
            raise ValueError(f"prefetch_layers {placement.prefetch_layers} must be >= 0")
        layer_params = {id(p) for p in layers.parameters()}
        for p in module.parameters():  # non-layer parameters stay resident
            if id(p) not in layer_params:
                p.data = p.data.to(manager.device)
        for buf_name, buf in module.named_buffers():
            _set_buffer(module, buf_name, buf.to(manager.device))
        component.blocks = [WeightBlock(list(layer.parameters()), manager.platform, manager.device) for layer in layers]
        for index, layer in enumerate(layers):
            component.hooks.append(layer.register_forward_pre_hook(self._before_layer(manager, component, index)))
            component.hooks.append(layer.register_forward_hook(self._after_layer(component, index)))

    def load(self, manager: ResidencyManager, component: ComponentState, stream: Any | None) -> int:
        layers = getattr(component.module, component.placement.layers_attr)
        _cast_on_device(component.module, component.dtype, skip=frozenset(id(p) for p in layers.parameters()))
        return 0  # layers stream in as they run

    def release(self, manager: ResidencyManager, component: ComponentState) -> int:
        released = component.released_bytes + sum(block.release() for block in component.blocks)
        component.released_bytes = 0
        component.ring = []  # the next use is another component: give the ring back
        return released

    def on_device(self, component: ComponentState) -> bool:
        return all(b.on_device for b in component.blocks)

    def _before_layer(self, manager: ResidencyManager, component: ComponentState, index: int) -> Any:
        prefetch = component.placement.prefetch_layers

        def hook(module: nn.Module, args: Any) -> None:
            block = component.blocks[index]
            if block.on_device:
                if block.wait():
                    manager.event("wait", component.name, layer=index)
            else:
                block.load(None, self._ring_slot(component, index), component.dtype)
                manager.event("prepare", component.name, layer=index, nbytes=block.nbytes)
            for ahead in range(index + 1, min(index + 1 + prefetch, len(component.blocks))):
                if not component.blocks[ahead].on_device:
                    component.blocks[ahead].load(manager.side_stream, self._ring_slot(component, ahead),
                                                 component.dtype)
            return None

        return hook

    @staticmethod
    def _ring_slot(component: ComponentState, index: int) -> torch.Tensor:
        """Layer `index` streams into ring slot index % (p + 1): with layer i running and
        p layers ahead in flight, the slot of layer i - 1 (already released) is the free one."""
        dtype = component.dtype or component.blocks[0].dtype
        if not component.ring or component.ring[0].dtype != dtype:
            numel = max(b.numel for b in component.blocks)
            device = component.blocks[0].device
            slots = component.placement.prefetch_layers + 1
            component.ring = [torch.empty(numel, dtype=dtype, device=device) for _ in range(slots)]
        return component.ring[index % len(component.ring)]

    @staticmethod
    def _after_layer(component: ComponentState, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            component.released_bytes += component.blocks[index].release()
            return None

        return hook


BUILTIN_STRATEGIES: dict[Strategy, ResidencyStrategy] = {
    Strategy.RESIDENT: ResidentStrategy(),
    Strategy.OFFLOAD: OffloadStrategy(),
    Strategy.LAYERWISE: LayerwiseStrategy(),
}


def _resolve(name: str, raw: Placement | Strategy | ResidencyStrategy | str) -> tuple[Placement, ResidencyStrategy]:
    """A component's placement and the strategy object that carries it out."""
    placement = raw if isinstance(raw, Placement) else Placement(raw)  # type: ignore[arg-type]
    if isinstance(placement.strategy, ResidencyStrategy):
        return placement, placement.strategy
    try:
        return placement, BUILTIN_STRATEGIES[Strategy(placement.strategy)]
    except ValueError:
        names = ", ".join(s.value for s in Strategy)
        raise ValueError(
            f"component {name!r}: unknown strategy {placement.strategy!r}; "
            f"use one of {names} or a ResidencyStrategy instance"
        ) from None


class ResidencyManager:
    def __init__(
        self,
        components: dict[str, nn.Module],
        placements: dict[str, Placement | Strategy | str],
        platform: Platform | None = None,
        device_index: int | None = None,
        *,
        empty_at_stage_boundaries: bool = False,
        record_trace: bool = True,
        log: Any = None,
    ) -> None:
        """`empty_at_stage_boundaries=True` reproduces the old habit (for benchmarks only).

        Events go to `self.trace` (when `record_trace`), to `log` as one JSON line each
        (when given), and to `torchhal_engine_event` observers; with none of the three
        no event is built at all.
        """
        unknown = set(placements) - set(components)
        if unknown:
            raise ValueError(f"placements name unknown components {sorted(unknown)}; known: {sorted(components)}")
        self.platform = platform or current_platform()
        self.device_index = self.platform.current_device() if device_index is None else device_index
        self.device = self.platform.device(self.device_index)
        self.side_stream = self.platform.new_stream(self.device_index)
        self.empty_at_stage_boundaries = empty_at_stage_boundaries
        self.record_trace = record_trace
        self.log = log
        self.trace: list[dict[str, Any]] = []
        self.components: dict[str, ComponentState] = {}
        for name, module in components.items():
            placement, strategy = _resolve(name, placements.get(name, Strategy.RESIDENT))
            state = ComponentState(name, module.eval(), placement, strategy)
            strategy.attach(self, state)
            self.components[name] = state
        self._timeline: list[ComponentUse] = []
        self._cursor = 0
        self._prefetched = False
        self._warmup = False
        self._in_request = False
        self._closed = False
        self._active: ComponentUse | None = None

    # -- requests -------------------------------------------------------------------------
    @contextlib.contextmanager
    def request(self, stages: Sequence[Stage], warmup: bool = False) -> Iterator[None]:
        """Bracket one request. An OOM inside fails the request cleanly (RequestFailed)."""
        self.begin_request(stages, warmup)
        try:
            yield
        except BaseException as exc:
            if not self.platform.is_out_of_memory(exc):
                self._abandon()
                raise
            self._handle_oom(exc)
            raise RequestFailed(f"request failed: out of memory on {self.device}: {exc}") from exc
        self.finish_request()

    def begin_request(self, stages: Sequence[Stage], warmup: bool = False) -> None:
        if self._closed:
            raise RuntimeError("this ResidencyManager is closed; build a new one for more requests")
        if self._in_request:
            raise RuntimeError("a request is already running; call finish_request() first")
        known = set(self.components)
        timeline = [use for stage in stages for use in stage.uses]
        unknown = sorted({u.component for u in timeline} - known)
        if unknown:
            raise ValueError(f"stages use unknown components {unknown}; registered: {sorted(known)}")
        for use in timeline:
            if use.dtype is not None and not (isinstance(use.dtype, torch.dtype) and use.dtype.is_floating_point):
                raise ValueError(
                    f"the use of {use.component!r} declares dtype {use.dtype!r}; "
                    "a target dtype is a floating torch.dtype such as torch.bfloat16"
                )
        self._timeline, self._cursor, self._prefetched = timeline, 0, False
        self._warmup, self._in_request = warmup, True
        self.event("request_start", None, uses=len(timeline), warmup=warmup)

    def begin_use(self, component: str, phase: str | None = None) -> None:
        if not self._in_request:
            raise RuntimeError("begin_use outside a request; call begin_request(stages) first")
        use = self._expect(component, phase)
        state = self.components[component]
        state.dtype = use.dtype
        moved = state.strategy.load(self, state, None)
        if moved:
            self._note_moved(state, "host", str(self.device), moved)
            self.event("prepare", component, nbytes=moved)
        elif state.strategy.wait(self, state):
            self.event("wait", component)
        self._active = use
        self._maybe_prefetch()

    def end_use(self, component: str) -> None:
        use = self._active
        if use is None or use.component != component:
            raise RuntimeError(f"end_use({component!r}) without a matching begin_use")
        self._active = None
        self._cursor += 1
        state = self.components[component]
        following = self._timeline[self._cursor] if self._cursor < len(self._timeline) else None
        if following is not None and following.component == component:
            # The very next use needs it again: keep it, and keep the cache warm for
            # the layers streamed back in (their blocks are reused, not re-allocated).
            self.event("keep", component, why="needed by the next use")
            if self.empty_at_stage_boundaries:
                self._empty(where="stage_boundary")
            return
        if self._keep_after_warmup(use) and state.strategy.keepable:
            released = False
        else:
            released = self._release(state)
        if self.empty_at_stage_boundaries:
            self._empty(where="stage_boundary")
        elif released and use.memory_intensive:
            self._empty(where="component_release")

    @contextlib.contextmanager
    def use_component(self, component: str, phase: str | None = None) -> Iterator[nn.Module]:
        self.begin_use(component, phase)
        try:
            yield self.components[component].module
        finally:
            if self._active is not None:
                self.end_use(component)

    def finish_request(self) -> None:
        if not self._in_request:
            raise RuntimeError("finish_request without a request")
        preferred = {u.component for u in self._timeline if u.preferred_ready_after_request}
        kept = {u.component for u in self._timeline if self._keep_after_warmup(u)}
        released_any = False
        for name, state in self.components.items():
            if not state.strategy.keepable:
                continue
            if name in preferred:
                # in the dtype this request used it in: the best guess for the next one
                state.dtype = next(u.dtype for u in self._timeline if u.component == name)
                moved = state.strategy.load(self, state, self.side_stream)
                if moved:
                    self._note_moved(state, "host", str(self.device), moved)
                    self.event("prefetch", name, why="preferred ready after request", nbytes=moved)
            elif name in kept:
                self.event("keep", name, why="keep_ready_after_warmup")
            else:
                released_any |= self._release(state)
        if released_any:
            self._empty(where="request_end")
        self.event("request_end", None)
        self._in_request, self._timeline = False, []

    def close(self) -> int | None:
        """Give the device back: every component returns to host memory, the layerwise
        hooks are removed (the modules run as plain host modules again), and the cache
        is emptied once. Returns the bytes the empty released. Not during a request."""
        if self._in_request:
            raise RuntimeError("close() during a request; finish_request() first")
        if self._closed:
            return None
        for state in self.components.values():
            state.strategy.detach(self, state)
            self.event("release", state.name, why="close")
        self._closed = True
        return self._empty(where="close")

    # -- profiling --------------------------------------------------------------------------
    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Observe memory around a stage (memory_info only: changes nothing)."""
        before = self.platform.memory_info(self.device_index)
        start = time.perf_counter()
        yield
        after = self.platform.memory_info(self.device_index)
        self.event("stage", None, stage=name, seconds=time.perf_counter() - start,
                    reserved_before=before.reserved, reserved_after=after.reserved, used_after=after.used)

    def export_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.trace, f, indent=1)

    def plot_memory_timeline(self, path: str) -> None:
        """PNG of reserved memory over the trace, with every empty_cache marked (needs matplotlib)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t0 = self.trace[0]["t"] if self.trace else 0.0
        key = "reserved" if any(e.get("reserved") is not None for e in self.trace) else "used"
        points = [(e["t"] - t0, e[key] / 2**20) for e in self.trace if e.get(key) is not None]
        fig, ax = plt.subplots(figsize=(9, 3.5))
        ax.step([p[0] for p in points], [p[1] for p in points], where="post", label=f"{key} (MiB)")
        for event in self.trace:
            if event["kind"] == "empty_cache":
                ax.axvline(event["t"] - t0, color="red", alpha=0.5, linestyle="--")
        ax.set_xlabel("seconds")
        ax.set_ylabel("MiB")
        ax.set_title("device memory; red lines: empty_cache")
        ax.legend(loc="upper left")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)

    # -- internals -------------------------------------------------------------------------
    def _expect(self, component: str, phase: str | None) -> ComponentUse:
        if component not in self.components:
            raise ValueError(f"unknown component {component!r}; registered: {sorted(self.components)}")
        if self._active is not None:
            raise RuntimeError(f"begin_use({component!r}) while {self._active.component!r} is in use")
        if self._cursor >= len(self._timeline):
            raise RuntimeError(f"begin_use({component!r}) after the request's declared uses ran out")
        use = self._timeline[self._cursor]
        if use.component != component or (phase is not None and use.phase not in (None, phase)):
            raise RuntimeError(
                f"begin_use({component!r}, phase={phase!r}) but the declared next use is "
                f"{use.component!r} (phase {use.phase!r}); declare the stages in the order they run"
            )
        return use

    def _maybe_prefetch(self) -> None:
        if self._prefetched:
            return
        for use in self._timeline[self._cursor + 1 :]:
            state = self.components[use.component]
            if not use.memory_intensive or use.component == self._timeline[self._cursor].component:
                continue
            if use.allow_prefetch and state.strategy.prefetchable:
                state.dtype = use.dtype
                moved = state.strategy.load(self, state, self.side_stream)
                if moved:
                    self._note_moved(state, "host", str(self.device), moved)
                    self.event("prefetch", use.component, nbytes=moved)
                    self._prefetched = True
            return  # only the next memory-intensive use, once per request

    def _keep_after_warmup(self, use: ComponentUse) -> bool:
        return self._warmup and use.keep_ready_after_warmup

    def _release(self, state: ComponentState) -> bool:
        nbytes = state.strategy.release(self, state)
        if not nbytes:
            return False
        self._note_moved(state, str(self.device), "host", nbytes)
        self.event("release", state.name, nbytes=nbytes)
        return True

    def _abandon(self) -> None:
        """Leave a consistent state after a failed request: non-resident weights go home."""
        for state in self.components.values():
            state.strategy.release(self, state)
        self._active, self._in_request, self._timeline = None, False, []

    def _handle_oom(self, error: BaseException) -> None:
        self.platform.report_out_of_memory(error, "residency request", self.device_index)
        self.event("oom", None, error=str(error)[:200])
        self._abandon()
        self._empty(where="oom", reason=ReleasePoint.OOM)

    def _empty(self, where: str, reason: ReleasePoint = ReleasePoint.COMPONENT_RELEASE) -> int | None:
        released = self.platform.empty_cache(reason, self.device_index)
        self.event("empty_cache", None, reason=reason.value, where=where, bytes_released=released)
        return released

    def _note_moved(self, state: ComponentState, source: str, destination: str, nbytes: int) -> None:
        self.platform.notify_component_moved(state.name, source, destination, nbytes)

    def event(self, kind: str, component: str | None, **fields: Any) -> None:
        """Record one action (strategies report theirs here too): trace, log, observers."""
        if not (self.record_trace or self.log is not None or self.platform.traces_events):
            return
        event: dict[str, Any] = {"kind": kind, "t": time.monotonic(), "component": component, **fields}
        memory = self.platform.memory_info(self.device_index)
        event["reserved"], event["used"] = memory.reserved, memory.used
        if self.record_trace:
            self.trace.append(event)
        self.platform.emit_event(event)
        if self.log is not None:
            self.log.info("torchhal.residency %s", json.dumps(event, default=str))


def _set_buffer(module: nn.Module, dotted: str, value: torch.Tensor) -> None:
    owner = module
    *path, last = dotted.split(".")
    for part in path:
        owner = getattr(owner, part)
    owner._buffers[last] = value
