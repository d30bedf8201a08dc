"""Platform: the API engine code calls, wrapping one `PlatformPlugin` privately.

The SPI is written once, in `PlatformPlugin`. `Platform` adds only behaviour: the default
device index, index validation, release points, observers and tracing, and the one check
of what the plugin answers (`Platform._answer`: a record of the SPI's type, a device count).
An SPI call the API exposes unchanged (a pass-through) is the plugin's own bound method, set
on the instance when the platform is made, so calling it costs exactly the plugin's call. A
fact that cannot change for the process (`graph_support`, `ipc_support`, `attention_support`,
`linear_support`, `compile_support`, `virtual_memory_support`, `distributed_support`,
`oom_error_types`) is asked of the
plugin once, checked and kept as a value. Observer hooks fire only where the engine changes
memory or asks to trace.

How a hook reaches one plugin (`call_plugin`) lives here, below the registry, so neither the
API nor the registry needs the other.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

import pluggy
import torch

from torchhal.platforms.errors import PluginContractError, TorchhalPluginWarning, describe_error, isolated
from torchhal.platforms.plugin import PlatformPlugin
from torchhal.platforms.records import DeviceInfo, MemoryInfo, PeakMemory, ReleasePoint
from torchhal.values import as_index, short_repr

if TYPE_CHECKING:
    import torch.distributed as dist

    from torchhal.attention import AttentionBackend, AttentionChoice, AttentionSpec
    from torchhal.platforms.communicator import Communicator

_P = ParamSpec("_P")
_R = TypeVar("_R")


def call_plugin(pm: pluggy.PluginManager, hook_name: str, plugin: object,
                **kwargs: Any) -> tuple[Any, BaseException | None]:
    """Call `plugin`'s implementation of `hook_name` through pluggy, isolated: (its results, None) or
    (None, what it raised). pluggy's own call stops at the first implementation that raises; a host
    calls each plugin apart, so one plugin's failure is its own."""
    others = [impl.plugin for impl in getattr(pm.hook, hook_name).get_hookimpls() if impl.plugin is not plugin]
    return isolated(pm.subset_hook_caller(hook_name, others), **kwargs)


def plugins_implementing(pm: pluggy.PluginManager, hook_name: str) -> list[pluggy.HookImpl]:
    """One implementation of `hook_name` a plugin (a plugin may implement a hook twice: `call_plugin` calls both)."""
    return list({impl.plugin_name: impl for impl in getattr(pm.hook, hook_name).get_hookimpls()}.values())


def notify_observers(pm: pluggy.PluginManager, hook_name: str, **kwargs: Any) -> None:
    """Call every observer of `hook_name`, each isolated: one that raises or exits is warned about."""
    for impl in plugins_implementing(pm, hook_name):
        _, error = call_plugin(pm, hook_name, impl.plugin, **kwargs)
        if error is not None:
            warnings.warn(
                f"observer {impl.plugin_name!r} failed in {hook_name}: {describe_error(error)}",
                TorchhalPluginWarning,
                stacklevel=2,
            )


class _PassThrough(Generic[_P, _R]):
    """An SPI method the API exposes unchanged; typed from the SPI, bound per instance.

    `Platform._bind` puts the plugin's bound method in the instance dict, which
    shadows this (non-data) descriptor: a call is then the plugin's call and nothing else.
    """

    def __init__(self, spi_method: Callable[Concatenate[PlatformPlugin, _P], _R]) -> None:
        self.name = spi_method.__name__
        self.__doc__ = spi_method.__doc__

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _PassThrough[_P, _R]: ...
    @overload
    def __get__(self, obj: Platform, owner: type | None = None) -> Callable[_P, _R]: ...
    def __get__(self, obj: Platform | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj._plugin, self.name)  # only reached before binding


def _answer_contract(spi_method: Callable[..., Any]) -> tuple[Callable[[object], bool], str]:
    """What an SPI query's return annotation lets its answer be, as (a test, a phrase naming it):
    one record (`GraphSupport | None`: or None), a tuple of exception classes, or a count."""
    hint = typing.get_type_hints(spi_method)["return"]
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    optional = type(None) in options
    (kind,) = [option for option in options if option is not type(None)]
    if kind is int:
        return lambda value: as_index(value) is not None and value >= 0, "an int >= 0"  # type: ignore[operator]
    if typing.get_origin(kind) is tuple:  # tuple[type[BaseException], ...]
        item, _ = typing.get_args(kind)
        (base,) = typing.get_args(item)
        return (lambda value: isinstance(value, tuple) and all(
            isinstance(kind, type) and issubclass(kind, base) for kind in value),
            f"a tuple of {base.__name__} subclasses, e.g. (torch.OutOfMemoryError,)")
    assert isinstance(kind, type) and dataclasses.is_dataclass(kind), hint
    article = "an" if kind.__name__[0] in "AEIOU" else "a"
    return (lambda value: isinstance(value, kind) or (value is None and optional),
            f"{article} {kind.__name__}{' or None' if optional else ''}")


class _Fact(Generic[_R]):
    """An SPI query whose answer is fixed for the process: asked once, checked, then a plain value."""

    def __init__(self, spi_method: Callable[[PlatformPlugin], _R]) -> None:
        self.name = spi_method.__name__
        self.__doc__ = spi_method.__doc__

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _Fact[_R]: ...
    @overload
    def __get__(self, obj: Platform, owner: type | None = None) -> _R: ...
    def __get__(self, obj: Platform | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj._answer(self.name, getattr(obj._plugin, self.name)())
        obj.__dict__[self.name] = value  # later reads are an instance-dict hit
        return value


class Platform:
    """One platform, as engine code sees it. Obtain with `torchhal.current_platform()`."""

    # -- pass-throughs: the plugin's bound methods (see `_bind`) ---------------------
    current_device = _PassThrough(PlatformPlugin.current_device)
    runtime_version = _PassThrough(PlatformPlugin.runtime_version)
    is_out_of_memory = _PassThrough(PlatformPlugin.is_out_of_memory)
    pin_memory = _PassThrough(PlatformPlugin.pin_memory)
    use_stream = _PassThrough(PlatformPlugin.use_stream)
    new_event = _PassThrough(PlatformPlugin.new_event)
    can_access_peer = _PassThrough(PlatformPlugin.can_access_peer)

    # -- facts: asked of the plugin once ----------------------------------------------
    oom_error_types = _Fact(PlatformPlugin.oom_error_types)
    graph_support = _Fact(PlatformPlugin.graph_support)
    ipc_support = _Fact(PlatformPlugin.ipc_support)
    attention_support = _Fact(PlatformPlugin.attention_support)
    linear_support = _Fact(PlatformPlugin.linear_support)
    compile_support = _Fact(PlatformPlugin.compile_support)
    virtual_memory_support = _Fact(PlatformPlugin.virtual_memory_support)
    distributed_support = _Fact(PlatformPlugin.distributed_support)

    def __init__(
        self, plugin: PlatformPlugin, pm: pluggy.PluginManager, distribution: str, version: str
    ) -> None:
        cls = type(plugin)  # the class attributes, checked when the class was defined
        self._plugin = plugin  # private: engines use this API; tests use platforms.testing
        self.name: str = cls.name
        self.device_type: str = cls.device_type
        self.priority: int = cls.priority
        self.dist_backend: str = cls.dist_backend
        self.visible_devices_env: tuple[str, ...] = tuple(cls.visible_devices_env)
        self.distribution = distribution
        self.version = version
        self._pm = pm
        self._has_event_observers = bool(pm.hook.torchhal_engine_event.get_hookimpls())
        self._bind()

    def _bind(self) -> None:
        """Set each pass-through to the plugin's bound method; forget facts and the device count."""
        #: A device index below this passes without asking the plugin (see `_index`); 0: ask first.
        self._checked_count = 0
        for name in _PASS_THROUGHS:
            self.__dict__[name] = getattr(self._plugin, name, None)
        if getattr(self.__dict__["is_out_of_memory"], "__func__", None) is PlatformPlugin.is_out_of_memory:
            # The SPI's default asks the plugin for its types on every call; this reads the
            # checked fact instead, so a wrong answer is a contract error, not a TypeError.
            self.__dict__["is_out_of_memory"] = self._is_out_of_memory
        for name in FACTS:
            self.__dict__.pop(name, None)

    def _answer(self, call: str, value: _R) -> _R:
        """`value`, the plugin's answer to `call`, once it is what the SPI's annotation says it is."""
        test, must = _CONTRACTS[call]
        if not test(value):
            raise PluginContractError(
                f"platform {self.name!r}: {call}() returned {short_repr(value)}; it must return {must}")
        return value

    def _is_out_of_memory(self, error: BaseException) -> bool:
        return isinstance(error, self.oom_error_types)

    def __repr__(self) -> str:
        return f"<Platform {self.name} ({self.distribution} {self.version})>"

    # -- devices -----------------------------------------------------------------
    def device_for_rank(self, local_rank: int, local_world_size: int) -> int:
        """The device index local rank `local_rank` of `local_world_size` on this host uses (the
        plugin's `device_for_rank`, given plain ints with 0 <= local_rank < local_world_size)."""
        rank, size = as_index(local_rank), as_index(local_world_size)
        if rank is None or size is None or not 0 <= rank < size:
            raise ValueError(f"device_for_rank({local_rank!r}, {local_world_size!r}): need integers with "
                             "0 <= local_rank < local_world_size (this process's rank on its host, and the "
                             "host's number of ranks)")
        return self._plugin.device_for_rank(rank, size)

    def set_device(self, index: int) -> None:
        self._plugin.set_device(self._check_index(index))

    def device(self, index: int | None = None) -> torch.device:
        """`torch.device` for `index` (default: the current device)."""
        return torch.device(self.device_type, self._index(index))

    def synchronize(self, index: int | None = None) -> None:
        self._plugin.synchronize(self._index(index))

    def device_count(self) -> int:
        return self._answer("device_count", self._plugin.device_count())

    def device_info(self, index: int | None = None) -> DeviceInfo:
        return self._answer("device_info", self._plugin.device_info(self._index(index)))

    # -- memory ----------------------------------------------------------------------
    def memory_info(self, index: int | None = None) -> MemoryInfo:
        """Observe one device's memory. Never empties the cache, never synchronizes."""
        info = self._plugin.memory_info(self._index(index))
        return info if type(info) is MemoryInfo else self._answer("memory_info", info)  # exact type first: cheap

    def empty_cache(self, reason: ReleasePoint, index: int | None = None) -> int | None:
        """Empty the allocator cache at a named release point; fires `torchhal_cache_emptied`."""
        if not isinstance(reason, ReleasePoint):
            choices = ", ".join(f"ReleasePoint.{r.name}" for r in ReleasePoint)
            raise TypeError(
                f"empty_cache(reason={reason!r}): the reason must be a ReleasePoint "
                f"({choices}); emptying the cache is only allowed at a named release point"
            )
        device = self._index(index)
        released = self._plugin.empty_cache(device)
        notify_observers(
            self._pm,
            "torchhal_cache_emptied",
            platform=self,
            device=device,
            reason=reason,
            bytes_released=released,
        )
        return released

    def available_memory(self, group: Communicator | dist.ProcessGroup | None = None) -> int:
        """Free bytes on the current device; with `group`, the minimum across its ranks.

        `group` is a `torchhal.distributed.Communicator` (a `DeviceGroup`'s `host`, say) or a
        torch.distributed ProcessGroup; either must reduce CPU tensors (gloo does, on any
        platform).
        """
        free = self.memory_info().free
        if group is None:
            return free
        import torch.distributed as dist

        from torchhal.platforms.communicator import Communicator

        value = torch.tensor([free], dtype=torch.int64)
        if isinstance(group, dist.ProcessGroup):
            dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
        elif isinstance(group, Communicator):
            group.all_reduce(value, "min")
        else:
            raise TypeError(
                f"available_memory(group={group!r}): pass a torchhal.distributed.Communicator "
                "(e.g. DeviceGroup.host) or a torch.distributed ProcessGroup"
            )
        return int(value.item())

    def peak_memory(self, index: int | None = None) -> PeakMemory:
        """Peak reserved/allocated bytes since the last `reset_peak_memory` (benchmarks, reports)."""
        return self._plugin.peak_memory(self._index(index))

    def reset_peak_memory(self, index: int | None = None) -> None:
        """Start a new peak measurement. Changes no memory, only the counters."""
        self._plugin.reset_peak_memory(self._index(index))

    def report_out_of_memory(self, error: BaseException, context: str, index: int | None = None) -> None:
        """Tell observers an OOM was caught (call before emptying with ReleasePoint.OOM)."""
        notify_observers(
            self._pm,
            "torchhal_out_of_memory",
            platform=self,
            device=self._index(index),
            error=error,
            context=context,
        )

    # -- streams ---------------------------------------------------------------------
    def new_stream(self, index: int | None = None) -> Any:
        return self._plugin.new_stream(self._index(index))

    def current_stream(self, index: int | None = None) -> Any:
        return self._plugin.current_stream(self._index(index))

    # -- IPC -------------------------------------------------------------------------
    def set_ipc_peer_redirect(self, enabled: bool) -> None:
        """Open IPC handles through the consumer's device (True) or the producer's (False).

        For measuring what the redirect saves, in one process: False is torch's default
        open. True is allowed only where the plugin declares the redirect.
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"set_ipc_peer_redirect({enabled!r}): pass True or False")
        if enabled and not type(self._plugin).ipc_peer_redirect:
            raise ValueError(
                f"platform {self.name!r} does not declare peer-redirected IPC opens "
                "(ipc_peer_redirect = False); only set_ipc_peer_redirect(False) applies"
            )
        vars(self._plugin)["ipc_peer_redirect"] = enabled  # this plugin instance only
        self.__dict__.pop("ipc_support", None)  # its record states the redirect: ask again

    # -- attention -------------------------------------------------------------------
    @property
    def attention_backends(self) -> tuple[AttentionBackend, ...]:
        """The plugin's attention backends in its order of preference, then torchhal's reference."""
        from torchhal.attention import ReferenceBackend

        support = self.attention_support
        return (*(support.backends if support is not None else ()), ReferenceBackend())

    def choose_attention(self, spec: AttentionSpec) -> AttentionChoice:
        """The backend for a model's attention and one line saying why (engines call this,
        never a kernel library): the first plugin backend that runs `spec`, else the reference."""
        from torchhal.attention import choose_backend

        *declared, reference = self.attention_backends
        return choose_backend(tuple(declared), spec, reference)

    # -- observers -------------------------------------------------------------------
    def notify_component_moved(self, component: str, source: str, destination: str, nbytes: int) -> None:
        notify_observers(
            self._pm,
            "torchhal_component_moved",
            component=component,
            source=source,
            destination=destination,
            nbytes=nbytes,
        )

    @property
    def traces_events(self) -> bool:
        """True when some plugin observes engine events (skip building them otherwise)."""
        return self._has_event_observers

    def emit_event(self, event: dict[str, Any]) -> None:
        if self._has_event_observers:
            notify_observers(self._pm, "torchhal_engine_event", event=event)

    # -- helpers -----------------------------------------------------------------------
    def _index(self, index: int | None) -> int:
        """The device index a plugin call gets: the current device for None, else `index` checked.
        An index below a device count already seen costs a type check and two compares (a hot path)."""
        if index is None:
            return self.current_device()
        if type(index) is int and 0 <= index < self._checked_count:
            return index
        return self._check_index(index)

    def _check_index(self, index: object) -> int:
        """`index` as a plain int once the plugin's device_count() says it exists, else a named error."""
        count = self.device_count()
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"device index {index!r} ({type(index).__name__}) for platform {self.name!r} is not an "
                            f"int; use 0..{max(count - 1, 0)}")
        if not 0 <= index < max(count, 1):
            raise ValueError(
                f"device index {index!r} is out of range for platform {self.name!r} "
                f"with {count} device(s); use 0..{max(count - 1, 0)}"
            )
        self._checked_count = max(count, 1)
        return int(index)  # an int subclass (IntEnum …) reaches the plugin as a plain int


def check_platform_argument(platform: object, where: str = "") -> None:
    """Refuse a `platform=` argument that is neither a Platform nor None (naming `where`, the call).
    An object standing in for one (a wrapper that delegates to a Platform) passes if it has
    the calls every user makes first."""
    stands_in = all(callable(getattr(platform, name, None)) for name in ("device", "current_device", "memory_info"))
    if platform is not None and not isinstance(platform, Platform) and not stands_in:
        raise TypeError(f"{where + ': ' if where else ''}platform = {platform!r} must be a torchhal Platform "
                        "(torchhal.get_platform(name) gives one), or None for the current platform")


_PASS_THROUGHS: tuple[str, ...] = tuple(n for n, v in vars(Platform).items() if isinstance(v, _PassThrough))
FACTS: tuple[str, ...] = tuple(n for n, v in vars(Platform).items() if isinstance(v, _Fact))
#: What `Platform` checks of the plugin's answers, where it receives them: call -> (test, what it must be).
_CONTRACTS = {name: _answer_contract(getattr(PlatformPlugin, name))
              for name in (*FACTS, "device_count", "device_info", "memory_info")}
