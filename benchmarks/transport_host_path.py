"""Host work per transport message: µs per `Producer.send` and per `Consumer.receive`,
and the queue hop of the message between processes.

    python benchmarks/transport_host_path.py [--out results] [--messages 20000] [--round-trips 2000]

The Python the transport runs for each message, on whatever platform is current (the CPU
platform here: its pool is host shared memory, so a "copy" is a memcpy of a few bytes and
the figures are the transport's own host work). Producer and consumer share this process,
as the CPU platform allows; each send is received and acknowledged before the next, as in
a steady stream. A small tensor (16 floats), so the copy itself is negligible.

`queue`: the message on the wire, through the queues `ipc_transport.py` uses
(torch.multiprocessing, spawn) to a consumer process: its pickled size and pickling /
unpickling time, and median round trips (put -> the consumer gets it -> reply -> get) of a
small object (`ping`), of a message the consumer only gets (`echo`), and of the whole path
(`send` -> put -> the consumer's `receive` -> reply: `transport`), with the consumer's
`receive` time inside it. `busy_ping`: the producer computes (a Python busy loop as long as
a `send`) before putting a small object: the same hop with the same host work before it
and none of the transport's, to tell the hop's cost from the message's.
"""

from __future__ import annotations

import argparse
import io
import pickle
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _harness import write_json  # noqa: E402

from torchhal.core.transport import Consumer, Producer, TransportConfig  # noqa: E402

QUEUE_TENSOR_FLOATS = 1024  # 4 KiB: the smallest size of the GPU benchmark


def measure(messages: int, outstanding: int) -> dict[str, float]:
    """Median µs per send and per receive over rounds of `outstanding` messages in flight."""
    producer = Producer(TransportConfig(budget_bytes=0, pool_floor_bytes=1 << 20))
    consumer = Consumer(0)
    tensor = torch.arange(16, dtype=torch.float32)
    send_us: list[float] = []
    receive_us: list[float] = []
    for _ in range(max(messages // outstanding, 1)):
        t0 = time.perf_counter()
        batch = [producer.send(tensor) for _ in range(outstanding)]
        t1 = time.perf_counter()
        for message in batch:
            consumer.receive(message)
        t2 = time.perf_counter()
        send_us.append((t1 - t0) / outstanding * 1e6)
        receive_us.append((t2 - t1) / outstanding * 1e6)
    producer.close()
    consumer.close()
    return {"send_us": statistics.median(send_us), "receive_us": statistics.median(receive_us)}


def consumer_loop(inbox: Any, outbox: Any) -> None:
    """The consumer process: `receive` a message, or only get it (`echo`, `ping`), and reply."""
    consumer = Consumer(0)
    outbox.put(("ready", 0.0))
    while True:
        item = inbox.get()
        if item is None:
            break
        t0 = time.perf_counter()
        if item[0] == "message":
            consumer.receive(item[1])
        outbox.put(("done", time.perf_counter() - t0))
    consumer.close()


def pickling(message: Any, number: int = 20_000) -> dict[str, float]:
    """Bytes and µs to pickle (the queue's pickler) and unpickle one queue item carrying `message`."""
    from multiprocessing.reduction import ForkingPickler  # torch.multiprocessing registers its reducers on it

    item = ("message", message)

    def dumps() -> bytes:
        buffer = io.BytesIO()
        ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(item)
        return buffer.getvalue()

    data = dumps()
    t0 = time.perf_counter()
    for _ in range(number):
        dumps()
    t1 = time.perf_counter()
    for _ in range(number):
        pickle.loads(data)
    t2 = time.perf_counter()
    return {"bytes": len(data), "pickle_us": (t1 - t0) / number * 1e6, "unpickle_us": (t2 - t1) / number * 1e6}


def queue_round_trips(round_trips: int, repeats: int = 3) -> dict[str, Any]:
    """Median µs per round trip through torch.multiprocessing queues (spawn, as ipc_transport.py)."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    process = ctx.Process(target=consumer_loop, args=(inbox, outbox))
    process.start()
    outbox.get(timeout=180)
    producer = Producer(TransportConfig(budget_bytes=0, pool_floor_bytes=1 << 20))
    tensor = torch.arange(QUEUE_TENSOR_FLOATS, dtype=torch.float32)
    message = producer.send(tensor)
    inbox.put(("message", message))  # the consumer opens the producer once, outside the timing
    outbox.get(timeout=60)

    def timed(make_item: Any) -> dict[str, float]:
        total, remote = [], []
        for i in range(round_trips + 50):
            t0 = time.perf_counter()
            inbox.put(make_item())
            _, inside = outbox.get(timeout=60)
            if i >= 50:
                total.append(time.perf_counter() - t0)
                remote.append(inside)
        return {"round_trip_us": statistics.median(total) * 1e6, "consumer_us": statistics.median(remote) * 1e6}

    send_s = []
    for _ in range(200):
        t0 = time.perf_counter()
        sent = producer.send(tensor)
        send_s.append(time.perf_counter() - t0)
        inbox.put(("message", sent))
        outbox.get(timeout=60)
    busy_s = statistics.median(send_s)

    def busy_ping() -> tuple[str, int]:
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            pass
        return ("ping", 1)

    # Interleaved, repeated: the host is shared, so each kind sees the same drift.
    runs: dict[str, list[dict[str, float]]] = {"ping": [], "echo": [], "busy_ping": [], "transport": []}
    for _ in range(repeats):
        runs["ping"].append(timed(lambda: ("ping", 1)))
        runs["echo"].append(timed(lambda: ("echo", message)))
        runs["busy_ping"].append(timed(busy_ping))
        runs["transport"].append(timed(lambda: ("message", producer.send(tensor))))
        producer.reclaim()
    inbox.put(None)
    process.join(60)
    producer.close()
    out: dict[str, Any] = {"tensor_bytes": tensor.numel() * 4, "pickled": pickling(message),
                           "busy_us": busy_s * 1e6}
    for kind, samples in runs.items():
        out[kind] = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
    out["transport_vs_ping"] = out["transport"]["round_trip_us"] / out["ping"]["round_trip_us"]
    out["echo_vs_ping"] = out["echo"]["round_trip_us"] / out["ping"]["round_trip_us"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--round-trips", type=int, default=2000)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    results["queue"] = queue_round_trips(args.round_trips)
    print("queue", results["queue"], flush=True)
    for outstanding in (1, 16, 256):
        measure(min(args.messages, 2000), outstanding)  # warm up
        results[f"outstanding_{outstanding}"] = measure(args.messages, outstanding)
        print(outstanding, results[f"outstanding_{outstanding}"], flush=True)
    write_json("transport_host_path", results, args.out)


if __name__ == "__main__":
    main()
