"""Hostile input to torchhal.distributed: a bad argument to `launch` or `init_group` is refused
in one line naming it, before anything starts (no rank spawned, no device set, no default
group name taken), and what used to hang (launch under torchrun, a group made again under a
closed one's name) works.

Most tests refuse before spawning, and ranks of a group are threads of this process over a
HashStore; only three tests start processes."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch

from torchhal.distributed import init_group, launch

ROOT = Path(__file__).resolve().parents[1]
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# -- targets (run in spawned ranks) ----------------------------------------------------------
def group_sum_and_torchelastic_variables(timeout_s: float) -> tuple[float, list[str]]:
    group = init_group(timeout=timedelta(seconds=timeout_s))
    try:
        total = group.comm.all_reduce(torch.tensor([float(group.rank + 1)])).item()
    finally:
        group.close()
    return total, sorted(name for name in os.environ if name.startswith("TORCHELASTIC_"))


# -- launch: ranks that used to hang or overflow ----------------------------------------------
def test_ranks_launched_from_a_torchrun_worker_do_not_look_for_torchruns_store(monkeypatch):
    # What torchrun puts in its workers' environment: ranks inheriting it waited for an agent
    # store on launch's port and timed out.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer")
    results = launch(group_sum_and_torchelastic_variables, 2, (5.0,), timeout=60, grace=1.0)
    assert results == [(3.0, []), (3.0, [])]
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the parent's own is kept
