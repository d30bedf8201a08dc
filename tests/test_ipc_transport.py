"""The IPC tensor transport across real processes on the CPU platform (shared memory)."""

import json
import multiprocessing as mp
import os
import pickle
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
from .transport_workers import fields, forge

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
    with pytest.raises(ValueError, match="workers = 0 must be an int >= 1"):
        pool_size(1 << 30, 0)


def test_round_trips_to_two_consumers_and_recycling(consumers):
    inboxes, outbox = consumers(2)
    producer = Producer(small(consumers=2))
    sent = tensors()
    for tensor in sent:
        message = producer.send(tensor)
        json.dumps(message)  # plain data: JSON-serialisable, no pickle needed
        assert isinstance(message, tuple) and all(isinstance(v, (str, int, tuple, type(None))) for v in message)
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
    assert fields(second)["offset"] != fields(first)["offset"]
    producer.close()
    consumer.close()


def test_full_pool_falls_back_to_host_memory_with_one_warning():
    producer = Producer(small())
    consumer = Consumer(0)
    big = torch.arange(400_000, dtype=torch.float32)  # 1.5 MiB > the 1 MiB pool
    with pytest.warns(UserWarning, match="1.5 MiB does not fit the 1 MiB pool.*TransportConfig.budget_bytes"):
        message = producer.send(big)
    assert fields(message)["kind"] == "host"
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
    assert fields(message)["kind"] == "host"
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
        ({"pool_id": f"{2**22 + 12345}-0123456789ab"}, "has exited"),
        # each field's type and range
        ({"slot": "0"}, "'slot' = '0' is not an int"),
        ({"generation": True}, "'generation' = True is not an int"),
        ({"offset": -512}, "'offset' = -512 is out of range"),
        ({"nbytes": 2**48}, "'nbytes' = 281474976710656 is out of range"),
        ({"dtype": 7}, "unknown dtype 7"),
        ({"event": 1}, "'event' = 1 is not a bool"),
        ({"event": True}, "stored none"),  # no interprocess events on this platform
        ({"kind": "host", "event": True}, "only pool messages carry an event"),
        ({"shape": [17]}, "larger than the 64 bytes"),
        ({"shape": [2**48]}, r"shape\[0\] = 281474976710656 is not a size"),
        ({"shape": [4, 4.0]}, r"shape\[1\] = 4.0 is not a size"),
        ({"shape": [1] * 33}, "more than 32 dimensions"),
        ({"shape": "16"}, "'shape' = '16' is not a sequence"),
        ({"stride": 1}, "'stride' = 1 is neither None nor ints"),
        ({"stride": [2]}, "reaches byte 124 but its storage holds 64"),
        # the producer id: its form, then an unknown producer of a live pid
        ({"pool_id": "../../etc/passwd"}, "is not a producer id"),
        ({"pool_id": "1-0123456789ab/../x"}, "is not a producer id"),
        ({"pool_id": 12345}, "is not a producer id"),
        ({"pool_id": "1-0123456789ab"}, "is gone"),  # pid 1 lives, but made no such pool
    ],
)
def test_bad_messages_are_clear_errors(change, match):
    producer, consumer = Producer(small()), Consumer(0)
    good = producer.send(torch.arange(16.0))
    acks = bytes(producer.control.shm.map)
    with pytest.raises(TransportError, match=match):
        consumer.receive(forge(good, **change))
    assert bytes(producer.control.shm.map) == acks  # nothing acknowledged for a rejected message
    assert consumer.receive(good).tolist() == list(range(16))  # and the consumer still takes the real one
    producer.close()
    consumer.close()


@pytest.mark.parametrize(
    "wire, match",
    [
        (None, "must be the tuple"),
        ({"kind": "pool"}, "must be the tuple"),  # a dict, or any mapping
        ("pool", "must be the tuple"),
        ((), "has 0 fields, not the 10"),
        (("pool",) * 11, "has 11 fields, not the 10"),
    ],
)
def test_messages_of_the_wrong_form_are_clear_errors(wire, match):
    with pytest.raises(TransportError, match=match):
        TensorMessage.from_wire(wire)
    producer, consumer = Producer(small()), Consumer(0)
    good = producer.send(torch.arange(4.0))
    with pytest.raises(TransportError, match=match):
        consumer.receive(wire)
    with pytest.raises(TransportError, match="has 9 fields"):
        consumer.receive(good[:-1])  # truncated
    assert consumer.receive(good).tolist() == list(range(4))
    producer.close()
    consumer.close()


def test_wire_record_round_trips_through_the_typed_message():
    producer = Producer(small())
    for tensor in tensors():
        wire = producer.send(tensor)
        message = TensorMessage.from_wire(wire)
        assert message.to_wire() == wire and TensorMessage.from_wire(json.loads(json.dumps(wire))) == message
        assert message.shape == tuple(tensor.shape) and message.stride == tensor.contiguous().stride()
        assert message.producer_pid == os.getpid() and message.control == producer.control.name
    producer.close()


def test_the_message_carries_no_per_producer_constants():
    """The pool handle and the event handles are in the control block: a message is a small record."""
    producer = Producer(small())
    wire = producer.send(torch.arange(16.0))
    assert len(pickle.dumps(wire)) < 120
    assert not any(isinstance(value, (dict, bytes)) for value in wire)
    producer.close()


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
            index = rng.randrange(len(message) + 1)
            if rng.random() < 0.1:
                del message[min(index, len(message) - 1) : index + 1]  # truncated
            elif index == len(message):
                message.append(rng.choice(junk))  # an extra field
            else:
                message[index] = rng.choice(junk)
        try:
            TensorMessage.from_wire(rng.choice([message, tuple(message)]))
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
        message = fields(good)
        for key in rng.sample(["offset", "nbytes", "shape", "stride", "generation", "slot"], rng.randint(1, 3)):
            if key in ("shape", "stride"):
                message[key] = [rng.choice([0, 1, 2, 15, 16, 17, 4096, 2**40]) for _ in range(rng.randint(1, 3))]
                if key == "stride" and rng.random() < 0.3:
                    message[key] = None  # contiguous
            else:
                message[key] = rng.choice([0, 1, 4, 512, 1024, 1 << 20, (1 << 20) - 4, 2**40])
        try:
            tensor = consumer.receive(forge(good, **message))
        except TransportError:
            continue
        received += 1
        # Exactly the bytes the message names, read from the producer's own pool.
        region = producer.pool[message["offset"] : message["offset"] + message["nbytes"]].view(torch.float32)
        stride = torch.empty(message["shape"]).stride() if message["stride"] is None else message["stride"]
        # Bitwise: the pool past the sent tensor is uninitialised and may hold NaNs (NaN != NaN).
        assert torch.equal(tensor.view(torch.int32), region.as_strided(message["shape"], stride).view(torch.int32))
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


def test_reused_slices_carry_each_send_in_its_own_dtype_and_shape():
    """Both sides keep pool views for reuse: the same bytes sent as another dtype, shape or
    stride must still arrive as sent, and a zero-copy view is never one kept for copies."""
    producer, consumer = Producer(small()), Consumer(0)
    sends = [torch.arange(32, dtype=torch.float32).reshape(4, 8), torch.arange(32, dtype=torch.float32).reshape(8, 4),
             torch.arange(64, dtype=torch.int16), torch.arange(32, dtype=torch.int32).reshape(4, 8),
             torch.arange(32, dtype=torch.float32).reshape(4, 8) * -1,
             torch.arange(32, dtype=torch.float32).reshape(4, 8).t(), torch.arange(32, dtype=torch.float32)[None]]
    offsets = set()
    for tensor in sends:  # each one acknowledged before the next: the same slice every time
        message = producer.send(tensor)
        offsets.add(fields(message)["offset"])
        got = consumer.receive(message)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), (tensor.shape, tensor.dtype)
        assert producer.reclaim() == 1
    assert offsets == {0}
    message = producer.send(sends[0])  # the same bytes, read transposed by a stride the sender chose
    assert torch.equal(consumer.receive(forge(message, shape=[8, 4], stride=[1, 8])), sends[0].t())
    producer.reclaim()
    first = consumer.receive(producer.send(sends[0]), copy=False)
    first.t_()  # a caller may change its view's metadata in place
    producer.reclaim()
    second = consumer.receive(producer.send(sends[0]), copy=False)
    assert second is not first and second.shape == (4, 8) and torch.equal(consumer.receive(producer.send(sends[0])),
                                                                          sends[0])
    producer.close()
    consumer.close()


def test_kept_views_are_bounded(monkeypatch):
    from torchhal.core.transport import consumer as consumer_module
    from torchhal.core.transport import producer as producer_module

    monkeypatch.setattr(producer_module, "MAX_KEPT_VIEWS", 4)
    monkeypatch.setattr(consumer_module, "MAX_KEPT_VIEWS", 4)
    producers, consumer = [Producer(small()), Producer(small())], Consumer(0)
    for length in range(1, 20):  # 19 shapes at the same offset: 19 keys on each side, per producer
        tensor = torch.arange(length, dtype=torch.float32)
        for producer in producers:
            assert torch.equal(consumer.receive(producer.send(tensor)), tensor)
            producer.reclaim()
    assert all(len(producer._views) <= 4 for producer in producers)
    assert sum(len(entry.views) for entry in consumer._open.values()) <= 4  # over all producers
    for producer in producers:
        producer.close()
    consumer.close()


def test_sent_tensors_join_no_autograd_graph_and_any_inference_mode():
    import torch.autograd.forward_ad as forward_ad

    producer, consumer = Producer(small()), Consumer(0)
    leaf = torch.arange(8.0, requires_grad=True)
    got = consumer.receive(producer.send(leaf * 2))
    assert not got.requires_grad and got.grad_fn is None and torch.equal(got, torch.arange(8.0) * 2)
    producer.reclaim()
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(torch.arange(8.0), torch.ones(8))
        got = consumer.receive(producer.send(dual))
        assert forward_ad.unpack_dual(got).tangent is None and torch.equal(got, torch.arange(8.0))
        # The producer's pool and its kept views must not take the tangent (it would be the pool's size).
        assert all(forward_ad.unpack_dual(view).tangent is None for view in [producer.pool, *producer._views.values()])
    producer.close()
    producer = Producer(small())  # its pool views are first made inside inference mode
    with torch.inference_mode():
        assert torch.equal(consumer.receive(producer.send(torch.arange(6.0))), torch.arange(6.0))
    producer.reclaim()
    assert torch.equal(consumer.receive(producer.send(torch.arange(6.0) + 1)), torch.arange(6.0) + 1)
    producer.close()
    consumer.close()


def test_a_hand_built_message_does_not_change_how_others_decode():
    TensorMessage("pool", "1-0123456789ab", 0, 0, 0, 24, "float32", (2.0, 3.0), (3, 1)).to_wire()  # type: ignore[arg-type]
    decoded = TensorMessage.from_wire(("pool", "1-0123456789ab", 0, 0, 0, 24, "float32", (2, 3), None, False))
    assert decoded.stride == (3, 1) and all(type(n) is int for n in decoded.stride)
