"""torchhal.distributed on gloo, across real processes (2 and 4 ranks on the CPU platform).

Each scenario runs once per rank in spawned processes (a FileStore in tmp_path for the
rendezvous) and reports plain data; the tests assert on what every rank saw. One spawn
serves every test of a scenario (module-scoped fixtures) to keep the file fast.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from torchhal.conformance_tests._helpers import receive, spawn_context, wait_exit

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}


# -- running ranks -------------------------------------------------------------------------


def _rank_main(scenario: str, rank: int, world: int, store_path: str, queue: Any) -> None:
    try:
        queue.put(("ok", {"rank": rank, **SCENARIOS[scenario](rank, world, store_path)}))
    except BaseException:
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def run_ranks(scenario: str, world: int, store_path: str, timeout: float = 120) -> list[dict[str, Any]]:
    ctx = spawn_context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(scenario, r, world, store_path, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        results = [receive(queue, f"{scenario} rank", timeout) for _ in procs]
    finally:
        for proc in procs:
            if wait_exit(proc, 30) is None:
                proc.kill()
    return sorted(results, key=lambda r: r["rank"])


def _cpu() -> Any:
    import torchhal

    return torchhal.get_platform("cpu")


def _group(rank: int, world: int, store_path: str, name: str = "t", timeout: float = 30) -> Any:
    import torch.distributed as dist

    from torchhal.distributed import init_group

    return init_group(_cpu(), rank=rank, world_size=world, local_rank=rank,
                      store=dist.FileStore(store_path, world), name=name, timeout=timedelta(seconds=timeout))


def _error_of(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# -- scenarios (run in every rank) ---------------------------------------------------------


def _values(rank: int, dtype: torch.dtype) -> torch.Tensor:
    # Distinct per rank, with a sign change, exactly representable in bfloat16.
    return torch.tensor([rank + 1, -2 * (rank + 1), 3 * (rank % 2), 8 - rank], dtype=dtype)


def collectives(rank: int, world: int, store_path: str) -> dict[str, Any]:
    import torch.distributed as dist

    group = _group(rank, world, store_path)
    comm = group.comm
    out: dict[str, Any] = {"default_group_initialized": dist.is_initialized(), "device": str(group.device)}
    out["reduce"] = {
        f"{op}/{name}": comm.all_reduce(_values(rank, dtype), op).tolist()
        for name, dtype in DTYPES.items() for op in ("sum", "max", "min")
    }
    out["reduce_dtypes"] = [str(comm.all_reduce(_values(rank, dtype)).dtype) for dtype in DTYPES.values()]
    mine = torch.full((2, 3), rank, dtype=torch.float32)
    out["gather_dim0"] = comm.all_gather(mine).tolist()
    out["gather_dim1"] = comm.all_gather(mine, dim=1).tolist()
    sizes = [r + 1 for r in range(world)]
    uneven = torch.arange(2 * (rank + 1), dtype=torch.int64).reshape(rank + 1, 2) + 100 * rank
    out["gather_uneven"] = comm.all_gather(uneven, sizes=sizes).tolist()
    out["gather_uneven_dim1"] = comm.all_gather(uneven.T.contiguous(), dim=1, sizes=sizes).tolist()
    src = world - 1
    out["broadcast"] = comm.broadcast(torch.arange(4, dtype=torch.float32) + 100 * rank, src).tolist()
    # A ring: even ranks send first, odd ranks receive first, so no pair waits on the other.
    to, frm = (rank + 1) % world, (rank - 1) % world
    inbox = torch.empty(3, dtype=torch.int64)
    if rank % 2 == 0:
        comm.send(torch.full((3,), rank, dtype=torch.int64), to)
        comm.recv(inbox, frm)
    else:
        comm.recv(inbox, frm)
        comm.send(torch.full((3,), rank, dtype=torch.int64), to)
    out["received"] = inbox.tolist()
    probe = torch.ones(2)
    out["bad_op"] = _error_of(lambda: comm.all_reduce(probe, "avg"))  # type: ignore[arg-type]
    out["bad_src"] = _error_of(lambda: comm.broadcast(probe, world))
    out["bad_dst_self"] = _error_of(lambda: comm.send(probe, rank))
    out["bad_src_type"] = _error_of(lambda: comm.recv(probe, "0"))
    out["bad_sizes_count"] = _error_of(lambda: comm.all_gather(uneven, sizes=sizes[:-1]))
    out["bad_sizes_mine"] = _error_of(lambda: comm.all_gather(uneven, sizes=[rank + 2] * world))
    out["bad_dim"] = _error_of(lambda: comm.all_gather(uneven, dim=2))
    # The refusals above touched no peer: the group still works.
    out["after_refusals"] = comm.all_reduce(torch.ones(1)).tolist()
    # A second named group in the same store, collectives interleaved with the first.
    second = _group(rank, world, store_path, name="second")
    interleaved = []
    for step in range(3):
        a = comm.all_reduce(torch.tensor([float(rank + step)]))
        b = second.comm.all_reduce(torch.tensor([float(100 * (rank + 1) + step)]), "max")
        interleaved.append([a.item(), b.item()])
    out["interleaved"] = interleaved
    # available_memory(host communicator): each rank pins a different answer.
    from torchhal.platforms.testing import patched_plugin

    platform = group.platform
    pinned = dataclasses.replace(platform.memory_info(), free=(1 << 30) + rank * (1 << 20))
    with patched_plugin(platform, memory_info=lambda index: pinned):
        out["available_memory"] = platform.available_memory(group.host)
    out["available_memory_bad"] = _error_of(lambda: platform.available_memory("group"))  # type: ignore[arg-type]
    out["default_group_initialized_after"] = dist.is_initialized()
    second.close()
    group.close()
    out["after_close"] = _error_of(lambda: comm.all_reduce(torch.ones(1)))
    return out


def with_default_group(rank: int, world: int, store_path: str) -> dict[str, Any]:
    import torch.distributed as dist

    from torchhal.distributed import init_group

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    group = init_group(_cpu(), rank=rank, world_size=world, local_rank=rank, timeout=timedelta(seconds=30))
    ours = group.comm.all_reduce(torch.tensor([float(rank + 1)])).item()
    theirs = torch.tensor([float(10 * (rank + 1))])
    dist.all_reduce(theirs)
    ours_again = group.comm.all_reduce(torch.tensor([float(rank)]), "max").item()
    out = {"ours": ours, "theirs": theirs.item(), "ours_again": ours_again,
           "default_world": dist.get_world_size()}
    group.close()
    dist.destroy_process_group()
    return out


def _peer_fails(rank: int, world: int, store_path: str, how: str) -> dict[str, Any]:
    from torchhal.distributed import CollectiveError

    group = _group(rank, world, store_path, name="fragile", timeout=5)
    group.comm.all_reduce(torch.ones(1))  # every rank is up
    if rank == 1:
        if how == "exits":
            os._exit(0)
        time.sleep(60)  # hangs; the test kills it
    time.sleep(0.5)
    start = time.monotonic()
    try:
        group.comm.all_reduce(torch.ones(1))
        error = None
    except CollectiveError as exc:
        error = str(exc)
    return {"elapsed": time.monotonic() - start, "error": error}


def env_rendezvous(rank: int, world: int, store_path: str) -> dict[str, Any]:
    """Plain env:// variables, no torchrun agent: rank 0 hosts the store, for both groups."""
    from torchhal.distributed import init_group

    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=open(store_path).read(), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    first = init_group(_cpu(), name="a", timeout=timedelta(seconds=30))
    second = init_group(_cpu(), name="b", timeout=timedelta(seconds=30))
    return {"sums": [first.comm.all_reduce(torch.tensor([1.0])).item(),
                     second.comm.all_reduce(torch.tensor([2.0])).item()]}


SCENARIOS: dict[str, Callable[[int, int, str], dict[str, Any]]] = {
    "collectives": collectives,
    "with_default_group": with_default_group,
    "env_rendezvous": env_rendezvous,
    "peer_exits": lambda rank, world, path: _peer_fails(rank, world, path, "exits"),
    "peer_hangs": lambda rank, world, path: _peer_fails(rank, world, path, "hangs"),
}


# -- expectations, computed here -------------------------------------------------------------


def _expected_reduce(world: int) -> dict[str, list[float]]:
    out = {}
    for name, dtype in DTYPES.items():
        stacked = torch.stack([_values(r, dtype) for r in range(world)])
        out[f"sum/{name}"] = stacked.sum(0).to(dtype).tolist()
        out[f"max/{name}"] = stacked.max(0).values.tolist()
        out[f"min/{name}"] = stacked.min(0).values.tolist()
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def ranks(request, tmp_path_factory):
    world = request.param
    return world, run_ranks("collectives", world, str(tmp_path_factory.mktemp("store") / "store"))


def test_all_reduce_sum_max_min_on_float32_bfloat16_int64(ranks):
    world, results = ranks
    expected = _expected_reduce(world)
    for r in results:
        assert r["reduce"] == expected, f"rank {r['rank']}"
        assert r["reduce_dtypes"] == ["torch.float32", "torch.bfloat16", "torch.int64"]


def test_all_gather_even_in_rank_order_along_either_dim(ranks):
    world, results = ranks
    dim0 = [[float(r)] * 3 for r in range(world) for _ in range(2)]
    dim1 = [[float(r) for r in range(world) for _ in range(3)]] * 2
    for r in results:
        assert r["gather_dim0"] == dim0 and r["gather_dim1"] == dim1


def test_all_gather_uneven_sizes(ranks):
    world, results = ranks
    rows = [[100 * r + 2 * i, 100 * r + 2 * i + 1] for r in range(world) for i in range(r + 1)]
    for r in results:
        assert r["gather_uneven"] == rows
        assert r["gather_uneven_dim1"] == [list(col) for col in zip(*rows, strict=True)]


def test_broadcast_from_the_last_rank_and_send_recv_around_a_ring(ranks):
    world, results = ranks
    for r in results:
        assert r["broadcast"] == [100.0 * (world - 1) + i for i in range(4)]
        assert r["received"] == [(r["rank"] - 1) % world] * 3


def test_bad_arguments_are_refused_naming_the_value_and_leave_the_group_working(ranks):
    world, results = ranks
    for r in results:
        assert r["bad_op"].startswith("ValueError") and "'avg'" in r["bad_op"] and "sum, max, min" in r["bad_op"]
        assert r["bad_src"].startswith("ValueError") and f"src=...) {world} is not a rank" in r["bad_src"]
        assert r["bad_dst_self"].startswith("ValueError") and "is this rank itself" in r["bad_dst_self"]
        assert r["bad_src_type"].startswith("ValueError") and "'0' is not a rank" in r["bad_src_type"]
        assert r["bad_sizes_count"].startswith("ValueError") and f"one non-negative int per rank ({world})" in \
            r["bad_sizes_count"]
        assert r["bad_sizes_mine"].startswith("ValueError") and f"sizes={[r['rank'] + 2] * world}" in \
            r["bad_sizes_mine"]
        assert r["bad_dim"].startswith("ValueError") and "dim=2" in r["bad_dim"]
        assert r["after_refusals"] == [float(world)]


def test_two_named_groups_interleave_without_interference(ranks):
    world, results = ranks
    expected = [[float(sum(range(world)) + world * step), float(100 * world + step)] for step in range(3)]
    for r in results:
        assert r["interleaved"] == expected


def test_available_memory_over_a_communicator_is_the_minimum_across_ranks(ranks):
    _, results = ranks
    for r in results:
        assert r["available_memory"] == 1 << 30
        assert r["available_memory_bad"].startswith("TypeError") and "group='group'" in r["available_memory_bad"]


def test_a_closed_group_refuses_collectives(ranks):
    _, results = ranks
    for r in results:
        assert r["after_close"].startswith("CollectiveError") and "group 't' is closed" in r["after_close"]


def test_init_group_leaves_the_default_group_uninitialised(ranks):
    _, results = ranks
    for r in results:
        assert r["device"] == "cpu:0"
        assert r["default_group_initialized"] is False and r["default_group_initialized_after"] is False


def test_with_a_users_default_group_init_group_rendezvous_on_its_store(tmp_path):
    results = run_ranks("with_default_group", 2, str(tmp_path / "store"))
    for r in results:
        assert (r["ours"], r["theirs"], r["ours_again"], r["default_world"]) == (3.0, 30.0, 1.0, 2)


@pytest.mark.parametrize("how", ["exits", "hangs"])
def test_a_dead_or_hung_peer_raises_collective_error_within_bounded_time(tmp_path, how):
    ctx = spawn_context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(f"peer_{how}", r, 2, str(tmp_path / "store"), queue))
             for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        survivor = receive(queue, "surviving rank", timeout=90)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            wait_exit(proc, 30)
    assert survivor["rank"] == 0
    assert survivor["elapsed"] < 30, f"CollectiveError took {survivor['elapsed']:.1f} s"
    error = survivor["error"]
    assert error is not None, "the collective completed without its peer"
    for part in ("all_reduce(op='sum')", "group 'fragile'", "rank 0 of 2", "timeout 5 s", "every rank is alive"):
        assert part in error, error


# -- single process: rendezvous and backends -------------------------------------------------


def test_torchrun_two_ranks_rendezvous_through_the_environment(tmp_path):
    script = tmp_path / "tp.py"
    script.write_text(textwrap.dedent("""
        import torch, torchhal
        from torchhal.distributed import init_group
        group = init_group(torchhal.get_platform("cpu"), name="a")
        second = init_group(torchhal.get_platform("cpu"), name="b")  # a second store on the same port
        total = group.comm.all_reduce(torch.tensor([group.rank + 1.0])).item()
        top = second.comm.all_reduce(torch.tensor([group.rank + 5.0]), "max").item()
        import os
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
        print(f"<rank {group.rank}/{group.world_size} local {group.placement.local_rank} {total} {top} {agent}>")
        group.comm.all_reduce(torch.zeros(1))  # no rank leaves while another still talks
        second.close()
        group.close()
    """))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sorted(re.findall(r"<(rank [^>]*)>", out.stdout))
    # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True): every rank is a client.
    assert lines == ["rank 0/2 local 0 3.0 6.0 True", "rank 1/2 local 1 3.0 6.0 True"], out.stdout


def test_env_rendezvous_without_torchrun_serves_two_groups_on_one_port(tmp_path):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "port").write_text(str(port))
    results = run_ranks("env_rendezvous", 2, str(tmp_path / "port"))
    assert [r["sums"] for r in results] == [[2.0, 4.0], [2.0, 4.0]]


def test_more_than_one_rank_without_a_rendezvous_names_the_variables(monkeypatch):
    from torchhal.distributed import init_group

    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="set MASTER_ADDR and MASTER_PORT"):
        init_group(_cpu(), rank=0, world_size=2)


def test_a_registered_vendor_backend_is_the_one_a_group_is_made_on(monkeypatch):
    """A backend registered the way torch_npu registers hccl (and the extended signature): torch's
    group construction calls its creator with the group's rank, size and timeout."""
    import torch.distributed as dist

    from torchhal.distributed import init_group

    for attr in ("_plugins", "backend_type_map", "backend_capability"):
        monkeypatch.setattr(dist.Backend, attr, dict(getattr(dist.Backend, attr)))
    monkeypatch.setattr(dist.Backend, "backend_list", list(dist.Backend.backend_list))
    made: list[tuple[Any, ...]] = []

    def plain(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
        made.append(("plain", rank, size, timeout))
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    def extended(opts: Any, pg_options: Any) -> Any:
        made.append(("extended", opts.group_rank, opts.group_size, opts.timeout))
        return dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)

    cpu = _cpu()
    for name, creator, extended_api in (("fakeccl", plain, False), ("fakeext", extended, True)):
        monkeypatch.setattr(dist.Backend, name.upper(), name, raising=False)
        dist.Backend.register_backend(name, creator, extended_api=extended_api, devices=["cpu"])
        monkeypatch.setattr(cpu, "dist_backend", name)
        group = init_group(cpu, rank=0, world_size=1, name=name, timeout=timedelta(seconds=7))
        assert group.comm.all_reduce(torch.ones(1)).item() == 1.0
        group.close()
    assert made == [("plain", 0, 1, timedelta(seconds=7)), ("extended", 0, 1, timedelta(seconds=7))]


def test_a_single_rank_group_needs_no_rendezvous_and_its_collectives_are_identities(monkeypatch):
    from torchhal.distributed import init_group

    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    group = init_group(_cpu())
    t = torch.tensor([1.0, 2.0])
    assert group.comm.all_reduce(t, "max") is t and t.tolist() == [1.0, 2.0]
    assert group.comm.all_gather(t, sizes=[2]) is t
    with pytest.raises(ValueError, match=r"sizes=\[3\]"):
        group.comm.all_gather(t, sizes=[3])
    with pytest.raises(ValueError, match="'avg'"):
        group.comm.all_reduce(t, "avg")  # type: ignore[arg-type]
    group.close()


def test_a_closed_group_of_one_rank_refuses_collectives_too(monkeypatch):
    from torchhal.distributed import CollectiveError, init_group

    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(variable, raising=False)
    group = init_group(rank=0, world_size=1, name="solo")
    assert group.comm.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]  # open: answered without a backend call
    group.close()
    for call in (lambda: group.comm.all_reduce(torch.ones(2)), lambda: group.comm.all_gather(torch.ones(2)),
                 lambda: group.comm.broadcast(torch.ones(2), 0), lambda: group.host.all_gather(torch.ones(2))):
        with pytest.raises(CollectiveError, match="group 'solo(/host)?' is closed"):
            call()
