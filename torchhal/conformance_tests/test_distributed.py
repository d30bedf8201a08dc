"""distributed: the platform's ranks through `torchhal.distributed.init_group` (contract 7).

The ranks (one per device, at least two and at most eight: `world_size`) run every clause
in one spawn and report each clause's outcome; each test below judges one clause, so a broken
communicator fails exactly the clause its bug touches.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import queue as queue_module
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from torchhal.platforms import Platform

from ._helpers import receive, spawn_context, wait_exit
from ._workers import DISTRIBUTED_DTYPES, DISTRIBUTED_OPS, captured_gather_expected, gathered_rows, rank_values

pytestmark = pytest.mark.conformance("distributed")

#: A rank whose peer died must hear of it within this long (the group's timeout is 10 s).
DEAD_PEER_BOUND_S = 45.0


#: torch.distributed's own backends; a vendor's registers itself (torch.distributed.Backend.register_backend).
BUILTIN_BACKENDS = ("gloo", "nccl", "xccl", "mpi", "ucc")


def backend_problem(platform: Platform) -> str | None:
    """Why the platform's declared `dist_backend` cannot be initialised in this process, or None."""
    import torch.distributed as dist

    name = platform.dist_backend
    if _available(name):
        return None
    registered = [str(key).lower() for key in getattr(dist.Backend, "_plugins", {})]
    here = [b for b in BUILTIN_BACKENDS if _available(b)] + registered
    close = difflib.get_close_matches(str(name).lower(), here + list(BUILTIN_BACKENDS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"platform {platform.name!r} declares dist_backend = {name!r}{hint}, which torch.distributed does not "
            f"have in this process (available here: {', '.join(here) or 'none'}), so init_group cannot start its "
            "ranks: correct the name, or have the plugin import the vendor's torch extension that registers it "
            "(torch.distributed.Backend.register_backend) when it loads")


def _available(backend: str) -> bool:
    import torch.distributed as dist

    try:
        return bool(dist.is_backend_available(backend))
    except (ValueError, RuntimeError):  # a malformed name ("a:b:c"): not available either
        return False


def skip_without_the_backend(platform: Platform) -> None:
    """The clauses need the declared backend: without it they cannot run (the backend test fails)."""
    if backend_problem(platform) is not None:
        pytest.skip(f"could not run: torch.distributed backend {platform.dist_backend!r} is not available here "
                    "(distributed::test_the_declared_dist_backend_is_available says why)")


def world_size(platform: Platform) -> int:
    """The clauses' ranks: one per device, at least two and at most eight. Where that is more ranks
    than devices, the platform's own `device_for_rank` decides whether they can share its devices,
    as it decides for `init_group`: a refusal makes the clauses not applicable. Callers take
    `device_index` first, so the runtime has started and its device count is this process's."""
    count = platform.device_count()
    world = max(2, min(count, 8))
    if world <= count:
        return world
    with pytest.MonkeyPatch.context() as env:
        # The suite's ranks share this process's environment: no launcher has given each rank a
        # device of its own through a visible-devices variable, so the platform is asked without one.
        for var in platform.visible_devices_env:
            env.delenv(var, raising=False)
        try:
            for rank in range(world):
                platform.device_for_rank(rank, world)
        except ValueError as exc:
            pytest.skip(f"not applicable: {world} ranks on {count} device(s), which device_for_rank refuses: {exc}")
    return world


@contextlib.contextmanager
def spawned_ranks(platform, target, world: int, *args: Any, grace_s: float = 30) -> Iterator[tuple[Any, list[Any]]]:
    """`target(platform name, rank, world, *args, queue)` for each rank, each in a spawned process;
    yields (queue, processes); a rank still running `grace_s` after the block is killed."""
    ctx = spawn_context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(platform.name, r, world, *args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        yield queue, procs
    finally:
        for proc in procs:
            if wait_exit(proc, grace_s) is None:
                proc.kill()
                wait_exit(proc, 30)


def run_ranks(platform, target, world: int, *args: Any, timeout: float = 300) -> list[dict[str, Any]]:
    with spawned_ranks(platform, target, world, *args) as (queue, procs):
        results = [receive(queue, "distributed rank", timeout) for _ in procs]
    return sorted(results, key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def ranks(platform, device_index, tmp_path_factory) -> tuple[int, list[dict[str, Any]]]:
    from ._workers import distributed_clauses

    skip_without_the_backend(platform)
    world = world_size(platform)
    return world, run_ranks(platform, distributed_clauses, world, str(tmp_path_factory.mktemp("dist") / "store"))


def outcomes(ranks, key: str) -> list[Any]:
    """Each rank's value for one clause; fails with the rank's error where it raised."""
    values = []
    for report in ranks[1]:
        status, value = report.get(key, ("error", "the clause did not run"))
        if status != "ok":
            pytest.fail(f"rank {report['rank']}: {value}")
        values.append(value)
    return values


def test_the_declared_dist_backend_is_available(platform: Platform, device_index: int) -> None:
    """A declared backend is a promise that init_group can start ranks on it: a typo, or a vendor
    backend whose extension is not imported, is the plugin's failure, never an undeclared skip."""
    # device_index made the device current first, as init_group does: an extension imported by the
    # plugin's device module has registered its backend by now.
    problem = backend_problem(platform)
    assert problem is None, problem


def test_each_rank_runs_on_the_device_device_for_rank_names(platform, ranks):
    world = ranks[0]
    for rank, seen in enumerate(outcomes(ranks, "device")):
        index = seen["device_for_rank"]
        assert 0 <= index < platform.device_count(), f"rank {rank}: device_for_rank gave {index}, not a device"
        if world <= platform.device_count():
            assert index == rank, (f"rank {rank} of {world} with {platform.device_count()} devices visible: "
                                   f"device_for_rank gave index {index}; visible device {rank} is that rank's")
        assert seen["group_device"] == seen["named"] == seen["comm_device"], f"rank {rank}: {seen}"
        # A result's device is the rank's (CPU tensors carry no index: host memory is one).
        result, named = torch.device(seen["tensor_device"]), torch.device(seen["named"])
        assert result.type == named.type and result.index in (None, named.index), f"rank {rank}: {seen}"
        assert seen["current"] == index, f"rank {rank}: init_group left device {seen['current']} current"


def test_all_reduce_sum_max_min_on_float32_bfloat16_int64(ranks):
    world = ranks[0]
    expected = {}
    for dtype_name, dtype in DISTRIBUTED_DTYPES.items():
        stacked = torch.stack([rank_values(r, dtype) for r in range(world)])
        reduced = {"sum": stacked.sum(0).to(dtype), "max": stacked.max(0).values, "min": stacked.min(0).values}
        for op in DISTRIBUTED_OPS:
            expected[f"{op}/{dtype_name}"] = [str(dtype), reduced[op].tolist()]
    for rank, got in enumerate(outcomes(ranks, "all_reduce")):
        wrong = {key: (got[key], value) for key, value in expected.items() if got.get(key) != value}
        assert not wrong, f"rank {rank}: all_reduce (got, expected) {wrong}"


def test_all_gather_even_and_uneven_sizes_in_rank_order(ranks):
    world = ranks[0]
    rows = gathered_rows(world)
    for rank, got in enumerate(outcomes(ranks, "all_gather")):
        assert got["even"] == [[float(r)] * 3 for r in range(world) for _ in range(2)], f"rank {rank}: even"
        for dtype_name in DISTRIBUTED_DTYPES:
            assert got[f"uneven/{dtype_name}"] == rows, f"rank {rank}: all_gather(sizes=...) on {dtype_name}"
            assert got[f"uneven_dim1/{dtype_name}"] == [list(c) for c in zip(*rows, strict=True)], \
                f"rank {rank}: all_gather(dim=1, sizes=...) on {dtype_name}"


def test_broadcast_from_the_last_rank(ranks):
    world = ranks[0]
    for rank, got in enumerate(outcomes(ranks, "broadcast")):
        assert got == [100.0 * (world - 1) + i for i in range(4)], f"rank {rank}: broadcast(src={world - 1})"


def test_send_recv_around_a_ring(ranks):
    world = ranks[0]
    for rank, got in enumerate(outcomes(ranks, "send_recv")):
        assert got == [(rank - 1) % world] * 3, f"rank {rank}: recv from rank {(rank - 1) % world} gave {got}"


def require_capturable_collectives(platform: Platform) -> None:
    if not platform.distributed_support.graph_capturable:
        pytest.skip("undeclared: the platform declares its collectives not graph-capturable")
    if platform.graph_support is None:
        pytest.fail("distributed_support declares graph-capturable collectives but the platform has no graphs")


# Engines capture every collective of a decode step: the layers' and the embedding's all_reduce,
# and the logits' all_gather along the vocabulary (torchhal/core/model/decoder.py). Each has its clause.
def test_captured_all_reduce_replays_on_new_inputs(platform, ranks):
    require_capturable_collectives(platform)
    world = ranks[0]
    expected = [[float(sum(10 * (step + 1) + r for r in range(world)))] * 8 for step in range(2)]
    for rank, got in enumerate(outcomes(ranks, "graph")):
        assert got == expected, f"rank {rank}: replayed all_reduce gave {got}"


def test_captured_all_gather_replays_on_new_inputs(platform: Platform, ranks: tuple[int, list[dict[str, Any]]]) -> None:
    require_capturable_collectives(platform)
    world = ranks[0]
    expected = [captured_gather_expected(world, step) for step in range(2)]
    for rank, got in enumerate(outcomes(ranks, "graph_all_gather")):
        for step, (replayed, wanted) in enumerate(zip(got, expected, strict=True)):
            assert replayed == wanted, (f"rank {rank}: all_gather(dim=-1) captured in a graph (as engines capture "
                                        f"the logits' gather) gave {replayed} on replay {step}; expected {wanted}")


def test_available_memory_over_the_host_communicator_is_the_minimum(ranks, measure):
    got = outcomes(ranks, "available_memory")
    assert got == [1 << 30] * ranks[0], "available_memory(group.host) must be the minimum across ranks"


#: Sums the dead-rank clause makes, in float32 elements: one element, and a decode step's
#: hidden row of an 8B model (16 KiB), the size a communicator may send another way than its
#: bulk path (the CUDA plugin's peer-memory all-reduce takes it).
DEAD_PEER_PROBES = {"one_element": 1, "decode_row": 4096}


@pytest.mark.parametrize("probe", list(DEAD_PEER_PROBES))
def test_a_rank_that_dies_stops_the_others_within_a_bound(platform, device_index, tmp_path, measure, probe):
    """A peer that exits never leaves a rank hanging or computing on a wrong sum: the rank's
    collective raises CollectiveError, or (a backend whose collectives run asynchronously on
    the device, as NCCL's under torch's default error handling) the backend ends the rank's
    process; either within the bound, whichever path the communicator sends the sum by."""
    from ._workers import distributed_peer_dies

    skip_without_the_backend(platform)
    world_size(platform)  # skips where two ranks cannot run
    with spawned_ranks(platform, distributed_peer_dies, 2, str(tmp_path / "store"), DEAD_PEER_PROBES[probe],
                       grace_s=0) as (queue, procs):
        receive(queue, "surviving rank (joining the group)", timeout=180)  # it is about to call
        survivor, exitcode = _report_or_exit(queue, procs[0], DEAD_PEER_BOUND_S)
    if survivor is None and exitcode is None:
        pytest.fail(f"the surviving rank neither raised CollectiveError nor ended within {DEAD_PEER_BOUND_S:.0f} s "
                    "of its collective (group timeout 10 s): a dead peer hangs the ranks left")
    if survivor is None:
        assert exitcode != 0, ("the surviving rank exited with code 0 without reporting: a dead peer must end it "
                               "as a failure")
        measure["outcome"] = f"the backend ended the process (exit code {exitcode})"
        return
    assert survivor["error"] is not None, ("all_reduce completed, and its result was read back, although its peer "
                                           "had exited: a wrong sum, silently")
    assert not survivor["error"].startswith("not a CollectiveError"), survivor["error"]
    assert "fragile" in survivor["error"] and "rank 0 of 2" in survivor["error"], survivor["error"]
    assert survivor["elapsed"] < DEAD_PEER_BOUND_S, f"CollectiveError came after {survivor['elapsed']:.0f} s"
    measure["outcome"] = "CollectiveError"
    measure["seconds"] = round(survivor["elapsed"], 1)
    measure["communicator"] = survivor["communicator"]  # which path a vendor's communicator sent the probe by


def _report_or_exit(queue: Any, proc: Any, bound: float) -> tuple[dict[str, Any] | None, int | None]:
    """The worker's report, or its exit code if it ended without one; (None, None) past `bound` seconds."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        ended = proc.exitcode is not None
        try:
            # Once it has ended, a report it put just before is still read: a last wait for it.
            status, value = queue.get(timeout=1.0 if ended else 0.2)
        except queue_module.Empty:
            if ended:
                return None, proc.exitcode
            continue
        if status != "ok":
            pytest.fail(f"surviving rank: worker failed: {value}")
        return value, None
    return None, None


def test_visible_devices_renumber_what_ranks_see(platform, registered):
    """With the visible-devices variable set to the devices in reverse, rank r's device is
    the physical device listed r-th: the runtime renumbers, device_for_rank follows."""
    from ._workers import device_identity, rank_device_identity

    count = platform.device_count()
    variables = registered.plugin.visible_devices_env
    if count < 2 or not variables:
        pytest.skip("not applicable: needs two visible devices and a visible-devices variable")
    if device_identity(platform.name, 0) is None:
        pytest.skip("not applicable: the device module reports no device UUID to tell devices apart")
    var = variables[0]
    listed = os.environ.get(var)
    physical = listed.split(",") if listed else [str(i) for i in range(count)]
    world = min(count, len(physical))
    env = {var: ",".join(reversed(physical[:world]))}
    results = run_ranks(platform, rank_device_identity, world, env, timeout=120)
    for r in results:
        expected = device_identity(platform.name, world - 1 - r["rank"])
        assert r["identity"] == expected, (f"rank {r['rank']} under {var}={env[var]} uses index {r['index']}, "
                                            f"device {r['identity']}; expected {expected}")
