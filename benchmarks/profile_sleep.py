"""Where a level-2 sleep's time goes, on the engine `sleep_wake.py` builds.

    python benchmarks/profile_sleep.py [--out DIR] [--cycles 4] [--tiny]

Per cycle: the sleep's wall time, the engine's steps inside it (drain, the occupation's sleep,
each region's release, the driver's unmaps, the cache emptied at the sleep release point) and
the largest unmaps by size; after the cycles, the driver's unmap and release calls alone on
allocations of several sizes (CUDA's virtual-memory driver only). The engine's methods are
wrapped with timers, so the figures carry a few microseconds of wrapping each.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _harness import write_json  # noqa: E402
from sleep_wake import LLAMA31_8B, SAVED_WEIGHTS, TINY, build_model, timed, tokens  # noqa: E402

import torchhal  # noqa: E402
from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine  # noqa: E402
from torchhal.plugins.virtual_memory import VmmDriver  # noqa: E402

spent: dict[str, list[float]] = collections.defaultdict(list)


def time_calls(owner: Any, name: str, key: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[key].append(time.perf_counter() - started)

    setattr(owner, name, wrapper)


def driver_calls(driver: VmmDriver) -> dict[str, dict[str, float]]:
    """Milliseconds in `cuMemUnmap` and in `cuMemRelease` for `count` allocations of `size`."""
    rows = {}
    for size, count in ((2 << 20, 256), (64 << 20, 16), (1 << 30, 1), (16 << 30, 1)):
        mapped = []
        for _ in range(count):
            va, handle = driver.reserve(size), driver.create(size)
            driver.map(va, size, handle)
            mapped.append((va, handle))
        driver.synchronize()
        unmap_s = release_s = 0.0
        for va, handle in mapped:
            started = time.perf_counter()
            driver._check("MemUnmap", ctypes.c_uint64(va), ctypes.c_size_t(size))
            unmap_s += time.perf_counter() - started
            started = time.perf_counter()
            driver._check("MemRelease", ctypes.c_uint64(handle))
            release_s += time.perf_counter() - started
            driver.free(va, size)
        rows[f"{size >> 20}MiBx{count}"] = {"unmap_ms": unmap_s * 1e3, "release_ms": release_s * 1e3}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    platform = torchhal.current_platform()
    index = platform.current_device()
    device = platform.device(index)
    config, dtype = (TINY, torch.float32) if args.tiny else (LLAMA31_8B, torch.bfloat16)
    model = build_model(config, dtype, device)
    SAVED_WEIGHTS.update({name: p.detach().clone() for name, p in model.named_parameters()})
    engine = GenerationEngine(EngineConfig(dtype=dtype, decode_graphs=DecodeGraphConfig(emulate=args.tiny)),
                              platform=platform, model=model)
    reference = tokens(engine)
    regions = getattr(engine.occupation, "regions", None)
    if regions is None:
        raise SystemExit(f"{platform.name} sleeps by host offload: it has no regions to profile")
    layout = {tag: {"allocations": len(region.live()), "bytes": sum(a.mapping.size for a in region.live())}
              for tag, region in regions._regions.items()}
    driver = regions.driver
    unmaps: list[tuple[int, float]] = []
    unmap = driver.unmap

    def timed_unmap(va: int, size: int, handle: int) -> None:
        started = time.perf_counter()
        unmap(va, size, handle)
        unmaps.append((size, time.perf_counter() - started))

    driver.unmap = timed_unmap  # type: ignore[method-assign]
    for owner, name, key in ((regions, "release", "regions.release"), (engine, "drain", "drain"),
                             (engine.occupation, "sleep", "occupation.sleep"),
                             (engine.events, "empty", "events.empty")):
        time_calls(owner, name, key)
    sync = lambda: platform.synchronize(index)  # noqa: E731
    cycles = []
    for _ in range(args.cycles):
        spent.clear()
        unmaps.clear()
        sleep_s, _ = timed(lambda: engine.release_memory_occupation(level=2), sync)
        row: dict[str, Any] = {"sleep_s": sleep_s, "steps_s": {k: sum(v) for k, v in spent.items()},
                               "unmap_calls": len(unmaps), "unmap_s": sum(s for _, s in unmaps),
                               "largest_unmaps_mib_ms": sorted(((size >> 20, s * 1e3) for size, s in unmaps),
                                                               key=lambda pair: -pair[1])[:4]}
        time.sleep(1.0)
        engine.resume_memory_occupation(tags=("weights",))
        engine.update_weights_from_tensors(SAVED_WEIGHTS)
        engine.resume_memory_occupation(tags=("kv_cache",))
        row["tokens_equal"] = tokens(engine) == reference
        cycles.append(row)
    driver.unmap = unmap  # type: ignore[method-assign]
    engine.close()
    results = {"platform": platform.name, "layout": layout, "cycles": cycles,
               "driver_calls": driver_calls(driver) if isinstance(driver, VmmDriver) else None}
    write_json("profile_sleep" + ("_tiny" if args.tiny else ""), results, args.out)


if __name__ == "__main__":
    main()
