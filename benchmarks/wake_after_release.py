"""How long a region's restore takes, against how long after a release it starts.

    python benchmarks/wake_after_release.py [--out DIR] [--gib 15] [--cycles 2]

Through the platform's `MemoryRegions` alone: `--gib` allocations of 1 GiB in one region,
released with a host backup, then restored after an idle gap of 0 to 1 s; beside it the
host -> device copy floor of the same bytes into a warm buffer. A driver that clears released
memory on a copy engine after the release returns (CUDA does) slows a restore that starts
inside that window; the gap at which the restore reaches the floor is how long it lasts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _harness import write_json  # noqa: E402
from sleep_wake import copy_floor, timed  # noqa: E402

import torchhal  # noqa: E402

GAPS_S = (0.0, 0.01, 0.03, 0.1, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--gib", type=int, default=15)
    parser.add_argument("--cycles", type=int, default=2)
    args = parser.parse_args()

    platform = torchhal.current_platform()
    index = platform.current_device()
    support = platform.virtual_memory_support
    if support is None:
        sys.exit(f"the {platform.name} platform declares no virtual memory")
    chunk = 1 << 30 if platform.graph_support is not None else 1 << 20  # small on a CPU
    regions = support.new_regions(index)
    held = [regions.allocate("weights", chunk) for _ in range(args.gib)]
    for tensor in held:
        tensor.random_(0, 255)

    sync = lambda: platform.synchronize(index)  # noqa: E731
    restore: dict[str, list[float]] = {f"{gap:g}": [] for gap in GAPS_S}
    for _ in range(args.cycles):
        for gap in GAPS_S:
            regions.release("weights", backup=True)
            time.sleep(gap)
            restore[f"{gap:g}"].append(timed(lambda: regions.restore("weights"), sync)[0])
    nbytes = chunk * args.gib
    floor = copy_floor(nbytes, platform.device(index), sync)["host_to_device_s"]
    results = {"platform": platform.name, "bytes": nbytes, "allocations": args.gib,
               "host_to_device_floor_s": floor,
               "restore_s_by_gap_s": restore,
               "restore_over_floor_by_gap_s": {gap: statistics.median(t) / floor for gap, t in restore.items()}}
    write_json("wake_after_release", results, args.out)


if __name__ == "__main__":
    main()
