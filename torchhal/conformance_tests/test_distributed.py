"""distributed (if declared): the platform's dist backend across two processes."""

from __future__ import annotations

import pytest

from ._helpers import receive, spawn_context, wait_exit

pytestmark = pytest.mark.conformance("distributed")


def test_two_process_all_reduce_and_available_memory(platform, tmp_path, measure):
    if platform.device_count() < 2 and platform.dist_backend != "gloo":
        pytest.skip("not applicable: device collectives need two devices (one rank per device)")
    from ._workers import distributed_rank

    ctx = spawn_context()
    q = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=distributed_rank, args=(platform.name, r, 2, store, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted((receive(q, "distributed rank") for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        wait_exit(p)
    for r in results:
        assert r["sum"] == [3.0] * 4, "all-reduce of 1 and 2 must give 3"
        assert r["min"] == 1 << 30, "available_memory(group) must be the minimum across ranks"
    measure["free_bytes_per_rank"] = [r["free"] for r in results]
