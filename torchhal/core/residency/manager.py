"""Component residency manager with explicit cache release points.

Pipelines declare which components each stage uses; the manager decides what
sits on the device and when it moves (the strategies decide how), and empties
the device cache only where memory was actually given back: after a
memory-intensive component left the device or a layerwise release happened
(ReleasePoint.COMPONENT_RELEASE; off with `empty_on_release=False`), and after an
out-of-memory error (ReleasePoint.OOM). Never between uses, never inside a memory query.

Every public method checks its arguments before it changes anything; what the
strategies are handed behind it has been checked.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from torchhal.core.devices import check_device_index, is_out_of_memory
from torchhal.core.residency.declarations import ComponentUse, RequestFailed, Stage, Strategy, UndeclaredUse
from torchhal.core.residency.strategies import (
    ComponentState,
    ResidencyStrategy,
    ResidentStrategy,
    cast_buffers,
    strategy_for,
)
from torchhal.core.residency.trace import ResidencyTrace
from torchhal.platforms import Platform, ReleasePoint, check_platform_argument, current_platform
from torchhal.values import check_bool

#: A component's placement: a built-in strategy's name, or a strategy object (one per component).
PlacementSpec = ResidencyStrategy | Strategy | str


def check_placements(placements: object) -> None:
    """`placements` is a dict (checked before anything reads it)."""
    if not isinstance(placements, Mapping):
        raise TypeError(
            f"placements must be a dict of component name -> strategy name or object, e.g. "
            f"{{'transformer': 'offload'}}, got {placements!r}; pass {{}} to keep every component resident"
        )


def _check_components(components: object, placements: Mapping[str, PlacementSpec]) -> dict[str, ResidencyStrategy]:
    """Each component's strategy object, once the components, their names and what their
    placements name are checked: nothing is attached yet."""
    if not isinstance(components, Mapping):
        raise TypeError(f"components must be a dict of component name -> nn.Module, e.g. {{'vae': vae}}, "
                        f"got a {type(components).__name__}")
    for name, module in components.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"component name {name!r} must be a non-empty str (uses name components by it)")
        if not isinstance(module, nn.Module):
            raise TypeError(f"component {name!r} is a {type(module).__name__}, not an nn.Module; "
                            "pass the module whose weights the manager should place")
        meta = next((n for n, p in module.named_parameters() if p.is_meta), None)
        if meta is not None:  # no data to place: every strategy's first copy would fail mid-attach
            raise ValueError(f"component {name!r} has {meta!r} on the meta device (no data); load its weights "
                             "before registering it (e.g. module.to_empty(device=...) and a state dict)")
    unknown = set(placements) - set(components)
    if unknown:
        raise ValueError(f"placements name unknown components {sorted(unknown)}; known: {sorted(components)}")
    strategies = {name: strategy_for(name, placements.get(name, Strategy.RESIDENT)) for name in components}
    owners: dict[int, str] = {}
    for name, strategy in strategies.items():
        owner = strategy.serving.name if strategy.serving is not None else owners.get(id(strategy))
        if owner is not None:
            raise ValueError(f"this {type(strategy).__name__} already serves a component; pass a new one for "
                             f"{name!r} (the same strategy object cannot keep the state of {owner!r} and {name!r})")
        owners[id(strategy)] = name
    _check_shared(components, strategies)
    return strategies


def _check_shared(components: Mapping[str, nn.Module], strategies: Mapping[str, ResidencyStrategy]) -> None:
    """A module or parameter held by two components must stay resident in both: a strategy
    that moves one component's weights (offload, layerwise, one of the user's) would move the
    other's under it. Shared and resident is fine (a controlnet built from its transformer's
    own blocks, as some diffusers pipelines do)."""
    owners: dict[int, tuple[str, str]] = {}  # id(parameter or module) -> (component, its name there)
    for name, module in components.items():
        for part, item in [("the module itself", module), *module.named_parameters()]:
            first = owners.setdefault(id(item), (name, part))
            moved = [n for n in (first[0], name) if not isinstance(strategies[n], ResidentStrategy)]
            if first[0] != name and moved:
                what = (f"are the same {type(module).__name__}" if part == "the module itself" else
                        f"share a parameter ({first[1]!r} of {first[0]!r}, {part!r} of {name!r})")
                movers = " and ".join(map(repr, moved))
                raise ValueError(f"components {first[0]!r} and {name!r} {what}, and {movers} would move it: a weight "
                                 f"two components hold must stay resident in both; leave {movers} resident, or pass "
                                 "the module holding it once")


@contextlib.contextmanager
def _reported(doing: str, what: str) -> Iterator[None]:
    """One step of a cleanup: a failure is a RuntimeWarning naming `doing` and the step, and the
    cleanup goes on (one failure must not leave the rest undone, nor replace the error that
    made the cleanup necessary)."""
    try:
        yield
    except Exception as failed:  # noqa: BLE001 - reported, then the next step runs
        warnings.warn(f"{doing}: {what} raised {type(failed).__name__}: {failed}", RuntimeWarning, stacklevel=3)


class _AsGiven:
    """Where a module's parameters and buffers are and its submodules' train/eval flags, to
    put a module back as it was given after a failed attach. Devices only, not the tensors:
    holding those would keep a second copy of the weights alive while the strategies attach."""

    def __init__(self, module: nn.Module) -> None:
        self.params = [(p, p.device) for p in module.parameters()]
        self.buffers = [(sub, key, buf.device) for sub in module.modules()
                        for key, buf in sub._buffers.items() if buf is not None]
        self.training = [(sub, sub.training) for sub in module.modules()]

    def restore(self) -> None:
        """Back on their devices with the values they hold now (detach kept them)."""
        for param, device in self.params:
            param.data = param.data.to(device)
        for sub, key, device in self.buffers:
            buf = sub._buffers[key]
            if buf is not None and buf.device != device:
                sub._buffers[key] = buf.to(device)
        for sub, was_training in self.training:
            sub.training = was_training


class _Timeline:
    """A request's declared uses in order, each with its stage: which of them may come next."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.uses = [use for stage in stages for use in stage.uses]
        self.spans: list[tuple[int, int, bool]] = []  # (first use, end, exact) of each stage
        self.stage_at: list[int] = []  # the stage of each use
        for index, stage in enumerate(stages):
            self.spans.append((len(self.stage_at), len(self.stage_at) + len(stage.uses), stage.exact))
            self.stage_at.extend([index] * len(stage.uses))

    def allowed(self, cursor: int) -> list[int]:
        """Positions the use after the one at `cursor` may take: the next use of an exact stage
        under way; else any use of the current stage if it is not exact, then, stage by stage,
        any use of a later stage that is not exact (it may not run at all), up to the first
        use of the next exact stage."""
        stage = -1 if cursor < 0 else self.stage_at[cursor]
        positions: list[int] = []
        if stage >= 0:
            first, end, exact = self.spans[stage]
            if exact and cursor + 1 < end:
                return [cursor + 1]
            if not exact:
                positions.extend(range(first, end))
        for first, end, exact in self.spans[stage + 1 :]:
            if exact:
                positions.append(first)
                break
            positions.extend(range(first, end))
        return positions

    def certain(self, positions: list[int]) -> bool:
        """Whether `positions` leave one use that must come (the next of an exact stage)."""
        return len(positions) == 1 and self.spans[self.stage_at[positions[0]]][2]


class ResidencyManager:
    def __init__(
        self,
        components: Mapping[str, nn.Module],
        placements: Mapping[str, PlacementSpec],
        platform: Platform | None = None,
        device_index: int | None = None,
        *,
        empty_after_every_use: bool = False,
        empty_on_release: bool = True,
        record_trace: bool = True,
        log: Any = None,
    ) -> None:
        """Components not named in `placements` are resident.

        `empty_after_every_use=True` empties the cache at every use's end (a baseline for
        benchmarks only). `empty_on_release=False` makes no release a release point: a
        memory-intensive component that leaves gives its memory to the allocator's cache,
        which serves the next use (only an out-of-memory error empties).
        Events go to `self.trace` (see ResidencyTrace) and, with `log` (a logging.Logger,
        or anything with an `.info` method), one JSON line each. Every argument is checked
        before anything is attached: a refusal changes nothing. A module or parameter two
        components hold must stay resident in both. An attach that raises (an out-of-memory
        error while a component attaches) is rolled back: every component started, the failing
        one included, is detached, its parameters and buffers go back to the devices they were
        given on (values kept) and its train/eval flags are restored; the strategy objects can
        be passed again. A step of that undo that raises is reported as a RuntimeWarning and
        the others still run; the attach's own error is the one raised.
        """
        check_placements(placements)
        check_platform_argument(platform, "ResidencyManager")
        strategies = _check_components(components, placements)
        for flag, value in (("empty_after_every_use", empty_after_every_use),
                            ("empty_on_release", empty_on_release), ("record_trace", record_trace)):
            check_bool(flag, value)
        if log is not None and not callable(getattr(log, "info", None)):
            raise TypeError(f"log must be a logging.Logger (anything with an .info method) or None, got {log!r}; "
                            "e.g. log=logging.getLogger('torchhal.residency')")
        self.platform = platform or current_platform()
        self.device_index = check_device_index(self.platform, device_index, "device_index")
        states = [ComponentState(name, module, strategies[name]) for name, module in components.items()]
        for state in states:  # every refusal before anything moves
            state.strategy.check(state)
        self.device = self.platform.device(self.device_index)
        self.side_stream = self.platform.new_stream(self.device_index)
        self.empty_after_every_use, self.empty_on_release = empty_after_every_use, empty_on_release
        self.trace = ResidencyTrace(self.platform, self.device_index, record=record_trace, log=log)
        self.components: dict[str, ComponentState] = {}
        self._attach(states)
        self._plan = _Timeline(())
        self._cursor = -1  # the use running or run last (-1: none yet)
        self._furthest = -1  # the furthest use reached: prefetching forecasts from there
        self._kept: ComponentUse | None = None  # a use whose component is kept for a next use that may not come
        self._active: ComponentUse | None = None
        self._uses_run = 0
        self._prefetched = self._warmup = self._in_request = self._oom_handled_by_request = self._closed = False
        self._copied_at_close: dict[str, int] = {}
        # bytes that load() reported, for strategies that do not count their own copies
        self._loaded_bytes = dict.fromkeys(self.components, 0)
        self._copied_at_request_start: dict[str, int] = {}
        #: host -> device bytes copied in the last finished request, per component (counted, not modelled)
        self.last_request_h2d_bytes: dict[str, int] = {}

    def _attach(self, states: list[ComponentState]) -> None:
        given = [_AsGiven(state.module) for state in states]
        started: list[ComponentState] = []
        try:
            for state in states:
                started.append(state)
                state.strategy.serving = state
                state.module.eval()
                state.buffer_dtypes = {name: buf.dtype for name, buf in state.module.named_buffers()
                                       if buf.dtype.is_floating_point}
                state.strategy.attach(self, state)
                self.components[state.name] = state
        except BaseException:
            # The component whose attach raised too: it may be half attached (detach undoes that).
            # Each step is undone even if another fails; the attach's error is the one raised.
            undoing = "undoing a failed ResidencyManager construction"
            for state in reversed(started):
                with _reported(undoing, f"{type(state.strategy).__name__}.detach of {state.name!r}"):
                    state.strategy.detach(self, state)
            for state, as_given in zip(states, given, strict=True):
                with _reported(undoing, f"putting {state.name!r} back on its devices"):
                    as_given.restore()
            for state in started:
                state.strategy.serving = None
            raise

    def copied_bytes(self) -> dict[str, int]:
        """Host -> device bytes each component's strategy has copied since registration: its own
        count (`ResidencyStrategy.copied_bytes`), else the bytes its `load` calls returned."""
        if self._closed:  # the strategies' own counts ended with their detach
            return dict(self._copied_at_close)
        counts = {}
        for name, state in self.components.items():
            own = state.strategy.copied_bytes()
            counts[name] = self._loaded_bytes[name] if own is None else own
        return counts

    @property
    def in_request(self) -> bool:
        """Whether a request is running (between begin_request and its finish or failure)."""
        return self._in_request

    @property
    def in_use(self) -> str | None:
        """The component whose use is running (between begin_use and end_use), if any."""
        return None if self._active is None else self._active.component

    def event(self, kind: str, component: str | None, **fields: Any) -> None:
        """Record one action (strategies report theirs here too): see ResidencyTrace.event."""
        self.trace.event(kind, component, **fields)

    # -- requests -------------------------------------------------------------------------
    @contextlib.contextmanager
    def request(self, stages: Sequence[Stage], warmup: bool = False) -> Iterator[None]:
        """Bracket one request. An OOM inside fails the request cleanly (RequestFailed)
        and empties the cache once, with reason OOM."""
        self.begin_request(stages, warmup)
        self._oom_handled_by_request = True
        try:
            yield
        except BaseException as exc:
            if not is_out_of_memory(self.platform, exc):
                self._abandon()
                raise
            self._handle_oom(exc)
            raise RequestFailed(f"request failed: out of memory on {self.device}: {exc}") from exc
        finally:
            self._oom_handled_by_request = False
        self.finish_request()

    def begin_request(self, stages: Sequence[Stage], warmup: bool = False) -> None:
        if self._closed:
            raise RuntimeError("this ResidencyManager is closed; build a new one for more requests")
        if self._in_request:
            raise RuntimeError("a request is already running, and requests do not nest (a managed pipeline called "
                               "from inside one of its own callbacks is one inside the other): make the call after "
                               "the running request ends, or end it with finish_request() first")
        check_bool("warmup", warmup)
        listed = not isinstance(stages, (Stage, str)) and isinstance(stages, Sequence)
        bad = [s for s in stages if not isinstance(s, Stage)] if listed else [stages]
        if bad:
            got = f"the single stage {stages.name!r}; pass [stage]" if isinstance(stages, Stage) else (
                repr(stages) if not listed else f"{bad[0]!r} in it")
            raise TypeError(f"a request is declared as a list of Stage records, got {got}")
        plan = _Timeline(stages)
        unknown = sorted({u.component for u in plan.uses} - set(self.components))
        if unknown:
            raise ValueError(f"stages use unknown components {unknown}; registered: {sorted(self.components)}")
        copied = self.copied_bytes()
        # before the request counts as started: an event that fails leaves no request behind
        self.event("request_start", None, uses=len(plan.uses), warmup=warmup)
        self._plan, self._cursor, self._furthest, self._kept, self._uses_run = plan, -1, -1, None, 0
        self._prefetched, self._warmup, self._in_request = False, warmup, True
        self._copied_at_request_start = copied

    def begin_use(self, component: str, phase: str | None = None) -> None:
        if not self._in_request:
            raise RuntimeError("begin_use outside a request; call begin_request(stages) first")
        position = self._expect(component, phase)
        if self._kept is not None and self._kept.component != component:
            # kept for a use that did not come: it leaves before this one loads, as at its use's end
            self._leave(self._kept, release_point=True)
            self._kept = None
        use = self._plan.uses[position]
        state = self.components[component]
        state.dtype = use.dtype
        cast_buffers(state, use.dtype)
        if not self._load(state, None, "prepare") and state.strategy.wait(self, state):
            self.event("wait", component)
        self._active, self._cursor, self._kept = use, position, None
        self._furthest = max(self._furthest, position)
        self._uses_run += 1
        self._maybe_prefetch()

    def end_use(self, component: str) -> None:
        self._end_use(component, release_point=True, failed=False)

    def _end_use(self, component: str, release_point: bool, failed: bool) -> None:
        use = self._active
        if use is None or use.component != component:
            raise RuntimeError(f"end_use({component!r}) without a matching begin_use")
        self._active = None
        allowed = [] if failed else self._plan.allowed(self._cursor)  # a failed use ends its request
        if any(self._plan.uses[p].component == component for p in allowed):
            # The next use may need it again: keep it, and keep the cache warm for the
            # layers streamed back in (their blocks are reused, not re-allocated). If a use
            # of another component comes instead, this one leaves when that one begins.
            self._kept = use
            why = "needed by the next use" if self._plan.certain(allowed) else "may be needed by the next use"
            self.event("keep", component, why=why)
        else:
            self._leave(use, release_point)
        if self.empty_after_every_use:
            self._empty(where="every_use")

    def _leave(self, use: ComponentUse, release_point: bool) -> None:
        """The used component leaves the device (unless warmup keeps it); its release empties
        the cache where it is a release point (the baseline that empties after every use
        empties at the use's end instead)."""
        state = self.components[use.component]
        if self._keep_after_warmup(use) and state.strategy.keepable:
            return
        if self._release(state) and use.memory_intensive and release_point and self.empty_on_release \
                and not self.empty_after_every_use:
            self._empty(where="component_release")

    @contextlib.contextmanager
    def use_component(self, component: str, phase: str | None = None) -> Iterator[nn.Module]:
        self.begin_use(component, phase)
        try:
            yield self.components[component].module
        except BaseException as exc:
            if self._active is not None:
                # Inside request(), an OOM is emptied once where the request fails (reason
                # OOM): releasing this component is then not a release point of its own.
                oom = self._oom_handled_by_request and is_out_of_memory(self.platform, exc)
                with _reported("ending a failed use", f"releasing {component!r}"):
                    self._end_use(component, release_point=not oom, failed=True)
            raise
        if self._active is not None:
            self.end_use(component)

    def finish_request(self) -> None:
        if not self._in_request:
            raise RuntimeError("finish_request without a request")
        if self._active is not None:  # its weights would leave the device under the running use
            name = self._active.component
            raise RuntimeError(f"finish_request() while {name!r} is in use; end_use({name!r}) first")
        uses = self._plan.uses
        preferred = {u.component for u in uses if u.preferred_ready_after_request}
        kept = {u.component for u in uses if self._keep_after_warmup(u)}
        last = self._kept
        if last is not None:  # kept for a use that did not come: it leaves as at its use's end
            if last.component not in preferred or not self.components[last.component].strategy.keepable:
                self._leave(last, release_point=True)  # a preferred one that the loop below keeps ready stays
            self._kept = None
        released_any = False
        for name, state in self.components.items():
            if not state.strategy.keepable:
                continue
            if name in preferred:
                # in the dtype this request used it in: the best guess for the next one
                state.dtype = next(u.dtype for u in uses if u.component == name)
                self._load(state, self.side_stream, "prefetch", why="preferred ready after request")
            elif name in kept:
                self.event("keep", name, why="keep_ready_after_warmup")
            else:
                released_any |= self._release(state)
        if released_any and self.empty_on_release:
            self._empty(where="request_end")
        now = self.copied_bytes()
        self.last_request_h2d_bytes = {name: now[name] - self._copied_at_request_start.get(name, 0) for name in now}
        self._in_request, self._plan = False, _Timeline(())  # ended before it is told: a failing log leaves it ended
        self.event("request_end", None, uses_run=self._uses_run, h2d_bytes=sum(self.last_request_h2d_bytes.values()),
                   h2d_bytes_by_component=dict(self.last_request_h2d_bytes))

    def close(self) -> int | None:
        """Give the device back: every component returns to host memory, the layerwise
        hooks are removed (the modules run as plain host modules again), and the cache
        is emptied once. Returns the bytes the empty released. Not during a request.
        The strategy objects are free to serve a component of another manager.

        A detach that raises does not stop the others: they are given back, the cache is
        emptied, and a RuntimeError names each failure (the first chained). The manager is
        closed to requests from the start; a later close() retries only the components whose
        detach failed. A failing event (a log that raises) is a RuntimeWarning: the device is
        given back regardless. A close with nothing left to give back returns None."""
        if self._in_request:
            raise RuntimeError("close() during a request; finish_request() first")
        attached = [state for state in self.components.values() if state.attached]
        if self._closed and not attached:
            return None
        if not self._closed:
            self._copied_at_close = self.copied_bytes()
            self._closed = True  # from here on no request starts, whatever fails below
        failures: list[tuple[str, Exception]] = []
        for state in attached:
            try:
                cast_buffers(state, None)
                state.strategy.detach(self, state)
            except Exception as failed:  # noqa: BLE001 - the others are still given back; raised below
                failures.append((state.name, failed))
                continue
            state.strategy.serving = None
        closing = "closing the ResidencyManager"
        for state in attached:
            if not state.attached:
                with _reported(closing, f"the release event of {state.name!r}"):
                    self.event("release", state.name, why="close")
        released = self.platform.empty_cache(ReleasePoint.COMPONENT_RELEASE, self.device_index)
        with _reported(closing, "the empty_cache event"):
            self.event("empty_cache", None, reason=ReleasePoint.COMPONENT_RELEASE.value, where="close",
                       bytes_released=released)
        if failures:
            named = "; ".join(f"{name!r}: {type(error).__name__}: {error}" for name, error in failures)
            raise RuntimeError(f"close() could not detach {named}; every other component was given back and "
                               "the cache emptied: call close() again to retry") from failures[0][1]
        return released

    # -- internals -------------------------------------------------------------------------
    def _expect(self, component: str, phase: str | None) -> int:
        """The timeline position of the use beginning: the first the stages allow next that
        is of this component (and phase)."""
        if not isinstance(component, str):
            raise TypeError(f"begin_use({component!r}): the component is named by a str, e.g. "
                            f"begin_use({next(iter(self.components), 'unet')!r})")
        if phase is not None and not isinstance(phase, str):  # compared with declared phases: 3 matched none
            raise TypeError(f"begin_use({component!r}, phase={phase!r}): phase must be a str (as declared in "
                            "ComponentUse) or None")
        if component not in self.components:
            raise ValueError(f"unknown component {component!r}; registered: {sorted(self.components)}")
        if self._active is not None:
            raise RuntimeError(f"begin_use({component!r}) while {self._active.component!r} is in use")
        uses, allowed = self._plan.uses, self._plan.allowed(self._cursor)
        fitting = [p for p in allowed if uses[p].component == component and (phase is None or uses[p].phase
                                                                             in (None, phase))]
        if fitting:  # a use declared with this very phase before one declared with any
            return next((p for p in fitting if phase is not None and uses[p].phase == phase), fitting[0])
        named = list(dict.fromkeys(repr(uses[p].component) + ("" if uses[p].phase is None else
                                                              f" (phase {uses[p].phase!r})") for p in allowed))
        declared = (f"but the declared next use is {'one of ' * (len(named) > 1)}{', '.join(named)}; declare the "
                    "stages in the order they run" if allowed else "after the request's declared uses ran out")
        raise UndeclaredUse(f"begin_use({component!r}, phase={phase!r}) {declared}", component,
                            uses[allowed[0]].component if allowed else None,
                            tuple(dict.fromkeys(uses[p].component for p in allowed)))

    def _maybe_prefetch(self) -> None:
        if self._prefetched:
            return
        # after the furthest use reached: a use of a stage that is not exact may go back in it
        for use in self._plan.uses[self._furthest + 1 :]:
            state = self.components[use.component]
            if not use.memory_intensive or use.component == self._plan.uses[self._cursor].component:
                continue
            if use.allow_prefetch and state.strategy.prefetchable:
                state.dtype = use.dtype
                self._prefetched = bool(self._load(state, self.side_stream, "prefetch"))
            return  # only the next memory-intensive use, once per request

    def _keep_after_warmup(self, use: ComponentUse) -> bool:
        return self._warmup and use.keep_ready_after_warmup

    def _release(self, state: ComponentState) -> bool:
        nbytes = state.strategy.release(self, state)
        if not nbytes:
            return False
        self.platform.notify_component_moved(state.name, str(self.device), "host", nbytes)
        self.event("release", state.name, nbytes=nbytes)
        return True

    def _abandon(self) -> None:
        """Leave a consistent state after a failed request: the request is over, and every
        non-resident component goes home, each even where another's release raised (the
        request's own error is the one that propagates)."""
        self._active, self._kept, self._in_request, self._plan = None, None, False, _Timeline(())
        for state in self.components.values():
            with _reported("abandoning a failed request", f"{type(state.strategy).__name__}.release of {state.name!r}"):
                self._release(state)

    def _handle_oom(self, error: BaseException) -> None:
        failing = "failing a request on out of memory"
        with _reported(failing, "the platform's OOM report"):
            self.platform.report_out_of_memory(error, "residency request", self.device_index)
        with _reported(failing, "the oom event"):
            self.event("oom", None, error=str(error)[:200])
        with _reported(failing, "abandoning the request"):
            self._abandon()
        with _reported(failing, "the OOM release point's empty"):
            self._empty(where="oom", reason=ReleasePoint.OOM)

    def _empty(self, where: str, reason: ReleasePoint = ReleasePoint.COMPONENT_RELEASE) -> None:
        released = self.platform.empty_cache(reason, self.device_index)
        self.event("empty_cache", None, reason=reason.value, where=where, bytes_released=released)

    def _load(self, state: ComponentState, stream: Any | None, kind: str, **fields: Any) -> int:
        """The strategy's load (`stream`: a prefetch on the side stream); bytes that reached the
        device are counted, told to the platform and recorded as a `kind` event."""
        moved = state.strategy.load(self, state, stream)
        if moved:
            self._loaded_bytes[state.name] += moved
            self.platform.notify_component_moved(state.name, "host", str(self.device), moved)
            self.event(kind, state.name, **fields, nbytes=moved)
        return moved


__all__ = ["PlacementSpec", "ResidencyManager", "check_placements"]
