"""Processes for the transport tests (spawned, so importable at top level). Plain data out."""

import warnings

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
            same_dtype = tensor.dtype == getattr(torch, message["dtype"])
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
    # exit without close(): as a crashed worker would
