"""PlatformPlugin: the SPI a vendor implements, written once.

This class is the single written form of the SPI. `SPI_METHODS` and `SPI_ATTRIBUTES` are
read from it, `Platform` exposes its methods without restating them, and its docstrings
are the SPI's text: `torchhal plugin new` writes the first paragraph of each as the
member's guidance, and the "Class attributes" and "Methods" of docs/spi-reference.md are
rendered from them (tests/test_spi_reference.py checks the file is what they render).

A vendor subclasses `PlatformPlugin`, fills in the class attributes and the abstract
methods, and returns an instance from the `torchhal_register_platforms` hook. The class
attributes are checked when the subclass is defined (`__init_subclass__`): a bad value is
a `PluginContractError` at the plugin's import, naming the class, the attribute and the
fix. Everything else has a default written against the device module's CUDA-style API
(`Stream`, `current_stream`, `synchronize` …), which torch.cuda, torch.xpu, torch.npu and
torch.musa all mirror.
"""

from __future__ import annotations

import abc
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, ClassVar

import torch

from torchhal.platforms.errors import PluginContractError
from torchhal.platforms.records import (
    AttentionSupport,
    Availability,
    CompileSupport,
    DeviceInfo,
    DistributedSupport,
    GraphSupport,
    IpcSupport,
    LinearSupport,
    MemoryInfo,
    PeakMemory,
    VirtualMemorySupport,
)
from torchhal.values import short_repr

#: The SPI version this torchhal implements: (major, minor). A minor release only adds
#: members, each with a default; a major release may remove or change members.
#: docs/vendor-guide.md ("Compatibility") states the policy; CHANGELOG.md what each version added.
SPI_VERSION: tuple[int, int] = (1, 9)

NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")  # used with fullmatch: no trailing newline


class PlatformPlugin(abc.ABC):
    """The platform plugin SPI: one instance serves every device of its platform."""

    name: ClassVar[str]
    """Unique platform name, a lowercase identifier (`myaccel`). `TORCHHAL_PLATFORM=name` and
    `torchhal conformance --platform name` select it."""
    device_type: ClassVar[str]
    """The torch device type string tensors of this platform carry (`torch.device(device_type, index)`).

    Several platforms may share one (ROCm uses `cuda`; a CPU-backed simulator uses `cpu`)."""
    priority: ClassVar[int] = 50
    """Which available platform wins when none is named: higher wins; the CPU is 0.

    Simulators go below 0, the built-in accelerators are at 90 and 100 (the SPI reference's
    "Priority ranges")."""
    replaces: ClassVar[str | None] = None
    """Name of a platform registered by another distribution that this one replaces (a vendor's
    own build of a built-in), or None.

    Only a plugin that is itself registered replaces: one dropped as a conflict, or replaced in
    turn, replaces nothing (C replaces B and B replaces `cpu`: B is dropped and `cpu` stays).
    Platforms that replace one another in a cycle are all dropped, each with a `conflict` naming
    them all. Naming the replaced platform (`TORCHHAL_PLATFORM`, `--platform`) is then an error
    naming the platform that replaced it."""
    dist_backend: ClassVar[str]
    """The `torch.distributed` backend for this platform's devices (`nccl`, `gloo`, `hccl` …).

    A name torch lacks must be registered by the extension the plugin imports
    (`torch.distributed.Backend.register_backend`); the `distributed` conformance group initialises it."""
    visible_devices_env: ClassVar[tuple[str, ...]] = ()
    """Environment variables that restrict which devices the runtime sees (`CUDA_VISIBLE_DEVICES`
    …), a tuple.

    Shown by `torchhal info` and in the conformance report header."""
    ipc_peer_redirect: ClassVar[bool] = False
    """True if your IPC open maps handles through the consumer's own device where peer access exists.

    See `IpcSupport.peer_redirect`; `Platform.set_ipc_peer_redirect(False)` turns it off for one process."""
    spi_version: ClassVar[tuple[int, int]] = (SPI_VERSION[0], 0)
    """The SPI version the plugin was written for, `(major, minor)`.

    The host refuses another major, naming both versions; an older minor works, a newer minor
    works with a notice. Left out, a plugin uses only what every release of the current major
    provides."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        problem = _attribute_problem(cls)
        if problem is not None:
            raise PluginContractError(problem)

    # -- detection ----------------------------------------------------------
    @abc.abstractmethod
    def is_available(self) -> Availability:
        """Cheap, idempotent, never raises, initialises no device: find_spec your extension, count
        devices, and return `Availability.no("why, and what to install")` on any problem.

        The registry calls it to decide whether this platform can be used here. It creates no
        device context (the suite checks, in a fresh process, that
        `device_module().is_initialized()` is still false afterwards, so your device module should
        offer `is_initialized()`); catch `ImportError`, `RuntimeError`, `OSError`. Import the vendor
        runtime lazily, inside methods: `import torchhal` must never import it. It must not call
        torchhal's platform API (`torchhal.registry()`, `current_platform()`, `get_platform()`,
        `list_platforms()`): detection holds the registry's locks, so such a call would wait for the
        detection it is part of; the host records a `detect` failure saying so, at once. A probe
        that does not return within `TORCHHAL_DETECT_TIMEOUT` seconds counts as a no."""

    # -- device -------------------------------------------------------------
    @abc.abstractmethod
    def device_module(self) -> ModuleType:
        """Return your torch device module (`torch.myaccel`), imported here, lazily.

        The defaults below call it. Conventions the conformance suite relies on:
        `is_initialized()` (detection leaves it false), and, where you keep the defaults,
        `device_count`, `current_device`, `set_device`, `synchronize`, `Stream`, `current_stream`,
        `stream`, `Event`, `max_memory_reserved`, `max_memory_allocated`, `reset_peak_memory_stats`,
        `can_device_access_peer`. The memory tests spy on its `empty_cache` and `synchronize` (if it
        has them) while calling `memory_info`."""

    def device_count(self) -> int:
        """Devices visible to this process (after the `visible_devices_env` restriction).

        Default: `int(device_module().device_count())`. `0` means unavailable: say so in
        `is_available`."""
        return int(self.device_module().device_count())

    def current_device(self) -> int:
        """The index work goes to when none is given.

        Default: `int(device_module().current_device())`."""
        return int(self.device_module().current_device())

    def set_device(self, index: int) -> None:
        """Make `index` current for this thread.

        Default: `device_module().set_device(index)`. `Platform.set_device` refuses an
        out-of-range index before calling you."""
        self.device_module().set_device(index)

    def synchronize(self, index: int) -> None:
        """Wait until all queued work on `index` finished.

        Default: `device_module().synchronize(index)`."""
        self.device_module().synchronize(index)

    @abc.abstractmethod
    def device_info(self, index: int) -> DeviceInfo:
        """Return `DeviceInfo(index, name, total_memory, capability)`: static facts of one device,
        total memory in bytes above 0, capability `(major, minor)` or None.

        `DeviceInfo` checks its fields where it is made (see [`DeviceInfo`](#deviceinfo));
        `torchhal info` reports the error as a `query` plugin error."""

    def runtime_version(self) -> str | None:
        """Your driver / runtime version string, for `torchhal info` and the conformance report header.

        Default: `None` (unknown)."""
        return None

    # -- memory -------------------------------------------------------------
    @abc.abstractmethod
    def memory_info(self, index: int) -> MemoryInfo:
        """Return `MemoryInfo(index, free, total, reserved, allocated)` in int bytes; only observe:
        no empty_cache, no synchronize, no other device; well under a millisecond.

        Free and total come from your `mem_get_info`, reserved and allocated from your caching
        allocator. Engines call it on hot paths. Where free memory cannot be queried, return
        `total - reserved` with `estimated=True`. Without a caching allocator, leave `reserved` and
        `allocated` as `None` (the memory tests that need them are then "not applicable"). With
        one, a free must keep the block cached (`reserved` unchanged) until `empty_cache`."""

    @abc.abstractmethod
    def empty_cache(self, index: int) -> int | None:
        """Return the allocator's cached blocks on `index` to the device; return the bytes released
        (`reserved_before - reserved_after`), or `None` if you cannot tell.

        It brings `reserved` down to about `allocated`. Engines reach it only through
        `Platform.empty_cache(reason, ...)` with a `ReleasePoint`."""

    @abc.abstractmethod
    def oom_error_types(self) -> tuple[type[BaseException], ...]:
        """Return the exception classes an out-of-memory allocation raises on this platform.

        A non-empty tuple of classes, asked once per process and kept."""

    def is_out_of_memory(self, error: BaseException) -> bool:
        """True if `error` is this platform's out-of-memory failure.

        Default: `isinstance(error, oom_error_types())`. Override where the runtime raises a
        generic error for OOM (the CPU platform recognises torch's `RuntimeError` "can't allocate
        memory"). The suite allocates eight times the device's memory and checks that this returns
        True for what was raised. Engines ask it on the path of an error already raised; a rule
        that itself raises is warned about (`TorchhalPluginWarning`) and the error is handled as not
        an OOM, so the engine's rollback still runs and the original error propagates."""
        return isinstance(error, self.oom_error_types())

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor in page-locked memory, for asynchronous host/device copies.

        Default: `tensor.pin_memory()`. A platform whose device memory is host memory returns `tensor`."""
        return tensor.pin_memory()

    def peak_memory(self, index: int) -> PeakMemory:
        """The allocator's high-water marks (bytes) since the last `reset_peak_memory`.

        Default: from `max_memory_reserved(index)` / `max_memory_allocated(index)`; `None` fields
        where the backend keeps no such counter."""
        module = self.device_module()
        return PeakMemory(index, int(module.max_memory_reserved(index)), int(module.max_memory_allocated(index)))

    def reset_peak_memory(self, index: int) -> None:
        """Start a new peak measurement on `index`.

        Default: `device_module().reset_peak_memory_stats(index)`."""
        self.device_module().reset_peak_memory_stats(index)

    def can_access_peer(self, index: int, peer: int) -> bool:
        """True if device `index` can map memory of device `peer` directly (IPC peer redirect uses it).

        Default: `bool(device_module().can_device_access_peer(index, peer))`."""
        return bool(self.device_module().can_device_access_peer(index, peer))

    # -- streams and events ---------------------------------------------------
    def new_stream(self, index: int) -> Any:
        """A new stream on `index`; it must work with `use_stream` and as the argument of an event's
        `record`/`wait`.

        Default: `device_module().Stream(device=index)`."""
        return self.device_module().Stream(device=index)

    def current_stream(self, index: int) -> Any:
        """The current stream of `index`; cheap: engines call it on hot paths.

        Default: `device_module().current_stream(index)`. The IPC transport calls it once per
        message on each side: where the runtime builds a new stream object per call (torch.cuda
        does, under a device guard: ~3 µs), keep one object per stream, as the CUDA plugin does
        (keyed by the runtime's stream id, ~0.2 µs)."""
        return self.device_module().current_stream(index)

    @contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        """Work issued inside goes to `stream`.

        Default: a context manager around `device_module().stream(stream)`. Written as a generator;
        the base class decorates it with `contextlib.contextmanager`, and so must an override."""
        with self.device_module().stream(stream):
            yield

    def new_event(self) -> Any:
        """An event with `record(stream)`, `wait(stream)`, `synchronize()` and `query()`.

        Default: `device_module().Event()`."""
        return self.device_module().Event()

    # -- capabilities (None = unsupported) ------------------------------------
    def graph_support(self) -> GraphSupport | None:
        """Return a `GraphSupport` to declare device graphs.

        Default: `None` (graphs unsupported; the `graphs` conformance group is skipped as
        undeclared). Asked once per process and kept."""
        return None

    def ipc_support(self) -> IpcSupport | None:
        """Return an `IpcSupport` to declare cross-process tensor sharing.

        Default: `None` (IPC unsupported; the `ipc` group is skipped as undeclared). Asked once per
        process and kept."""
        return None

    def attention_support(self) -> AttentionSupport | None:
        """Return an `AttentionSupport` naming your attention backends over the paged KV cache
        (`torchhal.attention.AttentionBackend`).

        Default: `None` (engines get torchhal's portable reference backend, and the `attention`
        conformance group is skipped as undeclared). Since SPI 1.2. Asked once per process and
        kept. Import your kernel library inside this method, and return `None` where it is not
        installed. See [Attention backends](#attention-backends) for the protocol a backend
        implements."""
        return None

    def linear_support(self) -> LinearSupport | None:
        """Return a `LinearSupport` naming your kernel for linears of few rows (decode):
        `kernel(x [M, K], weight [N, K], bias or None) -> [M, N]` with F.linear's numbers.

        Default: `None` (engines run every projection through `torch.nn.functional.linear`, and the
        `linear` conformance group is skipped as undeclared). Since SPI 1.4. Asked once per process
        and kept. Import your kernel library inside this method and return `None` where it is not
        installed. Built-in: CUDA declares `triton-gemv` (one row, float16/bfloat16, capturable)
        when Triton is importable."""
        return None

    def compile_support(self) -> CompileSupport | None:
        """Return a `CompileSupport` with inductor options for the layers engines compile, e.g.
        `{"triton.enable_pdl": True}`; result-neutral options only.

        Default: `None` (engines compile layers with inductor's defaults, and the `compile`
        conformance group is skipped as undeclared). Since SPI 1.5. Asked once per process and
        kept. Engines pass the options to `torch.compile(backend="inductor", options=...)` and to
        no other backend. Built-in: CUDA asks for `{"triton.enable_pdl": True}` on sm_90 and later
        when Triton is importable and `TORCHHAL_CUDA_PDL` is not `0`."""
        return None

    def virtual_memory_support(self) -> VirtualMemorySupport | None:
        """Return a `VirtualMemorySupport` whose `new_regions(device_index)` makes tagged regions:
        allocations whose physical memory is released (with or without a host backup) and
        restored under the same device addresses, and say whether graph memory can live in one.

        Default: `None` (engines sleep by host offload: the weights move to page-locked host
        memory, the KV cache and graphs are dropped and captured again on wake; the
        `virtual_memory` conformance group is skipped as undeclared). Since SPI 1.9. Asked once
        per process and kept. `torchhal.plugins.virtual_memory.Regions` implements the regions
        over any runtime's reserve / create / map / unmap calls. Built-in: CUDA (`cuMemCreate` /
        `cuMemMap`, graph memory in a `MemPool` region), NPU (`aclrtMallocPhysical` /
        `aclrtMapMem`, tensors through torch_npu's `MemPool`, graph memory not in regions), the
        CPU reference (host pages given back with `madvise`)."""
        return None

    # -- distributed ------------------------------------------------------------------
    def device_for_rank(self, local_rank: int, local_world_size: int) -> int:
        """The device index local rank `local_rank` (of `local_world_size` ranks on this host) uses.

        Default: `local_rank` when at least `local_world_size` devices are visible; `0` when one
        device is visible and a `visible_devices_env` variable is set (a launcher that pins each
        rank to its own device); otherwise a `ValueError` naming the rank count, the device count,
        each set variable with its value, and the fix. Indices count the devices this process
        sees, after the runtime applied the visible-devices variables: with
        `CUDA_VISIBLE_DEVICES=3,5`, local rank 1 uses index 1 (physical GPU 5).
        `torchhal.distributed.init_group` asks it on every rank and makes the answer current.
        Since SPI 1.3."""
        count = self.device_count()
        if local_world_size <= count:
            return local_rank
        if count == 1 and any(os.environ.get(var) for var in self.visible_devices_env):
            return 0  # one device made visible per rank
        shown = ", ".join(f"{var}={os.environ[var]!r}" for var in self.visible_devices_env if var in os.environ)
        raise ValueError(
            f"{local_world_size} local ranks need {local_world_size} {self.name} devices, but {count} "
            f"{'is' if count == 1 else 'are'} visible{f' ({shown})' if shown else ''}: start at most {count} "
            f"rank(s) on this host, or make more devices visible"
        )

    def distributed_support(self) -> DistributedSupport:
        """Return a `DistributedSupport` to supply your own communicator (a function given torchhal's
        default one, returning a wrapper that replaces e.g. `all_reduce`) or to declare collectives
        graph-capturable (only if they record into your device graphs and replay).

        Default: `DistributedSupport()`: torch.distributed's backend for `dist_backend`, called
        directly on torchhal's own process groups, not graph-capturable. Since SPI 1.3. Asked once
        per process and kept. See [`DistributedSupport`](#distributedsupport)."""
        return DistributedSupport()


#: The SPI methods, in documentation order: read from `PlatformPlugin` itself, never listed by hand.
SPI_METHODS: tuple[str, ...] = tuple(name for name, value in vars(PlatformPlugin).items()
                                     if not name.startswith("_") and callable(value))
#: The SPI class attributes, in documentation order, read from `PlatformPlugin`'s annotations.
SPI_ATTRIBUTES: tuple[str, ...] = tuple(name for name in PlatformPlugin.__annotations__ if not name.startswith("_"))
#: The class attributes a platform (a class with a `name`) must have: PlatformPlugin gives them no value.
REQUIRED_ATTRIBUTES: tuple[str, ...] = tuple(name for name in SPI_ATTRIBUTES if not hasattr(PlatformPlugin, name))


def _is_name(value: object) -> bool:
    return type(value) is str and NAME_PATTERN.fullmatch(value) is not None


def _is_text(value: object) -> bool:
    return type(value) is str and bool(value)


#: Attribute -> (test of its value, what it must be). Exact types: a str or int subclass would run
#: the plugin's own code (`__hash__`, `__eq__` …) wherever the host keys or compares the value.
_ATTRIBUTE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "name": (_is_name, "a lowercase identifier such as 'myaccel'"),
    "device_type": (_is_text, "a str: the torch device type its tensors carry"),
    "priority": (lambda v: type(v) is int, "an int: higher wins; the CPU is 0"),
    "replaces": (lambda v: v is None or _is_name(v), "None or one platform name, e.g. 'cuda'"),
    "dist_backend": (_is_text, "a str: the torch.distributed backend, e.g. 'gloo'"),
    # A list is taken as a tuple (the conformance suite flags it); a bare str would be split into letters.
    "visible_devices_env": (lambda v: type(v) in (tuple, list) and all(map(_is_text, v)),
                            "a tuple of environment variable names, e.g. ('MYACCEL_VISIBLE_DEVICES',), or () for none"),
    "ipc_peer_redirect": (lambda v: type(v) is bool, "True or False"),
    "spi_version": (lambda v: type(v) is tuple and len(v) == 2 and all(type(p) is int and p >= 0 for p in v),
                    f"(major, minor), e.g. {SPI_VERSION!r}"),
}


def _attribute_problem(cls: type) -> str | None:
    """Why `cls`'s SPI class attributes cannot work, or None. A class that names a platform needs
    every required attribute; one without a name (a shared base) is checked on what it sets."""
    name = getattr(cls, "name", None)
    where = f"{cls.__name__} (platform {name!r})" if _is_name(name) else cls.__name__
    for attribute, (test, must) in _ATTRIBUTE_RULES.items():
        if not hasattr(cls, attribute):
            if attribute in REQUIRED_ATTRIBUTES and hasattr(cls, "name"):
                return f"{where}: {attribute} is not set; it must be {must}"
            continue
        value = getattr(cls, attribute)
        if not test(value):
            return f"{where}: {attribute} is {short_repr(value)}; it must be {must}"
    return None
