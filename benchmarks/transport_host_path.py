"""Host work per transport message: µs per `Producer.send` and per `Consumer.receive`.

    python benchmarks/transport_host_path.py [--out results] [--messages 20000]

The Python the transport runs for each message, on whatever platform is current (the CPU
platform here: its pool is host shared memory, so a "copy" is a memcpy of a few bytes and
the figures are the transport's own host work). Producer and consumer share this process,
as the CPU platform allows; each send is received and acknowledged before the next, as in
a steady stream. A small tensor (16 floats), so the copy itself is negligible.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    parser.add_argument("--messages", type=int, default=20_000)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for outstanding in (1, 16, 256):
        measure(min(args.messages, 2000), outstanding)  # warm up
        results[f"outstanding_{outstanding}"] = measure(args.messages, outstanding)
        print(outstanding, results[f"outstanding_{outstanding}"], flush=True)
    write_json("transport_host_path", results, args.out)


if __name__ == "__main__":
    main()
