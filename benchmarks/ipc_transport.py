"""IPC transport on two GPUs, against its anchors: in-process GPU0 -> GPU1 copy and
torch.multiprocessing CUDA tensor sharing.

    python benchmarks/ipc_transport.py [--out results] [--transfers 10000] [--repeats 20]

Producer on GPU 0 (this process); consumer processes on GPU 1. Reports, in one run:
- MiB a consumer takes on the producer GPU (redirected open vs torch's default open);
- per size (4 KiB .. 256 MiB): in-process cuda:0 -> cuda:1 copy; torchhal transport with
  copy=True and copy=False (producer send -> consumer tensor ready, round trip); the
  torch.multiprocessing path engines use (a CUDA tensor through a torch.multiprocessing
  queue, the consumer copies it to its GPU); ratios against both anchors; and the
  transport with interprocess events off (`send` host-synchronizes its copy: the path
  before them, and the path of platforms without them);
- where the transport's time goes: producer `send`, consumer `receive`, and
  `consumer_wait` (the consumer synchronizes its stream, which waits on the producer's
  interprocess event then runs the copy: "tensor ready"; a stream, not device, synchronize);
- small messages: latency vs a torch.multiprocessing queue round trip of a small object,
  and the round trip of a transport message the consumer only gets (its queue hop alone);
- memory over --transfers transfers (producer and consumer reserved, pool fragments).
Finishes in a few minutes on 2 x H200 (goal: < 8 min).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _harness import write_json  # noqa: E402

import torchhal  # noqa: E402
from torchhal.core.transport import Consumer, Producer, TransportConfig  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
SMALL = [s for s in SIZES if s <= MiB]
#: round trips per transport mode before the sizes are timed (covers the slots a run cycles through)
WARMUP_ROUND_TRIPS = 128


def consumer_loop(redirect: bool, inbox, outbox, device: int = 1) -> None:
    import os

    platform = torchhal.get_platform("cuda")
    platform.set_device(device)
    if not redirect:
        platform.set_ipc_peer_redirect(False)  # torch's default open, on the producer's device
    torch.ones(1, device=platform.device(device))
    consumer = Consumer(0, platform, device)
    outbox.put(("ready", os.getpid(), None))
    while True:
        item = inbox.get()
        if item is None:
            break
        kind, payload = item[0], item[1]
        t0 = time.perf_counter()
        if kind == "message":  # torchhal transport, copy=True
            tensor = consumer.receive(payload)
        elif kind == "view":  # torchhal transport, copy=False
            tensor = consumer.receive(payload, copy=False)
        elif kind == "cuda":  # torch.multiprocessing CUDA tensor: copy to this GPU (what engines do)
            tensor = payload.to(platform.device(device))
        elif kind == "host":  # torch.multiprocessing host tensor
            tensor = payload.to(platform.device(device), non_blocking=False)
        elif kind == "ping":  # a small Python object: the queue's own round trip
            outbox.put(("pong", payload, None))
            continue
        elif kind == "echo":  # a transport message, not received: its queue hop alone
            outbox.put(("pong", None, None))
            continue
        elif kind == "flush":  # acknowledge the copies still pending (each is acked at the next receive)
            outbox.put(("flushed", consumer.flush_acks(), None))
            continue
        t1 = time.perf_counter()
        platform.current_stream(device).synchronize()  # the tensor is ready in this stream's order
        t2 = time.perf_counter()
        if len(item) > 2 and item[2] == "check":  # correctness, outside the timed path
            outbox.put(("checked", float(tensor.reshape(-1)[-1].float().item()), None))
        elif len(item) > 2 and item[2] == "stats":
            outbox.put(("stats", None, torch.cuda.memory_reserved(device)))
        else:
            outbox.put(("done", (t1 - t0, t2 - t1), None))
        del tensor


def smi_mib(pid: int) -> dict[int, int]:
    from tests.gpu_helpers import mib_per_process

    return {gpu: mib for (p, gpu), mib in mib_per_process().items() if p == pid}


def start_consumer(ctx, redirect: bool, queue_ctx):
    inbox, outbox = queue_ctx.Queue(), queue_ctx.Queue()
    proc = ctx.Process(target=consumer_loop, args=(redirect, inbox, outbox))
    proc.start()
    _, pid, _ = outbox.get(timeout=180)
    return proc, inbox, outbox, pid


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def gib_s(nbytes: int, ms: float) -> float:
    return nbytes / (1 << 30) / (ms / 1e3)


def in_process_copy_ms(nbytes: int, repeats: int) -> float:
    """Anchor 1: cuda:0 -> cuda:1 copy of the same size in this process."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0").random_(0, 255)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    samples = []
    for i in range(repeats + 3):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(1)
        if i >= 3:
            samples.append(time.perf_counter() - t0)
    del src, dst
    return median_ms(samples)


def queue_round_trip_ms(inbox, outbox, item: Any, repeats: int = 200, warmups: int = 10) -> float:
    """Median round trip of `item` through the consumer's queues (it answers without receiving)."""
    samples = []
    for i in range(repeats + warmups):
        t0 = time.perf_counter()
        inbox.put(item)
        outbox.get(timeout=60)
        if i >= warmups:
            samples.append(time.perf_counter() - t0)
    return median_ms(samples)


def round_trips(inbox, outbox, make_item, repeats: int, producer: Producer | None = None) -> dict[str, Any]:
    """Median round trip (send -> consumer tensor ready -> reply) and its parts."""
    total, send, receive, wait = [], [], [], []
    for i in range(repeats + 3):
        if producer is not None:
            producer.reclaim()
        torch.cuda.synchronize(0)
        t0 = time.perf_counter()
        item = make_item()
        t1 = time.perf_counter()
        inbox.put(item)
        _, parts, _ = outbox.get(timeout=120)
        t2 = time.perf_counter()
        if i >= 3:
            total.append(t2 - t0)
            send.append(t1 - t0)
            receive.append(parts[0])
            wait.append(parts[1])
    return {"ms": median_ms(total), "send_ms": median_ms(send), "consumer_receive_ms": median_ms(receive),
            "consumer_wait_ms": median_ms(wait)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    parser.add_argument("--transfers", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    started = time.perf_counter()
    platform = torchhal.get_platform("cuda")
    platform.set_device(0)
    ctx = mp.get_context("spawn")
    tmp = __import__("torch.multiprocessing", fromlist=["get_context"]).get_context("spawn")
    results: dict[str, Any] = {"context_mib_on_producer_gpu": {}, "sizes": [], "small_latency": {}, "flat": {},
                               "peer_access_0_1": torch.cuda.can_device_access_peer(0, 1)}

    producer = Producer(TransportConfig(budget_bytes=1 << 30, consumers=1), platform, 0)
    # The path without interprocess events, for comparison (each send host-synchronizes its copy).
    synced = Producer(TransportConfig(budget_bytes=1 << 30, consumers=1, interprocess_events=False), platform, 0)
    ipc = platform.ipc_support
    results["interprocess_events"] = ipc is not None and ipc.events is not None
    # 1. context on the producer's GPU, redirected vs torch's default open
    for redirect in (True, False):
        proc, inbox, outbox, pid = start_consumer(ctx, redirect, tmp)
        value = torch.arange(MiB, dtype=torch.float32, device="cuda:0")
        inbox.put(("message", producer.send(value), "check"))
        status, last, _ = outbox.get(timeout=120)
        time.sleep(1.0)
        usage = smi_mib(pid)
        results["context_mib_on_producer_gpu"]["redirected" if redirect else "default_open"] = {
            "gpu0_mib": usage.get(0, 0), "gpu1_mib": usage.get(1, 0), "data_correct": last == float(MiB - 1),
        }
        print("context", redirect, usage, last, flush=True)
        inbox.put(None)
        proc.join(60)
        producer.reclaim()

    # 2. per size: anchors and the transport (one transport consumer, one torch.multiprocessing consumer)
    proc, inbox, outbox, pid = start_consumer(ctx, True, tmp)
    mp_proc, mp_inbox, mp_outbox, mp_pid = start_consumer(ctx, True, tmp)
    # Steady state, as in an engine: the consumer opens each slot's interprocess event once
    # (~0.1 ms), and the first size row would otherwise pay it on every new slot it touches.
    warm = torch.ones(1024, device="cuda:0")
    for sender, kind in ((producer, "message"), (producer, "view"), (synced, "message")):
        round_trips(inbox, outbox, lambda s=sender, k=kind: (k, s.send(warm)), WARMUP_ROUND_TRIPS, sender)
    results["warmup_round_trips_per_mode"] = WARMUP_ROUND_TRIPS
    for nbytes in SIZES:
        tensor = torch.arange(nbytes // 4, dtype=torch.float32, device="cuda:0")
        inbox.put(("message", producer.send(tensor), "check"))
        expected = float(tensor[-1])  # float32 rounds arange's last value above 2**24
        correct = outbox.get(timeout=120)[1] == expected
        mp_inbox.put(("cuda", tensor, "check"))
        mp_correct = mp_outbox.get(timeout=120)[1] == expected
        row: dict[str, Any] = {"bytes": nbytes, "data_correct": correct and mp_correct}
        row["in_process_copy_ms"] = in_process_copy_ms(nbytes, args.repeats)
        row["transport_copy"] = round_trips(inbox, outbox, lambda t=tensor: ("message", producer.send(t)),
                                            args.repeats, producer)
        row["transport_view"] = round_trips(inbox, outbox, lambda t=tensor: ("view", producer.send(t)),
                                            args.repeats, producer)
        row["transport_copy_host_sync"] = round_trips(
            inbox, outbox, lambda t=tensor: ("message", synced.send(t)), args.repeats, synced
        )
        row["torch_mp_cuda"] = round_trips(mp_inbox, mp_outbox, lambda t=tensor: ("cuda", t), args.repeats)
        for key in ("transport_copy", "transport_view", "transport_copy_host_sync", "torch_mp_cuda"):
            row[key]["gib_s"] = gib_s(nbytes, row[key]["ms"])
        row["in_process_copy_gib_s"] = gib_s(nbytes, row["in_process_copy_ms"])
        row["transport_copy_vs_in_process"] = row["in_process_copy_ms"] / row["transport_copy"]["ms"]
        row["transport_copy_vs_torch_mp"] = row["torch_mp_cuda"]["ms"] / row["transport_copy"]["ms"]
        row["transport_view_vs_torch_mp"] = row["torch_mp_cuda"]["ms"] / row["transport_view"]["ms"]
        row["events_speedup_copy"] = row["transport_copy_host_sync"]["ms"] / row["transport_copy"]["ms"]
        print(row, flush=True)
        results["sizes"].append(row)
        producer.reclaim()
        synced.reclaim()
        del tensor
    time.sleep(1.0)
    results["context_mib_on_producer_gpu"]["torch_mp_cuda"] = {"gpu0_mib": smi_mib(mp_pid).get(0, 0)}
    results["context_mib_on_producer_gpu"]["transport_consumer"] = {"gpu0_mib": smi_mib(pid).get(0, 0)}

    # 3. small messages: transport latency vs a torch.multiprocessing queue round trip of a small object
    queue_ms = queue_round_trip_ms(inbox, outbox, ("ping", 0))
    message = producer.send(torch.ones(KiB, device="cuda:0"))
    echo_ms = queue_round_trip_ms(inbox, outbox, ("echo", message))
    inbox.put(("view", message))  # received (and so acknowledged) once: its slice is recycled as usual
    outbox.get(timeout=60)
    results["small_latency"] = {"torch_mp_queue_round_trip_ms": queue_ms,
                                "message_queue_round_trip_ms": echo_ms, "by_size": []}
    for row in results["sizes"]:
        if row["bytes"] in SMALL:
            results["small_latency"]["by_size"].append({
                "bytes": row["bytes"],
                "transport_copy_ms": row["transport_copy"]["ms"],
                "transport_view_ms": row["transport_view"]["ms"],
                "transport_copy_vs_queue": row["transport_copy"]["ms"] / queue_ms,
                "transport_view_vs_queue": row["transport_view"]["ms"] / queue_ms,
            })
    print(results["small_latency"], flush=True)

    # 4. memory flat over many transfers (copy and view alternating, sizes cycling)
    torch.cuda.synchronize()
    reserved_start = torch.cuda.memory_reserved(0)
    consumer_reserved = []
    payloads = [torch.randn(n // 4, device="cuda:0") for n in (4 * KiB, 64 * KiB, 1 * MiB, 4 * KiB + 512)]
    flat_started = time.perf_counter()
    for i in range(args.transfers):
        kind = "message" if i % 2 else "view"
        stats = i % 1000 == 0
        inbox.put((kind, producer.send(payloads[i % len(payloads)]), "stats" if stats else ""))
        _, _, reserved = outbox.get(timeout=60)
        if stats:
            consumer_reserved.append(reserved)
    inbox.put(("flush", None))
    outbox.get(timeout=60)
    producer.reclaim()
    results["flat"] = {
        "transfers": args.transfers,
        "seconds": time.perf_counter() - flat_started,
        "producer_reserved_start_end": [reserved_start, torch.cuda.memory_reserved(0)],
        "consumer_reserved_every_1000": consumer_reserved,
        "pool_free_bytes_end": producer.free_bytes,
        "pool_bytes": producer.pool_bytes,
        "pool_free_fragments_end": len(producer._free),
    }
    print(results["flat"], flush=True)
    for queue, process in ((inbox, proc), (mp_inbox, mp_proc)):
        queue.put(None)
        process.join(60)
    producer.close()
    synced.close()
    results["seconds"] = time.perf_counter() - started
    write_json("ipc_transport", results, args.out)


if __name__ == "__main__":
    main()
