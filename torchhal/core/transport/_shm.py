"""Shared-memory files of the transport: names, safe opening, control blocks, orphan reclaim.

Every file a producer creates is named `torchhal-<pid>-<token>-<role>` (role `ctl` for
the control block, `h<slot>-g<generation>` for a host block), so a consumer accepts a
name only if it belongs to the producer that sent the message, and anyone can tell
whose file it is after a crash. Opening never follows a symlink and accepts only a
regular file owned by this user, with one link.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
import tempfile
import uuid

from torchhal.core.transport.messages import EVENT_HANDLE_MAX, TransportError, control_name, handle_fingerprint

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
#: a file a producer made: its pid, its token, its role.
_OWNED_FILE = re.compile(r"torchhal-(\d{1,10})-[0-9a-f]{12}-(ctl|h\d{1,10}-g\d{1,20})")
_OPEN_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def new_pool_id() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def pid_alive(pid: int) -> bool:
    if pid <= 0:  # kill(0, ...) would signal this process group
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


class SharedFile:
    """A named block of shared memory: a file in SHM_DIR, mapped. Made with `size` (the
    producer), else opened as untrusted (the consumer): an empty file fails to map."""

    def __init__(self, name: str, size: int | None = None, writable: bool = True) -> None:
        path = os.path.join(SHM_DIR, name)
        if size is not None:
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
            except OSError as exc:  # ELOOP for a symlink, EACCES, ...
                problem = ("is gone (recycled, or its producer exited)" if isinstance(exc, FileNotFoundError)
                           else f"cannot be opened safely: {exc}")
                raise TransportError(f"shared memory {name!r} {problem}") from exc
        try:
            info = os.fstat(fd)
            if size is None and (not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid()
                                 or info.st_nlink != 1):
                raise TransportError(f"shared memory {name!r} is not a regular file of this user with one link; "
                                     "refusing it")
            self.size = info.st_size
            self.map = mmap.mmap(fd, self.size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.name = name

    def close(self) -> None:
        self.map.close()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))

    def discard(self) -> None:
        """Unmap and remove: a producer's host block that no message will name again."""
        self.close()
        self.unlink()


def _event_stride(event_bytes: int) -> int:
    return -(-event_bytes // 8) * 8


class Control:
    """int64 cells in shared memory, then the producer's constant records:
    [alive, pid, slots, consumers, pool_bytes, fingerprint x4, event_bytes, handle_bytes,
     gen[slots], ack[slots x consumers], event_len[slots]] + slots x event_bytes + handle_bytes.

    Each consumer writes only its own ack cells, so no cross-process atomics are needed.
    The producer writes the pool handle's record (its canonical plain data) and its
    fingerprint (sha256) once at creation, and a slot's event handle once, before the first
    message that asks to wait on it: consumers read them once instead of every message
    carrying them. The fingerprint tells a garbled or truncated handle record.
    """

    HEADER = 11
    MAX_CELLS = 1 << 24  # 128 MiB of cells: far beyond any real slots x consumers
    MAX_HANDLE_BYTES = 1 << 16  # a pool handle's plain data is well under a KiB

    def __init__(self, shm: SharedFile) -> None:
        self.shm = shm
        self._raw = memoryview(shm.map)
        self.cells = self._raw[: (shm.size // 8) * 8].cast("q")

    def _fix_layout(self, slots: int, consumers: int, pool_bytes: int, event_bytes: int, handle_bytes: int) -> None:
        """Keep the layout, constant for the block's life: read once (and checked against the
        file's size by `open`), never again from cells another process can write."""
        self.slots, self.consumers, self.pool_bytes = slots, consumers, pool_bytes
        #: bytes of each slot's event handle record (0: the producer has no interprocess events)
        self.event_bytes, self._handle_bytes = event_bytes, handle_bytes
        self._acks = self.HEADER + slots  # first ack cell
        self._event_lengths = self._acks + slots * consumers  # first event-length cell
        self._event_start = 8 * (self._event_lengths + slots)  # byte where the event handles start
        self._handle_start = self._event_start + slots * _event_stride(event_bytes)

    @classmethod
    def _size(cls, slots: int, consumers: int, event_bytes: int, handle_bytes: int) -> int:
        return 8 * (cls.HEADER + 2 * slots + slots * consumers) + slots * _event_stride(event_bytes) + handle_bytes

    @classmethod
    def create(cls, pool_id: str, slots: int, consumers: int, pool_bytes: int, handle: bytes = b"",
               event_bytes: int = 0) -> Control:
        assert len(handle) <= cls.MAX_HANDLE_BYTES and 0 <= event_bytes <= EVENT_HANDLE_MAX
        control = cls(SharedFile(control_name(pool_id), cls._size(slots, consumers, event_bytes, len(handle))))
        cells = control.cells
        for i in range(cls.HEADER + slots, cls.HEADER + slots + slots * consumers):
            cells[i] = -1  # no generation acknowledged yet
        cells[1], cells[2], cells[3], cells[4] = os.getpid(), slots, consumers, pool_bytes
        fingerprint = handle_fingerprint(handle) if handle else bytes(32)
        for i in range(4):
            cells[5 + i] = int.from_bytes(fingerprint[8 * i : 8 * i + 8], "little", signed=True)
        cells[9], cells[10] = event_bytes, len(handle)
        control._fix_layout(slots, consumers, pool_bytes, event_bytes, len(handle))
        control._raw[control._handle_start : control._handle_start + len(handle)] = handle
        cells[0] = 1
        return control

    @classmethod
    def open(cls, name: str, producer_pid: int) -> Control:
        """Open a producer's block as untrusted: its layout must agree with the file's size,
        and its pid with the one its name gives."""
        control = cls(SharedFile(name))
        try:
            header = control.cells[: cls.HEADER].tolist() + [0] * cls.HEADER  # a block too short for one: zeros
            pid, slots, consumers, pool_bytes, event_bytes, handle_bytes = (header[i] for i in (1, 2, 3, 4, 9, 10))
            if not (0 < slots and 0 < consumers and slots * (2 + consumers) < cls.MAX_CELLS
                    and 0 <= event_bytes <= EVENT_HANDLE_MAX and 0 <= handle_bytes <= cls.MAX_HANDLE_BYTES
                    and control.shm.size == cls._size(slots, consumers, event_bytes, handle_bytes)
                    and pid == producer_pid):
                raise TransportError(f"control block {name!r} has an inconsistent layout (its slots, consumers and "
                                     f"record sizes must give its file's size, its pid must be {producer_pid})")
            control._fix_layout(slots, consumers, pool_bytes, event_bytes, handle_bytes)
        except BaseException:
            control.close(unlink=False)
            raise
        return control

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def fingerprint(self) -> bytes:
        return b"".join(self.cells[5 + i].to_bytes(8, "little", signed=True) for i in range(4))

    def handle_record(self) -> bytes:
        """The pool handle's record as the producer wrote it (empty without a device pool)."""
        return bytes(self._raw[self._handle_start : self._handle_start + self._handle_bytes])

    def _event_at(self, slot: int) -> int:
        return self._event_start + slot * _event_stride(self.event_bytes)

    def set_event(self, slot: int, handle: bytes) -> None:
        """Store slot `slot`'s event handle (before any message asks to wait on it)."""
        assert 0 < len(handle) <= self.event_bytes
        self._raw[self._event_at(slot) : self._event_at(slot) + len(handle)] = handle
        self.cells[self._event_lengths + slot] = len(handle)

    def event(self, slot: int) -> bytes | None:
        """Slot `slot`'s event handle, None if the producer stored none; a garbled length is a TransportError."""
        length = self.cells[self._event_lengths + slot]
        if length == 0:
            return None
        if not 0 < length <= self.event_bytes:
            raise TransportError(f"control block {self.name!r} is garbled: slot {slot}'s event handle length "
                                 f"{length} is outside 1..{self.event_bytes}")
        return bytes(self._raw[self._event_at(slot) : self._event_at(slot) + length])

    def generation(self, slot: int) -> int:
        return self.cells[self.HEADER + slot]

    def bump(self, slot: int) -> int:
        self.cells[self.HEADER + slot] += 1
        return self.cells[self.HEADER + slot]

    def ack(self, slot: int, consumer: int, generation: int) -> None:
        self.cells[self._acks + slot * self.consumers + consumer] = generation

    def all_acked(self, slot: int) -> bool:
        gen = self.generation(slot)
        base = self._acks + slot * self.consumers
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
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed: list[str] = []
    for name in names:
        match = _OWNED_FILE.fullmatch(name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                os.unlink(path)
                removed.append(name)
    return removed
