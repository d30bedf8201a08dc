"""The IPC transport on real CUDA GPUs (producer here, consumer in a spawned process).
Skipped, with the reason, where no CUDA GPU is present (CI)."""

import json
import multiprocessing as mp

import pytest
import torch

import torchhal
from torchhal.core.transport import Consumer, Producer, TransportConfig, TransportError

from . import transport_workers
from .transport_workers import fields, forge, forge_handle_record

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
            assert fields(message)["kind"] == "pool"
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
    storage = json.loads(producer.control.handle_record())["storage"]
    for index, value in [(3, {"b64": "L2V0Yy9wYXNzd2Q="}), (1, {"b64": ""}), (4, 10**9)]:
        forged = [*storage[:index], value, *storage[index + 1 :]]
        # The handle record in the control block, with a matching fingerprint (a hostile producer).
        forge_handle_record(producer, lambda data, forged=forged: data.update(storage=forged))
        with pytest.raises(TransportError):
            Consumer(0, platform, 0).receive(good)
    producer.close()


class CountingEvent:
    """Wraps the producer's copy event: counts host synchronizes."""

    def __init__(self, event):
        self.event, self.synchronizes = event, 0

    def record(self, stream=None):
        self.event.record(stream)

    def synchronize(self):
        self.synchronizes += 1
        self.event.synchronize()


@pytest.mark.parametrize("copy", [True, False])
def test_interprocess_events_order_the_consumer_after_a_late_producer_copy(copy):
    """The producer never waits on the host; its copy runs behind ~100 ms of queued GPU work,
    and the consumer (another process, on GPU 1 where there are two) still reads the new
    values: its stream waits on the slot's interprocess event."""
    platform = torchhal.get_platform("cuda")
    ipc = platform.ipc_support
    assert ipc is not None and ipc.events is not None and ipc.events.handle_nbytes == 64
    producer = Producer(TransportConfig(budget_bytes=64 * MiB, pool_floor_bytes=MiB, max_slices=4), platform, 0)
    counting = CountingEvent(producer._copied)
    producer._copied = counting
    device = 1 if torch.cuda.device_count() > 1 else 0
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=transport_workers.consume, args=(0, inbox, outbox, copy, False, device))
    proc.start()
    try:
        for value in range(1, 9):  # 8 sends over 4 slots: every slot's event re-recorded
            tensor = torch.full((65536,), float(value), device="cuda:0")
            torch.cuda._sleep(200_000_000)  # the copy below waits behind this on the stream
            message = producer.send(tensor)
            assert fields(message)["kind"] == "pool" and fields(message)["event"] is True
            inbox.put(json.loads(json.dumps(message)))
            status, _, _, values = outbox.get(timeout=180)
            assert status == "ok", values
            assert set(values) == {float(value)}, f"consumer read stale bytes for send {value}"
            producer.reclaim()
    finally:
        inbox.put(None)
        proc.join(60)
    assert counting.synchronizes == 0
    producer.close()


def test_forged_event_handles_are_transport_errors():
    platform = torchhal.get_platform("cuda")
    producer = Producer(TransportConfig(budget_bytes=16 * MiB, pool_floor_bytes=MiB), platform, 0)
    good = producer.send(torch.ones(16, device="cuda:0"))
    slot = fields(good)["slot"]
    handle = producer.control.event(slot)
    assert handle is not None and len(handle) == 64
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=transport_workers.consume, args=(0, inbox, outbox))
    proc.start()
    try:
        # The slot's handle in the control block garbled: 64 zero bytes (the driver refuses), short.
        for garbled in [bytes(64), b"\0" * 3]:
            producer.control.set_event(slot, garbled)
            inbox.put(good)
            status, _, _, text = outbox.get(timeout=180)
            assert status == "error" and "event" in text, text
        producer.control.set_event(slot, handle)
        inbox.put(forge(good, event=17))  # not a flag
        status, _, _, text = outbox.get(timeout=180)
        assert status == "error" and "event" in text, text
        inbox.put(good)
        status, _, _, values = outbox.get(timeout=180)
        assert status == "ok" and values == [1.0] * 16
    finally:
        inbox.put(None)
        proc.join(60)
    producer.close()
