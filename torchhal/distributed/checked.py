"""Collectives checked across ranks before they run (TORCH_DISTRIBUTED_DEBUG=DETAIL).

Ranks that disagree on a collective (another shape, dtype, reduction or root, or another
call altogether) do not fail cleanly on their own: gloo aborts the process when the byte
counts differ and sums the wrong elements when they match, NCCL hangs or returns garbage,
and a plugin's own path (a peer-memory all-reduce taking messages of some sizes only) may
send the ranks down different roads. Under torch's DETAIL debug level, `init_group` wraps
the group's communicators in `CheckedCommunicator`: every rank first shares a description
of the call over the group's host (gloo) communicator, and any difference raises
`CollectiveError` on every rank, naming each rank's call. It costs a host round trip a
collective: a debugging setting. A captured graph is checked once, when it is captured.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchhal.platforms.communicator import CollectiveError, Communicator, ReduceOpName, WrappedCommunicator

#: Bytes of a call's description each rank shares (longer ones are cut: enough to tell calls apart).
DESCRIPTION_BYTES = 256


class CheckedCommunicator(WrappedCommunicator):
    """`inner`, each call first agreed on with the other ranks over `host` (an unchecked
    communicator of the same ranks on host memory)."""

    def __init__(self, inner: Communicator, host: Communicator, name: str) -> None:
        super().__init__(inner)
        self.host, self.name = host, name

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> torch.Tensor:
        self._agree(f"all_reduce(op={op!r}) {_layout(tensor)}")
        return self.inner.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None) -> torch.Tensor:
        extents = None if sizes is None else list(sizes)  # a generator is read once, here
        # Each rank's extent along `dim` is its own (sizes names them all); the rest must match.
        free = dim % tensor.dim() if extents is not None and isinstance(tensor, torch.Tensor) and tensor.dim() else None
        self._agree(f"all_gather(dim={dim}, sizes={extents}) {_layout(tensor, free)}")
        return self.inner.all_gather(tensor, dim, extents)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._agree(f"broadcast(src={src}) {_layout(tensor)}")
        return self.inner.broadcast(tensor, src)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        mine = f"send to rank {dst} {_layout(tensor)}"
        self.host.send(_encode(mine), dst)
        verdict = self.host.recv(_encode(""), dst)  # the receiver's own description if it differs
        if _decode(verdict):
            raise self._mismatch(mine, {self.rank: mine, dst: _decode(verdict)})
        self.inner.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        mine = f"recv from rank {src} {_layout(tensor)}"
        theirs = _decode(self.host.recv(_encode(""), src))
        agreed = theirs == f"send to rank {self.rank} {_layout(tensor)}"
        self.host.send(_encode("" if agreed else mine), src)
        if not agreed:
            raise self._mismatch(mine, {src: theirs, self.rank: mine})
        return self.inner.recv(tensor, src)

    def _agree(self, mine: str) -> None:
        gathered = self.host.all_gather(_encode(mine)).view(self.world_size, DESCRIPTION_BYTES)
        calls = {rank: _decode(row) for rank, row in enumerate(gathered)}
        if len(set(calls.values())) > 1:
            raise self._mismatch(mine, calls)

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
    return torch.frombuffer(bytearray(text.encode()[:DESCRIPTION_BYTES].ljust(DESCRIPTION_BYTES, b"\0")),
                            dtype=torch.uint8)


def _decode(row: torch.Tensor) -> str:
    return bytes(row.tolist()).rstrip(b"\0").decode(errors="replace")
