"""Typed, frozen records that cross the plugin boundary.

Hook results and SPI return values are records, never loose tuples or dicts, so
the manager can validate them and engine code can rely on their fields.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the protocol lives with the reference backend, which imports nothing from here
    from torchhal.attention import AttentionBackend
    from torchhal.platforms.communicator import Communicator


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
        # Validated where the record is made, so a plugin's bad value is caught at its
        # source. The common case is six plain checks (this runs on every memory query).
        reserved, allocated = self.reserved, self.allocated
        if not (
            type(self.device) is int
            and type(self.free) is int
            and type(self.total) is int
            and self.free >= 0
            and self.total >= 0
            and (reserved is None or (type(reserved) is int and reserved >= 0))
            and (allocated is None or (type(allocated) is int and allocated >= 0))
            and type(self.estimated) is bool
        ):
            _reject_fields(self, ("device", "free", "total"), ("reserved", "allocated"))

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
        reserved, allocated = self.reserved, self.allocated
        if not (
            type(self.device) is int
            and (reserved is None or (type(reserved) is int and reserved >= 0))
            and (allocated is None or (type(allocated) is int and allocated >= 0))
        ):
            _reject_fields(self, ("device",), ("reserved", "allocated"))


def _check_fields(record: object, checks: tuple[tuple[str, Callable[[Any], bool], str], ...]) -> None:
    """Raise a TypeError naming the first field whose value fails its test: (field, test, what it must be)."""
    for name, test, must in checks:
        value = getattr(record, name)
        if not test(value):
            raise TypeError(f"{type(record).__name__}.{name} is {value!r}; it must be {must}")


def _reject_fields(record: object, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    """Raise naming the first bad field; int subclasses (IntEnum …) are stored as plain ints."""
    cls = type(record).__name__
    for name in (*required, *optional):
        value = getattr(record, name)
        if value is None and name in optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            allowed = "an int" + (" or None" if name in optional else "")
            raise TypeError(
                f"{cls}.{name} is {value!r} ({type(value).__name__}); it must be {allowed} "
                "(bytes, or the device index): convert with int(...)"
            )
        if value < 0:
            raise ValueError(f"{cls}.{name} is {value}; it must be >= 0")
        if type(value) is not int:  # an int subclass (IntEnum): store a plain int
            object.__setattr__(record, name, int(value))
    estimated = getattr(record, "estimated", False)
    if not isinstance(estimated, bool):
        raise TypeError(f"{cls}.estimated is {estimated!r}; it must be True or False")


@dataclass(frozen=True)
class DeviceInfo:
    """Result of `PlatformPlugin.device_info(index)`: one device's facts, for reports."""

    index: int
    name: str
    total_memory: int
    capability: tuple[int, int] | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Checked where it is made, like MemoryInfo: a bad field is named at the plugin, not a
        # TypeError wherever a report first formats it.
        if not (type(self.index) is int and type(self.total_memory) is int and self.index >= 0
                and self.total_memory >= 0):
            _reject_fields(self, ("index", "total_memory"), ())
        if not isinstance(self.name, str):
            raise TypeError(f"DeviceInfo.name is {self.name!r} ({type(self.name).__name__}); it must be a str: "
                            "the product name, e.g. str(props.name)")
        capability = self.capability
        if capability is not None and not (
            isinstance(capability, tuple) and len(capability) == 2
            and all(isinstance(part, int) and not isinstance(part, bool) for part in capability)
        ):
            raise TypeError(f"DeviceInfo.capability is {capability!r}; it must be None or (major, minor) ints, "
                            "e.g. (9, 0)")
        extra = self.extra
        if not (isinstance(extra, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items())):
            raise TypeError(f"DeviceInfo.extra is {extra!r}; it must be a dict of str to str, e.g. "
                            "{'driver': '550.54'}")


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
        # Declaring graphs makes engines and the conformance suite use them: a hole here
        # would surface as "'NoneType' object is not callable" inside the first capture.
        _check_fields(self, (
            ("graph_class", lambda cls: isinstance(cls, type), "a class whose instances are graphs, e.g. "
             "torch.cuda.CUDAGraph (no graphs: return None from graph_support())"),
            ("new_pool", callable, "a function returning a memory-pool handle, e.g. torch.cuda.graph_pool_handle"),
            ("capture", callable, "a function capture(graph, pool, stream) returning a context manager"),
            ("is_capturing", callable, "a function returning True while the current stream captures, e.g. "
                                       "torch.cuda.is_current_stream_capturing"),
        ))


@dataclass(frozen=True)
class IpcHandle:
    """A device tensor shared across processes, as plain data (no pickled code).

    `storage` holds the backend's opaque storage handle fields (ints, bytes, str
    only); `storage_nbytes` is the size of that storage. The view fields describe
    the tensor inside it and are validated before any byte is read.
    """

    platform: str
    device: int
    storage: tuple[int | bytes | str | bool, ...]
    storage_nbytes: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset_bytes: int = 0


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
        _check_fields(self, (
            ("new", callable, "a function of a device index returning an interprocess event"),
            ("export", callable, "a function of an event returning its handle as bytes"),
            ("open", callable, "a function (handle bytes, producer device, consumer device) returning an event"),
            ("handle_nbytes", lambda n: isinstance(n, int) and not isinstance(n, bool),
             "an int: the length of an exported handle (64 for CUDA and HIP)"),
        ))
        if not 0 < self.handle_nbytes <= 256:  # the transport reserves 256 bytes a slot
            raise ValueError(f"IpcEvents.handle_nbytes is {self.handle_nbytes}; it must be in 1..256")


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
        _check_fields(self, (
            ("share", callable, "a function of a tensor returning an IpcHandle"),
            ("open", callable, "a function (IpcHandle, consumer device) returning a tensor"),
            ("peer_redirect", lambda flag: isinstance(flag, bool), "True or False"),
            ("note", lambda note: isinstance(note, str), "a str (one line for reports)"),
            ("events", lambda events: events is None or isinstance(events, IpcEvents),
             "None or an IpcEvents"),
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

        if not isinstance(self.backends, tuple):
            raise TypeError(f"AttentionSupport.backends is {self.backends!r}; it must be a tuple of backends, "
                            "in order of preference")
        for index, backend in enumerate(self.backends):
            missing = [name for name in ("write_kv", "decode", "prefill") if not callable(getattr(backend, name, None))]
            if not isinstance(getattr(backend, "capability", None), AttentionCapability) or missing:
                raise TypeError(f"AttentionSupport.backends[{index}] is {backend!r}; a backend needs a `capability` "
                                f"(an AttentionCapability) and the methods write_kv, decode and prefill"
                                + (f" (missing: {', '.join(missing)})" if missing else ""))
        if not isinstance(self.note, str):
            raise TypeError(f"AttentionSupport.note is {self.note!r}; it must be a str")


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
        # A wrong type is a TypeError, a value out of range a ValueError; each names the field.
        def bad(field: str, must: str, error: type[Exception] = TypeError) -> Exception:
            return error(f"LinearSupport.{field} is {getattr(self, field)!r}; it must be {must}")

        if not isinstance(self.name, str) or not self.name:
            raise bad("name", "a non-empty str naming the kernel (e.g. 'triton-gemv')")
        if not callable(self.kernel):
            raise bad("kernel", "a callable kernel(x, weight, bias) -> tensor")
        if not isinstance(self.max_rows, int) or isinstance(self.max_rows, bool):
            raise bad("max_rows", "an int: the most rows an input routed to the kernel has")
        if self.max_rows < 1:
            raise bad("max_rows", ">= 1 (the most rows an input routed to the kernel has)", ValueError)
        if not isinstance(self.dtypes, tuple) or not all(isinstance(d, torch.dtype) for d in self.dtypes):
            raise bad("dtypes", "a tuple of torch dtypes, e.g. (torch.float16, torch.bfloat16)")
        if not self.dtypes:
            raise bad("dtypes", "non-empty: the dtypes the kernel takes", ValueError)
        if not isinstance(self.graph_capture, bool):
            raise bad("graph_capture", "True or False")
        if not isinstance(self.note, str):
            raise bad("note", "a str (one line for reports)")


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
        if not isinstance(options, dict) or not options:
            raise TypeError(f"CompileSupport.inductor_options is {options!r}; it must be a non-empty dict of "
                            "inductor config names to values, e.g. {'triton.enable_pdl': True} "
                            "(no options: return None from compile_support())")
        for key, value in options.items():
            if not isinstance(key, str) or not key:
                raise TypeError(f"CompileSupport.inductor_options has key {key!r}; keys are inductor config names "
                                "(str), e.g. 'triton.enable_pdl'")
            if not isinstance(value, (bool, int, str)):
                raise TypeError(f"CompileSupport.inductor_options[{key!r}] is {value!r}; values are bool, int "
                                "or str")
        if not isinstance(self.note, str):
            raise TypeError(f"CompileSupport.note is {self.note!r}; it must be a str (one line for reports)")


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
        if self.communicator is not None and not callable(self.communicator):
            raise TypeError(f"DistributedSupport.communicator is {self.communicator!r}; it must be a function "
                            "given the default communicator and returning the one engines use, or None")
        if not isinstance(self.graph_capturable, bool):
            raise TypeError(f"DistributedSupport.graph_capturable is {self.graph_capturable!r}; it must be True or "
                            "False")
        if not isinstance(self.note, str):
            raise TypeError(f"DistributedSupport.note is {self.note!r}; it must be a str (one line for reports)")


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
