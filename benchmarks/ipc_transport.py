"""IPC transport on two GPUs: context MiB on the producer GPU, throughput, flat memory.

    python benchmarks/ipc_transport.py [--out results] [--transfers 10000]

Producer on GPU 0 (this process); consumer processes on GPU 1.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _harness import write_json  # noqa: E402

import torchhal  # noqa: E402
from torchhal.core.transport import Consumer, Producer, TransportConfig  # noqa: E402

MiB = 1 << 20


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
        kind, payload = item
        if kind == "message":
            tensor = consumer.receive(payload)
        elif kind == "host":  # torch.multiprocessing host tensor
            tensor = payload.to(platform.device(device), non_blocking=False)
        platform.synchronize(device)
        outbox.put(("done", float(tensor.view(-1)[-1].float().item()), torch.cuda.memory_reserved(device)))


def smi_mib(pid: int) -> dict[int, int]:
    from tests.gpu_helpers import mib_per_process

    return {gpu: mib for (p, gpu), mib in mib_per_process().items() if p == pid}


def start_consumer(ctx, redirect: bool, queue_ctx):
    inbox, outbox = queue_ctx.Queue(), queue_ctx.Queue()
    proc = ctx.Process(target=consumer_loop, args=(redirect, inbox, outbox))
    proc.start()
    _, pid, _ = outbox.get(timeout=180)
    return proc, inbox, outbox, pid


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    parser.add_argument("--transfers", type=int, default=10_000)
    args = parser.parse_args()
    platform = torchhal.get_platform("cuda")
    platform.set_device(0)
    ctx = mp.get_context("spawn")
    tmp = __import__("torch.multiprocessing", fromlist=["get_context"]).get_context("spawn")
    results: dict = {"context_mib_on_producer_gpu": {}, "throughput": [], "flat": {}}

    producer = Producer(TransportConfig(budget_bytes=1 << 30, consumers=1), platform, 0)
    # 1. context on the producer's GPU, redirected vs torch's default open
    for redirect in (True, False):
        proc, inbox, outbox, pid = start_consumer(ctx, redirect, tmp)
        value = torch.arange(MiB, dtype=torch.float32, device="cuda:0")
        inbox.put(("message", producer.send(value)))
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

    # 2. throughput: transport vs host tensors through torch.multiprocessing
    proc, inbox, outbox, pid = start_consumer(ctx, True, tmp)
    for size_mib in (1, 4, 16, 64):
        tensor = torch.randn(size_mib * MiB // 4, device="cuda:0")
        timings = {"transport": [], "torch_mp_host": []}
        for _ in range(12):
            for mode in timings:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if mode == "transport":
                    inbox.put(("message", producer.send(tensor)))
                else:
                    inbox.put(("host", tensor.cpu()))
                outbox.get(timeout=120)
                timings[mode].append(time.perf_counter() - t0)
                producer.reclaim()
        row = {"mib": size_mib}
        for mode, samples in timings.items():
            median = statistics.median(samples[2:])
            row[f"{mode}_ms"] = median * 1e3
            row[f"{mode}_gib_s"] = size_mib / 1024 / median
        row["speedup"] = row["torch_mp_host_ms"] / row["transport_ms"]
        print(row, flush=True)
        results["throughput"].append(row)

    # 3. memory flat over many transfers
    torch.cuda.synchronize()
    reserved_start = torch.cuda.memory_reserved(0)
    consumer_reserved = []
    small = torch.randn(16 * 1024, device="cuda:0")
    for i in range(args.transfers):
        inbox.put(("message", producer.send(small)))
        _, _, reserved = outbox.get(timeout=60)
        if i % 1000 == 0:
            consumer_reserved.append(reserved)
    producer.reclaim()
    results["flat"] = {
        "transfers": args.transfers,
        "producer_reserved_start_end": [reserved_start, torch.cuda.memory_reserved(0)],
        "consumer_reserved_every_1000": consumer_reserved,
        "pool_free_bytes_end": producer.free_bytes,
        "pool_bytes": producer.pool_bytes,
        "pool_free_fragments_end": len(producer._free),
    }
    print(results["flat"], flush=True)
    inbox.put(None)
    proc.join(60)
    producer.close()
    write_json("ipc_transport", results, args.out)


if __name__ == "__main__":
    main()
