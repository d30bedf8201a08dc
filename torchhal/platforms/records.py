"""Typed, frozen records that cross the plugin boundary.

Hook results and SPI return values are records, never loose tuples or dicts. Each record
checks its fields where it is made, in one rule table per record (`_check`), so a plugin's
bad value is named at its source: a hole in a declared capability is never met later as
"'NoneType' object is not callable". A new record lists its rules the same way.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from torchhal.values import short_repr

if TYPE_CHECKING:  # the protocol lives with the reference backend, which imports nothing from here
    from torchhal.attention import AttentionBackend
    from torchhal.platforms.communicator import Communicator

#: One rule: (field label, its value, whether the value passes, what it must be, the error raised).
#: Rules are judged in order: a rule on a value's range may assume the type rule before it passed.
Rule = tuple[str, Any, bool, str, type[Exception]]


def _check(record: object, rules: Iterable[Rule]) -> None:
    """Raise for the first rule `record` breaks, naming the field, its value and the fix."""
    for label, value, ok, must, error in rules:
        if not ok:
            raise error(f"{type(record).__name__}.{label} is {short_repr(value)}; {must}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _counts(record: object, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> Iterable[Rule]:
    """Byte counts and device indices: plain ints >= 0 (None allowed for `optional`)."""
    for name in (*required, *optional):
        value = getattr(record, name)
        if value is None and name in optional:
            continue
        allowed = "an int" + (" or None" if name in optional else "")
        must = f"it must be {allowed} (bytes, or a device index): convert with int(...)"
        yield name, value, _is_int(value), must, TypeError
        yield name, value, _is_int(value) and value >= 0, "it must be >= 0", ValueError


def _plain_ints(record: object, names: tuple[str, ...]) -> None:
    """Store int subclasses (IntEnum …) as plain ints: the checks passed, the value is an integer."""
    for name in names:
        value = getattr(record, name)
        if value is not None and type(value) is not int:
            object.__setattr__(record, name, int(value))


def _flag(record: object, name: str) -> Rule:
    value = getattr(record, name)
    return name, value, isinstance(value, bool), "it must be True or False", TypeError


def _note(record: object, name: str = "note") -> Rule:
    value = getattr(record, name)
    return name, value, isinstance(value, str), "it must be a str (one line for reports)", TypeError


def _function(record: object, name: str, does: str) -> Rule:
    value = getattr(record, name)
    return name, value, callable(value), f"it must be {does}", TypeError


class ReleasePoint(str, enum.Enum):
    """The only reasons the device allocator cache may be emptied (contract 2)."""

    COMPONENT_RELEASE = "component_release"
    OOM = "oom"
    WEIGHT_UPDATE = "weight_update"
    RESUME_GENERATION = "resume_generation"
    IDLE = "idle"
    SLEEP = "sleep"
    USER = "user"


@dataclass(frozen=True)
class Availability:
    """Result of `PlatformPlugin.is_available()`: a yes, or a no with its reason."""

    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available

    @classmethod
    def yes(cls, detail: str = "") -> Availability:
        return cls(True, detail)

    @classmethod
    def no(cls, reason: str) -> Availability:
        return cls(False, reason)


@dataclass(frozen=True)
class MemoryInfo:
    """Memory of one device, observed without changing it (contract 1).

    `reserved` and `allocated` are the caching allocator's bytes; `None` where
    the backend cannot tell (CPU). `estimated` is set when `free` was derived
    (total - reserved) because the backend has no free-memory query.
    """

    device: int
    free: int
    total: int
    reserved: int | None = None
    allocated: int | None = None
    estimated: bool = False

    def __post_init__(self) -> None:
        # Made on every memory query: the common case is these plain checks, the rules only name a failure.
        reserved, allocated = self.reserved, self.allocated
        if not (
            type(self.device) is int and type(self.free) is int and type(self.total) is int
            and self.device >= 0 and self.free >= 0 and self.total >= 0
            and (reserved is None or (type(reserved) is int and reserved >= 0))
            and (allocated is None or (type(allocated) is int and allocated >= 0))
            and type(self.estimated) is bool
        ):
            _check(self, (*_counts(self, ("device", "free", "total"), ("reserved", "allocated")),
                          _flag(self, "estimated")))
            _plain_ints(self, ("device", "free", "total", "reserved", "allocated"))

    @property
    def used(self) -> int:
        return self.total - self.free


@dataclass(frozen=True)
class PeakMemory:
    """The caching allocator's high-water marks on one device since the last reset.

    `None` where the backend keeps no such counter (CPU).
    """

    device: int
    reserved: int | None
    allocated: int | None

    def __post_init__(self) -> None:
        _check(self, _counts(self, ("device",), ("reserved", "allocated")))
        _plain_ints(self, ("device", "reserved", "allocated"))


@dataclass(frozen=True)
class DeviceInfo:
    """Result of `PlatformPlugin.device_info(index)`: one device's facts, for reports."""

    index: int
    name: str
    total_memory: int
    capability: tuple[int, int] | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        capability, extra = self.capability, self.extra
        _check(self, (
            *_counts(self, ("index", "total_memory")),
            ("name", self.name, isinstance(self.name, str), "it must be a str: the product name, e.g. str(props.name)",
             TypeError),
            ("capability", capability, capability is None or (
                isinstance(capability, tuple) and len(capability) == 2 and all(map(_is_int, capability))),
             "it must be None or (major, minor) ints, e.g. (9, 0)", TypeError),
            ("extra", extra, isinstance(extra, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in extra.items()),
             "it must be a dict of str to str, e.g. {'driver': '550.54'}", TypeError),
        ))
        _plain_ints(self, ("index", "total_memory"))


@dataclass(frozen=True)
class GraphSupport:
    """How a platform captures and replays device graphs (contract 4).

    graph_class:  the graph type (`torch.cuda.CUDAGraph` …); `graph_class()` makes one.
    new_pool:     returns a memory-pool handle; one pool may back many graphs.
    capture:      `capture(graph, pool, stream)` -> context manager that records the
                  work issued inside it into `graph`. It must NOT empty the cache.
    is_capturing: True while the current stream is capturing.
    """

    graph_class: type
    new_pool: Callable[[], Any]
    capture: Callable[[Any, Any, Any], AbstractContextManager[Any]]
    is_capturing: Callable[[], bool]

    def __post_init__(self) -> None:
        _check(self, (
            ("graph_class", self.graph_class, isinstance(self.graph_class, type), "it must be a class whose "
             "instances are graphs, e.g. torch.cuda.CUDAGraph (no graphs: return None from graph_support())",
             TypeError),
            _function(self, "new_pool", "a function returning a memory-pool handle, e.g. torch.cuda.graph_pool_handle"),
            _function(self, "capture", "a function capture(graph, pool, stream) returning a context manager"),
            _function(self, "is_capturing", "a function returning True while the current stream captures, e.g. "
                                            "torch.cuda.is_current_stream_capturing"),
        ))


class MemoryRegions(Protocol):
    """One device's tagged regions, owned by one engine (two engines never share a tag).

    Contract (the conformance clause `virtual_memory` checks each point on the device):
    - `allocate` returns a uint8 device tensor of `nbytes` in the tag's region; its memory
      lives as long as a tensor views it.
    - `release(tag, backup=...)` gives the tag's physical memory back to the device: the
      device's free memory (`Platform.memory_info`) rises by the bytes returned. With
      `backup`, the contents are copied to host memory first (allocated once per tag and
      reused by later releases). Nothing may touch the region until `restore`.
    - `restore(tag)` maps physical memory again under the same addresses: a backed-up
      region holds its old contents bit for bit, another holds undefined bytes.
    - `host_copy(tensor)` is the backup of a tensor in a region released with a backup.
    - `graph_pool(tag)` is a pool handle for `GraphSupport.capture` whose memory lives in
      the tag's region, or None when graph memory cannot live in a region.
    """

    def allocate(self, tag: str, nbytes: int) -> torch.Tensor: ...

    def release(self, tag: str, *, backup: bool) -> int: ...

    def restore(self, tag: str) -> int: ...

    def graph_pool(self, tag: str) -> Any | None: ...

    def region_bytes(self, tag: str) -> int: ...

    def released(self, tag: str) -> bool: ...

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """The backup's bytes of `tensor` (a uint8 view into a region released with a backup):
        host memory that `restore` copies back, so what is written there while released
        comes back."""


@dataclass(frozen=True)
class VirtualMemorySupport:
    """How a platform releases and restores device memory under the same addresses (contract 10):
    an engine's sleep gives its weights', KV cache's and graphs' memory back, and its wake maps
    it again under the same addresses, so captured graphs replay as they are.

    new_regions:  `new_regions(device_index)` -> a `MemoryRegions` for one device, owned by its
                  caller (two engines never share a tag).
    graph_memory: graph memory can live in a region (`MemoryRegions.graph_pool` answers a pool
                  handle): graphs keep their addresses and give their memory back while
                  released. False: graphs survive a release but their memory stays.
    not_released: what a release leaves on the device or breaks, in words for reports (the
                  device context, a communicator's buffers, ...).
    note:         one line for reports (which API maps the memory).
    """

    new_regions: Callable[[int], MemoryRegions]
    graph_memory: bool
    not_released: tuple[str, ...] = ()
    note: str = ""

    def __post_init__(self) -> None:
        words = self.not_released
        _check(self, (
            _function(self, "new_regions", "a function new_regions(device_index) returning the device's "
                                           "MemoryRegions"),
            _flag(self, "graph_memory"),
            ("not_released", words, isinstance(words, tuple) and all(isinstance(w, str) for w in words),
             "it must be a tuple of str", TypeError),
            _note(self),
        ))


@dataclass(frozen=True)
class IpcHandle:
    """A device tensor shared across processes, as plain data (no pickled code).

    `storage` holds the backend's opaque storage handle fields (ints, bytes, str
    only); `storage_nbytes` is the size of that storage. The view fields describe
    the tensor inside it and are validated (`torchhal.platforms.ipc.validate_handle`)
    before any byte is read.
    """

    platform: str
    device: int
    storage: tuple[int | bytes | str | bool, ...]
    storage_nbytes: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset_bytes: int = 0


#: The bytes the transport reserves for one exported event handle.
MAX_EVENT_HANDLE_NBYTES = 256


@dataclass(frozen=True)
class IpcEvents:
    """Events one process records and another waits on (optional part of `IpcSupport`).

    new:    device index -> an interprocess event (no timing) that streams of that device
            can `record`; it has `record(stream)` and `wait(stream)` like `new_event()`'s.
    export: event -> its handle as plain bytes (`handle_nbytes` long), called after the
            event's first record.
    open:   (handle bytes, producer device, consumer device) -> an event the consumer's
            streams can `wait` on, opened where the memory open would map (the consumer's
            device where peers allow); validates the bytes first, raises `IpcHandleError`.
    handle_nbytes: the exact length of an exported handle (the driver's handle size).
    """

    new: Callable[[int], Any]
    export: Callable[[Any], bytes]
    open: Callable[[bytes, int, int], Any]
    handle_nbytes: int

    def __post_init__(self) -> None:
        size = self.handle_nbytes
        _check(self, (
            _function(self, "new", "a function of a device index returning an interprocess event"),
            _function(self, "export", "a function of an event returning its handle as bytes"),
            _function(self, "open", "a function (handle bytes, producer device, consumer device) returning an event"),
            ("handle_nbytes", size, _is_int(size), "it must be an int: the length of an exported handle (64 for CUDA "
             "and HIP)", TypeError),
            ("handle_nbytes", size, _is_int(size) and 0 < size <= MAX_EVENT_HANDLE_NBYTES,
             f"it must be in 1..{MAX_EVENT_HANDLE_NBYTES}", ValueError),
        ))


@dataclass(frozen=True)
class IpcSupport:
    """How a platform shares device tensors across processes (contract 5).

    share: tensor -> IpcHandle (the storage stays alive while the producer holds it).
    open:  (handle, consumer device) -> tensor on the consumer's device; validates
           the handle first. Where `peer_redirect` is True the open maps the memory
           through the consumer's own device, so no context lands on the producer's.
    events: interprocess events (`IpcEvents`), or None: then a producer host-synchronizes
           its copy before a message leaves instead of the consumer waiting on the device.
    """

    share: Callable[[torch.Tensor], IpcHandle]
    open: Callable[[IpcHandle, int], torch.Tensor]
    peer_redirect: bool
    note: str = ""
    events: IpcEvents | None = None

    def __post_init__(self) -> None:
        _check(self, (
            _function(self, "share", "a function of a tensor returning an IpcHandle"),
            _function(self, "open", "a function (IpcHandle, consumer device) returning a tensor"),
            _flag(self, "peer_redirect"),
            _note(self),
            ("events", self.events, self.events is None or isinstance(self.events, IpcEvents),
             "it must be None or an IpcEvents", TypeError),
        ))


@dataclass(frozen=True)
class AttentionSupport:
    """The attention backends a platform supplies (contract 6), in order of preference.

    backends: objects of the `torchhal.attention.AttentionBackend` protocol, each
              declaring its `AttentionCapability`. Selection takes the first that runs the
              model's `AttentionSpec`, else torchhal's portable reference backend.
    note:     one line for reports.
    """

    backends: tuple[AttentionBackend, ...]
    note: str = ""

    def __post_init__(self) -> None:
        from torchhal.attention import AttentionCapability

        backends = self.backends
        _check(self, (("backends", backends, isinstance(backends, tuple),
                       "it must be a tuple of backends, in order of preference", TypeError), _note(self)))
        for index, backend in enumerate(backends):
            missing = [name for name in ("write_kv", "decode", "prefill") if not callable(getattr(backend, name, None))]
            _check(self, [(f"backends[{index}]", backend,
                           isinstance(getattr(backend, "capability", None), AttentionCapability) and not missing,
                           "a backend needs a `capability` (an AttentionCapability) and the methods write_kv, decode "
                           "and prefill" + (f" (missing: {', '.join(missing)})" if missing else ""), TypeError)])


@dataclass(frozen=True)
class LinearSupport:
    """A platform's matrix-vector kernel for decode-shaped linears (contract 8).

    kernel:        `kernel(x, weight, bias)`: x [M, K], weight [N, K] contiguous, bias [N] or
                   None -> [M, N] in x's dtype, F.linear's numbers within the dtype's rounding.
    max_rows:      engines route inputs of at most this many rows to it (F.linear the rest).
    dtypes:        the dtypes of x (and of weight and bias) it takes.
    graph_capture: a call records into the platform's device graphs and replays.
    note:          one line for reports.
    """

    name: str
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    max_rows: int
    dtypes: tuple[torch.dtype, ...]
    graph_capture: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        rows, dtypes = self.max_rows, self.dtypes
        most_rows = "the most rows an input routed to the kernel has"
        _check(self, (
            ("name", self.name, isinstance(self.name, str) and bool(self.name),
             "it must be a non-empty str naming the kernel (e.g. 'triton-gemv')", TypeError),
            _function(self, "kernel", "a callable kernel(x, weight, bias) -> tensor"),
            ("max_rows", rows, _is_int(rows), f"it must be an int: {most_rows}", TypeError),
            ("max_rows", rows, _is_int(rows) and rows >= 1, f"it must be >= 1 ({most_rows})", ValueError),
            ("dtypes", dtypes, isinstance(dtypes, tuple) and all(isinstance(d, torch.dtype) for d in dtypes),
             "it must be a tuple of torch dtypes, e.g. (torch.float16, torch.bfloat16)", TypeError),
            ("dtypes", dtypes, bool(dtypes), "it must be non-empty: the dtypes the kernel takes", ValueError),
            _flag(self, "graph_capture"),
            _note(self),
        ))


@dataclass(frozen=True)
class CompileSupport:
    """Inductor settings a platform wants for the layers engines compile (contract 9).

    inductor_options: `torch.compile(backend="inductor", options=...)` entries, e.g.
                      {"triton.enable_pdl": True} (CUDA on Hopper: each kernel may launch while
                      the one before it finishes). They must be result-neutral: they change how
                      kernels are built, launched or scheduled, never the numbers (the
                      conformance clause `compile` compares bits); settings that trade numbers
                      for speed are the user's to choose, not the platform's.
    note:             one line for reports.
    """

    inductor_options: dict[str, bool | int | str]
    note: str = ""

    def __post_init__(self) -> None:
        options = self.inductor_options
        _check(self, (
            ("inductor_options", options, isinstance(options, dict) and bool(options) and all(
                isinstance(key, str) and key and isinstance(value, (bool, int, str)) for key, value in options.items()),
             "it must be a non-empty dict: keys are inductor config names (a non-empty str), values are bool, int "
             "or str, e.g. {'triton.enable_pdl': True} (no options: return None from compile_support())", TypeError),
            _note(self),
        ))


@dataclass(frozen=True)
class DistributedSupport:
    """How a platform's ranks talk to each other (contract 7), beyond `dist_backend`.

    communicator:     None: torch.distributed's backend for `dist_backend`, called on a group
                      of torchhal's own (`torchhal.distributed.TorchCommunicator`). Else a
                      function given that default communicator and returning the one engines
                      use (a vendor's custom all-reduce wraps the default and replaces a call).
    graph_capturable: the collectives may be recorded in a device graph and replayed; engines
                      then keep them inside captured decode steps instead of breaking around them.
    note:             one line for reports.
    """

    communicator: Callable[[Communicator], Communicator] | None = None
    graph_capturable: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        # Read by every group and engine: a truthy non-bool would put collectives in graphs.
        _check(self, (
            ("communicator", self.communicator, self.communicator is None or callable(self.communicator),
             "it must be a function given the default communicator and returning the one engines use, or None",
             TypeError),
            _flag(self, "graph_capturable"),
            _note(self),
        ))


@dataclass(frozen=True)
class PluginFailure:
    """Record of a plugin that failed to import, register, validate, detect or answer (not an exception)."""

    plugin: str
    stage: str  # "import" | "register" | "validate" | "version" | "conflict" | "detect" | "query"
    error: str
    distribution: str | None = None
    #: every platform name and plugin (entry point) it involves: a conflict's, and the platform
    #: a plugin object failing validation would have registered
    involves: tuple[str, ...] = ()

    @property
    def failed_to(self) -> str:
        """What the plugin failed to do, for messages ("failed to detect")."""
        return _FAILED_TO.get(self.stage, self.stage)

    def __str__(self) -> str:
        dist = f" (distribution {self.distribution})" if self.distribution else ""
        return f"plugin {self.plugin!r}{dist} failed to {self.failed_to}: {self.error}"


_FAILED_TO = {"version": "match the SPI version", "conflict": "register a unique name", "query": "answer a query"}
