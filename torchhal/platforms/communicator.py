"""The collectives engine code uses, behind one protocol: `Communicator`.

`TorchCommunicator` is the default: torch.distributed's backend for the platform
(`Platform.dist_backend`), called on a process group of its own (never torch's default
group, so two engines can share a process). A vendor supplies its own communicator
(a custom all-reduce, say) through `DistributedSupport.communicator`, usually by
wrapping the default one and replacing the calls it does better.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from torchhal.values import as_index

#: Reductions every communicator supports, by name.
ReduceOpName = Literal["sum", "max", "min"]
REDUCE_OPS: tuple[str, ...] = ("sum", "max", "min")


class CollectiveError(RuntimeError):
    """A collective that could not complete: a peer rank died, hung past the group's
    timeout, or the backend failed. The group is unusable afterwards; make a new one."""


@runtime_checkable
class Communicator(Protocol):
    """Collectives over one group of ranks, one device per rank.

    Every rank of the group makes the same calls in the same order with tensors of the
    same dtype (and shape, except where `sizes` says otherwise). Tensors live on
    `device`. A call that cannot complete (a peer died or hangs) never hangs for ever and
    never hands back a wrong result: it raises `CollectiveError` within the group's
    timeout, or, where collectives run asynchronously on the device (NCCL under torch's
    default error handling), the call returns once queued and the backend ends the
    waiting process after that timeout, before the result can be read back, provided the
    waiter yields the GIL (NCCL's watchdog dumps Python stacks first; a blocking read holds
    it). No backend times out a collective replayed from a device graph, nor the CUDA
    plugin's peer-memory all-reduce, whose kernel waits for its peers on the device. So wait for a
    result through `DeviceGroup.wait_for`, which is bounded and yields. Bad arguments (an
    unknown `op`, a peer that is not another rank, `sizes` that do not fit, a tensor whose
    elements share memory given to a call that writes into it) raise ValueError before any rank
    is waited on; `TorchCommunicator` refuses so a dtype gloo cannot take, too.
    """

    rank: int
    world_size: int
    device: torch.device
    #: True when these collectives may be recorded in a device graph and replayed.
    graph_capturable: bool

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> torch.Tensor:
        """Reduce `tensor` across ranks, in place; returns it."""
        ...

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Every rank's `tensor` concatenated along `dim`, in rank order. `sizes`: each
        rank's extent along `dim` when they differ (every rank passes the same list)."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """`src`'s `tensor` written into every rank's `tensor`, in place; returns it."""
        ...

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send `tensor` to rank `dst` (which calls `recv` with a tensor of the same shape)."""
        ...

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into `tensor` from rank `src`; returns it."""
        ...


def is_on(place: torch.device, device: torch.device) -> bool:
    """Whether memory at `place` is `device`'s: host memory is one device whatever index a
    (simulated) CPU device carries."""
    return place.type == device.type and (place.type == "cpu" or place.index == device.index)


def overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether two elements of `tensor` may share memory (`expand()`, `unfold()`): a collective
    cannot write its result into such a tensor. Exact for what views make; the rare interleaved
    layout only `as_strided` makes counts as overlapping."""
    reach = 0  # the furthest offset the dimensions of smaller strides span
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda dim: dim[1]):
        if size > 1:
            if stride <= reach:
                return True
            reach += stride * (size - 1)
    return False


_TORCH_OPS: dict[str, Any] = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
#: The dtypes gloo's all_reduce, all_gather and broadcast take (its type switch); send and recv
#: move bytes and take any. Complex tensors go as pairs of reals where that is the same
#: operation: a sum and a broadcast, not max, min or an all_gather.
_GLOO_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                          torch.int32, torch.int64, torch.bool})


class TorchCommunicator:
    """`Communicator` on a torch.distributed process group or backend (`init_group`'s groups,
    a `ProcessGroupGloo` of a test's own), called directly: its calls are the group's alone.

    `store` is a key-value store of this group's alone (every rank sees the same one), for a
    communicator that wraps this one and must agree with its peers on resources of its own
    (the CUDA plugin's peer-memory buffers); None where the group was made without one."""

    def __init__(self, backend: Any, rank: int, world_size: int, device: torch.device,
                 graph_capturable: bool = False, *, name: str = "", timeout: timedelta | None = None,
                 store: dist.Store | None = None) -> None:
        self.backend = backend
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.graph_capturable = graph_capturable
        self.name = name
        self.timeout = timeout
        self._gloo = callable(getattr(backend, "name", None)) and backend.name() == "gloo"

    def __repr__(self) -> str:
        return (f"<TorchCommunicator {type(self.backend).__name__} rank {self.rank}/{self.world_size} "
                f"on {self.device}>")

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> torch.Tensor:
        call = f"all_reduce(op={op!r})"
        if op not in _TORCH_OPS:
            raise ValueError(f"{call}: choose one of {', '.join(REDUCE_OPS)}")
        self.check(tensor, call, written=True, complex_as_reals=op == "sum")
        if self.world_size == 1:
            return tensor
        options = dist.AllreduceOptions()
        options.reduceOp = _TORCH_OPS[op]
        with _in_place(tensor) as work:
            self._complete(call, lambda: self.backend.allreduce([work], options))
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None) -> torch.Tensor:
        self.check(tensor, "all_gather", complex_as_reals=False)
        index, extents = as_index(dim), None if sizes is None else list(sizes)  # a generator is read once, here
        problem = None
        if index is None or not -tensor.dim() <= index < tensor.dim():
            problem = f"all_gather(dim={dim!r}): give a dimension of the tensor (an int; it has {tensor.dim()})"
        elif extents is not None and (len(extents) != self.world_size or extents[self.rank] != tensor.shape[index]
                                      or any(as_index(n) is None or n < 0 for n in extents)):
            problem = (f"all_gather(sizes={extents}): give one non-negative int per rank ({self.world_size}), this "
                       f"rank's ({self.rank}) equal to its tensor's extent {tensor.shape[index]} along dim "
                       f"{index % tensor.dim()}")
        if problem is not None:
            raise ValueError(problem)
        assert index is not None
        dim = index % tensor.dim()
        if self.world_size == 1:
            return tensor
        if extents is None:
            return torch.cat(self._gather_equal(tensor.contiguous()), dim)
        padded = list(tensor.shape)
        padded[dim] = max(extents) - tensor.shape[dim]
        pieces = self._gather_equal(torch.cat((tensor, tensor.new_zeros(padded)), dim).contiguous())
        return torch.cat([piece.narrow(dim, 0, size) for piece, size in zip(pieces, extents, strict=True)], dim)

    def _gather_equal(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        pieces = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._complete("all_gather", lambda: self.backend.allgather([pieces], [tensor]))
        return pieces

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        src = self._peer(src, "broadcast(src=...)")
        self.check(tensor, f"broadcast(src={src})", written=True, complex_as_reals=True)
        if self.world_size == 1:
            return tensor
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        with _in_place(tensor) as work:
            self._complete(f"broadcast(src={src})", lambda: self.backend.broadcast([work], options))
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dst = self._peer(dst, "send(dst=...)", other=True)
        self.check(tensor, f"send(dst={dst})")
        self._complete(f"send(dst={dst})", lambda: self.backend.send([tensor.contiguous()], dst, 0))

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        src = self._peer(src, "recv(src=...)", other=True)
        self.check(tensor, f"recv(src={src})", written=True)
        with _in_place(tensor) as work:
            self._complete(f"recv(src={src})", lambda: self.backend.recv([work], src, 0))
        return tensor

    def check(self, tensor: object, call: str, *, written: bool = False, complex_as_reals: bool | None = None) -> None:
        """Refuse what is this rank's own mistake before its peers are waited on, and any call on
        a closed group (a group of one rank's too). `written`: the call writes its result into
        the tensor. `complex_as_reals`: the call is a collective, which on gloo takes only the
        dtypes of gloo's type switch, and complex ones as pairs of reals when this is True (send
        and recv, None, move bytes of any dtype)."""
        problem = None
        if not isinstance(tensor, torch.Tensor):
            problem = f"expected a torch.Tensor, got {type(tensor).__name__}"
        elif not is_on(tensor.device, self.device):
            problem = (f"the tensor is on {tensor.device}, this group's rank {self.rank} on {self.device}; move it "
                       "there first (tensor.to(group.device))")
        elif written and overlaps_itself(tensor):
            problem = (f"elements of the tensor share memory (shape {list(tensor.shape)}, strides "
                       f"{list(tensor.stride())}: an expand()ed or unfold()ed view, say), so the result cannot be "
                       "written into it; pass a tensor of its own (tensor.clone())")
        elif (self._gloo and complex_as_reals is not None and tensor.dtype not in _GLOO_DTYPES
              and not (complex_as_reals and tensor.dtype.is_complex)):
            # gloo fails the call only once the peers have met, in words that blame a peer.
            taken = ", ".join(sorted(str(dtype).removeprefix("torch.") for dtype in _GLOO_DTYPES))
            problem = (f"gloo cannot take {str(tensor.dtype).removeprefix('torch.')} tensors here; it takes "
                       f"{taken}{' and complex' if complex_as_reals else ''}: convert the tensor first "
                       "(tensor.to(...))")
        elif self.backend is None:
            raise CollectiveError(f"{call}: group {self.name or '?'!r} is closed (DeviceGroup.close); make a new "
                                  "group with init_group")
        if problem is not None:
            raise (ValueError if isinstance(tensor, torch.Tensor) else TypeError)(f"{call}: {problem}")

    def _complete(self, call: str, issue: Callable[[], Any]) -> None:
        """Issue a backend call and wait for it; a backend failure becomes one CollectiveError."""
        try:
            issue().wait()
        except RuntimeError as exc:  # torch's DistBackendError / DistError are RuntimeErrors
            timeout = f"{self.timeout.total_seconds():g} s" if self.timeout is not None else "the backend's"
            raise CollectiveError(
                f"{call} failed in group {self.name or '?'!r} at rank {self.rank} of {self.world_size} "
                f"(timeout {timeout}): {' '.join(str(exc).split())[:1200]}. Check that every rank is alive and "
                "makes the same calls in the same order (a dead, hung or diverged peer); the group cannot be reused"
            ) from exc

    def _peer(self, peer: object, call: str, other: bool = False) -> int:
        """`peer` as a rank of this group (an int; numpy's integers too); `other`: not this rank."""
        rank = as_index(peer)
        if rank is None or not 0 <= rank < self.world_size or (other and rank == self.rank):
            raise ValueError(f"{call} {peer!r} is " + ("this rank itself; point-to-point needs another rank"
                                                       if rank == self.rank and rank is not None and other else
                                                       f"not a rank of this group (an int, 0..{self.world_size - 1})"))
        return rank


@contextlib.contextmanager
def _in_place(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """`tensor` itself when contiguous, else a contiguous copy whose result is copied back:
    backends read and write a tensor's storage as if it were dense."""
    if tensor.is_contiguous():
        yield tensor
        return
    work = tensor.contiguous()
    yield work
    tensor.copy_(work)


class WrappedCommunicator:
    """A `Communicator` that forwards every call to `inner`, the group's default one (what
    `DistributedSupport.communicator` is given): subclass it and replace the calls you do
    better. Only claim `graph_capturable` where every call, yours and inner's, can be captured."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.rank, self.world_size, self.device = inner.rank, inner.world_size, inner.device
        self.graph_capturable = inner.graph_capturable

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> torch.Tensor:
        return self.inner.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None) -> torch.Tensor:
        return self.inner.all_gather(tensor, dim, sizes)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.inner.broadcast(tensor, src)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.inner.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.inner.recv(tensor, src)
