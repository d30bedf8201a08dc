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
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from torchhal.platforms import hookspecs
from torchhal.platforms.errors import TorchhalPluginWarning
from torchhal.platforms.plugin import PlatformPlugin
from torchhal.platforms.records import Availability, PluginFailure

ENTRY_POINT_GROUP = "torchhal"
ALLOW_LIST_ENV = "TORCHHAL_PLUGINS"
DEFAULT_PLUGINS: tuple[str, ...] = (
    "torchhal.plugins.cpu",
    "torchhal.plugins.cuda",
    "torchhal.plugins.rocm",
    "torchhal.plugins.xpu",
    "torchhal.plugins.npu",
    "torchhal.plugins.musa",
)
_NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class RegisteredPlatform:
    """One registered platform plugin and where it came from."""

    plugin: PlatformPlugin
    source: str  # the pluggy plugin name: module path or entry-point name
    distribution: str
    version: str


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

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self.platforms: dict[str, RegisteredPlatform] = {}
        self.failures: list[PluginFailure] = []
        self._availability: dict[str, Availability] = {}
        self._provenance: dict[str, tuple[str, str]] = {}  # pluggy name -> (dist, version)

    # -- loading ---------------------------------------------------------------
    def _record_failure(self, failure: PluginFailure) -> None:
        self.failures.append(failure)
        warnings.warn(str(failure), TorchhalPluginWarning, stacklevel=3)

    def add_plugin(self, plugin: object, name: str, distribution: str, version: str) -> bool:
        """Register one pluggy plugin (module or object); reject unknown hooks."""
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # pluggy raises ValueError / PluginValidationError
            self._record_failure(PluginFailure(name, "register", f"{type(exc).__name__}: {exc}", distribution))
            return False
        unknown = [
            caller.name
            for caller in self.pm.get_hookcallers(plugin) or []
            if not caller.has_spec()
        ]
        if unknown:
            self.pm.unregister(plugin)
            known = [n for n in dir(hookspecs) if n.startswith("torchhal_")]
            hints = []
            for hook_name in unknown:
                close = difflib.get_close_matches(hook_name, known, n=1)
                hints.append(f"{hook_name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            self._record_failure(
                PluginFailure(name, "register", "unknown hook " + ", ".join(hints), distribution)
            )
            return False
        self._provenance[name] = (distribution, version)
        return True

    def load_builtins(self, modules: Iterable[str]) -> None:
        version = _torchhal_version()
        for module_name in modules:
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:
                self._record_failure(PluginFailure(module_name, "import", f"{type(exc).__name__}: {exc}", "torchhal"))
                continue
            self.add_plugin(module, module_name, "torchhal", version)

    def load_entry_points(self, allow: frozenset[str] | None) -> None:
        seen: set[str] = set()
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allow is not None and ep.name not in allow:
                continue
            seen.add(ep.name)
            dist = ep.dist.name if ep.dist is not None else "<unknown distribution>"
            version = ep.dist.version if ep.dist is not None else "?"
            try:
                plugin = ep.load()
            except Exception as exc:
                self._record_failure(PluginFailure(ep.name, "import", f"{type(exc).__name__}: {exc}", dist))
                continue
            self.add_plugin(plugin, ep.name, dist, version)
        for missing in sorted((allow or frozenset()) - seen):
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
            try:
                result = impl.function()
            except Exception as exc:
                self._record_failure(PluginFailure(impl.plugin_name, "register", f"{type(exc).__name__}: {exc}", dist))
                continue
            for item in result if isinstance(result, (list, tuple)) else [result]:
                problem = _validate_platform_object(item)
                if problem:
                    self._record_failure(PluginFailure(impl.plugin_name, "validate", problem, dist))
                    continue
                assert isinstance(item, PlatformPlugin)
                candidates.setdefault(item.name, []).append(
                    RegisteredPlatform(item, impl.plugin_name, dist, version)
                )
        self._resolve_conflicts(candidates)

    def _resolve_conflicts(self, candidates: dict[str, list[RegisteredPlatform]]) -> None:
        replaced = {
            reg.plugin.replaces: reg
            for regs in candidates.values()
            for reg in regs
            if reg.plugin.replaces
        }
        for name, regs in candidates.items():
            if name in replaced:
                winner = replaced[name]
                if winner.plugin.name != name:
                    continue  # replaced by a platform of another name
                regs = [winner]
            if len(regs) > 1:
                who = " and ".join(f"{r.source} (distribution {r.distribution})" for r in regs)
                self._record_failure(
                    PluginFailure(
                        name,
                        "conflict",
                        f"platform name {name!r} is registered by {who}; uninstall one, or "
                        f"have one declare `replaces = {name!r}`",
                        regs[-1].distribution,
                    )
                )
                continue
            self.platforms[name] = regs[0]

    # -- queries ---------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self.platforms)

    def conflict_for(self, name: str) -> PluginFailure | None:
        return next((f for f in self.failures if f.stage == "conflict" and f.plugin == name), None)

    def availability(self, name: str) -> Availability:
        """Detect once per registry; an `is_available` that raises counts as 'no'."""
        cached = self._availability.get(name)
        if cached is not None:
            return cached
        reg = self.platforms[name]
        try:
            result = reg.plugin.is_available()
            if not isinstance(result, Availability):
                raise TypeError(
                    f"is_available() returned {type(result).__name__}; "
                    "return Availability.yes() or Availability.no(reason)"
                )
        except Exception as exc:
            self._record_failure(PluginFailure(name, "detect", f"{type(exc).__name__}: {exc}", reg.distribution))
            result = Availability.no(f"detection failed: {type(exc).__name__}: {exc}")
        self._availability[name] = result
        return result


def _validate_platform_object(item: Any) -> str | None:
    if not isinstance(item, PlatformPlugin):
        return (
            f"torchhal_register_platforms returned {type(item).__name__!s} {item!r}; "
            "return instances of torchhal.PlatformPlugin"
        )
    cls = type(item).__name__
    name = getattr(item, "name", None)
    if not isinstance(name, str) or not _NAME_PATTERN.match(name):
        return f"{cls}.name is {name!r}; use a lowercase identifier such as 'myaccel'"
    for attr, kind in (("device_type", str), ("dist_backend", str), ("priority", int)):
        value = getattr(item, attr, None)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{cls}.{attr} is {value!r}; it must be a {kind.__name__}"
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
    registry = PlatformRegistry(new_plugin_manager())
    registry.load_builtins(builtins)
    if entry_points:
        registry.load_entry_points(allow_list_from_env() if allow == "env" else allow)  # type: ignore[arg-type]
    for plugin, name in extra:
        registry.add_plugin(plugin, name, "<in-process>", "0")
    registry.collect_platforms()
    return registry

