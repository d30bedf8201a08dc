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
from typing import Any

import torch
from torch import nn

from torchhal.platforms import Platform, ReleasePoint, current_platform


class Strategy(str, enum.Enum):
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
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class Stage:
    name: str
    uses: tuple[ComponentUse, ...]


@dataclass(frozen=True)
class Placement:
    strategy: Strategy = Strategy.RESIDENT
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
        return self.numel * self.host.element_size()

    @property
    def on_device(self) -> bool:
        return self.device_buffer is not None

    def _views(self, flat: torch.Tensor, copy_from_params: bool) -> None:
        offset = 0
        for p in self.params:
            view = flat[offset : offset + p.numel()].view_as(p)
            if copy_from_params:
                view.copy_(p.data)
            p.data = view
            offset += p.numel()

    def load(self, stream: Any | None, into: torch.Tensor | None = None) -> None:
        """Copy to the device; on `stream` with an event when given (prefetch), else in order.

        `into` is a device buffer to reuse (a layerwise ring slot); else one is allocated.
        """
        if self.device_buffer is not None:
            return
        compute = self.platform.current_stream(self.device.index)
        # Allocated (or last used) in compute order, so waiting on compute makes it safe to overwrite.
        if into is None:
            into = torch.empty(self.numel, dtype=self.dtype, device=self.device)
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

    def release(self) -> bool:
        """Point the parameters back at host memory and drop the device copy."""
        if self.device_buffer is None:
            return False
        self._views(self.host, copy_from_params=False)
        self.device_buffer, self.ready = None, None
        return True


@dataclass
class _Component:
    name: str
    module: nn.Module
    placement: Placement
    blocks: list[WeightBlock] = field(default_factory=list)  # offload: 1; layerwise: one per layer
    ring: list[torch.Tensor] = field(default_factory=list)  # layerwise: p + 1 reusable device buffers
    layer_releases: int = 0
    hooks: list[Any] = field(default_factory=list)  # layerwise: removed by close()

    @property
    def on_device(self) -> bool:
        return self.placement.strategy is Strategy.RESIDENT or all(b.on_device for b in self.blocks)

    @property
    def device_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks if b.on_device)


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
        self.components: dict[str, _Component] = {}
        for name, module in components.items():
            raw = placements.get(name, Strategy.RESIDENT)
            placement = raw if isinstance(raw, Placement) else Placement(Strategy(raw))
            self.components[name] = self._register(name, module, placement)
        self._timeline: list[ComponentUse] = []
        self._cursor = 0
        self._prefetched = False
        self._warmup = False
        self._in_request = False
        self._closed = False
        self._active: ComponentUse | None = None

    # -- registration -------------------------------------------------------------------
    def _register(self, name: str, module: nn.Module, placement: Placement) -> _Component:
        component = _Component(name, module.eval(), placement)
        if placement.strategy is Strategy.RESIDENT:
            module.to(self.device)
            return component
        if placement.strategy is Strategy.OFFLOAD:
            for buf_name, buf in module.named_buffers():
                _set_buffer(module, buf_name, buf.to(self.device))
            component.blocks = [WeightBlock(list(module.parameters()), self.platform, self.device)]
            return component
        layers = getattr(module, placement.layers_attr, None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise ValueError(
                f"component {name!r} is layerwise but has no non-empty nn.ModuleList {placement.layers_attr!r}"
            )
        if placement.prefetch_layers < 0:
            raise ValueError(f"prefetch_layers {placement.prefetch_layers} must be >= 0")
        layer_params = {id(p) for p in layers.parameters()}
        for p in module.parameters():  # non-layer parameters stay resident
            if id(p) not in layer_params:
                p.data = p.data.to(self.device)
        for buf_name, buf in module.named_buffers():
            _set_buffer(module, buf_name, buf.to(self.device))
        component.blocks = [WeightBlock(list(layer.parameters()), self.platform, self.device) for layer in layers]
        for index, layer in enumerate(layers):
            component.hooks.append(layer.register_forward_pre_hook(self._before_layer(component, index)))
            component.hooks.append(layer.register_forward_hook(self._after_layer(component, index)))
        return component

    def _before_layer(self, component: _Component, index: int):
        prefetch = component.placement.prefetch_layers

        def hook(module: nn.Module, args: Any) -> None:
            block = component.blocks[index]
            if block.on_device:
                if block.wait():
                    self._event("wait", component.name, layer=index)
            else:
                block.load(None, self._ring_slot(component, index))
                self._event("prepare", component.name, layer=index, nbytes=block.nbytes)
            for ahead in range(index + 1, min(index + 1 + prefetch, len(component.blocks))):
                if not component.blocks[ahead].on_device:
                    component.blocks[ahead].load(self.side_stream, self._ring_slot(component, ahead))
            return None

        return hook

    def _ring_slot(self, component: _Component, index: int) -> torch.Tensor:
        """Layer `index` streams into ring slot index % (p + 1): with layer i running and
        p layers ahead in flight, the slot of layer i - 1 (already released) is the free one."""
        if not component.ring:
            numel = max(b.numel for b in component.blocks)
            dtype = component.blocks[0].dtype
            slots = component.placement.prefetch_layers + 1
            component.ring = [torch.empty(numel, dtype=dtype, device=self.device) for _ in range(slots)]
        return component.ring[index % len(component.ring)]

    def _after_layer(self, component: _Component, index: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if component.blocks[index].release():
                component.layer_releases += 1
            return None

        return hook

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
        self._timeline, self._cursor, self._prefetched = timeline, 0, False
        self._warmup, self._in_request = warmup, True
        self._event("request_start", None, uses=len(timeline), warmup=warmup)

    def begin_use(self, component: str, phase: str | None = None) -> None:
        if not self._in_request:
            raise RuntimeError("begin_use outside a request; call begin_request(stages) first")
        use = self._expect(component, phase)
        state = self.components[component]
        if state.placement.strategy is Strategy.OFFLOAD:
            block = state.blocks[0]
            if block.on_device:
                if block.wait():
                    self._event("wait", component)
            else:
                block.load(None)
                self._note_moved(state, "host", str(self.device), block.nbytes)
                self._event("prepare", component, nbytes=block.nbytes)
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
            self._event("keep", component, why="needed by the next use")
            if self.empty_at_stage_boundaries:
                self._empty(where="stage_boundary")
            return
        released = False
        if state.placement.strategy is Strategy.OFFLOAD and not self._keep_after_warmup(use):
            released = self._release(state)
        if state.layer_releases:
            self._event("release", component, layers=state.layer_releases)
            released = True
            state.layer_releases = 0
            state.ring = []  # the next use is another component: give the ring back
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
            if state.placement.strategy is not Strategy.OFFLOAD:
                continue
            if name in preferred:
                if not state.on_device:
                    state.blocks[0].load(self.side_stream)
                    self._event("prefetch", name, why="preferred ready after request", nbytes=state.blocks[0].nbytes)
            elif name in kept:
                self._event("keep", name, why="keep_ready_after_warmup")
            elif state.on_device:
                released_any |= self._release(state)
        if released_any:
            self._empty(where="request_end")
        self._event("request_end", None)
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
            for block in state.blocks:
                block.release()
            state.ring, state.layer_releases = [], 0
            for handle in state.hooks:
                handle.remove()
            state.hooks = []
            state.module.to("cpu")  # resident weights, buffers and layerwise non-layer parameters
            self._event("release", state.name, why="close")
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
        self._event("stage", None, stage=name, seconds=time.perf_counter() - start,
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
            if use.allow_prefetch and state.placement.strategy is Strategy.OFFLOAD and not state.on_device:
                state.blocks[0].load(self.side_stream)
                self._note_moved(state, "host", str(self.device), state.blocks[0].nbytes)
                self._event("prefetch", use.component, nbytes=state.blocks[0].nbytes)
                self._prefetched = True
            return  # only the next memory-intensive use, once per request

    def _keep_after_warmup(self, use: ComponentUse) -> bool:
        return self._warmup and use.keep_ready_after_warmup

    def _release(self, state: _Component) -> bool:
        nbytes = state.device_bytes
        if not state.blocks[0].release():
            return False
        self._note_moved(state, str(self.device), "host", nbytes)
        self._event("release", state.name, nbytes=nbytes)
        return True

    def _abandon(self) -> None:
        """Leave a consistent state after a failed request: non-resident weights go home."""
        for state in self.components.values():
            for block in state.blocks:
                block.release()
            state.ring = []
        self._active, self._in_request, self._timeline = None, False, []

    def _handle_oom(self, error: BaseException) -> None:
        self.platform.report_out_of_memory(error, "residency request", self.device_index)
        self._event("oom", None, error=str(error)[:200])
        self._abandon()
        self._empty(where="oom", reason=ReleasePoint.OOM)

    def _empty(self, where: str, reason: ReleasePoint = ReleasePoint.COMPONENT_RELEASE) -> int | None:
        released = self.platform.empty_cache(reason, self.device_index)
        self._event("empty_cache", None, reason=reason.value, where=where, bytes_released=released)
        return released

    def _note_moved(self, state: _Component, source: str, destination: str, nbytes: int) -> None:
        self.platform.notify_component_moved(state.name, source, destination, nbytes)

    def _event(self, kind: str, component: str | None, **fields: Any) -> None:
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
