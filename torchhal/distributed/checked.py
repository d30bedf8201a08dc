"""Collectives checked across ranks before they run (TORCH_DISTRIBUTED_DEBUG=DETAIL).

Ranks that disagree on a collective (another shape, dtype, reduction or root, or another
call altogether) do not fail cleanly on their own: gloo aborts the process when the byte
counts differ and sums the wrong elements when they match, and NCCL hangs or returns
garbage. Under torch's DETAIL debug level, `init_group` wraps the group's communicators in
`CheckedCommunicator`: every rank first shares a description of the call over a gloo group
of the check's own, and any difference raises `CollectiveError` on every rank, naming each
rank's call (between collectives). Calls the check cannot pair (a send facing a collective,
a collective on the group's device communicator facing one on its host communicator) time
out instead, and the error names the call each other rank last began on each communicator
(`CheckJournal`). It costs a host round trip or two a collective: a debugging setting. A
captured graph is checked once, when it is captured.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from torchhal.platforms.communicator import (
    CollectiveError,
    Communicator,
    ReduceOpName,
    WrappedCommunicator,
    is_on,
    overlaps_itself,
)
from torchhal.values import as_index

#: Bytes a rank shares per call: a digest of its whole description, then as much of the text as fits.
DIGEST_BYTES, DESCRIPTION_BYTES = 32, 256


class CheckJournal:
    """Where each rank of a group writes the call it last began on each of the group's checked
    communicators, numbered, so that a check that times out can say what the other ranks were
    doing: one that never made this call, or is in a collective of the other communicator."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, names: Sequence[str]) -> None:
        self.store, self.rank, self.world_size, self.names = store, rank, world_size, tuple(names)
        self._numbers = {name: itertools.count(1) for name in self.names}

    def began(self, name: str, call: str) -> int:
        number = next(self._numbers[name])
        with contextlib.suppress(RuntimeError):  # a diagnostic: the check itself says what failed
            self.store.set(f"{name}/{self.rank}", f"{number}\t{call}")
        return number

    def others(self) -> str:
        """The other ranks' last calls, in words; what the store could not answer is left out."""
        told = []
        for rank in range(self.world_size):
            for name in self.names if rank != self.rank else ():
                key = f"{name}/{rank}"
                with contextlib.suppress(RuntimeError):  # a store gone with its rank tells nothing
                    if not self.store.check([key]):
                        told.append(f"rank {rank} began no call on {name!r}")
                        continue
                    number, call = self.store.get(key).decode(errors="replace").split("\t", 1)
                    told.append(f"rank {rank}'s call {number} on {name!r} was {call}")
        return "; ".join(told)


class CheckedCommunicator(WrappedCommunicator):
    """`inner`, each call first agreed on with the other ranks over `checker`: a communicator
    of the same ranks on host memory that carries nothing else (a check sharing a group with
    other traffic would interleave with it differently on each rank when threads call both)."""

    def __init__(self, inner: Communicator, checker: Communicator, name: str,
                 journal: CheckJournal | None = None) -> None:
        super().__init__(inner)
        self.checker, self.name, self.journal = checker, name, journal

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> torch.Tensor:
        self._agree(f"all_reduce(op={op!r}) {self._describe(tensor, written=True)}")
        return self.inner.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None) -> torch.Tensor:
        extents = None if sizes is None else list(sizes)  # a generator is read once, here
        ndim = tensor.dim() if isinstance(tensor, torch.Tensor) else 0
        index = as_index(dim)  # numpy's integers too; a bad one the inner call names
        in_range = index is not None and -ndim <= index < ndim
        dim = index % ndim if index is not None and in_range else dim  # -1 and ndim - 1 are the same call
        # Each rank's extent along `dim` is its own (sizes names them all); the rest must match.
        free = dim if extents is not None and in_range else None
        call = f"all_gather(dim={dim}, sizes={extents}) {self._describe(tensor, free)}"
        if free is not None and extents is not None and len(extents) > self.rank \
                and extents[self.rank] != tensor.shape[free]:  # this rank's own mistake, shown to all
            call += f" of {tensor.shape[free]} along dim {free}, not sizes[{self.rank}]"
        self._agree(call)
        return self.inner.all_gather(tensor, dim, extents)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._agree(f"broadcast(src={src}) {self._describe(tensor, written=True)}")
        return self.inner.broadcast(tensor, src)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        mine = f"send to rank {dst} {self._describe(tensor)}"
        with self._checking(mine):
            self.checker.send(_encode(mine), dst)
            verdict = self.checker.recv(_encode(""), dst)  # empty, or the receiver's own call if it differs
        if _text(verdict):
            raise self._mismatch(mine, {self.rank: mine, dst: _text(verdict)})
        self.inner.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        described, layout = self._describe(tensor, written=True), _layout(tensor)
        mine = f"recv from rank {src} {described}"
        with self._checking(mine):
            theirs = self.checker.recv(_encode(""), src)
            on_its_device = described == layout
            agreed = on_its_device and _digest(theirs) == _digest(_encode(f"send to rank {self.rank} {layout}"))
            self.checker.send(_encode("" if agreed else mine), src)
        if not agreed:
            raise self._mismatch(mine, {src: _text(theirs), self.rank: mine})
        return self.inner.recv(tensor, src)

    def _describe(self, tensor: object, free_dim: int | None = None, written: bool = False) -> str:
        """What every rank's call must share (dtype, shape), and this rank's own mistakes of a
        device other than its own or, for a call that writes into it (`written`), a tensor whose
        elements share memory, shown to all: refused here alone, they would leave them waiting."""
        described = _layout(tensor, free_dim)
        if isinstance(tensor, torch.Tensor) and not is_on(tensor.device, self.device):
            described += f" on {tensor.device}, not rank {self.rank}'s {self.device}"
        if written and isinstance(tensor, torch.Tensor) and overlaps_itself(tensor):
            described += " whose elements share memory"
        return described

    def _agree(self, mine: str) -> None:
        with self._checking(mine):
            rows = self.checker.all_gather(_encode(mine)).view(self.world_size, DESCRIPTION_BYTES)
        if len({_digest(row) for row in rows}) > 1:
            raise self._mismatch(mine, {rank: _text(row) for rank, row in enumerate(rows)})

    @contextlib.contextmanager
    def _checking(self, mine: str) -> Iterator[None]:
        """A failure of the check's own traffic (a dead peer, a closed group, a peer in another
        call) raised as one of the caller's call, not of a gather the caller never made, with
        what the other ranks last began (`CheckJournal`)."""
        journal = self.journal
        number = journal.began(self.name, mine) if journal is not None else None
        try:
            yield
        except CollectiveError as exc:
            numbered = f" (this rank's call {number} on {self.name!r})" if number is not None else ""
            others = journal.others() if journal is not None else ""
            raise CollectiveError(
                f"{mine}: checking this call{numbered} with the other ranks of group {self.name!r} failed: {exc}"
                + (f". The other ranks' last calls: {others}" if others else "")
            ) from exc

    def _mismatch(self, mine: str, calls: dict[int, str]) -> CollectiveError:
        shown = "; ".join(f"rank {rank}: {call}" for rank, call in sorted(calls.items()))
        return CollectiveError(
            f"{mine}: the ranks of group {self.name!r} disagree on this collective ({shown}). Every rank must make "
            "the same collectives in the same order, with the same shapes, dtypes and arguments; this rank "
            f"({self.rank}) ran nothing of it"
        )


def _layout(tensor: object, free_dim: int | None = None) -> str:
    """dtype and shape (`free_dim`'s extent shown as *), or what the object is; the call itself names a bad one."""
    if not isinstance(tensor, torch.Tensor):
        return f"a {type(tensor).__name__}"
    shape = ["*" if d == free_dim else str(n) for d, n in enumerate(tensor.shape)]
    return f"{str(tensor.dtype).removeprefix('torch.')} [{', '.join(shape)}]"


def _encode(text: str) -> torch.Tensor:
    """A digest of the whole text (calls differing past the shown part still differ), then the text."""
    data = text.encode()
    digest = hashlib.sha256(data).digest() if text else bytes(DIGEST_BYTES)
    row = (digest + data[: DESCRIPTION_BYTES - DIGEST_BYTES]).ljust(DESCRIPTION_BYTES, b"\0")
    return torch.frombuffer(bytearray(row), dtype=torch.uint8)


def _digest(row: torch.Tensor) -> bytes:
    return bytes(row[:DIGEST_BYTES].tolist())


def _text(row: torch.Tensor) -> str:
    return bytes(row[DIGEST_BYTES:].tolist()).rstrip(b"\0").decode(errors="replace")
