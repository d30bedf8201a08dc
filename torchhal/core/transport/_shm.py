"""Shared-memory files of the transport: names, safe opening, control blocks, orphan reclaim.

Every file a producer creates is named `torchhal-<pid>-<token>-<role>` (role `ctl` for
the control block, `h<slot>-g<generation>` for a host block), so a consumer accepts a
name only if it belongs to the producer that sent the message, and anyone can tell
whose file it is after a crash. Opening never follows a symlink and accepts only a
regular file owned by this user, with one link.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import tempfile
import uuid

from torchhal.core.transport.messages import TransportError

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

#: pool ids are `<producer pid>-<12 hex digits>`; file names embed them.
POOL_ID = re.compile(r"(\d{1,10})-([0-9a-f]{12})")
#: any file of this package, old or new naming, with the creating pid first.
_OWNED_FILE = re.compile(r"torchhal-(\d{1,10})-[0-9a-f]{12,32}(-[a-z0-9-]{1,40})?")
_OPEN_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def new_pool_id() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def control_name(pool_id: str) -> str:
    return f"torchhal-{pool_id}-ctl"


def host_name(pool_id: str, slot: int, generation: int) -> str:
    return f"torchhal-{pool_id}-h{slot}-g{generation}"


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OverflowError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


class SharedFile:
    """A named block of shared memory: a file in SHM_DIR, mapped."""

    def __init__(self, name: str, size: int | None = None, writable: bool = True) -> None:
        path = os.path.join(SHM_DIR, name)
        if size is not None:  # create (producer side)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | _OPEN_FLAGS, 0o600)
            try:
                os.ftruncate(fd, max(size, 1))
            except BaseException:
                os.close(fd)
                os.unlink(path)
                raise
        else:
            try:
                fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | _OPEN_FLAGS)
            except FileNotFoundError:
                raise TransportError(f"shared memory {name!r} is gone (recycled, or its producer exited)") from None
            except OSError as exc:  # ELOOP for a symlink, EACCES, ...
                raise TransportError(f"shared memory {name!r} cannot be opened safely: {exc}") from exc
        try:
            info = os.fstat(fd)
            if size is None and (
                not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_nlink != 1
            ):
                raise TransportError(
                    f"shared memory {name!r} is not a regular file of this user with one link; refusing it"
                )
            self.size = info.st_size
            if self.size == 0:
                raise TransportError(f"shared memory {name!r} is empty")
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            self.map = mmap.mmap(fd, self.size, access=access)
        finally:
            os.close(fd)
        self.name = name

    def close(self) -> None:
        self.map.close()

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass


class Control:
    """int64 cells in shared memory:
    [alive, pid, slots, consumers, pool_bytes, fingerprint x4, gen[slots], ack[slots x consumers]].

    Each consumer writes only its own ack cells, so no cross-process atomics are needed.
    The fingerprint (sha256 of the pool handle's plain data) ties a message's handle to
    the producer that made this block.
    """

    HEADER = 9
    MAX_CELLS = 1 << 24  # 128 MiB of cells: far beyond any real slots x consumers

    def __init__(self, shm: SharedFile) -> None:
        self.shm = shm
        self._raw = memoryview(shm.map)
        self.cells = self._raw[: (shm.size // 8) * 8].cast("q")

    @classmethod
    def create(cls, pool_id: str, slots: int, consumers: int, pool_bytes: int, fingerprint: bytes) -> Control:
        control = cls(SharedFile(control_name(pool_id), 8 * (cls.HEADER + slots + slots * consumers)))
        cells = control.cells
        for i in range(cls.HEADER + slots, len(cells)):
            cells[i] = -1
        cells[1], cells[2], cells[3], cells[4] = os.getpid(), slots, consumers, pool_bytes
        for i in range(4):
            cells[5 + i] = int.from_bytes(fingerprint[8 * i : 8 * i + 8].ljust(8, b"\0"), "little", signed=True)
        cells[0] = 1
        return control

    @classmethod
    def open(cls, name: str, producer_pid: int) -> Control:
        control = cls(SharedFile(name))
        try:
            cells = control.cells
            if len(cells) < cls.HEADER:
                raise TransportError(f"control block {name!r} is too small to be one")
            slots, consumers = cells[2], cells[3]
            if not (0 < slots and 0 < consumers and slots * (1 + consumers) < cls.MAX_CELLS
                    and control.shm.size == 8 * (cls.HEADER + slots + slots * consumers)):
                raise TransportError(f"control block {name!r} has an inconsistent layout")
            if cells[1] != producer_pid:
                raise TransportError(f"control block {name!r} belongs to pid {cells[1]}, not {producer_pid}")
        except BaseException:
            control.close(unlink=False)
            raise
        return control

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def slots(self) -> int:
        return self.cells[2]

    @property
    def consumers(self) -> int:
        return self.cells[3]

    @property
    def pool_bytes(self) -> int:
        return self.cells[4]

    @property
    def fingerprint(self) -> bytes:
        return b"".join(self.cells[5 + i].to_bytes(8, "little", signed=True) for i in range(4))

    def generation(self, slot: int) -> int:
        return self.cells[self.HEADER + slot]

    def bump(self, slot: int) -> int:
        self.cells[self.HEADER + slot] += 1
        return self.cells[self.HEADER + slot]

    def ack(self, slot: int, consumer: int, generation: int) -> None:
        self.cells[self.HEADER + self.slots + slot * self.consumers + consumer] = generation

    def all_acked(self, slot: int) -> bool:
        gen = self.generation(slot)
        base = self.HEADER + self.slots + slot * self.consumers
        return all(self.cells[base + c] == gen for c in range(self.consumers))

    @property
    def alive(self) -> bool:
        return self.cells[0] == 1

    def close(self, unlink: bool) -> None:
        if unlink:
            self.cells[0] = 0
        self.cells.release()
        self._raw.release()
        self.shm.close()
        if unlink:
            self.shm.unlink()


def reclaim_orphans(directory: str | None = None) -> list[str]:
    """Unlink transport files whose creating process has exited; returns their names.

    Only regular files of this user named like this package's files are touched; a
    file whose pid was reused by a live process is kept until that process exits.
    """
    directory = directory or SHM_DIR
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.geteuid()
    for name in names:
        match = _OWNED_FILE.fullmatch(name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_uid == uid:
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue  # gone meanwhile, or not ours to remove
    return removed
