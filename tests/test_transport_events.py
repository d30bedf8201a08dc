"""The transport's interprocess-event path, on the CPU with a fake plugin whose events are
plain bytes: the producer never host-synchronizes, the consumer's stream waits on the
slot's event before reading, opened events are bounded and dropped with their producer,
and bad event handles are TransportErrors. A plugin without the capability keeps the
host-synchronized path."""

from __future__ import annotations

import dataclasses
import gc
import json
import random
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from torchhal.core.transport import Consumer, Producer, TransportConfig, TransportError
from torchhal.core.transport._shm import Control
from torchhal.platforms import IpcEvents, IpcHandleError, IpcSupport, Platform, get_platform, hookimpl
from torchhal.plugins.cpu import CpuPlatform

from .transport_workers import fields, forge

MiB = 1 << 20
HANDLE_NBYTES = 64


class Log:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.exported: dict[bytes, FakeIpcEvent] = {}
        self.opened: weakref.WeakSet[OpenedEvent] = weakref.WeakSet()
        self.device_done = True  # False: the device has not yet run the work queued so far

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]


class FakeIpcEvent:
    """The producer's interprocess event: records, and exports a 64-byte handle."""

    def __init__(self, log: Log, device: int) -> None:
        self.log, self.device, self.records = log, device, 0
        self.handle = f"fake-event-{len(log.exported)}".encode().ljust(HANDLE_NBYTES, b"\0")

    def record(self, stream: Any = None) -> None:
        self.records += 1
        self.log.calls.append(("record", self.handle, stream))

    def wait(self, stream: Any = None) -> None:
        self.log.calls.append(("producer-wait", self.handle, stream))

    def synchronize(self) -> None:
        self.log.calls.append(("event-synchronize", self.handle))


class OpenedEvent:
    """What a consumer opens from a handle: logs the stream each wait is queued on."""

    def __init__(self, log: Log, handle: bytes, device: int) -> None:
        self.log, self.handle, self.device = log, handle, device

    def record(self, stream: Any = None) -> None:
        raise AssertionError("a consumer never records a producer's event")

    def wait(self, stream: Any = None) -> None:
        self.log.calls.append(("wait", self.handle, stream))

    def synchronize(self) -> None:
        self.log.calls.append(("host-synchronize", self.handle))


class CountingEvent:
    """`new_event()`: counts host synchronizes (the path without interprocess events). Its
    work is done once `log.device_done` is True (a host synchronize waits for that)."""

    def __init__(self, log: Log) -> None:
        self.log = log

    def record(self, stream: Any = None) -> None:
        self.log.calls.append(("copy-record", stream))

    def wait(self, stream: Any = None) -> None:
        self.log.calls.append(("copy-wait", stream))

    def synchronize(self) -> None:
        self.log.calls.append(("host-synchronize", "copy"))
        self.log.device_done = True

    def query(self) -> bool:
        self.log.calls.append(("copy-query",))
        return self.log.device_done


def make_plugin(log: Log, with_events: bool) -> object:
    """An in-process registration of the fake platform (CPU memory, fake streams and events)."""
    class FakeEventsPlatform(CpuPlatform):
        name = "fakeevents"
        priority = 7

        def synchronize(self, index: int) -> None:
            log.calls.append(("host-synchronize", "device"))

        def new_event(self) -> Any:
            return CountingEvent(log)

        def current_stream(self, index: int) -> Any:
            return ("current", index)

        def new_stream(self, index: int) -> Any:
            return ("side", index)

        @contextmanager
        def use_stream(self, stream: Any) -> Iterator[None]:
            log.calls.append(("use_stream", stream))
            yield
            log.calls.append(("use_stream-exit", stream))

        def ipc_support(self) -> IpcSupport | None:
            base = super().ipc_support()
            assert base is not None
            return dataclasses.replace(base, events=fake_events(log) if with_events else None)

    class Registration:
        @hookimpl
        def torchhal_register_platforms(self) -> list[CpuPlatform]:
            return [FakeEventsPlatform()]

    return Registration()


def fake_events(log: Log) -> IpcEvents:
    def new(device: int) -> FakeIpcEvent:
        log.calls.append(("new", device))
        return FakeIpcEvent(log, device)

    def export(event: FakeIpcEvent) -> bytes:
        assert event.records >= 1, "exported before its first record"
        log.exported[event.handle] = event
        return event.handle

    def open_event(handle: bytes, producer: int, consumer: int) -> OpenedEvent:
        log.calls.append(("open", handle, producer, consumer))
        if handle not in log.exported:
            raise IpcHandleError(f"the driver refuses event handle {handle[:16]!r}")
        opened = OpenedEvent(log, handle, consumer)
        log.opened.add(opened)
        return opened

    return IpcEvents(new=new, export=export, open=open_event, handle_nbytes=HANDLE_NBYTES)


@pytest.fixture
def log() -> Log:
    return Log()


@pytest.fixture
def platform(make_registry: Any, log: Log) -> Platform:
    make_registry(make_plugin(log, with_events=True))
    return get_platform("fakeevents")


@pytest.fixture
def plain_platform(make_registry: Any, log: Log) -> Platform:
    make_registry(make_plugin(log, with_events=False))
    return get_platform("fakeevents")


def config(**overrides: Any) -> TransportConfig:
    return TransportConfig(**{"budget_bytes": 0, "pool_floor_bytes": MiB, **overrides})


def host_syncs(log: Log) -> int:
    return sum(1 for call in log.calls if call[0] in ("host-synchronize", "event-synchronize"))


def test_send_records_the_slot_event_and_never_synchronizes(platform, log):
    producer = Producer(config(), platform, 0)
    consumer = Consumer(0, platform, 0)
    for i in range(12):
        message = producer.send(torch.arange(16.0) + i)
        assert fields(message)["kind"] == "pool" and fields(message)["event"] is True
        json.dumps(message)  # still plain data
        assert consumer.receive(message).tolist() == (torch.arange(16.0) + i).tolist()
    assert host_syncs(log) == 0
    # One event per slot, recorded on the pool device's current stream, once per send.
    records = [call for call in log.calls if call[0] == "record"]
    assert len(records) == 12 and {call[2] for call in records} == {("current", 0)}
    assert log.names().count("new") == len(log.exported) >= 1
    producer.close()
    consumer.close()


def test_without_the_capability_send_synchronizes_its_copy(plain_platform, log):
    producer = Producer(config(), plain_platform, 0)
    consumer = Consumer(0, plain_platform, 0)
    for i in range(5):
        message = producer.send(torch.arange(8.0) + i)
        assert fields(message)["event"] is False
        assert consumer.receive(message).tolist() == (torch.arange(8.0) + i).tolist()
    assert log.names().count("host-synchronize") == 5  # one per send: its copy event
    assert "open" not in log.names() and "wait" not in log.names()
    producer.close()
    consumer.close()


def test_events_can_be_turned_off_per_producer(platform, log):
    producer = Producer(config(interprocess_events=False), platform, 0)
    consumer = Consumer(0, platform, 0)
    message = producer.send(torch.arange(8.0))
    assert fields(message)["event"] is False and host_syncs(log) == 1
    assert consumer.receive(message).tolist() == list(range(8))
    assert "wait" not in log.names()
    producer.close()
    consumer.close()


@pytest.mark.parametrize(("copy", "copy_stream", "stream"), [
    (True, False, ("current", 0)), (False, False, ("current", 0)), (True, True, ("side", 0)),
])
def test_the_reading_stream_waits_on_the_slot_event_before_the_copy(platform, log, copy, copy_stream, stream):
    producer = Producer(config(), platform, 0)
    consumer = Consumer(0, platform, 0, copy_stream=copy_stream)
    message = producer.send(torch.arange(32.0))
    before = len(log.calls)
    got = consumer.receive(message, copy=copy)
    assert got.tolist() == list(range(32))
    after = log.calls[before:]
    waits = [call for call in after if call[0] == "wait"]
    assert waits == [("wait", slot_event(producer, message), stream)]
    if copy_stream:  # the side stream waits first, then copies, then the caller's stream waits on it
        names = [call[0] for call in after]
        assert names.index("wait") < names.index("use_stream") < names.index("copy-wait")
    assert host_syncs(log) == 0
    producer.close()
    consumer.close()


def slot_event(producer: Producer, message: Any) -> bytes | None:
    """The event handle the producer stored in its control block for the message's slot."""
    return producer.control.event(fields(message)["slot"])


def event_length_cell(control: Control, slot: int) -> int:
    return Control.HEADER + control.slots + control.slots * control.consumers + slot


def test_each_slot_event_is_opened_once_and_the_cache_is_bounded_by_the_slots(platform, log):
    producer = Producer(config(max_slices=3), platform, 0)
    consumer = Consumer(0, platform, 0)
    outstanding = []
    for i in range(60):
        outstanding.append(producer.send(torch.arange(4.0) + i))
        if len(outstanding) == 3 or i == 59:  # three in flight: all slots in use
            for message in outstanding:
                consumer.receive(message)
            outstanding.clear()
            producer.reclaim()
    opens = [call for call in log.calls if call[0] == "open"]
    assert len(opens) == len({call[1] for call in opens}) == 3  # once per slot, never again
    assert len(log.opened) <= 3
    producer.close()
    consumer.close()


def test_an_opened_slot_event_is_kept_whatever_the_control_block_says_later(platform, log):
    """A slot's handle is written once; the consumer reads it once (not per message), so a
    later rewrite of the control block neither costs a read nor swaps the event it waits on."""
    producer = Producer(config(max_slices=1), platform, 0)
    consumer = Consumer(0, platform, 0)
    first = producer.send(torch.arange(4.0))
    handle = slot_event(producer, first)
    consumer.receive(first)
    producer.reclaim()
    producer.control.set_event(fields(first)["slot"], bytes(HANDLE_NBYTES))  # the driver refuses these
    second = producer.send(torch.arange(4.0) + 1)
    assert fields(second)["slot"] == fields(first)["slot"]
    assert consumer.receive(second).tolist() == [1.0, 2.0, 3.0, 4.0]
    waits = [call for call in log.calls if call[0] == "wait"]
    assert [call[1] for call in waits] == [handle, handle]
    assert [call[1] for call in log.calls if call[0] == "open"] == [handle]
    producer.close()
    consumer.close()


def test_opened_events_are_dropped_with_their_producer(platform, log):
    consumer = Consumer(0, platform, 0, max_producers=1)
    first = Producer(config(), platform, 0)
    consumer.receive(first.send(torch.arange(4.0)))
    gc.collect()
    assert len(log.opened) == 1
    second = Producer(config(), platform, 0)
    message = second.send(torch.arange(4.0))
    consumer.receive(message)  # evicts the first producer's entry
    gc.collect()
    assert [event.handle for event in log.opened] == [slot_event(second, message)]
    first.close()
    second.close()
    consumer.close()
    gc.collect()
    assert len(log.opened) == 0


def test_close_waits_for_the_last_copies_before_the_events_go(platform, log):
    producer = Producer(config(), platform, 0)
    producer.send(torch.arange(4.0))
    producer.send(torch.arange(4.0))
    producer.close()
    assert log.names().count("event-synchronize") == 2  # one per slot event made


def test_send_stores_each_slot_event_handle_once_in_the_control_block(platform, log):
    producer = Producer(config(max_slices=2), platform, 0)
    consumer = Consumer(0, platform, 0)
    for i in range(3):
        messages = [producer.send(torch.arange(4.0) + i) for _ in range(2)]  # both slots in flight
        for message in messages:
            assert slot_event(producer, message) in log.exported  # stored before the message left
            consumer.receive(message)
        producer.reclaim()
    assert producer.control.event_bytes == HANDLE_NBYTES and len(log.exported) == 2  # one per slot
    producer.close()
    consumer.close()


@pytest.mark.parametrize(("garble", "match"), [
    (lambda control, slot: control.set_event(slot, b"AAA"), "event handle of 3 bytes is not a fakeevents event handle"),
    (lambda control, slot: control.set_event(slot, bytes(HANDLE_NBYTES)), "cannot be opened: the driver refuses"),
    (lambda control, slot: control.cells.__setitem__(event_length_cell(control, slot), 400), "garbled"),
    (lambda control, slot: control.cells.__setitem__(event_length_cell(control, slot), -1), "garbled"),
    (lambda control, slot: control.cells.__setitem__(event_length_cell(control, slot), 0), "stored none"),
])
def test_bad_event_handles_in_the_control_block_are_transport_errors(platform, log, garble, match):
    producer = Producer(config(), platform, 0)
    consumer = Consumer(0, platform, 0)
    message = producer.send(torch.arange(16.0))
    slot = fields(message)["slot"]
    good_handle = slot_event(producer, message)
    assert good_handle is not None
    garble(producer.control, slot)
    with pytest.raises(TransportError, match=match):
        consumer.receive(message)
    # The slice is not acknowledged, so it is not recycled; with the handle back the message works.
    producer.control.set_event(slot, good_handle)
    assert consumer.receive(message).tolist() == list(range(16))
    producer.close()
    consumer.close()


def test_an_event_on_a_host_message_is_refused(platform, log):
    producer = Producer(config(), platform, 0)
    consumer = Consumer(0, platform, 0)
    big = torch.zeros(2 * MiB, dtype=torch.uint8)  # over the 1 MiB pool: host shared memory
    with pytest.warns(UserWarning, match="IPC pool full"):
        message = producer.send(big)
    assert fields(message)["kind"] == "host" and fields(message)["event"] is False
    with pytest.raises(TransportError, match="only pool messages carry an event"):
        consumer.receive(forge(message, event=True))
    producer.close()
    consumer.close()


def test_a_consumer_without_the_capability_refuses_an_event_it_cannot_wait_on(make_registry, log):
    make_registry(make_plugin(log, with_events=True))
    producer = Producer(config(), get_platform("fakeevents"), 0)
    message = producer.send(torch.arange(4.0))
    make_registry(make_plugin(log, with_events=False))  # the consumer's process: the platform without events
    consumer = Consumer(0, get_platform("fakeevents"), 0)
    with pytest.raises(TransportError, match="cannot open interprocess events"):
        consumer.receive(message)
    producer.close()
    consumer.close()


def test_fuzzed_event_fields_only_ever_raise_transport_errors(platform, log):
    producer = Producer(config(), platform, 0)
    consumer = Consumer(0, platform, 0)
    good = producer.send(torch.arange(64.0))
    rng = random.Random(18)
    junk: list[Any] = [None, 0, 1, -1, 2**70, 3.5, True, False, b"raw", [], {}, {"b64": "AAAA"}, "=", "A" * 88,
                       "true", "\u00e9" * 88]
    accepted = 0
    for _ in range(500):
        event = rng.choice(junk)
        try:
            got = consumer.receive(forge(good, event=event))
        except TransportError:
            continue
        accepted += 1
        assert type(event) is bool and got.tolist() == list(range(64))  # only a real flag is taken
    assert accepted > 0
    producer.close()
    consumer.close()


def test_a_copy_is_acknowledged_only_once_it_ran_on_the_device(platform, log):
    """The producer may overwrite a slice as soon as it is acknowledged, so a copy=True
    receive acknowledges only when its copy has run; a view is acknowledged at once."""
    producer = Producer(config(), platform, 0)
    consumer = Consumer(0, platform, 0)
    log.device_done = False  # copies queued from now on have not run yet
    consumer.receive(producer.send(torch.arange(4.0)))
    assert producer.reclaim() == 0
    consumer.receive(producer.send(torch.arange(4.0)), copy=False)
    assert producer.reclaim() == 1  # the view, not the pending copy
    log.device_done = True
    consumer.receive(producer.send(torch.arange(4.0)))  # checks the pending copy first
    assert producer.reclaim() == 2
    log.device_done = False
    consumer.receive(producer.send(torch.arange(4.0)))
    assert producer.reclaim() == 0
    assert consumer.flush_acks(wait=False) == 0 and producer.reclaim() == 0
    assert consumer.flush_acks() == 1 and producer.reclaim() == 1  # waits for the copy
    log.device_done = False
    consumer.receive(producer.send(torch.arange(4.0)))
    consumer.close()  # waits for copies in flight and acknowledges them
    assert producer.reclaim() == 1
    producer.close()


def test_earlier_copies_are_checked_only_once_this_copy_is_queued(platform, log):
    """Bookkeeping of earlier copies runs while the device runs this message's copy, not
    before the copy is queued (it would delay the tensor by that much)."""
    producer = Producer(config(), platform, 0)
    consumer = Consumer(0, platform, 0)
    log.device_done = False
    consumer.receive(producer.send(torch.arange(4.0)))  # its copy pending
    log.device_done = True
    start = len(log.calls)
    consumer.receive(producer.send(torch.arange(4.0)))
    names = [call[0] for call in log.calls[start:] if call[0] in ("wait", "copy-record", "copy-query")]
    assert names == ["wait", "copy-record", "copy-query", "copy-query"]  # queue, then both acks
    assert producer.reclaim() == 2
    producer.close()
    consumer.close()


# -- the CUDA plugin's mapping onto torch.cuda's interprocess events (a fake torch.cuda) ----


def cuda_plugin_with_fake_events(peer_access: bool = True, refuse: bool = False, handle_size: int = 64):
    from torchhal.plugins.cuda import CudaPlatform

    from .fakes import make_device_module

    module = make_device_module("cuda", count=2, peer_access=peer_access)

    class FakeCudaEvent:
        def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
            module.calls.append(("Event", interprocess, enable_timing))

        def ipc_handle(self) -> bytes:
            return b"h" * handle_size

        @classmethod
        def from_ipc_handle(cls, device: Any, handle: bytes) -> str:
            module.calls.append(("from_ipc_handle", device, handle))
            if refuse:
                raise RuntimeError("CUDA error: invalid resource handle")
            return "opened"

    module.Event = FakeCudaEvent
    plugin = CudaPlatform()
    plugin.__dict__["_device_module"] = module
    return plugin, module


def test_cuda_events_map_onto_torch_cuda_interprocess_events():
    plugin, module = cuda_plugin_with_fake_events()
    events = plugin.ipc_events()
    assert events is not None and events.handle_nbytes == 64
    event = events.new(1)
    assert module.calls[-3:] == [("device:enter", 1), ("Event", True, False), ("device:exit", 1)]  # no timing
    assert events.export(event) == b"h" * 64
    module.calls.clear()
    assert events.open(b"e" * 64, 0, 1) == "opened"
    # Opened on the consumer's device (peers allow), inside that device's context.
    assert module.calls[-3:] == [("device:enter", 1), ("from_ipc_handle", 1, b"e" * 64), ("device:exit", 1)]


def test_cuda_events_open_on_the_producer_device_without_peer_access():
    plugin, module = cuda_plugin_with_fake_events(peer_access=False)
    plugin.ipc_events().open(b"e" * 64, 0, 1)
    assert ("from_ipc_handle", 0, b"e" * 64) in module.calls


@pytest.mark.parametrize(("handle", "producer", "consumer", "match"), [
    (b"e" * 63, 0, 1, "is not 64 bytes"),
    (b"e" * 65, 0, 1, "is not 64 bytes"),
    ("e" * 64, 0, 1, "is not 64 bytes"),
    (b"e" * 64, 0, 2, "consumer device 2 is not a visible"),
    (b"e" * 64, -1, 1, "producer device -1 is not a visible"),
    (b"e" * 64, True, 1, "producer device True is not a visible"),
])
def test_cuda_event_open_checks_the_handle_before_the_driver_call(handle, producer, consumer, match):
    plugin, module = cuda_plugin_with_fake_events()
    with pytest.raises(IpcHandleError, match=match):
        plugin.ipc_events().open(handle, producer, consumer)
    assert "from_ipc_handle" not in [call[0] for call in module.calls]


def test_cuda_event_driver_refusals_and_odd_exports_are_ipc_handle_errors():
    plugin, _ = cuda_plugin_with_fake_events(refuse=True)
    with pytest.raises(IpcHandleError, match="invalid resource handle"):
        plugin.ipc_events().open(b"e" * 64, 0, 1)
    plugin, _ = cuda_plugin_with_fake_events(handle_size=32)
    events = plugin.ipc_events()
    with pytest.raises(IpcHandleError, match="is not 64 bytes"):
        events.export(events.new(0))


def test_a_cuda_event_class_without_ipc_means_no_events():
    plugin, module = cuda_plugin_with_fake_events()
    del module.Event.from_ipc_handle  # e.g. a torch without interprocess events
    assert plugin.ipc_events() is None
