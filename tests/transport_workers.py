"""Processes for the transport tests (spawned, so importable at top level). Plain data out."""

import os
import warnings
import weakref

import torch

import torchhal
from torchhal.core.transport import Consumer, Producer, TransportConfig, TransportError


def consume(rank, inbox, outbox, copy=True, copy_stream=False, device=None):
    platform = torchhal.current_platform()
    if device is not None:
        platform.set_device(device)
    consumer = Consumer(rank, platform, device_index=device, copy_stream=copy_stream)
    while True:
        message = inbox.get(timeout=120)
        if message is None:
            break
        try:
            tensor = consumer.receive(message, copy=copy)
            same_dtype = tensor.dtype == getattr(torch, fields(message)["dtype"])
            outbox.put(("ok", rank, same_dtype, tensor.to(torch.float64).flatten().tolist()))
        except TransportError as exc:
            outbox.put(("error", rank, False, str(exc)))
    consumer.close()


def produce_then_exit(outbox, release, with_host_block=False):
    producer = Producer(TransportConfig(budget_bytes=0, pool_floor_bytes=1 << 20))
    if with_host_block:  # a tensor over the 1 MiB pool leaves a host block too
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            producer.send(torch.zeros(2 << 20, dtype=torch.uint8))
    outbox.put(producer.send(torch.arange(16, dtype=torch.float32)))
    release.wait(60)
    # Crash: no close(), and no interpreter exit either (its finalizers unlink the files).
    os._exit(0)


# -- the wire record, for tests that read or forge messages -----------------------------------

def fields(message):
    """A wire message as a dict of its named fields (no validation: it may be forged)."""
    from torchhal.core.transport.messages import WIRE_FIELDS

    return dict(zip(WIRE_FIELDS, message, strict=True))


def forge(message, **changes):
    """The wire message with `changes` to its named fields (as a hostile sender would)."""
    from torchhal.core.transport.messages import WIRE_FIELDS

    values = {**fields(message), **changes}
    return tuple(values[name] for name in WIRE_FIELDS)


def forge_handle_record(producer, change):
    """Replace `producer`'s control block by one whose pool handle record is `change(plain data)`,
    with a matching fingerprint (a hostile producer process can write its own block): the
    generations, acknowledgements and event handles are carried over. Call before any
    consumer opened the producer."""
    import json

    from torchhal.core.transport._shm import Control

    old = producer.control
    data = json.loads(old.handle_record())
    change(data)
    record = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    slots, consumers, pool_bytes, event_bytes = old.slots, old.consumers, old.pool_bytes, old.event_bytes
    cells = list(old.cells[Control.HEADER : Control.HEADER + 2 * slots + slots * consumers])
    events = bytes(old._raw[old._event_start : old._handle_start])
    old.close(unlink=True)
    new = Control.create(producer.pool_id, slots, consumers, pool_bytes, record, event_bytes)
    for i, value in enumerate(cells):
        new.cells[Control.HEADER + i] = value
    new._raw[new._event_start : new._event_start + len(events)] = events
    producer.control = new
    # The producer's finalizer unlinks the block it was made with: now this one.
    from torchhal.core.transport.producer import _unlink_files

    producer._unlink_files.detach()
    producer._unlink_files = weakref.finalize(producer, _unlink_files, new, producer._host_blocks, os.getpid())
