"""`init_group`: the process group engine code asks for, on any platform.

A `DeviceGroup` is a group of ranks, one device each, with two communicators: `comm`
on the platform's backend (`Platform.dist_backend`: nccl, xccl, hccl ...) for device
tensors, and `host` on gloo for small host-side agreements (the KV pool size every rank
can hold, say). Both are torchhal's own process groups: torch.distributed's default
group is neither created nor used, so an engine can share its process with other
torch.distributed users, and two engines with two groups can live in one process.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchhal.distributed.checked import CheckedCommunicator, CheckJournal
from torchhal.platforms import Platform, check_platform_argument, current_platform
from torchhal.platforms.communicator import CollectiveError, Communicator, TorchCommunicator
from torchhal.values import as_index, parse_decimal

#: How long a collective waits for a peer before it raises (a dead or hung rank).
DEFAULT_TIMEOUT = timedelta(minutes=5)
#: The longest timeout taken: a year is no timeout in practice, and much longer ones overflow
#: the backends' deadline arithmetic (gloo refuses timedelta.max, and hangs given 274 years).
MAX_TIMEOUT = timedelta(days=365)
#: The shortest group timeout: backends count in whole milliseconds, and read 0 as none.
MIN_TIMEOUT = timedelta(milliseconds=1)
#: Default names given to groups built so far (a refused or failed call takes none).
_default_names_taken = 0
#: Held by the init_group that is making a default-named group, from taking its name to counting it,
#: and the thread that holds it (None while free).
_default_naming = threading.Lock()
_default_naming_thread: int | None = None
#: The env:// stores reached so far, by (MASTER_ADDR, MASTER_PORT, rank, world size), kept for the
#: process's life as torch's default group keeps its own: rank 0's serves every rank's groups, and
#: going with the group that made it would cut off a peer already making the next group through it.
_env_stores: dict[tuple[str, str, int, int], dist.Store] = {}
#: A forked child's inherited stores: its parent's connections, never used nor closed there.
_parents_env_stores: list[dict[tuple[str, str, int, int], dist.Store]] = []
#: What rank 0 writes of each attempt to form a group (`_attempt`): opened, then formed or failed.
_FORMING, _FORMED, _FAILED = "forming", "formed", "failed"


def _after_fork_in_child() -> None:
    """A forked child has only the forking thread: a lock another thread held stays held there. Nor
    may it talk over its parent's store connections (closing rank 0's would stop a server thread
    the child does not have): it reaches the env:// rendezvous anew."""
    global _default_naming, _default_naming_thread, _env_stores
    _default_naming, _default_naming_thread = threading.Lock(), None
    _parents_env_stores.append(_env_stores)
    _env_stores = {}


if hasattr(os, "register_at_fork"):  # not on Windows, which cannot fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


#: Far above any real job; forming a group lists a key per rank, so a mistyped size (2**40)
#: would fill the host's memory before any timeout.
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True)
class RankPlacement:
    """Where this process sits: its rank in the group and on its host."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_rank", "local_world_size"):
            value = getattr(self, name)
            number = as_index(value)
            if number is None:
                raise TypeError(f"{name} = {value!r} must be an int")
            object.__setattr__(self, name, number)  # a numpy integer becomes a plain int
        for name in ("world_size", "local_world_size"):
            if getattr(self, name) > MAX_WORLD_SIZE:
                raise ValueError(f"{name} = {getattr(self, name)} is more ranks than any group torchhal forms "
                                 f"(at most {MAX_WORLD_SIZE}): check the value (WORLD_SIZE / LOCAL_WORLD_SIZE "
                                 "when read from the environment)")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} of world_size {self.world_size}: need 0 <= rank < world_size")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"local_rank {self.local_rank} of local_world_size {self.local_world_size}: "
                             "need 0 <= local_rank < local_world_size")

    @classmethod
    def from_env(cls, rank: int | None = None, world_size: int | None = None,
                 local_rank: int | None = None) -> RankPlacement:
        """Given values first, then torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
        LOCAL_WORLD_SIZE); a single process (rank 0 of 1) when neither says. The local values
        say where this process sits on its host (its device), so a group of the caller's own
        inside a larger torchrun job keeps the worker's LOCAL_RANK device."""
        def read(var: str, given: int | None, default: int) -> int:
            if given is not None:
                return given
            text = os.environ.get(var)
            if text is None:
                return default
            value = parse_decimal(text)
            if value is None:
                raise ValueError(f"{var}={text!r} must be a decimal integer such as 0 or 3 (torchrun sets it)")
            return value

        world = read("WORLD_SIZE", world_size, 1)
        if rank is None and "RANK" not in os.environ and isinstance(world, int) and world > 1:
            # Rank 0 by default would make every process rank 0: the group would never form.
            raise ValueError(f"world_size {world} needs this process's rank: pass rank= (0..{world - 1}) or set "
                             "RANK (torchrun does)")
        the_rank = read("RANK", rank, 0)
        if (local_rank is None and "LOCAL_RANK" not in os.environ and rank is None and world_size is None
                and isinstance(world, int) and world > 1):
            # Local rank 0 by default would put every rank of the host on device 0.
            raise ValueError(f"RANK={the_rank} and WORLD_SIZE={world} are set but LOCAL_RANK is not: set it (this "
                             "process's rank on its host, which picks its device; torchrun sets it) or pass "
                             "local_rank=")
        local = read("LOCAL_RANK", local_rank, the_rank if world_size is not None or rank is not None else 0)
        local_world = read("LOCAL_WORLD_SIZE", None, world)
        return cls(the_rank, world, local, local_world)


@dataclass
class DeviceGroup:
    """A group of ranks, one device each, and the communicators engine code uses."""

    name: str
    placement: RankPlacement
    platform: Platform
    device: torch.device
    comm: Communicator
    host: Communicator
    timeout: timedelta
    _owned: tuple[TorchCommunicator, ...] = ()
    _releases: list[weakref.WeakMethod[Callable[[], None]]] = field(default_factory=list)
    _closed: bool = False

    @property
    def rank(self) -> int:
        return self.placement.rank

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    @property
    def closed(self) -> bool:
        """`close()` has run: the communicators refuse every call."""
        return self._closed

    def release_on_close(self, release: Callable[[], None]) -> None:
        """Have `close()` call `release` (a bound method: the group holds it weakly, so its
        object's lifetime is its own) before it shuts the backends down. Whatever holds device
        graphs that captured this group's collectives registers one that drops them: NCCL
        cannot destroy a communicator while a captured graph still uses it (the shutdown waits
        for ever). `GenerationEngine(..., group=)` registers its graphs' release."""
        if not callable(release) or not hasattr(release, "__self__"):
            raise TypeError(f"release = {release!r} must be a bound method (the group holds it weakly)")
        if self.closed:
            raise CollectiveError(f"release_on_close: group {self.name!r} is closed (DeviceGroup.close); make a new "
                                  "group with init_group")
        self._releases = [ref for ref in self._releases if ref() is not None]
        self._releases.append(weakref.WeakMethod(release))

    def close(self) -> None:
        """Shut the group's backends down and drop them (its communicators then refuse calls).
        What registered with `release_on_close` is released first; if a release raises, the
        backends stay up and the error propagates, and calling `close()` again finishes the
        job from the release that failed. Close after every rank's engine calls have returned
        (a rank that closes mid-generate leaves its peers waiting in a collective).

        Close a group before the process exits: a backend left to interpreter teardown can
        abort the process when a peer has already gone."""
        while self._releases:
            release = self._releases[0]()
            if release is not None:
                release()  # raises: this one and the rest stay registered, the backends up
            del self._releases[0]
        backends = {id(comm.backend): comm.backend for comm in self._owned if comm.backend is not None}
        for backend in backends.values():
            shutdown = getattr(backend, "shutdown", None)
            if callable(shutdown):
                shutdown()
        for comm in self._owned:
            comm.backend = None
        self._owned = ()
        self._closed = True

    def wait_for(self, event: Any, what: str) -> None:
        """Wait until device work recorded by `event` (the platform's event) is done, for at
        most the group's timeout; past it, raise `CollectiveError` naming `what`. For work that
        replays collectives from a device graph: no backend times those out (NCCL's watchdog
        watches only collectives it launched itself), so a dead or hung peer would leave a
        plain wait blocked for ever. Use it too for eager collectives' results on NCCL: its
        watchdog ends a timed-out process only after dumping Python stacks, which waits for the
        GIL a blocking read holds; this wait yields it."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not event.query():
            if time.monotonic() > deadline:
                raise CollectiveError(
                    f"{what}: device work in group {self.name!r} at rank {self.rank} of {self.world_size} did not "
                    f"finish within the group's timeout ({self.timeout.total_seconds():g} s). Its collectives are "
                    "waiting on a dead, hung or diverged peer; the group cannot be reused"
                )
            time.sleep(0)  # yield the GIL; the poll costs about what a spinning wait does


def init_group(
    platform: Platform | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    store: dist.Store | None = None,
    name: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> DeviceGroup:
    """Join a group of `world_size` ranks on `platform` (default: the current platform).

    Placement: the arguments, else torchrun's environment (see `RankPlacement.from_env`).
    Rendezvous: `store` if given; else torch.distributed's default store when a default
    group exists (that group keeps working); else torch's env:// rendezvous on
    MASTER_ADDR:MASTER_PORT, as `init_process_group` does it (under torchrun, the agent's
    store). `name` keeps two groups in one store apart (default: one per call, numbered in
    call order, which every rank must then follow). Threads have no call order: a default-named
    call while another thread is inside one is refused, so pass `name=` to each group when
    threads make groups (a default-named call from inside one, on its thread, is refused too).
    So is a default-named group smaller than the job whose rendezvous it shares (a sub-group
    under torchrun): the job's groups would pair up by arrival. Two processes joining one
    group as the same rank are refused, naming that. The rank's device is
    `platform.device_for_rank` and is made current. A collective on a dead or hung peer
    raises `CollectiveError` within `timeout` (gloo); on NCCL, wait for its result through
    `DeviceGroup.wait_for`, which raises it (a blocking read can hang: see there). Call `close()`
    before exiting; a group made again under a closed one's name, on the same store, is a new group,
    and so is one made again after a failed attempt. Bad arguments are refused before anything is
    touched (the device, the store, the names).
    """
    global _default_names_taken, _default_naming_thread
    check_platform_argument(platform)  # init_group's refusals start with the argument
    placement = RankPlacement.from_env(rank, world_size, local_rank)
    # Under a millisecond the stores and backends read 0 ms, which they take as no timeout at all.
    if not isinstance(timeout, timedelta) or not MIN_TIMEOUT <= timeout <= MAX_TIMEOUT:
        raise ValueError(f"timeout = {timeout!r} must be a datetime.timedelta of at least 1 ms and at most "
                         f"{MAX_TIMEOUT.days} days")
    if store is not None and not isinstance(store, dist.Store):
        raise TypeError(f"store = {store!r} must be a torch.distributed.Store (TCPStore, FileStore, HashStore ...), "
                        "or None for the rendezvous in the environment")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name = {name!r} must be a non-empty str, or None for a default name")
    platform = platform if platform is not None else current_platform()
    index = platform.device_for_rank(placement.local_rank, placement.local_world_size)
    connect, sharing = _rendezvous(placement, timeout) if store is None else ((lambda: store), None)
    if name is None and sharing is not None and sharing[0] > placement.world_size:
        raise ValueError(f"name = None: this group of {placement.world_size} ranks meets on {sharing[1]}, which "
                         f"{sharing[0]} processes share, and default names would pair the ranks of their groups "
                         "in the order they arrive: pass a name= unique to each sub-group (name=f'tp{replica}', "
                         "say)")
    if name is None:
        # This call's own lock: a fork inside the call gives the child a fresh one, and the
        # child must release the one it holds. Non-blocking: waiting would number the groups
        # in whichever order the threads ran.
        naming = _default_naming
        if not naming.acquire(blocking=False):
            if _default_naming_thread == threading.get_ident():  # e.g. a plugin's communicator hook
                raise ValueError("name = None: init_group was called from inside a default-named init_group on the "
                                 "same thread, which would take the outer group's name; pass name= to the inner one")
            raise ValueError("name = None: another thread of this process is inside a default-named init_group; "
                             "default names follow call order, which threads do not have: pass name= to each group "
                             "when threads make groups")
        _default_naming_thread = threading.get_ident()
        try:
            group = _make_group(platform, placement, index, connect, f"group{_default_names_taken}", timeout)
            _default_names_taken += 1  # only now: a refused or failed call must not shift this rank's names
            return group
        finally:
            _default_naming_thread = None
            naming.release()
    return _make_group(platform, placement, index, connect, name, timeout)


def _make_group(platform: Platform, placement: RankPlacement, index: int, connect: Callable[[], dist.Store],
                group_name: str, timeout: timedelta) -> DeviceGroup:
    """The checked init_group's group: the device made current, the store reached, the backends made."""
    platform.set_device(index)
    device = platform.device(index)
    support = platform.distributed_support
    base: dist.Store | None = None
    try:
        base = connect()
        with _attempt(base, group_name, placement, timeout) as prefix:
            checked = _ranks_check_collectives(base, prefix, placement, timeout, group_name)
            host_backend = _new_backend("gloo", dist.PrefixStore(f"{prefix}/host", base), placement, timeout,
                                        group_name)
            # The device's own backend, even where it is gloo too: a backend pairs the ranks' calls by
            # their order on it, and threads may call `comm` and `host` at once (one feeding requests
            # over `host` while the engine steps): one shared backend would pair one rank's device sum
            # with another's host sum (a wrong sum, or a wait until the timeout). Made here, in the
            # attempt, as gloo's meets its peers; other backends connect later, at their first call.
            device_backend = (_new_backend("gloo", dist.PrefixStore(f"{prefix}/device", base), placement, timeout,
                                           group_name) if platform.dist_backend == "gloo" else None)
            # The checks of the device's and the host's collectives each get a gloo group of their own,
            # as threads may call both and the order their checks meet in must not depend on that.
            checkers = [TorchCommunicator(_new_backend("gloo", dist.PrefixStore(f"{prefix}/check/{part}", base),
                                                       placement, timeout, group_name),
                                          placement.rank, placement.world_size, torch.device("cpu"),
                                          name=f"{group_name}/check/{part}", timeout=timeout)
                        for part in (("device", "host") if checked else ())]
    except RuntimeError as exc:  # torch's DistStoreError / DistNetworkError: a peer or the store never came
        if isinstance(exc, dist.DistNetworkError) and base is not None:
            _forget_env_store(base)  # rank 0's server went (restarted, say): the next call connects anew
        reason = " ".join(str(exc).split())[:300]
        raise CollectiveError(
            f"init_group: group {group_name!r} did not form at rank {placement.rank} of {placement.world_size} "
            f"within {timeout.total_seconds():g} s: {reason}. Check that every rank calls init_group with the same "
            "name and world size, that MASTER_ADDR:MASTER_PORT (or the store) reaches rank 0's store, and that no "
            "rank has died; calling init_group again on every rank makes a new attempt"
        ) from exc
    host = TorchCommunicator(host_backend, placement.rank, placement.world_size, torch.device("cpu"),
                             name=f"{group_name}/host", timeout=timeout)
    if device_backend is None:
        device_backend = _new_backend(
            platform.dist_backend, dist.PrefixStore(f"{prefix}/device", base), placement, timeout, group_name
        )
    default = TorchCommunicator(device_backend, placement.rank, placement.world_size, device,
                                graph_capturable=support.graph_capturable, name=group_name, timeout=timeout,
                                store=dist.PrefixStore(f"{prefix}/communicator", base))
    comm = support.communicator(default) if support.communicator is not None else default
    if not checkers:
        return DeviceGroup(group_name, placement, platform, device, comm, host, timeout, (host, default))
    device_checker, host_checker = checkers
    host_name = f"{group_name}/host"
    journal = CheckJournal(dist.PrefixStore(f"{prefix}/check/journal", base), placement.rank, placement.world_size,
                           (group_name, host_name))
    return DeviceGroup(group_name, placement, platform, device,
                       CheckedCommunicator(comm, device_checker, group_name, journal),
                       CheckedCommunicator(host, host_checker, host_name, journal), timeout,
                       (host, default, *checkers))


def _ranks_check_collectives(store: dist.Store, prefix: str, placement: RankPlacement, timeout: timedelta,
                             group_name: str) -> bool:
    """Whether the group's collectives are checked across ranks first (torch's own switch,
    TORCH_DISTRIBUTED_DEBUG=DETAIL). Every rank must say the same: the check is a collective
    of its own, which a rank without it would never join."""
    mine = dist.get_debug_level() == dist.DebugLevel.DETAIL
    store.set(f"{prefix}/checked/{placement.rank}", "1" if mine else "0")
    keys = [f"{prefix}/checked/{rank}" for rank in range(placement.world_size)]
    store.wait(keys, timeout)
    checked = [store.get(key) == b"1" for key in keys]
    if len(set(checked)) > 1:
        # Rank 0 (whose exit may take the store with it) leaves only once every other rank has read.
        if placement.rank:
            store.set(f"{prefix}/checked-read/{placement.rank}", "1")
        else:
            store.wait([f"{prefix}/checked-read/{rank}" for rank in range(1, placement.world_size)], timeout)
        on = [rank for rank, flag in enumerate(checked) if flag]
        off = [rank for rank, flag in enumerate(checked) if not flag]
        raise ValueError(f"init_group: TORCH_DISTRIBUTED_DEBUG=DETAIL is set on rank(s) {on} of group {group_name!r} "
                         f"and not on rank(s) {off}: set it on every rank or on none (its check of each collective "
                         "is a collective every rank takes part in)")
    return mine


def _rendezvous(placement: RankPlacement, timeout: timedelta) -> tuple[Callable[[], dist.Store], tuple[int, str]]:
    """How this rank will reach its peers (checked now, connected when called), and how many
    processes share that rendezvous, with what it is: other groups may meet on it too."""
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store, (dist.get_world_size(), "torch.distributed's default group")
    if placement.world_size == 1:
        return dist.HashStore, (1, "a store of its own")
    missing = [var for var in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(var)]
    if missing:
        raise ValueError(
            f"{placement.world_size} ranks need a rendezvous: set {' and '.join(missing)} (torchrun does), "
            "or pass store= to init_group"
        )
    address, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    if not (port.isdecimal() and 0 < int(port) < 65536):
        raise ValueError(f"MASTER_PORT={port!r} must be a TCP port number, 1 to 65535 (the port of rank 0's store)")
    _check_master_addr(address)
    job = os.environ.get("WORLD_SIZE", "")
    sharing = (int(job) if job.isdecimal() else placement.world_size,
               f"the env:// rendezvous (MASTER_ADDR:MASTER_PORT, WORLD_SIZE={job})")
    key = (address, port, placement.rank, placement.world_size)

    def connect() -> dist.Store:
        if (store := _env_stores.get(key)) is not None:
            return store
        # torch's own env:// rendezvous, so torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE)
        # and a multi-tenant TCPStore on rank 0 (several groups, one port) work as they do for
        # init_process_group.
        store, _, _ = next(dist.rendezvous("env://", rank=placement.rank, world_size=placement.world_size,
                                           timeout=timeout))
        return _env_stores.setdefault(key, store)  # a thread that got there first keeps its own

    return connect, sharing


def _forget_env_store(store: dist.Store) -> None:
    for key in [key for key, kept in _env_stores.items() if kept is store]:
        del _env_stores[key]


def _check_master_addr(address: str) -> None:
    """MASTER_ADDR names one host that resolves: torch's rendezvous tries any other until the
    group's timeout, then names only a socket. A colon is taken in a bare IPv6 address (::1)
    alone: torch's TCPStore takes no brackets ([::1] times out too)."""
    if any(char.isspace() for char in address) or (":" in address and not _is_ipv6(address)):
        raise ValueError(f"MASTER_ADDR={address!r} must be a host name or IP address alone, without spaces, a scheme "
                         "(tcp://), a port (that is MASTER_PORT) or brackets around an IPv6 address: set MASTER_ADDR "
                         "to rank 0's host name or IP address")
    try:
        socket.getaddrinfo(address, None)
    except (OSError, UnicodeError) as exc:  # gaierror; UnicodeError for a name IDNA cannot encode ("a..b")
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"MASTER_ADDR={address!r} does not resolve ({reason}): set MASTER_ADDR to rank 0's host "
                         "name or IP address") from exc


def _is_ipv6(address: str) -> bool:
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def _attempt(store: dist.Store, name: str, placement: RankPlacement, timeout: timedelta) -> Iterator[str]:
    """The key prefix of this attempt to form the group `name` on `store`: a new one each time,
    as a group made again (after close, or after a failed attempt) would meet its predecessor's keys.
    Rank 0 opens the attempts and writes whether each formed or failed; every other rank joins
    the newest one opened since the last it joined, unless it failed, so a rank that failed or
    timed out alone, or a late one, costs the ranks' next attempts nothing."""
    base = f"torchhal/{name}/{placement.world_size}"
    rank = placement.rank
    number = _open_attempt(store, base, name) if rank == 0 else _newest_attempt(store, base, name, rank, timeout)
    prefix = f"{base}.{number}"
    try:
        if rank and store.add(f"{prefix}/rank/{rank}", 1) > 1:
            raise _joined_twice(name, rank)
        yield prefix
    except BaseException as exc:
        with contextlib.suppress(RuntimeError):  # a store that failed with the attempt tells no one anyway
            if rank == 0:
                store.set(f"{prefix}/state", _FAILED)
            # Another process of this rank is why this one timed out: the first of the two is told so too.
            if isinstance(exc, RuntimeError) and (store.add(f"{base}/attempts", 0) > number if rank == 0
                                                  else store.add(f"{prefix}/rank/{rank}", 0) > 1):
                raise _joined_twice(name, rank) from exc
        raise
    else:
        if rank == 0:
            store.set(f"{prefix}/state", _FORMED)
    finally:
        if rank:
            with contextlib.suppress(RuntimeError):
                store.set(f"{base}/joined/{rank}", str(number))  # where its next call looks from


def _open_attempt(store: dist.Store, base: str, name: str) -> int:
    """Rank 0's next attempt; refused while its last one is still forming: that is another rank 0's."""
    number = store.add(f"{base}/attempts", 1)
    last = f"{base}.{number - 1}/state"
    if number > 1 and not (store.check([last]) and store.get(last).decode() in (_FORMED, _FAILED)):
        store.set(f"{base}.{number}/state", _FAILED)
        raise _joined_twice(name, 0)
    store.set(f"{base}.{number}/state", _FORMING)
    return number


def _newest_attempt(store: dist.Store, base: str, name: str, rank: int, timeout: timedelta) -> int:
    """The newest attempt rank 0 has opened since this rank last joined one, unless rank 0 gave
    up on it; waits up to `timeout` for one."""
    first = store.add(f"{base}/joined/{rank}", 0) + 1  # read (0 if never set)
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            store.wait([f"{base}.{first}/state"], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except RuntimeError as exc:  # DistStoreError: the wait timed out
            raise RuntimeError(f"rank 0 opened no new attempt to form group {name!r}: it has not called init_group "
                               "with this name and world size, or has died") from exc
        newest = store.add(f"{base}/attempts", 0)
        for number in range(newest, first - 1, -1):
            state = f"{base}.{number}/state"  # absent for an instant: rank 0 counts an attempt, then writes it
            if not store.check([state]) or store.get(state).decode() != _FAILED:
                return number
        first = newest + 1  # rank 0 gave up on every attempt opened so far: wait for its next


def _joined_twice(name: str, rank: int) -> ValueError:
    return ValueError(f"init_group: two processes are forming group {name!r} as rank {rank} at once: two processes "
                      f"with RANK={rank} (or the same rank=), or two groups made under the name {name!r}. Give each "
                      "process its own rank and each group its own name; if the other process died making the "
                      "group, retry")


def _new_backend(backend: str, store: dist.Store, placement: RankPlacement, timeout: timedelta,
                 name: str) -> Any:
    """A torch.distributed backend object for one group, not registered with torch's world."""
    rank, size = placement.rank, placement.world_size
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    if backend == "xccl" and hasattr(dist, "ProcessGroupXCCL"):
        xccl_options = dist.ProcessGroupXCCL.Options()
        xccl_options._timeout = timeout
        return dist.ProcessGroupXCCL(store, rank, size, xccl_options)
    # A vendor's backend (hccl, mccl ...), registered by its torch extension at import.
    plugin = getattr(dist.Backend, "_plugins", {}).get(backend.upper())
    if plugin is None:
        raise ValueError(
            f"torch.distributed backend {backend!r} is not available in this process: install the vendor's "
            "torch extension that registers it (torch.distributed.Backend.register_backend)"
        )
    if not plugin.extended_api:
        return plugin.creator_fn(store, rank, size, timeout)
    # The extended signature, called as torch's new_group calls it.
    request = dist.distributed_c10d._DistributedBackendOptions()
    request.store = store
    request.group_rank = rank
    request.group_size = size
    request.timeout = timeout
    request.group_id = name
    request.global_ranks_in_group = list(range(size))
    return plugin.creator_fn(request, None)
