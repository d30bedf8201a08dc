"""Code the conformance tests run in spawned processes (importable, top level).

Workers talk to the test through multiprocessing queues and return plain data
only, so a worker may exit before its results are read.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

import torchhal
from torchhal.platforms.testing import patched_plugin, plugin_under_test

from ._helpers import capture


def worker(work: Callable[..., tuple[Any, Any]]) -> Callable[..., None]:
    """`work(platform, device, *inputs)` as a spawned process (`_helpers.Spawned`), called as
    `(platform name, device, *inputs, queue, release)`: on the named platform with `device`
    current, it reports ('ok', the value `work` returns first) or ('error', what it raised), never
    hanging its parent, and holds what `work` returns second until released."""

    @functools.wraps(work)
    def run(name: str, device: int, *args: Any) -> None:
        *inputs, queue, release = args
        try:
            platform = torchhal.get_platform(name)
            platform.set_device(device)
            value, keep_alive = work(platform, device, *inputs)
            queue.put(("ok", value))
            release.wait(120)
            del keep_alive
        except BaseException as exc:  # report, never hang the parent
            queue.put(("error", f"{type(exc).__name__}: {exc}"))

    return run


@worker
def open_handles(platform: torchhal.Platform, device: int, handles: list[Any]) -> tuple[Any, Any]:
    """Open each handle on `device`; report each tensor's device and values."""
    tensors = [platform.ipc_support.open(handle, device) for handle in handles]  # type: ignore[union-attr]
    return [{"device_type": t.device.type, "device_index": t.device.index or 0,
             "values": t.detach().to("cpu", torch.float64).flatten().tolist()} for t in tensors], None


@worker
def wait_event_then_read(platform: torchhal.Platform, device: int, producer: int, handle: Any,
                         event_handle: bytes) -> tuple[Any, Any]:
    """Open the producer's memory and event on `device`; the current stream waits on the
    event, then sums the memory; report the sum."""
    ipc = platform.ipc_support
    assert ipc is not None and ipc.events is not None
    tensor = ipc.open(handle, device)
    event = ipc.events.open(event_handle, producer, device)
    event.wait(platform.current_stream(tensor.device.index or 0))
    return float(tensor.sum().to("cpu")), None


@worker
def open_and_hold(platform: torchhal.Platform, device: int, handle: Any) -> tuple[Any, Any]:
    """Open a handle on `device` and do a little work there; hold the tensor."""
    tensor = platform.ipc_support.open(handle, device)  # type: ignore[union-attr]
    return float(tensor.sum().item()), tensor


@worker
def query_memory_and_hold(platform: torchhal.Platform, device: int) -> tuple[Any, Any]:
    """Use one device: allocate, query memory_info(device) repeatedly; hold the block."""
    block = torch.ones(1 << 20, device=platform.device(device))
    for _ in range(10):
        platform.memory_info(device)
    platform.synchronize(device)
    return float(block[0].item()), block


@worker
def share_then_exit(platform: torchhal.Platform, device: int) -> tuple[Any, Any]:
    """Producer: share a tensor and hold it until the consumer has it; exiting is the parent's test."""
    tensor = torch.arange(1024, dtype=torch.float32, device=platform.device(device))
    platform.synchronize(device)
    return platform.ipc_support.share(tensor), tensor  # type: ignore[union-attr]


#: dtypes every communicator reduces and gathers (the clause's values are exact in each).
DISTRIBUTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}
DISTRIBUTED_OPS = ("sum", "max", "min")


def rank_values(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Distinct per rank, with a sign change; exactly representable in bfloat16."""
    return torch.tensor([rank + 1, -2 * (rank + 1), 3 * (rank % 2), 8 - rank], dtype=dtype)


#: Rank r's gathered values start at GATHER_STRIDE * r: distinct per rank, and below 256 for the
#: clause's 8 ranks, so bfloat16 (8 significant bits) holds every one exactly.
GATHER_STRIDE = 32


def gather_piece(rank: int) -> torch.Tensor:
    """Rank `rank`'s uneven all_gather input: rank + 1 rows of 2, int64 (cast per dtype)."""
    return torch.arange(2 * (rank + 1)).reshape(rank + 1, 2) + GATHER_STRIDE * rank


def gathered_rows(world: int) -> list[list[int]]:
    """Every rank's `gather_piece`, in rank order: what all_gather(sizes=...) must give."""
    return torch.cat([gather_piece(r) for r in range(world)]).tolist()


def _join(name: str, rank: int, world: int, store_path: str, group_name: str, timeout_s: float) -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    from torchhal.distributed import init_group

    # The clauses judge the plugin's communicator itself: not with init_group's cross-rank check
    # (TORCH_DISTRIBUTED_DEBUG=DETAIL) in front of it, which would answer a dead peer for it.
    dist.set_debug_level(dist.DebugLevel.OFF)
    return init_group(torchhal.get_platform(name), rank=rank, world_size=world, local_rank=rank,
                      store=dist.FileStore(store_path, world), name=group_name, timeout=timedelta(seconds=timeout_s))


def distributed_clauses(name: str, rank: int, world: int, store_path: str, queue: Any) -> None:
    """One rank of the distributed group's clauses, through init_group and the platform's
    communicator. Each clause reports ('ok', value) or ('error', message), so a broken
    collective fails its own clause and the others still run."""
    import traceback

    report: dict[str, Any] = {"rank": rank}
    try:
        group = _join(name, rank, world, store_path, "conformance", 60)
        platform, comm = group.platform, group.comm
        device = group.device

        def clause(key: str, work: Any) -> None:
            try:
                report[key] = ("ok", work())
            except Exception as exc:
                report[key] = ("error", f"{type(exc).__name__}: {exc}")

        def on_host(tensor: torch.Tensor) -> list[Any]:
            return tensor.to("cpu").tolist()

        index = platform.device_for_rank(rank, world)
        clause("device", lambda: {
            "device_for_rank": index, "group_device": str(device), "named": str(platform.device(index)),
            "comm_device": str(comm.device), "current": platform.current_device(),
            "tensor_device": str(comm.all_reduce(torch.ones(1, device=device)).device)})
        clause("all_reduce", lambda: {
            f"{op}/{dtype_name}": [str(result.dtype), on_host(result)]
            for dtype_name, dtype in DISTRIBUTED_DTYPES.items() for op in DISTRIBUTED_OPS
            for result in [comm.all_reduce(rank_values(rank, dtype).to(device), op)]})

        def gathers() -> dict[str, Any]:
            sizes = [r + 1 for r in range(world)]
            out = {}
            for dtype_name, dtype in DISTRIBUTED_DTYPES.items():
                mine = gather_piece(rank).to(dtype).to(device)
                out[f"uneven/{dtype_name}"] = on_host(comm.all_gather(mine, sizes=sizes))
                out[f"uneven_dim1/{dtype_name}"] = on_host(comm.all_gather(mine.T.contiguous(), dim=1, sizes=sizes))
            out["even"] = on_host(comm.all_gather(torch.full((2, 3), rank, dtype=torch.float32, device=device)))
            return out

        clause("all_gather", gathers)
        clause("broadcast", lambda: on_host(comm.broadcast(
            torch.arange(4, dtype=torch.float32, device=device) + 100 * rank, world - 1)))

        def ring() -> list[Any]:
            # Even ranks send first, odd ranks receive first: no pair waits on the other.
            inbox = torch.empty(3, dtype=torch.int64, device=device)
            outbox = torch.full((3,), rank, dtype=torch.int64, device=device)
            to, frm = (rank + 1) % world, (rank - 1) % world
            if rank % 2 == 0:
                comm.send(outbox, to)
                comm.recv(inbox, frm)
            else:
                comm.recv(inbox, frm)
                comm.send(outbox, to)
            return on_host(inbox)

        clause("send_recv", ring)
        if comm.graph_capturable and platform.graph_support is not None:
            clause("graph", lambda: _captured_all_reduce(platform, comm, rank, index))
            clause("graph_all_gather", lambda: _captured_all_gather(platform, comm, rank, index))

        def available() -> int:
            pinned = dataclasses.replace(platform.memory_info(index), free=(1 << 30) + rank * (1 << 20))
            # Free memory drifts between ranks' reads; each rank's answer is pinned so the
            # reduction itself is checked exactly: rank r reports 1 GiB + r MiB.
            with patched_plugin(platform, memory_info=lambda index: pinned):
                return platform.available_memory(group.host)

        clause("available_memory", available)
        group.host.all_reduce(torch.zeros(1))  # nobody leaves while a peer still talks
        group.close()
        queue.put(("ok", report))
    except BaseException:
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def _captured_all_reduce(platform: torchhal.Platform, comm: Any, rank: int, index: int) -> list[Any]:
    """all_reduce recorded in a device graph, replayed on new inputs; the replay's sums."""
    static = torch.full((8,), float(rank + 1), device=platform.device(index))

    def reduce() -> torch.Tensor:
        comm.all_reduce(static)
        return static

    return _replayed(platform, index, static, reduce, [torch.full((8,), float(10 * (step + 1) + rank))
                                                      for step in range(2)])


def captured_gather_input(rank: int, step: int) -> torch.Tensor:
    """Rank `rank`'s [2, 3] float32 piece at replay `step` (a logits shard: rows by vocabulary slice)."""
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * rank + 1000 * step


def captured_gather_expected(world: int, step: int) -> list[list[float]]:
    """Every rank's piece of `step` side by side along the last dim, in rank order."""
    return torch.cat([captured_gather_input(r, step) for r in range(world)], dim=-1).tolist()


def _captured_all_gather(platform: torchhal.Platform, comm: Any, rank: int, index: int) -> list[Any]:
    """all_gather along the last dim (as engines gather the logits) recorded in a device graph,
    replayed on new inputs; each replay's gathered tensor."""
    static = captured_gather_input(rank, -1).to(platform.device(index))  # captured on other values than any replay's
    return _replayed(platform, index, static, lambda: comm.all_gather(static, dim=-1),
                     [captured_gather_input(rank, step) for step in range(2)])


def _replayed(platform: torchhal.Platform, index: int, static: torch.Tensor,
              collective: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> list[Any]:
    """`collective` (reading `static`) captured in a device graph (`_helpers.capture`), replayed
    once per input copied into `static`; what the captured call returned, after each replay."""
    graph, result = capture(platform, index, collective)  # a tensor the replays write (the graph's pool, or static)
    replays = []
    for value in inputs:
        static.copy_(value.to(static.device))
        graph.replay()
        platform.synchronize(index)
        replays.append(result.to("cpu").tolist())
    return replays


def distributed_peer_dies(name: str, rank: int, world: int, store_path: str, elements: int, queue: Any) -> None:
    """Rank 1 exits mid-group. Rank 0 says it is about to call, then makes two float32 sums of
    `elements` and reads the result back as an engine reads its tokens (waiting through
    `DeviceGroup.wait_for`, bounded by the group's timeout), and reports how that ended, and
    when; unless its backend ends the process first, as NCCL's watchdog does."""
    import time

    from torchhal.distributed import CollectiveError

    try:
        group = _join(name, rank, world, store_path, "fragile", 10)
        probe = torch.ones(elements, device=group.device)
        group.comm.all_reduce(probe)
        group.platform.synchronize(group.device.index or 0)
        if rank == 1:
            os._exit(0)
        time.sleep(0.5)
        queue.put(("ok", {"rank": rank, "calling": True}))
        time.sleep(0.2)  # the queue's feeder thread sends it before a platform ending the process can lose it
        start = time.monotonic()
        error = None
        try:
            # A backend that queues collectives on the device returns from the calls; it must
            # fail by the time their result is read back.
            for _ in range(2):
                group.comm.all_reduce(probe)
            # Not a blocking read: on NCCL it holds the GIL while the watchdog, past the
            # timeout, waits for the GIL to dump Python stacks before it ends the process.
            done = group.platform.new_event()
            done.record(group.platform.current_stream(group.device.index or 0))
            group.wait_for(done, "the surviving rank's read of its sum")
            probe.to("cpu")
        except CollectiveError as exc:
            error = str(exc)
        except Exception as exc:
            error = f"not a CollectiveError: {type(exc).__name__}: {exc}"
        queue.put(("ok", {"rank": rank, "elapsed": time.monotonic() - start, "error": error,
                          "communicator": repr(group.comm)}))
        # Delivered before anything else can happen: a backend that lets the read return a wrong
        # sum and then ends the process must not pass as one that ended it first.
        queue.close()
        queue.join_thread()
    except BaseException as exc:
        queue.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))


def device_identity(name: str, index: int) -> str | None:
    """The physical identity (UUID) the device module reports for `index`, or None."""
    module = plugin_under_test(torchhal.get_platform(name)).device_module()
    properties = getattr(module, "get_device_properties", None)
    uuid = getattr(properties(index), "uuid", None) if callable(properties) else None
    return None if uuid is None else str(uuid)


def rank_device_identity(name: str, rank: int, world: int, env: dict[str, str], queue: Any) -> None:
    """Under `env` (a visible-devices list), the identity of the device rank `rank` maps to."""
    try:
        os.environ.update(env)
        index = torchhal.get_platform(name).device_for_rank(rank, world)
        queue.put(("ok", {"rank": rank, "index": index, "identity": device_identity(name, index)}))
    except BaseException as exc:
        queue.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
