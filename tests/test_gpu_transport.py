"""The IPC transport on real CUDA GPUs (producer here, consumer in a spawned process).
Skipped, with the reason, where no CUDA GPU is present (CI)."""

import json
import multiprocessing as mp

import pytest
import torch

import torchhal
from torchhal.core.transport import Consumer, Producer, TransportConfig, TransportError

from . import transport_workers

MiB = 1 << 20
has_cuda = torch.cuda.is_available() and torch.version.cuda is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_cuda, reason="needs a CUDA GPU (none here)")]


# CUDA IPC cannot open an allocation in the process that made it, so every consumer
# here is another process.
@pytest.mark.parametrize(("copy", "copy_stream"), [(True, False), (True, True), (False, False)])
def test_device_pool_round_trip_across_processes(copy, copy_stream):
    platform = torchhal.get_platform("cuda")
    producer = Producer(TransportConfig(budget_bytes=64 * MiB, pool_floor_bytes=MiB), platform, 0)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=transport_workers.consume, args=(0, inbox, outbox, copy, copy_stream))
    proc.start()
    sent = [torch.arange(4096, dtype=torch.float32, device="cuda:0").reshape(64, 64).t(),
            torch.arange(300, dtype=torch.int64, device="cuda:0"),
            torch.linspace(-1, 1, 100, device="cuda:0").to(torch.bfloat16)]
    try:
        for tensor in sent:
            message = producer.send(tensor)
            assert message["kind"] == "pool"
            inbox.put(json.loads(json.dumps(message)))
            status, _, same_dtype, values = outbox.get(timeout=180)
            assert status == "ok" and same_dtype, values
            assert values == tensor.to(torch.float64).flatten().tolist()
    finally:
        inbox.put(None)
        proc.join(60)
    producer.reclaim()  # each send reclaims what was acknowledged before it; this takes the last
    assert producer.free_bytes == producer.pool_bytes
    producer.close()


def test_forged_device_handle_fields_are_transport_errors():
    platform = torchhal.get_platform("cuda")
    producer = Producer(TransportConfig(budget_bytes=16 * MiB, pool_floor_bytes=MiB), platform, 0)
    good = json.loads(json.dumps(producer.send(torch.ones(16, device="cuda:0"))))
    for index, value in [(3, {"b64": "L2V0Yy9wYXNzd2Q="}), (1, {"b64": ""}), (4, 10**9)]:
        message = json.loads(json.dumps(good))
        message["pool_handle"]["storage"][index] = value
        with pytest.raises(TransportError):
            Consumer(0, platform, 0).receive(message)
    producer.close()
