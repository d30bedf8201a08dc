"""The pluggy plugin manager: built-ins and entry points through one path.

Built-in platforms are plugins like any other: `DEFAULT_PLUGINS` names their
modules as strings (platforms/ imports no plugin module), and third-party
distributions add theirs through the `torchhal` entry-point group. A plugin
that fails at any stage is recorded as a `PluginFailure`, warned about, and
isolated: the other platforms keep working.

This module sits above the hook specs and the SPI and below selection; it
never makes a `Platform` (selection does) and calls no observer.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as metadata
import os
import re
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType, ModuleType
from typing import Any

import pluggy

from torchhal.platforms import hookspecs
from torchhal.platforms.errors import PlatformError, TorchhalPluginWarning, describe_error, isolated
from torchhal.platforms.plugin import SPI_VERSION, PlatformPlugin, deprecated_overrides
from torchhal.platforms.records import Availability, PluginFailure

ENTRY_POINT_GROUP = "torchhal"
ALLOW_LIST_ENV = "TORCHHAL_PLUGINS"
DETECT_TIMEOUT_ENV = "TORCHHAL_DETECT_TIMEOUT"
#: Seconds one plugin's `is_available()` may take before it counts as "no".
DEFAULT_DETECT_TIMEOUT = 10.0
DEFAULT_PLUGINS: tuple[str, ...] = (
    "torchhal.plugins.cpu",
    "torchhal.plugins.cuda",
    "torchhal.plugins.rocm",
    "torchhal.plugins.xpu",
    "torchhal.plugins.npu",
    "torchhal.plugins.musa",
)
_NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")  # used with fullmatch: no trailing newline
#: Seconds between looks at where a detection probe is (a call back into torchhal is found in two).
_PROBE_LOOK_S = 0.05
#: The modules whose locks a detection holds: a probe waiting in them never returns.
_REGISTRY_MODULES = (__name__, "torchhal.platforms.selection")


class DetectionReentryError(PlatformError):
    """A plugin's is_available() called torchhal's platform API and waits for the detection it is part of."""


@dataclass(frozen=True)
class RegisteredPlatform:
    """One registered platform plugin and where it came from."""

    plugin: PlatformPlugin
    source: str  # the pluggy plugin name: module path or entry-point name
    distribution: str
    version: str
    builtin: bool = False  # registered by a module of DEFAULT_PLUGINS


def _describe_plugin(plugin: object) -> str:
    if isinstance(plugin, ModuleType):
        empty = " (a namespace package: no __init__.py)" if getattr(plugin, "__file__", None) is None else ""
        return f"module {plugin.__name__!r}{empty}"
    return repr(plugin)


def detect_timeout_from_env() -> float | None:
    """Seconds from TORCHHAL_DETECT_TIMEOUT (default 10); None (no limit) for 0 or less."""
    raw = os.environ.get(DETECT_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_DETECT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise PlatformError(
            f"{DETECT_TIMEOUT_ENV}={raw!r} is not a number of seconds; set it to e.g. "
            f"{DEFAULT_DETECT_TIMEOUT:g}, or 0 for no limit"
        )
    return seconds if seconds > 0 else None


def _torchhal_version() -> str:
    try:
        return metadata.version("torchhal")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def allow_list_from_env() -> frozenset[str] | None:
    """None: all entry points; empty set: none; else only these names."""
    raw = os.environ.get(ALLOW_LIST_ENV)
    if raw is None:
        return None
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


class PlatformRegistry:
    """Registered platforms by name, the plugin failures met on the way, and detection."""

    def __init__(self, pm: pluggy.PluginManager, detect_timeout: float | None = DEFAULT_DETECT_TIMEOUT) -> None:
        self.pm = pm
        self.platforms: dict[str, RegisteredPlatform] = {}
        self.failures: list[PluginFailure] = []
        #: Warnings about plugins that still work (deprecated members, a newer SPI minor).
        self.notices: list[str] = []
        #: Entry points that TORCHHAL_PLUGINS left out: name -> distribution.
        self.excluded: dict[str, str] = {}
        self.allow: frozenset[str] | None = None
        self.detect_timeout = detect_timeout
        self._availability: dict[str, Availability] = {}
        self._provenance: dict[str, tuple[str, str]] = {}  # pluggy name -> (dist, version)
        self._builtins: set[str] = set()  # pluggy names of the built-in modules
        self._builtin_names: set[str] = set()  # their last parts ("cpu"): always loaded, whatever TORCHHAL_PLUGINS says
        #: Platforms dropped by a `replaces` declaration: replaced name -> the platform that replaced it.
        self.replaced: dict[str, RegisteredPlatform] = {}
        self._lock = threading.Lock()

    # -- loading ---------------------------------------------------------------
    def _record_failure(self, failure: PluginFailure) -> None:
        self.failures.append(failure)
        warnings.warn(str(failure), TorchhalPluginWarning, stacklevel=3)

    def record_failure(self, failure: PluginFailure) -> None:
        """Record and warn about a plugin failure met outside loading (e.g. a query in `info`)."""
        self._record_failure(failure)

    def _notice(self, message: str) -> None:
        self.notices.append(message)
        warnings.warn(message, TorchhalPluginWarning, stacklevel=3)

    def add_plugin(self, plugin: object, name: str, distribution: str, version: str) -> bool:
        """Register one pluggy plugin (module or object); reject unknown hooks, no hooks and wrappers."""
        declared = _declared_wrappers(plugin)
        if declared:  # before pluggy, whose message for a plain function says to make it a generator
            self._record_failure(PluginFailure(name, "register", _wrapper_problem(declared), distribution))
            return False
        _, error = isolated(lambda: self.pm.register(plugin, name=name))
        if error is not None:  # pluggy raises ValueError / PluginValidationError
            self._record_failure(PluginFailure(name, "register", describe_error(error), distribution))
            return False
        problem = _hook_problem(plugin, self.pm.get_hookcallers(plugin) or [])
        if problem is not None:
            self.pm.unregister(plugin)
            self._record_failure(PluginFailure(name, "register", problem, distribution))
            return False
        self._provenance[name] = (distribution, version)
        return True

    def load_builtins(self, modules: Iterable[str]) -> None:
        version = _torchhal_version()
        for module_name in modules:
            self._builtin_names.add(module_name.rsplit(".", 1)[-1])
            module, error = isolated(importlib.import_module, module_name)
            if error is not None:
                self._record_failure(PluginFailure(module_name, "import", describe_error(error), "torchhal"))
                continue
            if self.add_plugin(module, module_name, "torchhal", version):
                self._builtins.add(module_name)

    def load_entry_points(self, allow: frozenset[str] | None) -> None:
        seen: set[str] = set()
        self.allow = allow
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else "<unknown distribution>"
            if allow is not None and ep.name not in allow:
                self.excluded[ep.name] = dist
                continue
            seen.add(ep.name)
            version = ep.dist.version if ep.dist is not None else "?"
            plugin, error = isolated(ep.load)
            if error is not None:
                self._record_failure(PluginFailure(ep.name, "import", describe_error(error), dist))
                continue
            self.add_plugin(plugin, ep.name, dist, version)
        for dist, ep in _near_miss_entry_points():
            self._notice(f"distribution {dist!r} declares entry point {ep.name!r} in group {ep.group!r}, which "
                         f"torchhal does not read: plugins register under group {ENTRY_POINT_GROUP!r} "
                         f"([project.entry-points.{ENTRY_POINT_GROUP}] in pyproject.toml)")
        for missing in sorted((allow or frozenset()) - seen - self._builtin_names):
            self._record_failure(
                PluginFailure(
                    missing,
                    "import",
                    f"named in {ALLOW_LIST_ENV} but no installed distribution has an entry "
                    f"point {missing!r} in group {ENTRY_POINT_GROUP!r}",
                )
            )

    def collect_platforms(self) -> None:
        """Call each plugin's registration hook in isolation and validate results."""
        candidates: dict[str, list[RegisteredPlatform]] = {}
        for impl in self.pm.hook.torchhal_register_platforms.get_hookimpls():
            dist, version = self._provenance.get(impl.plugin_name, ("<unknown distribution>", "?"))
            result, error = isolated(impl.function)
            if error is not None:
                self._record_failure(PluginFailure(impl.plugin_name, "register", describe_error(error), dist))
                continue
            for item in result if isinstance(result, (list, tuple)) else [result]:
                problem, error = isolated(_validate_platform_object, item)
                if error is not None:  # e.g. a `name` property that raises
                    problem = f"reading its class attributes raised {describe_error(error)}"
                if problem:
                    # The platform it would have been, so naming it explains why it is missing.
                    name = getattr(item, "name", None) if error is None else None
                    self._record_failure(PluginFailure(impl.plugin_name, "validate", problem, dist,
                                                       (name,) if isinstance(name, str) else ()))
                    continue
                assert isinstance(item, PlatformPlugin)
                if not self._spi_compatible(item, impl.plugin_name, dist):
                    continue
                builtin = impl.plugin_name in self._builtins
                candidates.setdefault(item.name, []).append(
                    RegisteredPlatform(item, impl.plugin_name, dist, version, builtin)
                )
        self._resolve_conflicts(candidates)

    def _spi_compatible(self, item: PlatformPlugin, source: str, dist: str) -> bool:
        """Refuse another SPI major; note a newer minor and deprecated members."""
        cls = type(item).__name__
        major, minor = item.spi_version
        ours = ".".join(map(str, SPI_VERSION))
        if major != SPI_VERSION[0]:
            self._record_failure(
                PluginFailure(
                    source,
                    "version",
                    f"{cls} (platform {item.name!r}) targets torchhal SPI {major}.{minor}, but this "
                    f"torchhal implements SPI {ours}; install a {item.name!r} plugin release built "
                    f"for SPI {SPI_VERSION[0]}.x, or a torchhal release implementing SPI {major}.x",
                    dist,
                )
            )
            return False
        if minor > SPI_VERSION[1]:
            self._notice(
                f"plugin {source!r} ({dist}): {cls} targets SPI {major}.{minor}, newer than this "
                f"torchhal's SPI {ours}; members added after {ours} are not called. Upgrade torchhal"
            )
        for entry in deprecated_overrides(item):
            self._notice(f"plugin {source!r} ({dist}): " + entry.message(cls, "defines"))
        return True

    def _resolve_conflicts(self, candidates: dict[str, list[RegisteredPlatform]]) -> None:
        self._drop_repeats(candidates)
        replacers: dict[str, list[RegisteredPlatform]] = {}
        for regs in candidates.values():
            for reg in regs:
                if reg.plugin.replaces:
                    replacers.setdefault(reg.plugin.replaces, []).append(reg)
        for target, regs in replacers.items():
            if len(regs) == 1:
                continue
            # Two replacements of one platform: neither wins, the replaced one stays.
            who = " and ".join(f"{r.source} (distribution {r.distribution})" for r in regs)
            for reg in regs:
                self._record_failure(
                    PluginFailure(
                        reg.source,
                        "conflict",
                        f"{who} each declare `replaces = {target!r}`; both are dropped and {target!r} is "
                        "kept. Uninstall one of them",
                        reg.distribution,
                        (target, *dict.fromkeys(x for r in regs for x in (r.plugin.name, r.source))),
                    )
                )
                candidates[reg.plugin.name].remove(reg)
        for name, regs in candidates.items():
            if not regs:
                continue
            own = [r for r in regs if r.plugin.replaces == name]  # replaces a platform of its own name
            if own:
                regs = own
            builtin = next((r for r in regs if r.builtin), None)
            if builtin is not None and len(regs) > 1:
                # A built-in is displaced only through `replaces`: impostors are dropped.
                for impostor in regs:
                    if impostor is not builtin:
                        self._record_failure(
                            PluginFailure(
                                impostor.source,
                                "conflict",
                                f"registers platform name {name!r}, which is torchhal's built-in "
                                f"{name!r} platform; the built-in is kept and this one dropped. "
                                f"Rename it, or declare `replaces = {name!r}` to replace the built-in",
                                impostor.distribution,
                                (name, impostor.source),
                            )
                        )
                regs = [builtin]
            if len(regs) > 1:
                who = " and ".join(f"{r.source} (distribution {r.distribution})" for r in regs)
                self._record_failure(
                    PluginFailure(
                        name,
                        "conflict",
                        f"platform name {name!r} is registered by {who}; uninstall one, or "
                        f"have one declare `replaces = {name!r}`",
                        regs[-1].distribution,
                        (name, *dict.fromkeys(r.source for r in regs)),
                    )
                )
                continue
            self.platforms[name] = regs[0]
        # Replacements last: only a replacer that kept its own name may drop what it replaces.
        self._apply_replacements()

    def _drop_repeats(self, candidates: dict[str, list[RegisteredPlatform]]) -> None:
        """Drop a platform name one plugin returned more than once: a mistake of that plugin, not a
        conflict between distributions (no other plugin is involved, nothing to uninstall)."""
        for name, regs in candidates.items():
            counts = Counter(reg.source for reg in regs)
            for source, count in counts.items():
                if count > 1:
                    distribution = next(reg.distribution for reg in regs if reg.source == source)
                    self._record_failure(
                        PluginFailure(
                            source,
                            "conflict",
                            f"plugin {source!r} returned platform {name!r} {count} times from "
                            "torchhal_register_platforms; return one instance (one platform serves all its devices: "
                            "each call takes the device index)",
                            distribution,
                            (name, source),
                        )
                    )
            candidates[name] = [reg for reg in regs if counts[reg.source] == 1]

    def _apply_replacements(self) -> None:
        """Drop the platforms that registered platforms replace. A replaced platform replaces
        nothing: in a chain (C replaces B, B replaces A) C drops B and A stays. Platforms that
        replace one another in a cycle are all dropped, as a conflict naming each."""
        replacer_of = {
            reg.plugin.replaces: reg
            for name, reg in self.platforms.items()
            if reg.plugin.replaces not in (None, name) and reg.plugin.replaces in self.platforms
        }  # one replacer a target at most: rival replacers were dropped
        replaced: dict[str, RegisteredPlatform] = {}
        cycles: list[list[str]] = []
        for name in self.platforms:
            chain = [name]  # name, the platform replacing it, the one replacing that …
            while chain[-1] in replacer_of and replacer_of[chain[-1]].plugin.name not in chain:
                chain.append(replacer_of[chain[-1]].plugin.name)
            if chain[-1] in replacer_of:  # back at `name`: a cycle
                if name == min(chain):
                    cycles.append(chain)
            elif len(chain) % 2 == 0:  # the top of the chain stays, and every second one below it
                replaced[name] = replacer_of[name]
        for cycle in cycles:
            regs = [self.platforms.pop(name) for name in cycle]
            who = " and ".join(f"platform {reg.plugin.name!r} (plugin {reg.source!r}, distribution "
                               f"{reg.distribution}) declares `replaces = {reg.plugin.replaces!r}`" for reg in regs)
            involves = tuple(dict.fromkeys((*cycle, *(reg.source for reg in regs))))
            for reg in regs:
                self._record_failure(
                    PluginFailure(
                        reg.source,
                        "conflict",
                        f"{who}: they replace one another in a cycle, so none applies and all are dropped. "
                        "Uninstall one of them, or remove its `replaces`",
                        reg.distribution,
                        involves,
                    )
                )
        for name, reg in replaced.items():
            del self.platforms[name]
            self.replaced[name] = reg

    def replacement_note(self, name: str) -> str | None:
        """Why platform `name` is not registered when a plugin's `replaces` dropped it, naming the platform
        to use instead; None when nothing replaced it."""
        reg = self.replaced.get(name)
        if reg is None:
            return None
        return (f"platform {name!r} was replaced by platform {reg.plugin.name!r} (plugin {reg.source!r}, "
                f"distribution {reg.distribution}), which declares `replaces = {name!r}`; name {reg.plugin.name!r} "
                f"instead, or uninstall {reg.distribution} to get {name!r} back")

    # -- queries ---------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self.platforms)

    def conflict_for(self, name: str) -> PluginFailure | None:
        """The conflict that names platform `name`: over its name, or one its plugin was a party to."""
        return next((f for f in self.failures if f.stage == "conflict" and (f.plugin == name or name in f.involves)),
                    None)

    def availability(self, name: str) -> Availability:
        """Detect once per registry, isolated and time-limited; a failure counts as 'no'."""
        cached = self._availability.get(name)
        if cached is not None:
            return cached
        with self._lock:
            cached = self._availability.get(name)
            if cached is not None:
                return cached
            reg = self.platforms[name]
            result, error = self.detect(reg.plugin)
            if error is None and not isinstance(result, Availability):
                error = TypeError(
                    f"is_available() returned {type(result).__name__}; "
                    "return Availability.yes() or Availability.no(reason)"
                )
            if isinstance(error, TimeoutError):
                self._record_failure(PluginFailure(name, "detect", str(error), reg.distribution))
                result = Availability.no(f"detection timed out: {error}")
            elif error is not None:
                # torchhal's own finding is said as it is; what the plugin raised, with its type
                said = str(error) if isinstance(error, DetectionReentryError) else describe_error(error)
                self._record_failure(PluginFailure(name, "detect", said, reg.distribution))
                result = Availability.no(f"detection failed: {said}")
            assert isinstance(result, Availability)
            self._availability[name] = result
            return result

    def detect(self, plugin: PlatformPlugin) -> tuple[object, BaseException | None]:
        """`plugin.is_available()` in a daemon thread, waited for `detect_timeout` seconds:
        (its answer, None), or (None, what it raised; a TimeoutError when it did not return; a
        DetectionReentryError when it waits in a call back into torchhal).
        Uncached: the conformance suite probes through it under the host's limit.

        A probe that hangs is abandoned, not killed (Python cannot stop a thread): it
        keeps running in the background and does not hold the process open at exit.
        """
        outcome: list[tuple[object, BaseException | None]] = []
        thread = threading.Thread(target=_probe, args=(plugin, outcome), name=f"torchhal-detect-{plugin.name}",
                                  daemon=True)
        thread.start()
        deadline = None if self.detect_timeout is None else time.monotonic() + self.detect_timeout
        seen: FrameType | None = None
        while not outcome:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None, TimeoutError(
                    f"is_available() did not return within {self.detect_timeout:g} s "
                    f"({DETECT_TIMEOUT_ENV}); the probe was abandoned, still running"
                )
            thread.join(_PROBE_LOOK_S if left is None else min(_PROBE_LOOK_S, left))
            # Detection runs under the registry's lock (and, from current_platform(), selection's):
            # a probe calling back into either waits for this very detection. Found in the same
            # call twice, it waits there, not passing through: say so now, not at the limit (or never).
            call = None if outcome else _call_back(thread)
            if call is not None and call is seen:
                caller = call.f_back
                where = f" from {caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else ""
                return None, DetectionReentryError(
                    f"is_available() calls back into torchhal ({call.f_globals['__name__']}.{call.f_code.co_name}()"
                    f"{where}) while torchhal detects platforms, and waits there for that detection, which "
                    "never ends; is_available() must not call torchhal's platform API (torchhal.registry(), "
                    "current_platform(), get_platform(), list_platforms()): decide from the device runtime "
                    "alone. The probe was abandoned"
                )
            seen = call
        result, error = outcome[0]
        if isinstance(error, KeyboardInterrupt):
            raise error
        return result, error


def _probe(plugin: PlatformPlugin, outcome: list[tuple[object, BaseException | None]]) -> None:
    """A detection thread's body: what `plugin.is_available()` returned or raised, into `outcome`."""
    try:
        outcome.append(isolated(plugin.is_available))
    except KeyboardInterrupt as exc:  # re-raised in the caller's thread
        outcome.append((None, exc))


def _call_back(thread: threading.Thread) -> FrameType | None:
    """The outermost frame of torchhal's registry or selection code that the probe `thread` is
    in, called from the plugin's is_available(); None while it runs outside them."""
    frames = sys._current_frames()
    frame = frames.get(thread.ident) if thread.ident is not None else None
    found = None
    while frame is not None and frame.f_code is not _probe.__code__:  # up to the probe's own frame
        if frame.f_globals.get("__name__") in _REGISTRY_MODULES:
            found = frame
        frame = frame.f_back
    return found


def _hook_problem(plugin: object, callers: list[pluggy.HookCaller]) -> str | None:
    """Why a registered plugin's hook implementations cannot work, or None: no torchhal hook at
    all, or a hook name no spec has. (A wrapper is refused before registration: torchhal calls
    each implementation itself, isolated, so a wrapper's generator would be made and dropped.)"""
    if not callers:
        return (f"{_describe_plugin(plugin)} implements no torchhal hook, so it registers nothing; point the "
                "entry point at the module that defines torchhal_register_platforms (decorated with "
                "torchhal.hookimpl)")
    unknown = [caller.name for caller in callers if not caller.has_spec()]
    if unknown:
        known = [n for n in dir(hookspecs) if n.startswith("torchhal_")]
        hints = []
        for hook_name in unknown:
            close = difflib.get_close_matches(hook_name, known, n=1)
            hints.append(f"{hook_name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return "unknown hook " + ", ".join(hints)
    return None


#: Groups a vendor may write for torchhal's, squashed (lower case, letters and digits only).
_NEAR_MISS_GROUPS = frozenset({"torchhal", "torchhalplatforms", "torchhalplatform", "torchhalplugins",
                               "torchhalplugin"})


def _near_miss_entry_points() -> list[tuple[str, metadata.EntryPoint]]:
    """(distribution, entry point) in a group that reads like torchhal's but is not it
    ("torchhal.platforms", "torch_hal", "TorchHAL"): their plugins would be silently absent.
    Other groups that merely start with "torchhal" may be another project's own."""
    def squashed(group: str) -> str:
        return "".join(c for c in group.lower() if c.isalnum())

    return [(dist.metadata["Name"] or "<unknown distribution>", ep)
            for dist in metadata.distributions() for ep in dist.entry_points
            if ep.group != ENTRY_POINT_GROUP and squashed(ep.group) in _NEAR_MISS_GROUPS]


def _wrapper_problem(wrappers: list[str]) -> str:
    return (f"implements {', '.join(wrappers)} as a hook wrapper, which torchhal never runs: it calls each hook "
            "implementation itself; declare it with a plain @torchhal.hookimpl (an observer is called after "
            "the event, with its arguments)")


def _declared_wrappers(plugin: object) -> list[str]:
    """The plugin's hooks marked wrapper=True or hookwrapper=True ("'hook' (wrapper=True)"),
    read from the marks `torchhal.hookimpl` leaves, as pluggy reads them (every attribute, the
    hook named by `specname` where given), before pluggy registers the plugin."""
    found = []
    for attribute in dir(plugin):
        try:
            options = getattr(getattr(plugin, attribute), f"{hookspecs.PROJECT_NAME}_impl", None)
        except Exception:  # a property that raises: pluggy's registration reports it
            continue
        if isinstance(options, dict):
            hook = options.get("specname") or attribute
            found += [f"{hook!r} ({flag}=True)" for flag in ("wrapper", "hookwrapper") if options.get(flag)]
    return found


def _validate_platform_object(item: Any) -> str | None:
    if not isinstance(item, PlatformPlugin):
        return (
            f"torchhal_register_platforms returned {type(item).__name__!s} {item!r}; "
            "return instances of torchhal.PlatformPlugin"
        )
    cls = type(item).__name__
    name = getattr(item, "name", None)
    if not isinstance(name, str) or not _NAME_PATTERN.fullmatch(name):
        return f"{cls}.name is {name!r}; use a lowercase identifier such as 'myaccel'"
    for attr, kind in (("device_type", str), ("dist_backend", str), ("priority", int)):
        value = getattr(item, attr, None)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{cls}.{attr} is {value!r}; it must be a {kind.__name__}"
    replaces = getattr(item, "replaces", None)
    if replaces is not None and not (isinstance(replaces, str) and _NAME_PATTERN.fullmatch(replaces)):
        return f"{cls}.replaces is {replaces!r}; it must be None or one platform name, e.g. 'cuda'"
    variables = getattr(item, "visible_devices_env", None)
    # A list of names is normalised to a tuple (the conformance suite flags it); None or a bare
    # str would break the host (a str is split into letters).
    if not (isinstance(variables, (tuple, list)) and all(isinstance(var, str) and var for var in variables)):
        return (f"{cls}.visible_devices_env is {variables!r}; it must be a tuple of environment variable names, "
                "e.g. ('MYACCEL_VISIBLE_DEVICES',), or () for none")
    version = getattr(item, "spi_version", None)
    if not (
        isinstance(version, tuple)
        and len(version) == 2
        and all(isinstance(part, int) and not isinstance(part, bool) and part >= 0 for part in version)
    ):
        return f"{cls}.spi_version is {version!r}; it must be (major, minor), e.g. {SPI_VERSION!r}"
    return None


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def build_registry(
    builtins: Iterable[str] = DEFAULT_PLUGINS,
    *,
    entry_points: bool = True,
    allow: frozenset[str] | None | str = "env",
    extra: Iterable[tuple[object, str]] = (),
) -> PlatformRegistry:
    """Make a fresh registry. Tests pass `extra=[(plugin_obj, name)]` and no globals leak."""
    registry = PlatformRegistry(new_plugin_manager(), detect_timeout_from_env())
    registry.load_builtins(builtins)
    if entry_points:
        registry.load_entry_points(allow_list_from_env() if allow == "env" else allow)  # type: ignore[arg-type]
    for plugin, name in extra:
        registry.add_plugin(plugin, name, "<in-process>", "0")
    registry.collect_platforms()
    return registry

