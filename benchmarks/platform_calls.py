"""Cost of the platform layer: current_platform(), Platform calls vs the plugin and
the device module, memory_info vs the backend's own queries, and empty_cache.

    python benchmarks/platform_calls.py [--out results]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _harness import per_call_ns, write_json  # noqa: E402

import torchhal  # noqa: E402
from torchhal.platforms import ReleasePoint  # noqa: E402

GiB = 1 << 30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    args = parser.parse_args()

    platform = torchhal.current_platform()
    plugin = platform.plugin
    results: dict[str, object] = {"platform": platform.name}
    # Initialise the device first: before init, torch.cuda.device_count() asks NVML on every call.
    torch.ones(1, device=platform.device(0))
    platform.synchronize(0)

    results["current_platform_cached"] = per_call_ns(torchhal.current_platform, number=200_000)
    results["platform.device_count"] = per_call_ns(platform.device_count, number=100_000)
    results["plugin.device_count"] = per_call_ns(plugin.device_count, number=100_000)
    results["platform.memory_info(0)"] = per_call_ns(lambda: platform.memory_info(0), number=20_000)
    results["plugin.memory_info(0)"] = per_call_ns(lambda: plugin.memory_info(0), number=20_000)
    results["platform.memory_info()"] = per_call_ns(platform.memory_info, number=20_000)

    def overhead(a: str, b: str) -> float:
        return results[a]["median_ns"] - results[b]["median_ns"]  # type: ignore[index]

    results["platform_overhead_ns"] = {
        "device_count": overhead("platform.device_count", "plugin.device_count"),
        "memory_info(0)": overhead("platform.memory_info(0)", "plugin.memory_info(0)"),
    }

    if platform.device_type != "cpu":
        module = platform.device_module
        torch.empty(1, device=platform.device(0))  # initialise the allocator
        results["direct.mem_get_info(0)"] = per_call_ns(lambda: module.mem_get_info(0), number=20_000)
        results["direct.memory_reserved(0)"] = per_call_ns(lambda: module.memory_reserved(0), number=2_000)
        results["direct.device_count"] = per_call_ns(module.device_count, number=100_000)
        # Where the allocator counters can come from (the cost memory_info pays on top of mem_get_info).
        for label, reader in (
            ("torch._C._cuda_memoryStats", getattr(torch._C, "_cuda_memoryStats", None)),
            ("torch._C._accelerator_getDeviceStats", getattr(torch._C, "_accelerator_getDeviceStats", None)),
        ):
            if reader is not None and platform.device_type == torch.device("cuda").type:
                results[f"stats_reader.{label}"] = per_call_ns(lambda r=reader: r(0), number=2_000)
        results["memory_info_over_mem_get_info"] = (
            results["platform.memory_info(0)"]["median_ns"]  # type: ignore[index]
            / results["direct.mem_get_info(0)"]["median_ns"]  # type: ignore[index]
        )
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
    write_json("platform_calls", results, args.out)


if __name__ == "__main__":
    main()
