"""ipc (if declared): plain-data handles, opened on the consumer's device (contract 5)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch

from torchhal.platforms import IpcHandleError

from ._helpers import Spawned, memory_taken

pytestmark = pytest.mark.conformance("ipc")

PLAIN = (int, bytes, str, bool)


def not_refused(calls: dict[str, Callable[[], object]]) -> list[str]:
    """Each call that does not raise IpcHandleError, and what it did instead: an error that is not
    IpcHandleError is a crash, not a clear refusal."""
    problems = []
    for label, call in calls.items():
        try:
            call()
        except IpcHandleError:
            continue
        except Exception as exc:
            problems.append(f"{label}: raised {type(exc).__name__}: {exc} instead of IpcHandleError")
            continue
        problems.append(f"{label}: accepted")
    return problems


def consumer_device(platform, device_index):
    return (device_index + 1) % platform.device_count()


def sample_tensors(platform, device_index):
    device = platform.device(device_index)
    base = torch.arange(4096, dtype=torch.float32, device=device).reshape(64, 64)
    return [
        base,  # contiguous float32
        base[3:, 5::3],  # offset and stride
        base.t(),  # transposed
        torch.arange(100, dtype=torch.int64, device=device)[10:],
        (torch.arange(300, device=device) % 7).to(torch.uint8),
        torch.linspace(-2, 2, 257, device=device).to(torch.bfloat16),
    ]


def test_handles_are_plain_data(platform, device_index):
    handle = platform.ipc_support.share(torch.ones(16, device=platform.device(device_index)))
    assert all(isinstance(field, PLAIN) for field in handle.storage), handle.storage
    assert isinstance(handle.dtype, str) and all(isinstance(v, int) for v in handle.shape + handle.stride)


def test_round_trip_across_processes(platform, device_index, measure):
    tensors = sample_tensors(platform, device_index)
    handles = [platform.ipc_support.share(t) for t in tensors]
    platform.synchronize(device_index)
    consumer = consumer_device(platform, device_index)
    from ._workers import open_handles

    with Spawned(open_handles, platform.name, consumer, handles) as spawned:
        results = spawned.answer("IPC consumer")
    measure["consumer_device"] = consumer
    for tensor, got in zip(tensors, results, strict=True):
        assert got["device_type"] == platform.device_type
        assert got["device_index"] == consumer, "the consumer's tensor must be on its own device"
        assert got["values"] == tensor.to("cpu", torch.float64).flatten().tolist()


def test_no_context_on_the_producer_device(platform, device_index, measure):
    if platform.device_count() < 2:
        pytest.skip("not applicable: one device, so producer and consumer share it")
    if not platform.ipc_support.peer_redirect:
        pytest.skip("undeclared: the platform does not declare peer-redirected opens")
    from ._workers import open_and_hold

    tensor = torch.ones(1 << 20, device=platform.device(device_index))
    handle = platform.ipc_support.share(tensor)
    platform.synchronize(device_index)
    consumer = consumer_device(platform, device_index)
    total, lost_mib = memory_taken(platform, device_index, open_and_hold, platform.name, consumer, handle)
    assert total == float(1 << 20)
    measure["producer_device_mib_used_by_consumer"] = lost_mib
    assert lost_mib < 64, f"the consumer created {lost_mib:.0f} MiB on the producer's device"


def test_malformed_handles_are_rejected(platform, device_index):
    good = platform.ipc_support.share(torch.zeros(8, 8, device=platform.device(device_index)))
    bad_handles = {
        "offset past the storage": dataclasses.replace(good, offset_bytes=good.storage_nbytes),
        "shape past the storage": dataclasses.replace(good, shape=(64, 64), stride=(64, 1)),
        "unknown dtype": dataclasses.replace(good, dtype="float1024"),
        "negative shape": dataclasses.replace(good, shape=(-8, 8)),
        "overflowing shape": dataclasses.replace(good, shape=(2**62, 2**62)),
        "misaligned offset": dataclasses.replace(good, offset_bytes=1),
        "stride/shape mismatch": dataclasses.replace(good, stride=(1,)),
    }
    open_handle = platform.ipc_support.open
    assert not_refused({label: functools.partial(open_handle, handle, device_index)
                        for label, handle in bad_handles.items()}) == []


def test_producer_exit_does_not_crash_the_consumer(platform, device_index):
    from ._workers import share_then_exit

    with Spawned(share_then_exit, platform.name, device_index) as producer:
        opened = platform.ipc_support.open(producer.answer("IPC producer"), device_index)
        copy = opened.clone()
        platform.synchronize(device_index)
        assert producer.finish() == 0
    # The consumer keeps working: its own copy is intact and new device work runs.
    assert float(copy.sum().to("cpu")) == float(sum(range(1024)))
    assert float((torch.ones(16, device=platform.device(device_index)) * 2).sum().to("cpu")) == 32.0
    del opened


def events_or_skip(platform):
    events = platform.ipc_support.events
    if events is None:
        pytest.skip("undeclared: the platform declares no interprocess events (IpcSupport.events)")
    return events


def test_interprocess_event_handles_are_plain_bytes_and_checked(platform, device_index):
    events = events_or_skip(platform)
    event = events.new(device_index)
    event.record(platform.current_stream(device_index))
    handle = events.export(event)
    assert isinstance(handle, bytes) and len(handle) == events.handle_nbytes
    bad = {"short": handle[:-1], "long": handle + b"\0", "not bytes": handle.hex()}
    opens = {label: functools.partial(events.open, value, device_index, device_index) for label, value in bad.items()}
    opens["device past the last"] = functools.partial(events.open, handle, device_index, platform.device_count())
    assert not_refused(opens) == []
    event.synchronize()


def test_a_consumer_stream_waits_on_the_producer_event_across_processes(platform, device_index, measure):
    events = events_or_skip(platform)
    device = platform.device(device_index)
    tensor = torch.zeros(1 << 20, device=device)
    handle = platform.ipc_support.share(tensor)
    tensor.fill_(3.0)  # queued: the consumer must wait for it through the event
    event = events.new(device_index)
    event.record(platform.current_stream(device_index))
    consumer = consumer_device(platform, device_index)
    from ._workers import wait_event_then_read

    with Spawned(wait_event_then_read, platform.name, consumer, device_index, handle, events.export(event)) as spawned:
        total = spawned.answer("IPC event consumer")
    measure["consumer_device"] = consumer
    assert total == 3.0 * (1 << 20)
