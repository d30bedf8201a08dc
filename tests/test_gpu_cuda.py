"""CUDA on real GPUs. Skipped, with the reason, where no CUDA GPU is present (CI)."""

import json
import multiprocessing as mp
import time

import pytest
import torch

import torchhal
from torchhal.platforms import ReleasePoint

from .conftest import run_cli

MiB = 1 << 20
has_cuda = torch.cuda.is_available() and torch.version.cuda is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_cuda, reason="needs a CUDA GPU (none here)")]
two_gpus = pytest.mark.skipif(not has_cuda or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@pytest.fixture
def cuda():
    return torchhal.get_platform("cuda")


def test_info_selects_cuda_with_its_devices():
    out = run_cli("info", "--json")
    info = json.loads(out.stdout)
    assert info["current"]["name"] == "cuda"
    devices = info["current"]["devices"]
    assert len(devices) == torch.cuda.device_count()
    for i, d in enumerate(devices):
        assert d["device"]["name"] == torch.cuda.get_device_name(i)
        assert d["memory"]["total"] == torch.cuda.mem_get_info(i)[1]
    assert info["current"]["capabilities"]["graphs"] == "CUDAGraph"


def test_memory_info_keeps_reserved_and_never_empties(cuda, monkeypatch):
    block = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda:0")
    del block
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    reserved = torch.cuda.memory_reserved(0)
    mem = cuda.memory_info(0)
    assert calls == [] and torch.cuda.memory_reserved(0) == reserved
    assert mem.reserved == reserved and mem.allocated == torch.cuda.memory_allocated(0)
    free, total = torch.cuda.mem_get_info(0)
    assert mem.total == total and abs(mem.free - free) < 64 * MiB


def test_empty_cache_lowers_reserved_to_allocated(cuda):
    cuda.empty_cache(ReleasePoint.USER, 0)  # `keep` must not land inside an older cached segment
    # What no empty_cache can release: free bytes in segments that tensors of earlier tests
    # (in this process) still hold.
    held_slack = torch.cuda.memory_reserved(0) - torch.cuda.memory_allocated(0)
    keep = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")
    block = torch.empty(1024 * MiB, dtype=torch.uint8, device="cuda:0")
    del block
    before = torch.cuda.memory_reserved(0)
    released = cuda.empty_cache(ReleasePoint.USER, 0)
    after = torch.cuda.memory_reserved(0)
    assert released == before - after >= 1024 * MiB
    assert after - torch.cuda.memory_allocated(0) - held_slack < 32 * MiB
    del keep


def test_graph_capture_keeps_reserved_and_replays(cuda):
    support = cuda.graph_support
    block = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda:0")
    del block
    reserved_before = torch.cuda.memory_reserved(0)
    x = torch.randn(64, 1024, device="cuda:0")
    w = torch.randn(1024, 1024, device="cuda:0")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.relu(x @ w)
    torch.cuda.current_stream().wait_stream(stream)
    pool = support.new_pool()
    g1, g2 = support.graph_class(), support.graph_class()
    with support.capture(g1, pool, stream):
        y1 = torch.relu(x @ w)
    with support.capture(g2, pool, stream):
        y2 = y1 * 2 + 1
    assert torch.cuda.memory_reserved(0) >= reserved_before, "capture emptied the cache"
    for _ in range(3):
        x.copy_(torch.randn(64, 1024, device="cuda:0"))
        g1.replay()
        g2.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y1, torch.relu(x @ w))
        torch.testing.assert_close(y2, torch.relu(x @ w) * 2 + 1)


@two_gpus
def test_ipc_consumer_creates_no_context_on_the_producer_gpu(cuda):
    from .gpu_helpers import consumer_open, mib_per_process

    tensor = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
    handle = cuda.ipc_support.share(tensor)
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    q, release = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=consumer_open, args=(handle, 1, True, q, release))
    proc.start()
    try:
        status, result = q.get(timeout=180)
        assert status == "ok", result
        time.sleep(0.5)
        usage = mib_per_process()
    finally:
        release.set()
        proc.join(60)
    assert result["sum"] == float(sum(range(1 << 20))) and result["device"] == "cuda:1"
    assert usage.get((result["pid"], 0), 0) == 0, f"consumer holds memory on GPU 0: {usage}"
    assert usage.get((result["pid"], 1), 0) > 0


def test_current_stream_follows_the_stream_in_use_and_is_kept(cuda):
    default = cuda.current_stream(0)
    assert default == torch.cuda.current_stream(0) and cuda.current_stream(0) is default
    side = torch.cuda.Stream(0)
    with torch.cuda.stream(side):
        assert cuda.current_stream(0) == side and cuda.current_stream(0).cuda_stream == side.cuda_stream
    assert cuda.current_stream(0) is default
