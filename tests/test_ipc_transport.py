"""The IPC tensor transport across real processes on the CPU platform (shared memory)."""

import json
import multiprocessing as mp
import random
import time
import warnings

import pytest
import torch

import torchhal
from torchhal.core.transport import (
    POOL_FLOOR_BYTES,
    Consumer,
    Producer,
    TensorMessage,
    TransportConfig,
    TransportError,
    pool_size,
)

from . import transport_workers

MiB = 1 << 20


def small(**overrides):
    return TransportConfig(**{"budget_bytes": 0, "pool_floor_bytes": 1 * MiB, **overrides})


def tensors():
    base = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    return [base, base.t(), base[3:, 5::3], torch.arange(300, dtype=torch.int64),
            (torch.arange(333) % 7).to(torch.uint8), torch.linspace(-1, 1, 100).to(torch.bfloat16), torch.zeros(0)]


@pytest.fixture
def consumers():
    ctx = mp.get_context("spawn")
    started = []

    def start(count):
        inboxes, outbox = [ctx.Queue() for _ in range(count)], ctx.Queue()
        for rank in range(count):
            proc = ctx.Process(target=transport_workers.consume, args=(rank, inboxes[rank], outbox))
            proc.start()
            started.append((proc, inboxes[rank]))
        return inboxes, outbox

    yield start
    for proc, inbox in started:
        inbox.put(None)
        proc.join(30)


def test_pool_budget_split_with_floor():
    assert pool_size(1 << 30, 4) == 256 * MiB
    assert pool_size(1 << 30, 16) == POOL_FLOOR_BYTES  # 64 MiB share, raised to the 128 MiB floor
    with pytest.raises(ValueError, match="workers 0"):
        pool_size(1 << 30, 0)


def test_round_trips_to_two_consumers_and_recycling(consumers):
    inboxes, outbox = consumers(2)
    producer = Producer(small(consumers=2))
    sent = tensors()
    for tensor in sent:
        message = producer.send(tensor)
        json.dumps(message)  # plain data: JSON-serialisable, no pickle needed
        for inbox in inboxes:
            inbox.put(message)
    results = [outbox.get(timeout=120) for _ in range(2 * len(sent))]
    assert all(r[0] == "ok" and r[2] for r in results), results
    for rank in range(2):
        got = [r[3] for r in results if r[1] == rank]
        assert got == [t.to(torch.float64).flatten().tolist() for t in sent]
    assert producer.reclaim() == len(sent)  # both consumers acked: every slice is free
    assert producer.free_bytes == producer.pool_bytes  # and adjacent free slices merged back into one
    producer.close()


def test_memory_stays_flat_over_many_transfers(consumers):
    inboxes, outbox = consumers(1)
    producer = Producer(small(max_slices=8))
    for i in range(300):
        message = producer.send(torch.full((1000 + i % 17,), float(i)))
        inboxes[0].put(message)
        status, _, _, values = outbox.get(timeout=60)
        assert status == "ok" and values[0] == float(i)
    producer.reclaim()
    assert producer.free_bytes == producer.pool_bytes and len(producer._free) == 1
    producer.close()


def test_unacknowledged_slices_are_not_reused():
    producer = Producer(small(consumers=2))
    consumer = Consumer(0)
    first = producer.send(torch.ones(1000))
    consumer.receive(first)  # only one of two consumers acked
    assert producer.reclaim() == 0
    second = producer.send(torch.ones(1000))
    assert second["offset"] != first["offset"]
    producer.close()
    consumer.close()


def test_full_pool_falls_back_to_host_memory_with_one_warning():
    producer = Producer(small())
    consumer = Consumer(0)
    big = torch.arange(400_000, dtype=torch.float32)  # 1.5 MiB > the 1 MiB pool
    with pytest.warns(UserWarning, match="1.5 MiB does not fit the 1 MiB pool.*TransportConfig.budget_bytes"):
        message = producer.send(big)
    assert message["kind"] == "host"
    assert torch.equal(consumer.receive(message), big)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        producer.send(big)  # warned once per pool lifetime
    producer.reclaim()
    producer.close()
    consumer.close()


def test_no_ipc_capability_uses_the_host_path(make_registry, monkeypatch):
    make_registry()
    platform = torchhal.current_platform()
    monkeypatch.setattr(type(platform), "ipc_support", property(lambda self: None))
    producer, consumer = Producer(small()), Consumer(0)
    message = producer.send(torch.arange(10))
    assert message["kind"] == "host"
    assert consumer.receive(message).tolist() == list(range(10))
    producer.close()
    consumer.close()


def test_zero_copy_view_on_request():
    producer, consumer = Producer(small()), Consumer(0)
    message = producer.send(torch.arange(8.0))
    view = consumer.receive(message, copy=False)
    assert view.tolist() == list(range(8)) and view.untyped_storage().nbytes() == producer.pool_bytes
    producer.close()
    consumer.close()


@pytest.mark.parametrize(
    "change, match",
    [
        ({"offset": 2 * MiB}, "exceeds its pool"),
        ({"nbytes": 10 * MiB}, "exceeds its pool"),
        ({"dtype": "float128"}, "unknown dtype"),
        ({"shape": [-4]}, r"shape\[0\] = -4"),
        ({"shape": [2**60], "stride": [1]}, "shape|exceeds|reaches"),
        ({"shape": [4000], "stride": [1]}, "reaches byte 16000 but its storage holds 64"),
        ({"generation": 99}, "stale message"),
        ({"slot": 5000}, "outside the producer's"),
        ({"kind": "telepathy"}, "neither 'pool' nor 'host'"),
        ({"offset": 2}, "multiples of the float32 size"),
        ({"producer_pid": 2**22 + 12345}, "has exited"),
    ],
)
def test_bad_messages_are_clear_errors(change, match):
    producer, consumer = Producer(small()), Consumer(0)
    message = {**producer.send(torch.arange(16.0)), **change}
    with pytest.raises(TransportError, match=match):
        consumer.receive(message)
    producer.close()
    consumer.close()


def test_recycled_slice_is_a_stale_message():
    producer, consumer = Producer(small()), Consumer(0)
    old = producer.send(torch.arange(16.0))
    consumer.receive(old)
    producer.reclaim()
    producer.send(torch.arange(16.0))  # same slot, next generation
    with pytest.raises(TransportError, match="stale message"):
        consumer.receive(old)
    producer.close()
    consumer.close()


def test_message_from_an_exited_producer_is_a_clear_error():
    ctx = mp.get_context("spawn")
    outbox, release = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=transport_workers.produce_then_exit, args=(outbox, release))
    proc.start()
    message = outbox.get(timeout=120)
    release.set()
    deadline = time.monotonic() + 60
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.05)
    consumer = Consumer(0)
    with pytest.raises(TransportError, match="has exited|is gone"):
        consumer.receive(message)
    consumer.close()


def test_fuzzed_messages_only_ever_raise_transport_errors():
    producer = Producer(small())
    good = producer.send(torch.arange(64.0).reshape(8, 8))
    rng = random.Random(1234)
    junk = [None, -1, 2**70, "x", 3.5, [], {}, [1, -2], {"b64": "!!"}, True, b"raw", [2**62, 2**62]]
    for _ in range(3000):
        message = json.loads(json.dumps(good))
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(list(message) + ["pool_handle.storage", "pool_handle.storage_nbytes", "extra"])
            if key.startswith("pool_handle."):
                if isinstance(message.get("pool_handle"), dict):
                    message["pool_handle"][key.split(".")[1]] = rng.choice(junk)
            elif rng.random() < 0.2:
                message.pop(key, None)
            else:
                message[key] = rng.choice(junk)
        try:
            TensorMessage.from_dict(message)
        except TransportError:
            pass
    producer.close()


def test_fuzzed_numbers_through_receive_never_read_out_of_bounds():
    """Plausible-looking numbers, end to end: each message is received or a TransportError."""
    producer, consumer = Producer(small()), Consumer(0)
    good = producer.send(torch.arange(256.0).reshape(16, 16))
    rng = random.Random(99)
    received = 0
    for _ in range(2000):
        message = json.loads(json.dumps(good))
        for key in rng.sample(["offset", "nbytes", "shape", "stride", "generation", "slot"], rng.randint(1, 3)):
            if key in ("shape", "stride"):
                message[key] = [rng.choice([0, 1, 2, 15, 16, 17, 4096, 2**40]) for _ in range(rng.randint(1, 3))]
            else:
                message[key] = rng.choice([0, 1, 4, 512, 1024, 1 << 20, (1 << 20) - 4, 2**40])
        try:
            tensor = consumer.receive(message)
        except TransportError:
            continue
        received += 1
        # Exactly the bytes the message names, read from the producer's own pool.
        region = producer.pool[message["offset"] : message["offset"] + message["nbytes"]].view(torch.float32)
        assert torch.equal(tensor, region.as_strided(message["shape"], message["stride"]))
    assert received > 0  # some mutations stay valid, and those read inside their slice
    producer.close()
    consumer.close()


def test_copy_on_a_side_stream_returns_the_same_values():
    producer, consumer = Producer(small()), Consumer(0, copy_stream=True)
    for tensor in tensors():
        got = consumer.receive(producer.send(tensor))
        assert torch.equal(got, tensor) and got.untyped_storage().nbytes() != producer.pool_bytes
    producer.close()
    consumer.close()
