"""GPU-side helpers for tests and benchmarks: nvidia-smi per-process memory, IPC workers."""

from __future__ import annotations

import subprocess
from typing import Any


def gpu_index_by_uuid() -> dict[str, int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout
    result = {}
    for line in out.strip().splitlines():
        index, uuid = (part.strip() for part in line.split(","))
        result[uuid] = int(index)
    return result


def mib_per_process() -> dict[tuple[int, int], int]:
    """{(pid, gpu index): MiB used}, from nvidia-smi --query-compute-apps."""
    by_uuid = gpu_index_by_uuid()
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout
    result: dict[tuple[int, int], int] = {}
    for line in out.strip().splitlines():
        if not line.strip():
            continue
        pid, uuid, used = (part.strip() for part in line.split(","))
        result[(int(pid), by_uuid.get(uuid, -1))] = int(used)
    return result


def consumer_open(handle: Any, consumer: int, redirect: bool, queue: Any, release: Any) -> None:
    """Open a CUDA IPC handle on `consumer`; redirected (torchhal) or torch's default path."""
    import os

    import torch

    import torchhal

    try:
        torch.cuda.set_device(consumer)
        torch.ones(1, device=f"cuda:{consumer}")  # the consumer's own context first
        platform = torchhal.get_platform("cuda")
        if not redirect:
            platform.set_ipc_peer_redirect(False)  # torch's default: open on the producer's device
        ipc = platform.ipc_support
        assert ipc is not None  # the CUDA plugin declares IPC
        tensor = ipc.open(handle, consumer)
        torch.cuda.synchronize(consumer)
        queue.put(("ok", {"pid": os.getpid(), "sum": float(tensor.sum().item()), "device": str(tensor.device)}))
        release.wait(120)
    except BaseException as exc:
        queue.put(("error", f"{type(exc).__name__}: {exc}"))
