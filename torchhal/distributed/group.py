"""`init_group`: the process group engine code asks for, on any platform.

A `DeviceGroup` is a group of ranks, one device each, with two communicators: `comm` on the
platform's backend (`Platform.dist_backend`: nccl, xccl, hccl ...) for device tensors, and
`host` on gloo for small host-side agreements (the KV pool size every rank can hold, say).
Both are torch.distributed process groups of torchhal's own, built by torch's own group
construction beside its default group, which is neither created nor used: an engine shares
its process with other torch.distributed users, and two engines with two groups can live in
one process.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from torchhal.platforms import Platform, check_platform_argument, current_platform
from torchhal.platforms.communicator import CollectiveError, Communicator, TorchCommunicator
from torchhal.values import as_index, parse_decimal

#: How long a collective waits for a peer before it raises (a dead or hung rank).
DEFAULT_TIMEOUT = timedelta(minutes=5)
#: The longest timeout taken: longer ones overflow the backends' deadline arithmetic.
MAX_TIMEOUT = timedelta(days=365)
#: The shortest group timeout: backends count in whole milliseconds, and read 0 as none.
MIN_TIMEOUT = timedelta(milliseconds=1)
#: Far above any real job; a mistyped size (2**40) would have the store list a key per rank.
MAX_WORLD_SIZE = 1 << 20
#: How long forming a group may take, as a multiple of its timeout and seconds more: torch's
#: own waits inside it, each bounded by that timeout, answer first when the store answers at
#: all (a FileStore a second or so late).
_FORMING_BOUND = (1.1, 2.0)
#: Default names given so far in this process (a refused or failed call takes none).
_default_named = 0
#: The thread inside a default-named init_group, with its call's token, by process id (a
#: forked child finds no entry of its own, so it needs no fork handler).
_naming: dict[int, tuple[int, object]] = {}
#: The next generation of each (name, world size) this process forms: a group made again
#: under its name meets its peers under a new store prefix, as torch numbers new groups.
_generations: dict[tuple[str, int], int] = {}
#: The env:// stores reached, by (process, MASTER_ADDR, MASTER_PORT, rank, world size), kept
#: for the process's life as torch keeps its default store: rank 0's serves every group.
_env_stores: dict[tuple[int, str, str, int, int], dist.Store] = {}


@dataclass(frozen=True)
class RankPlacement:
    """Where this process sits: its rank in the group and on its host."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_rank", "local_world_size"):
            number = as_index(getattr(self, name))
            if number is None:
                raise TypeError(f"{name} = {getattr(self, name)!r} must be an int")
            object.__setattr__(self, name, number)  # a numpy integer becomes a plain int
        problem = next((f"{name} = {getattr(self, name)} is more ranks than any group torchhal forms (at most "
                        f"{MAX_WORLD_SIZE}): check the value (WORLD_SIZE / LOCAL_WORLD_SIZE when read from the "
                        "environment)" for name in ("world_size", "local_world_size")
                        if getattr(self, name) > MAX_WORLD_SIZE), None)
        if problem is None and (self.world_size < 1 or not 0 <= self.rank < self.world_size):
            problem = f"rank {self.rank} of world_size {self.world_size}: need 0 <= rank < world_size"
        if problem is None and (self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size):
            problem = (f"local_rank {self.local_rank} of local_world_size {self.local_world_size}: need "
                       "0 <= local_rank < local_world_size")
        if problem is not None:
            raise ValueError(problem)

    @classmethod
    def from_env(cls, rank: int | None = None, world_size: int | None = None,
                 local_rank: int | None = None) -> RankPlacement:
        """Given values first, then torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
        LOCAL_WORLD_SIZE); a single process (rank 0 of 1) when neither says. The local values
        say where this process sits on its host (its device), so a group of the caller's own
        inside a larger torchrun job keeps the worker's LOCAL_RANK device."""
        def read(var: str, given: int | None, default: int) -> int:
            text = os.environ.get(var)
            if given is not None or text is None:
                return default if given is None else given
            value = parse_decimal(text)
            if value is None:
                raise ValueError(f"{var}={text!r} must be a decimal integer such as 0 or 3 (torchrun sets it)")
            return value

        world = read("WORLD_SIZE", world_size, 1)
        several = isinstance(world, int) and world > 1
        the_rank = read("RANK", rank, 0)
        problem = None
        if several and rank is None and "RANK" not in os.environ:
            # Rank 0 by default would make every process rank 0: the group would never form.
            problem = f"world_size {world} needs this process's rank: pass rank= (0..{world - 1}) or set RANK " \
                      "(torchrun does)"
        elif several and local_rank is None and "LOCAL_RANK" not in os.environ and rank is None and world_size is None:
            # Local rank 0 by default would put every rank of the host on device 0.
            problem = f"RANK={the_rank} and WORLD_SIZE={world} are set but LOCAL_RANK is not: set it (this " \
                      "process's rank on its host, which picks its device; torchrun sets it) or pass local_rank="
        if problem is not None:
            raise ValueError(problem)
        local = read("LOCAL_RANK", local_rank, the_rank if world_size is not None or rank is not None else 0)
        return cls(the_rank, world, local, read("LOCAL_WORLD_SIZE", None, world))


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
        assert hasattr(release, "__self__") and not self.closed, "an open group takes bound methods only"
        self._releases = [ref for ref in self._releases if ref() is not None]
        self._releases.append(weakref.WeakMethod(release))

    def close(self) -> None:
        """Shut the group's backends down and drop them (its communicators then refuse calls).
        What registered with `release_on_close` is released first; if a release raises, the
        backends stay up and the error propagates, and calling `close()` again finishes the
        job from the release that failed. Close after every rank's engine calls have returned
        (a rank that closes mid-generate leaves its peers waiting in a collective), and before
        the process exits: a backend left to interpreter teardown can abort the process when a
        peer has already gone."""
        while self._releases:
            release = self._releases[0]()
            if release is not None:
                release()  # raises: this one and the rest stay registered, the backends up
            del self._releases[0]
        for comm in self._owned:
            if comm.backend is not None:
                dist.destroy_process_group(comm.backend)
                comm.backend = None
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
    Rendezvous: `store` if given; else torch.distributed's default store when a default group
    exists (that group keeps working); else torch's env:// rendezvous on MASTER_ADDR:MASTER_PORT,
    as `init_process_group` does it (under torchrun, the agent's store). `name` keeps two groups
    on one store apart (default: one per call, numbered in call order, which every rank must then
    follow; so threads making groups pass `name=`, and a default-named group smaller than the job
    whose rendezvous it shares is refused). A group made again under its name is a new group, and
    so is one made again on every rank after a failed attempt. Two processes joining one group as
    the same rank are refused, naming that. The rank's device is `platform.device_for_rank` and is
    made current. Forming the group takes at most `timeout` (and a little more); a collective on a dead
    or hung peer raises `CollectiveError` within `timeout` (gloo); on NCCL, wait for its result
    through `DeviceGroup.wait_for`, which raises it. Call `close()` before exiting. Bad arguments
    are refused before anything is touched (the device, the store, the names).
    """
    global _default_named
    check_platform_argument(platform)  # init_group's refusals start with the argument
    placement = RankPlacement.from_env(rank, world_size, local_rank)
    if store is not None and not isinstance(store, dist.Store):
        raise TypeError(f"store = {store!r} must be a torch.distributed.Store (TCPStore, FileStore, HashStore ...), "
                        "or None for the rendezvous in the environment")
    pid, mine = os.getpid(), (threading.get_ident(), object())
    holder = _naming.setdefault(pid, mine) if name is None else mine  # atomic under the GIL
    try:
        problem = _refusal(placement, store, name, timeout, holder, mine)
        if problem is not None:
            raise ValueError(problem)
        platform = platform if platform is not None else current_platform()
        index = platform.device_for_rank(placement.local_rank, placement.local_world_size)
        platform.set_device(index)
        group = _make_group(platform, placement, index, store, name or f"group{_default_named}", timeout)
        _default_named += name is None  # only now: a refused or failed call must not shift this rank's names
        return group
    finally:
        if name is None and holder is mine and os.getpid() == pid:
            del _naming[pid]


def _refusal(placement: RankPlacement, store: dist.Store | None, name: object, timeout: object,
             holder: tuple[int, object], mine: tuple[int, object]) -> str | None:
    """What is wrong with an init_group call, if anything: its arguments, the env:// variables
    it would read, and a default name it cannot take."""
    # Under a millisecond the stores and backends read 0 ms, which they take as no timeout at all.
    if not isinstance(timeout, timedelta) or not MIN_TIMEOUT <= timeout <= MAX_TIMEOUT:
        return f"timeout = {timeout!r} must be a datetime.timedelta of at least 1 ms and at most " \
               f"{MAX_TIMEOUT.days} days"
    if name is not None and (not isinstance(name, str) or not name):
        return f"name = {name!r} must be a non-empty str, or None for a default name"
    shared: tuple[int, str] | None = None
    if store is None and dist.is_initialized():
        shared = dist.get_world_size(), "torch.distributed's default group"
    elif store is None and placement.world_size > 1:
        problem = _env_problem(placement.world_size)
        if problem is not None:
            return problem
        job = os.environ.get("WORLD_SIZE", "")
        shared = parse_decimal(job) or 0, f"the env:// rendezvous (MASTER_ADDR:MASTER_PORT, WORLD_SIZE={job})"
    if name is None and shared is not None and shared[0] > placement.world_size:
        return (f"name = None: this group of {placement.world_size} ranks meets on {shared[1]}, which {shared[0]} "
                "processes share, and default names would pair the ranks of their groups in the order they arrive: "
                "pass a name= unique to each sub-group (name=f'tp{replica}', say)")
    if holder is not mine and holder[0] == mine[0]:  # e.g. a plugin's communicator hook
        return ("name = None: init_group was called from inside a default-named init_group on the same thread, "
                "which would take the outer group's name; pass name= to the inner one")
    if holder is not mine:
        return ("name = None: another thread of this process is inside a default-named init_group; default names "
                "follow call order, which threads do not have: pass name= to each group when threads make groups")
    return None


def _env_problem(world_size: int) -> str | None:
    """What is wrong with MASTER_ADDR and MASTER_PORT, if anything: torch's rendezvous would try
    a malformed or unresolvable address until the group's timeout, then name only a socket."""
    missing = [var for var in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(var)]
    if missing:
        return f"{world_size} ranks need a rendezvous: set {' and '.join(missing)} (torchrun does), or pass store= " \
               "to init_group"
    address, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    number = parse_decimal(port)
    if number is None or not 0 < number < 65536:
        return f"MASTER_PORT={port!r} must be a TCP port number, 1 to 65535 (the port of rank 0's store)"
    # A colon only in a bare IPv6 address (::1): torch's TCPStore takes no brackets.
    if any(char.isspace() for char in address) or (":" in address and not _is_ipv6(address)):
        return (f"MASTER_ADDR={address!r} must be a host name or IP address alone, without spaces, a scheme (tcp://), "
                "a port (that is MASTER_PORT) or brackets around an IPv6 address: set MASTER_ADDR to rank 0's host "
                "name or IP address")
    try:
        socket.getaddrinfo(address, None)
    except (OSError, UnicodeError) as exc:  # gaierror; UnicodeError for a name IDNA cannot encode ("a..b")
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return f"MASTER_ADDR={address!r} does not resolve ({reason}): set MASTER_ADDR to rank 0's host name or IP " \
               "address"
    return None


def _is_ipv6(address: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(address).version == 6
    return False


def _make_group(platform: Platform, placement: RankPlacement, index: int, store: dist.Store | None,
                name: str, timeout: timedelta) -> DeviceGroup:
    """The checked init_group's group: its torch groups formed, its communicators made."""
    connect, where, kept = _connector(placement, store, timeout)
    given_up = threading.Event()
    outcome = _within(timeout.total_seconds() * _FORMING_BOUND[0] + _FORMING_BOUND[1],
                      lambda: _form(platform.dist_backend, placement, connect, name, timeout, given_up))
    if not isinstance(outcome, tuple):
        given_up.set()
        if isinstance(outcome, dist.DistNetworkError) and kept is not None:  # rank 0's server went: connect anew
            _env_stores.pop(kept, None)
        if outcome is not None and not isinstance(outcome, RuntimeError):  # not torch's: raised as it was
            raise outcome
        if outcome is None:
            reason = f"no answer from {where} (a peer that never came, or a listener that accepts and never " \
                     "answers: another program on that port, a stopped rank 0)"
        elif "address already in use" in str(outcome).lower():
            reason = f"{where} is taken by another process: a second process with RANK=0, or another program"
        else:
            reason = " ".join(str(outcome).split())[:300]
        raise CollectiveError(
            f"init_group: group {name!r} did not form at rank {placement.rank} of {placement.world_size} within "
            f"{timeout.total_seconds():g} s: {reason}. Check that every rank calls init_group with the same name "
            f"and world size (and TORCH_DISTRIBUTED_DEBUG alike), that {where} is reachable, and that no rank has "
            "died; calling init_group again on every rank makes a new attempt"
        ) from outcome
    host_group, device_group, comm_store = outcome
    host = TorchCommunicator(host_group, placement.rank, placement.world_size, torch.device("cpu"),
                             name=f"{name}/host", timeout=timeout)
    support = platform.distributed_support
    default = TorchCommunicator(device_group, placement.rank, placement.world_size, platform.device(index),
                                graph_capturable=support.graph_capturable, name=name, timeout=timeout,
                                store=comm_store)
    comm = support.communicator(default) if support.communicator is not None else default
    return DeviceGroup(name, placement, platform, platform.device(index), comm, host, timeout, (host, default))


def _connector(placement: RankPlacement, store: dist.Store | None,
               timeout: timedelta) -> tuple[Callable[[], dist.Store], str, tuple[int, str, str, int, int] | None]:
    """How this rank reaches its peers' store (called while forming), what that is in words, and
    the key it is kept under (env:// only)."""
    if store is not None:
        return (lambda: store), "the store given to init_group", None
    if dist.is_initialized():
        return c10d._get_default_store, "the store of torch.distributed's default group", None
    if placement.world_size == 1:
        return dist.HashStore, "a store of its own", None
    address, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    key = (os.getpid(), address, port, placement.rank, placement.world_size)

    def connect() -> dist.Store:
        if key not in _env_stores:
            # torch's env:// rendezvous, as init_process_group's: torchrun's agent store where
            # torchrun says so (TORCHELASTIC_USE_AGENT_STORE), else rank 0 hosts one for every group.
            made, _, _ = next(dist.rendezvous("env://", rank=placement.rank, world_size=placement.world_size,
                                              timeout=timeout))
            _env_stores.setdefault(key, made)  # a thread that got there first keeps its own
        return _env_stores[key]

    return connect, f"rank 0's store at {address}:{port} (MASTER_ADDR:MASTER_PORT)", key


def _within(seconds: float, work: Callable[[], Any]) -> Any:
    """`work()`'s result or the exception it raised, or None when it has not returned within
    `seconds`. A thread of its own because torch's TCPStore waits without bound on a listener
    that accepts and never answers (a program on a mistyped port, a rank 0 stopped by SIGSTOP):
    its own timeout bounds only a store that answers."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome.append(exc)

    thread = threading.Thread(target=run, name="torchhal-init-group", daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome[0] if outcome else None


def _form(backend: str, placement: RankPlacement, connect: Callable[[], dist.Store], name: str,
          timeout: timedelta, given_up: threading.Event) -> tuple[dist.ProcessGroup, dist.ProcessGroup, dist.Store]:
    """The group's torch groups (host, device) and the store of its communicator. Each call forms
    a new generation of `name` on the store; a generation that failed on any rank is never joined
    again, so ranks that all call again after a failure meet in the next one."""
    base = connect()
    key = (name, placement.world_size)
    number = _generations.get(key, 0)
    while base.check([f"torchhal/{name}/{placement.world_size}/{number}/failed"]):
        number += 1
    prefix = f"torchhal/{name}/{placement.world_size}/{number}"
    if base.add(f"{prefix}/rank/{placement.rank}", 1) > 1:  # not marked failed: the first claimant forms it
        raise _claimed_twice(name, placement.rank)
    try:
        # The device's own group even where it is gloo too: a backend pairs the ranks' calls by their
        # order on it, and threads may call `comm` and `host` at once (one feeding requests over
        # `host` while the engine steps): one shared backend would pair one rank's device sum with
        # another's host sum.
        host = _torch_group("gloo", base, placement, f"{prefix}/host", timeout)
        device = _torch_group(backend, base, placement, prefix, timeout)
    except BaseException as exc:
        twice = False
        with contextlib.suppress(RuntimeError):  # a store that failed with the attempt tells no one anyway
            base.set(f"{prefix}/failed", "1")
            twice = base.add(f"{prefix}/rank/{placement.rank}", 0) > 1  # why this one timed out
        # The claim that explains a timeout (the timeout its context), else the failure itself.
        raise _claimed_twice(name, placement.rank) if twice and isinstance(exc, RuntimeError) else exc  # noqa: B904
    _generations[key] = number + 1
    if given_up.is_set():  # init_group has raised its timeout: nobody uses these
        base.set(f"{prefix}/failed", "1")
        dist.destroy_process_group(host)
        dist.destroy_process_group(device)
    return host, device, dist.PrefixStore(f"{prefix}/communicator", base)


def _torch_group(backend: str, store: dist.Store, placement: RankPlacement, name: str,
                 timeout: timedelta) -> dist.ProcessGroup:
    """A torch process group of the whole group's ranks, registered with torch under `name`
    (symmetric memory finds it there) and not torch's default group. Built by torch's own
    construction of a group, the one `init_process_group` and `new_group` call: `new_group`
    itself needs a default group, which torchhal leaves alone. It makes the backend torch
    registers for `backend` (a vendor's too) and, under TORCH_DISTRIBUTED_DEBUG=DETAIL, wraps it
    in torch's check of each collective across ranks."""
    group, _ = c10d._new_process_group_helper(placement.world_size, placement.rank, [], backend, store,
                                              group_name=c10d.GroupName(name), timeout=timeout)
    # The group's ranks are its own; destroy_process_group reads the map new_group writes.
    c10d._world.pg_group_ranks[group] = {rank: rank for rank in range(placement.world_size)}
    return group


def _claimed_twice(name: str, rank: int) -> ValueError:
    return ValueError(f"init_group: two processes are forming group {name!r} as rank {rank} at once: two processes "
                      f"with RANK={rank} (or the same rank=), or two groups made under the name {name!r}. Give each "
                      "process its own rank and each group its own name; if the other process died making the "
                      "group, retry")
