"""The plugin host, on pluggy: built-ins and entry points through one path.

Built-in platforms are plugins like any other: `DEFAULT_PLUGINS` names their modules as
strings (platforms/ imports no plugin module), and third-party distributions add theirs
through the `torchhal` entry-point group, which pluggy loads (`load_setuptools_entrypoints`,
one entry point at a time, so each failure is that plugin's own record) with the names
`TORCHHAL_PLUGINS` leaves out blocked (`set_blocked`). pluggy checks every hook against its
spec (`check_pending`) and dispatches the registration hook. A plugin that fails at any
stage is recorded as a `PluginFailure`, warned about, and isolated: the other platforms
keep working. While the host waits on a plugin's code (its import, its registration hook,
a query), a watch names the plugin after `TORCHHAL_DETECT_TIMEOUT` seconds and says how to
skip it; a detection that long is abandoned.

This module sits above the hook specs and the SPI and below selection; it never makes a
`Platform` (selection does) and calls no observer.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as metadata
import os
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import FrameType, ModuleType

import pluggy

from torchhal.platforms import hookspecs
from torchhal.platforms.errors import PlatformError, TorchhalPluginWarning, describe_error, isolated, watched
from torchhal.platforms.platform import call_plugin, plugins_implementing
from torchhal.platforms.plugin import SPI_VERSION, PlatformPlugin
from torchhal.platforms.records import Availability, PluginFailure
from torchhal.values import short_repr

ENTRY_POINT_GROUP = "torchhal"
ALLOW_LIST_ENV = "TORCHHAL_PLUGINS"
DETECT_TIMEOUT_ENV = "TORCHHAL_DETECT_TIMEOUT"
#: Seconds one plugin's `is_available()` may take before it counts as "no", and the host's
#: wait on any other plugin call before it names the plugin.
DEFAULT_DETECT_TIMEOUT = 10.0
DEFAULT_PLUGINS: tuple[str, ...] = (
    "torchhal.plugins.cpu",
    "torchhal.plugins.cuda",
    "torchhal.plugins.rocm",
    "torchhal.plugins.xpu",
    "torchhal.plugins.npu",
    "torchhal.plugins.musa",
)
REGISTER_HOOK = "torchhal_register_platforms"
#: Seconds between looks at where a detection probe is (a call back into torchhal is found in two).
_PROBE_LOOK_S = 0.05
#: The modules whose locks a detection holds: a probe waiting in them never returns.
_REGISTRY_MODULES = (__name__, "torchhal.platforms.selection")
#: Groups a vendor may write for torchhal's, squashed (lower case, letters and digits only).
_NEAR_MISS_GROUPS = frozenset({"torchhal", "torchhalplatforms", "torchhalplatform", "torchhalplugins",
                               "torchhalplugin"})


class DetectionReentryError(PlatformError):
    """A plugin's is_available() called torchhal's platform API and waits for the detection it is part of."""


@dataclass(frozen=True, eq=False)  # compared by identity: a field's __eq__ would run plugin code
class RegisteredPlatform:
    """One registered platform plugin and where it came from."""

    plugin: PlatformPlugin
    source: str  # the pluggy plugin name: module path or entry-point name
    distribution: str
    version: str
    builtin: bool = False  # registered by a module of DEFAULT_PLUGINS
    #: Its class's `name`, `priority` and `replaces`, checked when the class was defined.
    name: str = field(init=False)
    priority: int = field(init=False)
    replaces: str | None = field(init=False)

    def __post_init__(self) -> None:
        for attribute in ("name", "priority", "replaces"):
            object.__setattr__(self, attribute, getattr(type(self.plugin), attribute))


class PluginManager(pluggy.PluginManager):
    """pluggy's manager with torchhal's hook specs; it refuses hook wrappers and notes the plugin
    an entry point loaded (so a failure after the import is a `register` failure, not `import`).

    torchhal calls each plugin's implementations apart (`call_plugin`), so a wrapper would wrap
    only its own plugin's call: it is refused before pluggy's own check, whose message for a plain
    function marked as a wrapper says to make it a generator."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.loaded: object = None

    def register(self, plugin: object, name: str | None = None) -> str | None:
        self.loaded = plugin
        return super().register(plugin, name)

    def parse_hookimpl_opts(self, plugin: object, name: str) -> pluggy.HookimplOpts | None:
        opts = super().parse_hookimpl_opts(plugin, name)
        for flag in ("wrapper", "hookwrapper"):
            if opts is not None and opts.get(flag):
                raise pluggy.PluginValidationError(plugin, (
                    f"implements {opts.get('specname') or name!r} ({flag}=True) as a hook wrapper, which torchhal "
                    "never runs: it calls each plugin's implementations apart; declare it with a plain "
                    "@torchhal.hookimpl (an observer is called after the event, with its arguments)"))
        return opts


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


def allow_list_from_env() -> frozenset[str] | None:
    """None: all entry points; empty set: none; else only these names."""
    raw = os.environ.get(ALLOW_LIST_ENV)
    if raw is None:
        return None
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def _torchhal_version() -> str:
    try:
        return metadata.version("torchhal")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class PlatformRegistry:
    """Registered platforms by name, the plugin failures met on the way, and detection."""

    def __init__(self, pm: PluginManager, detect_timeout: float | None = DEFAULT_DETECT_TIMEOUT) -> None:
        self.pm = pm
        self.platforms: dict[str, RegisteredPlatform] = {}
        self.failures: list[PluginFailure] = []
        #: Warnings about plugins that still work (a newer SPI minor, an entry point in a near-miss group).
        self.notices: list[str] = []
        #: Entry points that TORCHHAL_PLUGINS left out: name -> distribution.
        self.excluded: dict[str, str] = {}
        self.allow: frozenset[str] | None = None
        self.detect_timeout = detect_timeout
        #: Platforms dropped by a `replaces` declaration: replaced name -> the platform that replaced it.
        self.replaced: dict[str, RegisteredPlatform] = {}
        self._availability: dict[str, Availability] = {}
        self._provenance: dict[str, tuple[str, str, bool]] = {}  # pluggy name -> (distribution, version, built-in)
        #: The built-ins' last parts ("cpu"): they load whatever TORCHHAL_PLUGINS says.
        self._builtin_names: set[str] = set()
        self._entry_points: list[str] = []
        self._lock = threading.Lock()

    # -- failures, notices, watches ------------------------------------------------
    def record_failure(self, failure: PluginFailure) -> None:
        """Record and warn about a plugin failure (a query in `info` records its own the same way)."""
        self.failures.append(failure)
        warnings.warn(str(failure), TorchhalPluginWarning, stacklevel=3)

    def _fail(self, plugin: str, stage: str, error: str, distribution: str | None = None,
              involves: tuple[str, ...] = ()) -> None:
        self.record_failure(PluginFailure(plugin, stage, error, distribution, involves))

    def _notice(self, message: str) -> None:
        self.notices.append(message)
        warnings.warn(message, TorchhalPluginWarning, stacklevel=3)

    def watch(self, source: str, what: str, distribution: str | None = None) -> AbstractContextManager[None]:
        """Name plugin `source` and how to skip it, should `what` (its call the host waits on) not
        return within the detection limit."""
        if self.detect_timeout is None:
            return nullcontext()
        distribution = distribution or self._provenance.get(source, ("?",))[0]
        if distribution == "torchhal":
            skip = "it is one of torchhal's built-in plugins, which always load: report it"
        else:
            others = ",".join(name for name in self._entry_points if name != source)
            skip = f"to skip it, set {ALLOW_LIST_ENV} to the entry points to load without it: {ALLOW_LIST_ENV}={others}"
        return watched(self.detect_timeout, f"torchhal is waiting on plugin {source!r} ({distribution}): {what} has "
                                            f"not returned after {self.detect_timeout:g} s ({DETECT_TIMEOUT_ENV}) and "
                                            f"may hang; {skip}")

    # -- loading ---------------------------------------------------------------
    def add_plugin(self, plugin: object, name: str, distribution: str, version: str, builtin: bool = False) -> bool:
        """Register one pluggy plugin (a module or object) and check it; False (recorded) if it fails."""
        _, error = isolated(self.pm.register, plugin, name)
        return self._checked(plugin, name, distribution, version, builtin, error)

    def _checked(self, plugin: object, name: str, distribution: str, version: str, builtin: bool,
                 error: BaseException | None) -> bool:
        """Keep a plugin pluggy registered (`error` None) whose hooks all have specs and which implements one."""
        if isinstance(error, pluggy.PluginValidationError):
            problem = str(error)
        elif error is not None:
            problem = describe_error(error)
        elif isolated(self.pm.check_pending)[1] is not None:
            known = [n for n in dir(hookspecs) if n.startswith("torchhal_")]
            unknown = [caller.name for caller in self.pm.get_hookcallers(plugin) or [] if not caller.has_spec()]
            problem = "unknown hook " + ", ".join(f"{hook!r}" + "".join(
                f" (did you mean {close!r}?)" for close in difflib.get_close_matches(hook, known, n=1))
                for hook in unknown)
        elif not self.pm.get_hookcallers(plugin):
            empty = (" (a namespace package: no __init__.py)"
                     if isinstance(plugin, ModuleType) and getattr(plugin, "__file__", None) is None else "")
            what = f"module {plugin.__name__!r}{empty}" if isinstance(plugin, ModuleType) else short_repr(plugin)
            problem = (f"{what} implements no torchhal hook, so it registers nothing; point the entry point at the "
                       f"module that defines {REGISTER_HOOK} (decorated with torchhal.hookimpl)")
        elif isolated(hash, plugin)[1] is not None:  # pluggy keeps plugins in sets (subset_hook_caller)
            problem = ("the plugin object is not hashable; pluggy keeps plugins in sets: register a module or an "
                       "object without a __hash__ of its own")
        else:
            self._provenance[name] = (distribution, version, builtin)
            return True
        if self.pm.has_plugin(name):
            self.pm.unregister(name=name)
        self._fail(name, "register", problem, distribution)
        return False

    def load_builtins(self, modules: Iterable[str]) -> None:
        version = _torchhal_version()
        for module_name in modules:
            self._builtin_names.add(module_name.rsplit(".", 1)[-1])
            with self.watch(module_name, "its import", "torchhal"):
                module, error = isolated(importlib.import_module, module_name)
            if error is not None:
                self._fail(module_name, "import", describe_error(error), "torchhal")
            else:
                self.add_plugin(module, module_name, "torchhal", version, builtin=True)

    def load_entry_points(self, allow: frozenset[str] | None) -> None:
        """Load every entry point of group `torchhal` through pluggy, one at a time; those `allow`
        leaves out are blocked."""
        self.allow = allow
        first: dict[str, str] = {}  # entry-point name -> the distribution pluggy loads it from
        points = []
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist, version = (ep.dist.name, ep.dist.version) if ep.dist is not None else ("<unknown distribution>", "?")
            if ep.name in first:
                self._fail(ep.name, "conflict", f"distributions {first[ep.name]} and {dist} both declare entry point "
                           f"{ep.name!r}; only {first[ep.name]}'s loads. Uninstall one of them", dist, (ep.name,))
                continue
            first[ep.name] = dist
            points.append((ep.name, dist, version))
            if allow is not None and ep.name not in allow:
                self.pm.set_blocked(ep.name)
                self.excluded[ep.name] = dist
        self._entry_points = [name for name, _, _ in points]
        for name, dist, version in points:
            self.pm.loaded = None
            with self.watch(name, "its import", dist):
                _, error = isolated(self.pm.load_setuptools_entrypoints, ENTRY_POINT_GROUP, name)
            if error is not None and self.pm.loaded is None:
                self._fail(name, "import", describe_error(error), dist)
            elif self.pm.loaded is not None:
                self._checked(self.pm.loaded, name, dist, version, False, error)
        for dist, ep in _near_miss_entry_points():
            self._notice(f"distribution {dist!r} declares entry point {ep.name!r} in group {ep.group!r}, which "
                         f"torchhal does not read: plugins register under group {ENTRY_POINT_GROUP!r} "
                         f"([project.entry-points.{ENTRY_POINT_GROUP}] in pyproject.toml)")
        for missing in sorted((allow or frozenset()) - set(first) - self._builtin_names):
            self._fail(missing, "import", f"named in {ALLOW_LIST_ENV} but no installed distribution has an entry "
                                          f"point {missing!r} in group {ENTRY_POINT_GROUP!r}")

    def collect_platforms(self) -> None:
        """Call each plugin's registration hook through pluggy, isolated; keep one platform a name."""
        candidates: list[RegisteredPlatform] = []
        for impl in plugins_implementing(self.pm, REGISTER_HOOK):
            source = impl.plugin_name
            dist, version, builtin = self._provenance.get(source, ("<unknown distribution>", "?", False))
            with self.watch(source, f"its {REGISTER_HOOK}()", dist):
                results, error = call_plugin(self.pm, REGISTER_HOOK, impl.plugin)
            if error is None:  # reading what it returned runs its code too (isinstance, repr)
                found, error = isolated(self._platforms_of, results, source, dist, version, builtin)
                candidates += found or []
            if error is not None:
                self._fail(source, "register", describe_error(error), dist)
        self._resolve(candidates)

    def _platforms_of(self, results: list[object], source: str, dist: str, version: str,
                      builtin: bool) -> list[RegisteredPlatform]:
        """The platforms a plugin's hook returned that this host can run: PlatformPlugins of its SPI major."""
        found = []
        for returned in results:  # pluggy: one result per implementation
            for item in returned if isinstance(returned, (list, tuple)) else [returned]:
                if not isinstance(item, PlatformPlugin):
                    returned_text = f"{type(item).__name__} {short_repr(item)}"
                    self._fail(source, "validate", f"{REGISTER_HOOK} returned {returned_text}; return instances of "
                                                   "torchhal.PlatformPlugin", dist)
                    continue
                cls = type(item)
                (major, minor), ours = cls.spi_version, ".".join(map(str, SPI_VERSION))
                if major != SPI_VERSION[0]:
                    self._fail(source, "version", (
                        f"{cls.__name__} (platform {cls.name!r}) targets torchhal SPI {major}.{minor}, but this "
                        f"torchhal implements SPI {ours}; install a {cls.name!r} plugin release built for SPI "
                        f"{SPI_VERSION[0]}.x, or a torchhal release implementing SPI {major}.x"), dist, (cls.name,))
                    continue
                if minor > SPI_VERSION[1]:
                    self._notice(f"plugin {source!r} ({dist}): {cls.__name__} targets SPI {major}.{minor}, newer "
                                 f"than this torchhal's SPI {ours}; members added after {ours} are not called. "
                                 "Upgrade torchhal")
                found.append(RegisteredPlatform(item, source, dist, version, builtin))
        return found

    # -- one platform a name --------------------------------------------------------
    def _resolve(self, candidates: list[RegisteredPlatform]) -> None:
        """Keep one platform per name, recording each conflict: a name one plugin returned twice, rival
        replacements of one platform, rival owners of one name (a replacement of its own name wins,
        then a built-in); then apply the replacements."""
        def drop(regs: list[RegisteredPlatform]) -> None:
            candidates[:] = [reg for reg in candidates if all(reg is not gone for gone in regs)]

        repeats = Counter((reg.source, reg.name) for reg in candidates)
        for (source, name), count in repeats.items():
            if count > 1:
                twice = [reg for reg in candidates if (reg.source, reg.name) == (source, name)]
                self._fail(source, "conflict", f"plugin {source!r} returned platform {name!r} {count} times from "
                           f"{REGISTER_HOOK}; return one instance (one platform serves all its devices: each call "
                           "takes the device index)", twice[0].distribution, (name, source))
                drop(twice)
        for target in {reg.replaces for reg in candidates if reg.replaces}:
            rivals = [reg for reg in candidates if reg.replaces == target]
            if len(rivals) > 1:  # neither wins, the replaced one stays
                who = " and ".join(f"{r.source} (distribution {r.distribution})" for r in rivals)
                involves = (target, *dict.fromkeys(x for r in rivals for x in (r.name, r.source)))
                for reg in rivals:
                    self._fail(reg.source, "conflict", f"{who} each declare `replaces = {target!r}`; both are dropped "
                               f"and {target!r} is kept. Uninstall one of them", reg.distribution, involves)
                drop(rivals)
        for name in dict.fromkeys(reg.name for reg in candidates):
            regs = [reg for reg in candidates if reg.name == name]
            regs = [reg for reg in regs if reg.replaces == name] or regs
            builtin = next((reg for reg in regs if reg.builtin), None)
            for impostor in regs if builtin is not None else []:  # a built-in is displaced only through `replaces`
                if impostor is not builtin:
                    self._fail(impostor.source, "conflict", f"registers platform name {name!r}, which is torchhal's "
                               f"built-in {name!r} platform; the built-in is kept and this one dropped. Rename it, or "
                               f"declare `replaces = {name!r}` to replace the built-in", impostor.distribution,
                               (name, impostor.source))
            regs = [builtin] if builtin is not None else regs
            if len(regs) > 1:
                who = " and ".join(f"{r.source} (distribution {r.distribution})" for r in regs)
                self._fail(name, "conflict", f"platform name {name!r} is registered by {who}; uninstall one, or have "
                           f"one declare `replaces = {name!r}`", regs[-1].distribution,
                           (name, *dict.fromkeys(r.source for r in regs)))
            else:
                self.platforms[name] = regs[0]
        self._apply_replacements()  # last: only a replacer that kept its own name may drop what it replaces

    def _apply_replacements(self) -> None:
        """Drop the platforms that registered platforms replace. A replaced platform replaces
        nothing: in a chain (C replaces B, B replaces A) C drops B and A stays. Platforms that
        replace one another in a cycle are all dropped, as a conflict naming each."""
        replacer_of = {reg.replaces: reg for name, reg in self.platforms.items()
                       if reg.replaces not in (None, name) and reg.replaces in self.platforms}
        replaced: dict[str, RegisteredPlatform] = {}
        cycles: list[list[str]] = []
        for name in self.platforms:
            chain = [name]  # name, the platform replacing it, the one replacing that …
            while chain[-1] in replacer_of and replacer_of[chain[-1]].name not in chain:
                chain.append(replacer_of[chain[-1]].name)
            if chain[-1] in replacer_of:  # back at `name`: a cycle
                if name == min(chain):
                    cycles.append(chain)
            elif len(chain) % 2 == 0:  # the top of the chain stays, and every second one below it
                replaced[name] = replacer_of[name]
        for cycle in cycles:
            regs = [self.platforms.pop(name) for name in cycle]
            who = " and ".join(f"platform {reg.name!r} (plugin {reg.source!r}, distribution {reg.distribution}) "
                               f"declares `replaces = {reg.replaces!r}`" for reg in regs)
            involves = tuple(dict.fromkeys((*cycle, *(reg.source for reg in regs))))
            for reg in regs:
                self._fail(reg.source, "conflict", f"{who}: they replace one another in a cycle, so none applies "
                           "and all are dropped. Uninstall one of them, or remove its `replaces`", reg.distribution,
                           involves)
        for name, reg in replaced.items():
            del self.platforms[name]
            self.replaced[name] = reg

    def replacement_note(self, name: str) -> str | None:
        """Why platform `name` is not registered when a plugin's `replaces` dropped it, naming the platform
        to use instead; None when nothing replaced it."""
        reg = self.replaced.get(name)
        if reg is None:
            return None
        return (f"platform {name!r} was replaced by platform {reg.name!r} (plugin {reg.source!r}, "
                f"distribution {reg.distribution}), which declares `replaces = {name!r}`; name {reg.name!r} "
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
                error = TypeError(f"is_available() returned {type(result).__name__}; "
                                  "return Availability.yes() or Availability.no(reason)")
            if error is not None:
                # torchhal's own finding is said as it is; what the plugin raised, with its type
                said = str(error) if isinstance(error, (TimeoutError, DetectionReentryError)) else describe_error(error)
                self._fail(name, "detect", said, reg.distribution)
                result = Availability.no(f"detection {'timed out' if isinstance(error, TimeoutError) else 'failed'}: "
                                         f"{said}")
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
        thread = threading.Thread(target=_probe, args=(plugin, outcome), name=f"torchhal-detect-{type(plugin).name}",
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


def _near_miss_entry_points() -> list[tuple[str, metadata.EntryPoint]]:
    """(distribution, entry point) in a group that reads like torchhal's but is not it
    ("torchhal.platforms", "torch_hal", "TorchHAL"): their plugins would be silently absent.
    Other groups that merely start with "torchhal" may be another project's own."""
    def squashed(group: str) -> str:
        return "".join(c for c in group.lower() if c.isalnum())

    return [(dist.metadata["Name"] or "<unknown distribution>", ep)
            for dist in metadata.distributions() for ep in dist.entry_points
            if ep.group != ENTRY_POINT_GROUP and squashed(ep.group) in _NEAR_MISS_GROUPS]


def build_registry(
    builtins: Iterable[str] = DEFAULT_PLUGINS,
    *,
    entry_points: bool = True,
    allow: frozenset[str] | None | str = "env",
    extra: Iterable[tuple[object, str]] = (),
) -> PlatformRegistry:
    """Make a fresh registry. Tests pass `extra=[(plugin_obj, name)]` and no globals leak."""
    registry = PlatformRegistry(PluginManager(), detect_timeout_from_env())
    registry.load_builtins(builtins)
    if entry_points:
        registry.load_entry_points(allow_list_from_env() if allow == "env" else allow)  # type: ignore[arg-type]
    for plugin, name in extra:
        registry.add_plugin(plugin, name, "<in-process>", "0")
    registry.collect_platforms()
    return registry
