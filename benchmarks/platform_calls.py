"""Cost of the platform layer: current_platform(), Platform calls vs the plugin and
the device module, memory_info vs the backend's own queries, and empty_cache.

    python benchmarks/platform_calls.py [--out results]

"goals" in the JSON holds the three figures of the hot-path goals, each with its
limit and whether this run met it:
- pass_through_overhead_ns: the worst Platform pass-through minus the direct call (median of
  alternating paired timings):
  the vendor module's function where the plugin's call is that function
  (device_count, current_device), else the plugin's method; <= 100 ns.
- memory_info_over_floor: Platform.memory_info(0) / (mem_get_info(0) + one allocator
  stats read), the median of alternating paired timings in this run (on CPU the floor is
  the OS query and the memory cgroup's files); <= 1.15.
- current_platform_cached_ns: torchhal.current_platform() once resolved; <= 100 ns.
Runs on CPU too (the floor and direct calls are then the CPU plugin's own).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _harness import paired_overhead_ns, paired_ratio, per_call_ns, write_json  # noqa: E402

import torchhal  # noqa: E402
from torchhal.platforms import ReleasePoint  # noqa: E402
from torchhal.platforms.testing import plugin_under_test  # noqa: E402

GiB = 1 << 30
PASS_THROUGH_LIMIT_NS = 100.0
MEMORY_INFO_LIMIT = 1.15
CURRENT_PLATFORM_LIMIT_NS = 100.0


def median(results: dict[str, Any], key: str) -> float:
    return float(results[key]["median_ns"])


def memory_floor(platform: torchhal.Platform, module: Any) -> dict[str, Callable[[], Any]]:
    """The backend queries one memory_info cannot avoid, by name."""
    if module is None:  # CPU: the OS's figures and the memory cgroup's limit
        import psutil

        from torchhal.plugins.host_memory import cgroup_limit

        return {"psutil.virtual_memory": psutil.virtual_memory, "cgroup_limit": cgroup_limit}
    floor: dict[str, Callable[[], Any]] = {"mem_get_info(0)": lambda: module.mem_get_info(0)}
    stats = getattr(torch._C, "_cuda_memoryStats", None)
    if stats is not None and platform.device_type == torch.device("cuda").type:
        floor["torch._C._cuda_memoryStats(0)"] = lambda: stats(0)  # one allocator stats read
    else:
        floor["memory_reserved(0)"] = lambda: module.memory_reserved(0)
        floor["memory_allocated(0)"] = lambda: module.memory_allocated(0)
    return floor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    args = parser.parse_args()

    platform = torchhal.current_platform()
    plugin = plugin_under_test(platform)  # the benchmark compares the API with what is under it
    accelerator = platform.device_type != "cpu"
    # The vendor's own device module, to time direct calls against (None on CPU).
    module = getattr(torch, platform.device_type) if accelerator else None
    results: dict[str, Any] = {"platform": platform.name}
    # Initialise the device first: before init, torch.cuda.device_count() asks NVML on every call.
    torch.ones(1, device=platform.device(0))
    platform.synchronize(0)

    results["current_platform_cached"] = per_call_ns(torchhal.current_platform, number=200_000)

    # -- pass-throughs: Platform vs plugin vs the direct call ------------------------
    error = torch.OutOfMemoryError("benchmark")
    calls: dict[str, tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any] | None]] = {
        "device_count": (platform.device_count, plugin.device_count, module.device_count if module else None),
        "current_device": (platform.current_device, plugin.current_device, module.current_device if module else None),
        "is_out_of_memory": (lambda: platform.is_out_of_memory(error), lambda: plugin.is_out_of_memory(error), None),
        "new_event": (platform.new_event, plugin.new_event, None),
    }
    overheads: dict[str, float] = {}
    for name, (api, spi, direct) in calls.items():
        results[f"platform.{name}"] = per_call_ns(api, number=100_000)
        results[f"plugin.{name}"] = per_call_ns(spi, number=100_000)
        if direct is not None:
            results[f"direct.{name}"] = per_call_ns(direct, number=100_000)
        # The goal's figure: API minus the direct call, timed in alternating pairs.
        paired = paired_overhead_ns(api, direct or spi)
        results[f"overhead.{name}"] = paired
        overheads[name] = paired["median_ns"]
        # A pass-through bound at resolution is the plugin's own method: no layer to cost anything.
        results[f"bound_to_plugin.{name}"] = getattr(platform, name) == getattr(plugin, name)
    results["pass_through_overhead_ns"] = overheads
    if module is not None:  # the plugin's own cost over the vendor's constructor (not an API overhead)
        results["direct.Event"] = per_call_ns(module.Event, number=100_000)

    # -- memory_info vs its floor, same run ---------------------------------------------
    torch.empty(1, device=platform.device(0))  # initialise the allocator
    results["platform.memory_info(0)"] = per_call_ns(lambda: platform.memory_info(0), number=20_000)
    results["plugin.memory_info(0)"] = per_call_ns(lambda: plugin.memory_info(0), number=20_000)
    results["platform.memory_info()"] = per_call_ns(platform.memory_info, number=20_000)
    floor_ns = 0.0
    readers = memory_floor(platform, module)
    for label, reader in readers.items():
        results[f"floor.{label}"] = per_call_ns(reader, number=20_000)
        floor_ns += median(results, f"floor.{label}")
    results["memory_info_floor_ns"] = floor_ns

    def floor() -> None:
        for reader in readers.values():
            reader()

    # The goal's figure: memory_info and its floor timed in alternating pairs (separate
    # medians of the floor moved 18-30 us between runs on the H100 host).
    results["memory_info_over_floor_paired"] = paired_ratio(lambda: platform.memory_info(0), floor)

    if module is not None:
        # Where else the allocator counters can come from, and the flattening accessor.
        results["direct.memory_reserved(0)"] = per_call_ns(lambda: module.memory_reserved(0), number=2_000)
        stats_reader = getattr(torch._C, "_accelerator_getDeviceStats", None)
        if stats_reader is not None:
            results["stats_reader.torch._C._accelerator_getDeviceStats"] = per_call_ns(lambda: stats_reader(0),
                                                                                      number=2_000)
        results["empty_cache_nothing_cached"] = per_call_ns(
            lambda: platform.empty_cache(ReleasePoint.USER, 0), number=200, repeat=7
        )
        samples = []
        released = []
        for _ in range(7):
            block = torch.empty(4 * GiB, dtype=torch.uint8, device=platform.device(0))
            del block  # 4 GiB now sits in the cache
            t0 = time.perf_counter_ns()  # host time: what the caller pays
            released.append(platform.empty_cache(ReleasePoint.USER, 0))
            samples.append(time.perf_counter_ns() - t0)
        samples.sort()
        results["empty_cache_4GiB_cached"] = {"median_ns": samples[len(samples) // 2], "min_ns": samples[0],
                                              "max_ns": samples[-1], "bytes_released": released}

    worst = max(overheads, key=lambda name: overheads[name])
    memory_ratio = results["memory_info_over_floor_paired"]["median"]
    cached_ns = median(results, "current_platform_cached")
    results["goals"] = {
        "pass_through_overhead_ns": {"value": overheads[worst], "call": worst, "limit": PASS_THROUGH_LIMIT_NS,
                                     "met": overheads[worst] <= PASS_THROUGH_LIMIT_NS},
        "memory_info_over_floor": {"value": memory_ratio, "limit": MEMORY_INFO_LIMIT,
                                   "met": memory_ratio <= MEMORY_INFO_LIMIT},
        "current_platform_cached_ns": {"value": cached_ns, "limit": CURRENT_PLATFORM_LIMIT_NS,
                                       "met": cached_ns <= CURRENT_PLATFORM_LIMIT_NS},
    }
    write_json("platform_calls", results, args.out)


if __name__ == "__main__":
    main()
