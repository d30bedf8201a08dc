"""Seeded, bounded fuzzing of the IPC transport's `Consumer.receive` and the CPU platform's
`ipc_open` against real shared-memory pools.

    python scripts/fuzz_transport.py --cases 1000000 [--seed 0]

Each case mutates a valid message (or handle) and asserts:
- only the documented error type escapes (`TransportError`, or `IpcHandleError` for `ipc_open`);
- an accepted message yields exactly the elements of the bytes it names
  ([offset, offset + nbytes) of its slice), and a zero-copy view lies inside them;
- /dev/shm files of this process do not grow by more than SHM_BOUND bytes and the
  process's memory maps by more than MAPS_BOUND entries;
- symlinked or foreign files are never opened for writing (their contents stay intact).
A crash (SIGSEGV) ends the process: run it in a subprocess (the CI test does).
Prints one JSON line with the counts; exits 1 on the first violated assertion.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import torchhal  # noqa: E402
from torchhal.core.transport import (  # noqa: E402
    MAX_OPEN_PRODUCERS,
    Consumer,
    Producer,
    TensorMessage,
    TransportConfig,
    TransportError,
)
from torchhal.core.transport.messages import WIRE_FIELDS  # noqa: E402
from torchhal.platforms import IpcHandleError  # noqa: E402
from torchhal.platforms.ipc import DTYPES  # noqa: E402

MiB = 1 << 20
SHM_BOUND = 1 * MiB  # growth of this process's /dev/shm files over the whole run
MAPS_BOUND = 2 * MAX_OPEN_PRODUCERS + 32  # growth of /proc/self/maps entries over the whole run
SHM_DIR = "/dev/shm"

JUNK: list[Any] = [None, -1, 0, 1, 3.5, "x", "", [], {}, True, [1, -2], {"b64": "!!"}, 2**31, 2**48, 2**70,
                   "é\x00/..", "a" * 5000, [2**62, 2**62], {"b64": "AAAA"}]
SIZES = [0, 1, 2, 3, 4, 7, 8, 64, 511, 512, 513, 4096, MiB - 4, MiB, MiB + 4, 2**31, 4 << 30, 2**47, 2**48]
NAMES = [b"/torch_1_2_3", b"/../etc/passwd", b"/torch_" + b"9" * 30 + b"_1_1", b"", b"\x00", b"/" + b"a" * 300,
         b"/torch_1_2_3\x00x", "/tmp/é".encode(), b"/tmp/evil.sock", b"/tmp/torch-shm-dir-AAAAAA/manager.sock"]


def own_shm_bytes() -> int:
    """Bytes of /dev/shm files this process created (torch's and the transport's)."""
    pid = str(os.getpid())
    total = 0
    for name in os.listdir(SHM_DIR):
        if name.startswith((f"torch_{pid}_", f"torchhal-{pid}-")):
            try:
                total += os.lstat(os.path.join(SHM_DIR, name)).st_size
            except OSError:
                pass
    return total


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Elements as raw bytes (bit-exact, NaN-safe, any dtype)."""
    fresh = torch.empty(tensor.numel(), dtype=tensor.dtype)
    fresh.copy_(tensor.reshape(-1))
    return fresh.view(torch.uint8)


def map_count() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


class Fuzzer:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.platform = torchhal.get_platform("cpu")
        config = TransportConfig(budget_bytes=0, pool_floor_bytes=MiB, max_slices=64)
        self.producer = Producer(config, self.platform)
        self.other = Producer(config, self.platform)  # a second live producer: its names are not ours
        self.consumer = Consumer(0, self.platform)
        self.good: list[tuple[Any, ...]] = []
        for tensor in (torch.arange(256.0).reshape(16, 16), torch.arange(300, dtype=torch.int64),
                       torch.linspace(-1, 1, 100).to(torch.bfloat16), (torch.arange(333) % 251).to(torch.uint8),
                       torch.arange(64, dtype=torch.float64).reshape(8, 8).t(), torch.zeros(0)):
            self.good.append(self.producer.send(tensor))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.good.append(self.producer.send(torch.arange(300_000, dtype=torch.float32)))  # host fallback
        self.good.append(self.other.send(torch.ones(32)))
        # Traps: a symlink and a FIFO under names the transport would accept as ours.
        pid, token = os.getpid(), "feedfacecafe"
        self.trap_target = Path(f"/tmp/torchhal-fuzz-target-{pid}")
        self.trap_target.write_bytes(b"\x07" * 4096)
        self.traps = [os.path.join(SHM_DIR, f"torchhal-{pid}-{token}-ctl"),
                      os.path.join(SHM_DIR, f"torchhal-{pid}-{token}-h0-g1")]
        for trap in self.traps:
            if os.path.lexists(trap):
                os.unlink(trap)
        os.symlink(self.trap_target, self.traps[0])
        os.mkfifo(self.traps[1], 0o600)
        self.trap_pool = f"{pid}-{token}"
        self.shared = torch.arange(1024, dtype=torch.float32)  # kept alive: the handle names its storage
        self.handle = self.platform.ipc_support.share(self.shared[16:])  # type: ignore[union-attr]
        self.handle_bytes = bytes(torch.arange(1024, dtype=torch.float32).numpy().tobytes())
        self.counts = {"cases": 0, "accepted": 0, "rejected": 0, "open_cases": 0, "open_accepted": 0}

    def close(self) -> None:
        for trap in self.traps:
            if os.path.lexists(trap):
                os.unlink(trap)
        self.trap_target.unlink()
        self.consumer.close()
        self.producer.close()
        self.other.close()

    # -- mutations -----------------------------------------------------------------------
    def mutate_message(self) -> Any:
        """A valid wire record with 1-3 mutations: junk in a field, a field dropped or added,
        plausible numbers, a random view, dtype, event flag, or another producer's names."""
        rng = self.rng
        good = rng.choice(self.good)
        message: dict[str, Any] = dict(zip(WIRE_FIELDS, good, strict=True))
        structural = None
        for _ in range(rng.randint(1, 3)):
            choice = rng.random()
            key = rng.choice(WIRE_FIELDS)
            if choice < 0.15:
                message[key] = rng.choice(JUNK)
            elif choice < 0.2:
                structural = rng.choice(["drop", "extra", "junk", "list"])
            elif choice < 0.45:
                field = rng.choice(["offset", "nbytes", "slot", "generation"])
                message[field] = rng.choice(SIZES) if rng.random() < 0.7 else max(0, message[field] if
                                                                                    type(message[field]) is int
                                                                                    else 0) + rng.randint(-8, 8)
            elif choice < 0.6:
                dims = rng.randint(0, 4)
                message["shape"] = [rng.choice([0, 1, 2, 3, 15, 16, 17, 300, 4096, 2**40]) for _ in range(dims)]
                message["stride"] = None if rng.random() < 0.3 else \
                    [rng.choice([0, 1, 2, 16, 17, 4096, 2**40]) for _ in range(dims)]
            elif choice < 0.7:
                message["dtype"] = rng.choice(list(DTYPES) + ["float128", "", "uint8 "])
            elif choice < 0.8:
                message["event"] = rng.choice([True, False, 1, None])
            else:
                self.mutate_names(message)
        wire: Any = [message[name] for name in WIRE_FIELDS]
        if structural == "drop":
            del wire[rng.randrange(len(wire))]
        elif structural == "extra":
            wire.append(rng.choice(JUNK))
        elif structural == "junk":
            return rng.choice(JUNK + [dict(message)])
        return wire if structural == "list" else tuple(wire)

    def mutate_names(self, message: dict[str, Any]) -> None:
        rng = self.rng
        other = dict(zip(WIRE_FIELDS, self.good[-1], strict=True))
        pid = os.getpid()
        pick = rng.randrange(5)
        if pick == 0:  # another live producer's pool
            message["pool_id"] = other["pool_id"]
        elif pick == 1:  # the symlink trap
            message["pool_id"] = self.trap_pool
        elif pick == 2:  # the FIFO trap as a host block
            message.update(kind="host", pool_id=self.trap_pool, slot=0, generation=1)
        elif pick == 3:  # a fresh pool id every time (cache growth)
            message["pool_id"] = f"{pid}-{rng.getrandbits(48):012x}"
        else:  # our token under another pid, or names that are no pool id
            token = str(message["pool_id"]).split("-")[-1]
            message["pool_id"] = rng.choice([f"1-{token}", f"{2**22 + 1}-{token}", f"0-{token}",
                                             "../../etc/passwd", f"{pid}-{token}/../x", "x" * 300])

    def mutate_handle(self) -> Any:
        rng = self.rng
        handle = self.handle
        changes: dict[str, Any] = {}
        for _ in range(rng.randint(1, 2)):
            field = rng.choice(["offset_bytes", "storage_nbytes", "shape", "stride", "dtype", "storage", "device",
                                "platform"])
            if field in ("offset_bytes", "storage_nbytes"):
                changes[field] = rng.choice(SIZES + [-4, True])
            elif field in ("shape", "stride"):
                dims = rng.randint(0, 2)
                changes[field] = tuple(rng.choice([0, 1, 2, 100, 1008, 1009, 2**40, -1]) for _ in range(dims))
            elif field == "dtype":
                changes["dtype"] = rng.choice(list(DTYPES) + ["object"])
            elif field == "storage":
                manager, name = handle.storage
                changes["storage"] = rng.choice([(rng.choice(NAMES), name), (manager, rng.choice(NAMES)),
                                                 (manager,), (name, manager), (1, 2), "ab"])
            elif field == "device":
                changes["device"] = rng.choice([1, -1, True])
            else:
                changes["platform"] = rng.choice(["cuda", "", 3])
        return dataclasses.replace(handle, **changes)

    # -- checks ----------------------------------------------------------------------------
    def check_message(self, wire: Any) -> None:
        copy = self.rng.random() < 0.5
        try:
            tensor = self.consumer.receive(wire, copy=copy)
        except TransportError:
            self.counts["rejected"] += 1
            return
        self.counts["accepted"] += 1
        message = TensorMessage.from_wire(wire)  # accepted: its fields, contiguous strides derived
        dtype = DTYPES[message.dtype]
        offset, nbytes = message.offset, message.nbytes
        if message.kind == "pool":
            producer = self.producer if message.pool_id == self.producer.pool_id else self.other
            assert producer.pool is not None
            named = bytearray(producer.pool[offset : offset + nbytes].numpy().tobytes())
            if not copy and tensor.numel():  # the view's bytes lie inside the named range
                opened = self.consumer._open[message.pool_id].pool  # the consumer's own mapping
                assert opened is not None
                base = opened.data_ptr() + offset
                itemsize = tensor.element_size()
                last = tensor.data_ptr() + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(),
                                                                          strict=True)) * itemsize
                assert base <= tensor.data_ptr() and last + itemsize <= base + nbytes, (message, "view outside")
        else:
            with open(os.path.join(SHM_DIR, message.host_name), "rb") as block:
                named = bytearray(block.read(nbytes))
        reference = torch.frombuffer(named, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        # The reference's storage is exactly the named bytes: as_strided refuses anything beyond.
        expected = reference.view(dtype).as_strided(message.shape, message.stride)
        assert tensor.dtype == dtype and torch.equal(as_bytes(tensor.cpu()), as_bytes(expected)), (message, "bytes")

    def check_open(self, handle: Any) -> None:
        self.counts["open_cases"] += 1
        try:
            tensor = self.platform.ipc_support.open(handle, 0)  # type: ignore[union-attr]
        except IpcHandleError:
            return
        self.counts["open_accepted"] += 1
        itemsize = tensor.element_size()
        if tensor.numel() > 1 << 20:  # a broadcast (stride 0) view: check its extent, do not materialise it
            steps = zip(tensor.shape, tensor.stride(), strict=True)
            last = tensor.storage_offset() + sum((n - 1) * s for n, s in steps)
            assert (last + 1) * itemsize <= len(self.handle_bytes), (handle, "open extent")
            return
        storage_bytes = self.handle_bytes[: handle.storage_nbytes]
        reference = torch.frombuffer(bytearray(storage_bytes), dtype=torch.uint8) if storage_bytes else \
            torch.empty(0, dtype=torch.uint8)
        expected = reference[: len(storage_bytes) // itemsize * itemsize].view(tensor.dtype).as_strided(
            handle.shape, handle.stride, handle.offset_bytes // itemsize)
        assert torch.equal(as_bytes(tensor), as_bytes(expected)), (handle, "open bytes")

    def run(self, cases: int) -> dict[str, Any]:
        shm_start, maps_start = own_shm_bytes(), map_count()
        trap_before = self.trap_target.read_bytes()
        started = time.perf_counter()
        for case in range(cases):
            self.counts["cases"] += 1
            try:
                if self.rng.random() < 0.2:
                    self.check_open(self.mutate_handle())
                else:
                    self.check_message(self.mutate_message())
            except AssertionError:
                raise
            except Exception as exc:
                raise AssertionError(f"case {case}: wrong error type {type(exc).__name__}: {exc}") from exc
            if case % 2000 == 0 or case == cases - 1:
                assert own_shm_bytes() - shm_start <= SHM_BOUND, f"/dev/shm grew by {own_shm_bytes() - shm_start}"
                assert map_count() - maps_start <= MAPS_BOUND, f"memory maps grew by {map_count() - maps_start}"
        assert self.trap_target.read_bytes() == trap_before, "a symlinked file was written through"
        return {**self.counts, "seconds": round(time.perf_counter() - started, 2),
                "shm_growth_bytes": own_shm_bytes() - shm_start, "maps_growth": map_count() - maps_start,
                "shm_bound": SHM_BOUND, "maps_bound": MAPS_BOUND}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    fuzzer = Fuzzer(args.seed)
    try:
        summary = fuzzer.run(args.cases)
    except AssertionError as exc:
        print(json.dumps({"failed": str(exc)[:2000], **fuzzer.counts}), flush=True)
        return 1
    finally:
        fuzzer.close()
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
