"""A real diffusers FluxPipeline under torchhal's residency manager vs diffusers' own offloading.

    python benchmarks/diffusers_residency.py [--out results]      # H100: ~2.5 B-parameter Flux transformer, bf16
    python benchmarks/diffusers_residency.py --tiny --out /tmp/r   # CPU smoke run: tiny sizes, GPU-only rows skipped

Same pipeline (random weights, no download), prompt, steps and resolution for every row:
fully resident; diffusers enable_model_cpu_offload / enable_sequential_cpu_offload (need
accelerate); diffusers group offloading, block level and leaf level, each with a stream;
torchhal offload; torchhal layerwise (prefetch 1 and 2: the transformer's blocks through a
ring, its other weights on call; the VAE decoder's up blocks streamed at their own sizes,
as diffusers' group offloading streams them). Per request: median time of the measured
requests, peak allocated / reserved device memory, host RSS, cache empties, host->device
bytes, and time / (bytes / pinned host->device bandwidth measured in this run). The bytes
of torchhal rows are counted (what its strategies copied in the last request,
`ResidencyManager.last_request_h2d_bytes`); those of diffusers rows are modelled from
component sizes and calls (`h2d_bytes_model`: diffusers does not count them). The JSON
holds every row's events of the last request with the allocator's state at each (per
pool on a GPU), and a PNG the memory timeline of one request per row. Device peaks come
from torch.cuda here (the benchmark's own measurement); torchhal itself only goes through
the platform API.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torch  # noqa: E402
from _harness import write_json  # noqa: E402
from diffusers_flux import BENCH, TINY, FluxSize, call_kwargs, flux_pipeline  # noqa: E402

import torchhal  # noqa: E402
from torchhal.core.residency import LayerwiseStrategy, ResidencyTrace, Strategy, plot_memory_timelines  # noqa: E402
from torchhal.core.residency.diffusers import ManagedPipeline  # noqa: E402

BLOCKS = ("transformer_blocks", "single_transformer_blocks")
VAE_BLOCKS = ("decoder.up_blocks",)
ENCODERS_AND_VAE = ("text_encoder", "text_encoder_2", "vae")
GiB = 1 << 30
HAS_GPU = torch.cuda.is_available()


# -- measurement helpers (benchmark only) -------------------------------------------------------
class EmptyCounter:
    """Counts every torch.cuda.empty_cache call (torchhal's and diffusers' alike)."""

    def __init__(self) -> None:
        self.count, self.trace = 0, None  # trace: where diffusers rows mark their empties
        if HAS_GPU:
            self._real = torch.cuda.empty_cache
            torch.cuda.empty_cache = self._counted

    def _counted(self) -> None:
        self.count += 1
        if self.trace is not None:
            self.trace.event("empty_cache", None, where="diffusers")
        self._real()


def reset_peaks() -> None:
    if HAS_GPU:
        torch.cuda.reset_peak_memory_stats()
    try:  # reset the process's peak RSS (VmHWM); not allowed everywhere
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def device_peaks() -> dict[str, int | None]:
    if not HAS_GPU:
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None}
    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved()}


def host_memory() -> dict[str, int | None]:
    fields: dict[str, int | None] = {"host_rss_bytes": None, "host_peak_rss_bytes": None}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                fields["host_rss_bytes"] = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                fields["host_peak_rss_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return fields


def pinned_h2d_bandwidth(platform: Any, nbytes: int) -> float:
    """Bytes per second of one pinned host -> device copy (median of 10)."""
    src = platform.pin_memory(torch.empty(nbytes, dtype=torch.uint8))
    dst = torch.empty(nbytes, dtype=torch.uint8, device=platform.device(0))
    samples = []
    for _ in range(11):
        platform.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        platform.synchronize()
        samples.append(time.perf_counter() - t0)
    return nbytes / statistics.median(samples[1:])


def nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


# -- the rows -------------------------------------------------------------------------------------
Row = Callable[[Any, Any], tuple[Callable[..., Any], Callable[[], object], Any]]


def fresh(reference: Any) -> Any:
    """A new pipeline object with copies of the reference's modules (shared tokenizers)."""
    return type(reference)(**{name: (copy.deepcopy(c) if isinstance(c, torch.nn.Module | type(reference.scheduler))
                                     else c) for name, c in reference.components.items()})


def diffusers_row(setup: Callable[[Any, torch.device], None]) -> Row:
    def build(pipe: Any, platform: Any) -> tuple[Callable[..., Any], Callable[[], object], Any]:
        setup(pipe, platform.device(0))
        trace = ResidencyTrace(platform, 0)
        handles = []
        for name, module in [*((n, getattr(pipe, n)) for n in ("text_encoder", "text_encoder_2", "transformer")),
                             ("vae", pipe.vae.decoder)]:
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: trace.event("begin_use", n)))
            handles.append(module.register_forward_hook(lambda m, a, o, n=name: trace.event("end_use", n)))

        def call(**kwargs: Any) -> Any:
            trace.event("request_start", None)
            out = pipe(**kwargs)
            trace.event("request_end", None)
            return out

        def teardown() -> None:
            for h in handles:
                h.remove()
            if hasattr(pipe, "remove_all_hooks"):
                pipe.remove_all_hooks()

        return call, teardown, trace

    return build


def torchhal_row(transformer: Any, vae: Any = lambda: Strategy.OFFLOAD, empty_on_release: bool = False) -> Row:
    def build(pipe: Any, platform: Any) -> tuple[Callable[..., Any], Callable[[], object], Any]:
        placements = {"text_encoder": Strategy.OFFLOAD, "text_encoder_2": Strategy.OFFLOAD, "vae": vae()}
        managed = ManagedPipeline(pipe, {**placements, "transformer": transformer()}, platform=platform,
                                  device_index=0, empty_on_release=empty_on_release)
        return managed, managed.close, managed.manager.trace

    return build


def layerwise(prefetch: int) -> Row:
    """The transformer's blocks through a ring, its other weights loaded on call and released with
    it; the VAE decoder's up blocks at their own sizes (the encoder, never called, never loads)."""
    return torchhal_row(lambda: LayerwiseStrategy(prefetch, BLOCKS, rest="on_call"),
                        lambda: LayerwiseStrategy(1, VAE_BLOCKS, buffers="exact", rest="on_call"))


ROWS: dict[str, tuple[Row, str | None]] = {
    # name: (builder, why it cannot run here or None)
    "resident": (diffusers_row(lambda p, d: p.to(d)), None),
    "diffusers_model_cpu_offload": (diffusers_row(lambda p, d: p.enable_model_cpu_offload(device=d)), "accelerate"),
    "diffusers_sequential_cpu_offload": (diffusers_row(lambda p, d: p.enable_sequential_cpu_offload(device=d)),
                                         "accelerate"),
    "diffusers_group_block_stream": (diffusers_row(lambda p, d: p.enable_group_offload(
        onload_device=d, offload_type="block_level", num_blocks_per_group=1, use_stream=True)), "gpu"),
    "diffusers_group_leaf_stream": (diffusers_row(lambda p, d: p.enable_group_offload(
        onload_device=d, offload_type="leaf_level", use_stream=True)), "gpu"),
    "torchhal_offload": (torchhal_row(lambda: Strategy.OFFLOAD), None),
    # the same, emptying the cache after each component leaves (less held between stages)
    "torchhal_offload_empty_on_release": (torchhal_row(lambda: Strategy.OFFLOAD, empty_on_release=True), None),
    "torchhal_layerwise_p1": (layerwise(1), None),
    "torchhal_layerwise_p2": (layerwise(2), None),
}


#: The slowest row last, so a spent time budget skips it rather than a torchhal row.
RUN_ORDER = ("resident", "torchhal_offload", "torchhal_offload_empty_on_release", "diffusers_model_cpu_offload",
             "torchhal_layerwise_p1", "torchhal_layerwise_p2", "diffusers_group_block_stream",
             "diffusers_group_leaf_stream", "diffusers_sequential_cpu_offload")
assert sorted(RUN_ORDER) == sorted(ROWS)


def h2d_bytes_model(row: str, sizes: dict[str, int], steps: int) -> int:
    """Weights a diffusers row must move host -> device in one request (inputs are negligible);
    torchhal rows count theirs instead. `sizes` has "vae_decoder": decoding calls only the decoder."""
    encoders = sizes["text_encoder"] + sizes["text_encoder_2"]
    if row == "resident":
        return 0
    if row == "diffusers_model_cpu_offload":
        return encoders + sizes["vae"] + sizes["transformer"]  # each whole component once a request
    # sequential / group offloading: the modules each call runs are onloaded at every call (the
    # transformer every step), and the VAE's encoder, never called, is never onloaded
    return encoders + steps * sizes["transformer"] + sizes["vae_decoder"]


def skip_reason(requirement: str | None) -> str | None:
    if requirement == "gpu" and not HAS_GPU:
        return "needs an accelerator with streams"
    if requirement == "accelerate":
        if not HAS_GPU:
            return "needs an accelerator"
        try:
            import accelerate  # noqa: F401
        except ImportError:
            return "needs the accelerate package (pip install accelerate)"
    return None


def run_row(name: str, build: Row, reference: Any, platform: Any, kwargs: Callable[[], dict], reps: int,
            counter: EmptyCounter, breakdown: bool = False,
            ) -> tuple[dict[str, Any], list[dict[str, Any]], torch.Tensor | None]:
    pipe = fresh(reference)
    call, teardown, trace = build(pipe, platform)
    record_allocator_pools(trace)
    counter.trace = trace if not name.startswith("torchhal") else None
    try:
        call(**kwargs())  # warm-up: first-use allocations, pinning, kernels
        platform.synchronize()
        reset_peaks()
        counter.count, times, image = 0, [], None
        for _ in range(reps):
            start_events = len(trace.events)
            platform.synchronize()
            t0 = time.perf_counter()
            image = call(**kwargs()).images
            platform.synchronize()
            times.append(time.perf_counter() - t0)
        events = trace.events[start_events:]
        row = {"median_s": statistics.median(times), "times_s": times, **device_peaks(), **host_memory(),
               **h2d_counted(call),
               "cache_empties_per_request": counter.count / reps,
               "empties_by_where_last_request": _count(e.get("where", "?") for e in events
                                                       if e["kind"] == "empty_cache")}
        if breakdown and HAS_GPU:
            def one_request(request: Callable[..., Any] = call) -> Any:  # bound now: `call` is deleted below
                return request(**kwargs())

            row["peak_breakdown"] = peak_breakdown(one_request)
    finally:
        counter.trace = None
        teardown()
        # drop every reference to this row's modules so none of its device memory counts in the next row
        del pipe, call, teardown
        gc.collect()
        platform.empty_cache(torchhal.ReleasePoint.USER)
    return row, events, None if image is None else image.float().cpu()


def peak_breakdown(request: Callable[[], Any], top: int = 25) -> dict[str, Any]:
    """One more request under the allocator's memory history: the blocks allocated during it
    that are live at its peak of allocated bytes, summed by the first frame outside torch (what
    a row holds at its peak that another does not). Diagnostic only (slow): `--peak-breakdown`."""
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        request()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)

    def where(event: dict[str, Any]) -> str:
        for frame in event.get("frames", []):
            name = frame.get("filename", "")
            if "/torch/" not in name and not name.startswith("??"):
                return f"{name.rsplit('/site-packages/', 1)[-1]}:{frame.get('line')} {frame.get('name')}"
        return "(torch internals)"

    current, peak, peak_index = 0, 0, -1
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            current += event["size"]
        elif event["action"] == "free_requested":
            current -= event["size"]
        if current > peak:
            peak, peak_index = current, index
    live: dict[int, dict[str, Any]] = {}
    for event in trace[: peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    by_frame: dict[str, list[int]] = {}
    for event in live.values():
        entry = by_frame.setdefault(where(event), [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    ranked = sorted(by_frame.items(), key=lambda item: -item[1][0])
    return {"peak_over_request_start_bytes": peak, "live_blocks_at_peak": len(live),
            "by_frame": [{"where": k, "bytes": v[0], "blocks": v[1]} for k, v in ranked[:top]]}


def h2d_counted(call: Any) -> dict[str, Any]:
    """A torchhal row's host -> device bytes of the last request, as its strategies counted them."""
    manager = getattr(call, "manager", None)
    if manager is None:
        return {}
    by_component = dict(manager.last_request_h2d_bytes)
    return {"h2d_bytes": sum(by_component.values()), "h2d_bytes_by_component": by_component,
            "h2d_bytes_source": "counted"}


POOL_STATS = ("allocated_bytes.large_pool.current", "allocated_bytes.small_pool.current",
              "reserved_bytes.large_pool.current", "reserved_bytes.small_pool.current",
              "segment.large_pool.current", "segment.small_pool.current")


def record_allocator_pools(trace: Any) -> None:
    """Benchmark only: every event of `trace` also carries the caching allocator's per-pool state,
    so the JSON shows where reserved memory sits (large/small pool, how many segments)."""
    if not HAS_GPU:
        return
    original = trace.event

    def event(kind: str, component: str | None, **fields: Any) -> None:
        original(kind, component, **fields)
        if trace.events:
            stats = torch.cuda.memory_stats()
            trace.events[-1]["pools"] = {key: stats.get(key, 0) for key in POOL_STATS}

    trace.event = event


def compact(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last request's events for the JSON, time relative to its first event."""
    t0 = events[0]["t"] if events else 0.0
    return [{**{k: v for k, v in e.items() if k != "t"}, "t": round(e["t"] - t0, 6)} for e in events]


def _count(items: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny sizes, 2 requests a row")
    parser.add_argument("--rows", default=",".join(RUN_ORDER), help="comma-separated subset of: " + ", ".join(ROWS))
    parser.add_argument("--budget-s", type=float, default=300.0, help="skip the remaining rows after this long")
    parser.add_argument("--peak-breakdown", action="store_true",
                        help="one more request per row under the allocator's memory history: what is live at "
                             "its peak, by source line (GPU; slow)")
    args = parser.parse_args()
    started = time.perf_counter()
    platform = torchhal.current_platform()
    size: FluxSize = TINY if args.tiny else BENCH
    steps, resolution, reps = (2, 32, 2) if args.tiny else (4, 1024, 5)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    reference = flux_pipeline(size, dtype)
    sizes = {name: nbytes(getattr(reference, name)) for name in (*ENCODERS_AND_VAE, "transformer")}
    sizes["vae_decoder"] = nbytes(reference.vae.decoder)
    layer_bytes = sum(nbytes(getattr(reference.transformer, b)) for b in BLOCKS)
    bandwidth = pinned_h2d_bandwidth(platform, (64 << 20) if args.tiny else GiB)
    print(f"built in {time.perf_counter() - started:.1f}s; component bytes {sizes}; "
          f"pinned H2D {bandwidth / 1e9:.1f} GB/s", flush=True)
    counter = EmptyCounter()
    results: dict[str, Any] = {
        "size": {**size.__dict__, "vae_channels": list(size.vae_channels)}, "dtype": str(dtype), "steps": steps,
        "resolution": resolution, "requests_measured": reps, "component_bytes": sizes,
        "transformer_layer_bytes": layer_bytes, "pinned_h2d_bytes_per_s": bandwidth, "rows": {},
    }
    timelines: dict[str, list[dict[str, Any]]] = {}
    resident_image = None
    for name in args.rows.split(","):
        build, requirement = ROWS[name]
        reason = skip_reason(requirement)
        if reason is None and time.perf_counter() - started > args.budget_s:
            reason = f"time budget of {args.budget_s:.0f}s spent"
        if reason is not None:
            results["rows"][name] = {"skipped": reason}
            print(f"{name}: skipped ({reason})", flush=True)
            continue
        t_row = time.perf_counter()
        try:
            row, events, image = run_row(name, build, reference, platform,
                                         lambda: call_kwargs(size, steps, resolution), reps, counter,
                                         args.peak_breakdown)
        except Exception as exc:  # one failing row must not lose the others
            results["rows"][name] = {"failed": f"{type(exc).__name__}: {exc}"[:500]}
            traceback.print_exc()
            continue
        if "h2d_bytes" not in row:  # a diffusers row: modelled, not counted
            row["h2d_bytes"] = h2d_bytes_model(name, sizes, steps)
            row["h2d_bytes_source"] = "modelled"
        moved = row["h2d_bytes"]
        row["transfer_floor_s"] = moved / bandwidth
        row["time_over_transfer_floor"] = row["median_s"] / row["transfer_floor_s"] if moved else None
        if resident_image is None and name == "resident":
            resident_image = image
        if resident_image is not None and image is not None:
            row["max_abs_diff_vs_resident"] = float((image - resident_image).abs().max())
        row["row_wall_s"] = time.perf_counter() - t_row
        row["events_last_request"] = compact(events)
        results["rows"][name] = row
        timelines[name] = events
        print(name, {k: v for k, v in row.items() if k not in ("times_s", "events_last_request")}, flush=True)
    results["total_wall_s"] = time.perf_counter() - started
    path = write_json("diffusers_residency", results, args.out)
    try:
        png = path.with_name("diffusers_residency_timeline.png")
        plot_memory_timelines(timelines, str(png))
        print(f"wrote {png}")
    except ImportError:
        print("matplotlib missing: no timeline plot")


if __name__ == "__main__":
    main()
