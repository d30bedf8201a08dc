"""`torchhal info`: the registered platforms, the current one and its devices."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from torchhal.cli.output import emit, refuse

if TYPE_CHECKING:
    from torchhal.platforms import Platform, PlatformRegistry

GiB = 1 << 30
#: Devices `info` lists; a larger count (a plugin may answer anything) is said, not listed.
MAX_LISTED_DEVICES = 64


def _environment(platform_env: tuple[str, ...]) -> dict[str, str]:
    names = sorted({k for k in os.environ if k.startswith("TORCHHAL_")} | set(platform_env))
    return {k: os.environ[k] for k in names if k in os.environ}


def _asker(reg: PlatformRegistry, platform: Platform) -> Callable[..., tuple[Any, bool]]:
    """`ask(label, call, *args)`: (result, True), or (None, False) with a "query" failure recorded.
    A plugin never ends `info`, and one that hangs is named by the registry's watch."""
    from torchhal.platforms.errors import describe_error, isolated
    from torchhal.platforms.records import PluginFailure

    source = reg.platforms[platform.name].source

    def ask(label: str, call: Callable[..., Any], *args: Any) -> tuple[Any, bool]:
        with reg.watch(source, label):
            result, error = isolated(call, *args)
        if error is None:
            return result, True
        reg.record_failure(PluginFailure(platform.name, "query", f"{label}: {describe_error(error)}",
                                         platform.distribution))
        return None, False

    return ask


def _devices(ask: Callable[..., tuple[Any, bool]], platform: Platform) -> tuple[int | None, list[dict[str, Any]]]:
    """The device count the plugin answers, and a row for each of the first MAX_LISTED_DEVICES."""
    count, _ = ask("device_count()", platform.device_count)
    rows = []
    for index in range(min(count or 0, MAX_LISTED_DEVICES)):
        device, _ = ask(f"device_info({index})", lambda i=index: asdict(platform.device_info(i)))
        memory, _ = ask(f"memory_info({index})", lambda i=index: asdict(platform.memory_info(i)))
        rows.append({"index": index, "device": device, "memory": memory})
    return count, rows


def _attention_rows(platform: Platform) -> list[dict[str, Any]]:
    """The attention backends in the order selection tries them: the platform's, then the reference.
    An engine takes the first whose capability runs its model (`Platform.choose_attention`)."""
    support = platform.attention_support
    declared = len(support.backends) if support is not None else 0
    rows = []
    for index, backend in enumerate(platform.attention_backends):
        cap = backend.capability
        rows.append({"name": cap.name, "dtypes": [str(d).removeprefix("torch.") for d in cap.dtypes],
                     "head_dims": list(cap.head_dims) if cap.head_dims is not None else None,
                     "block_sizes": list(cap.block_sizes) if cap.block_sizes is not None else None,
                     "prefill": cap.prefill, "sliding_window": cap.sliding_window, "soft_cap": cap.soft_cap,
                     "graph_capture": cap.graph_capture, "note": cap.note,
                     # the platform's own line (e.g. which kernel its prefill takes, and why)
                     "platform_note": support.note if support is not None and index < declared else ""})
    return rows


def _capabilities(ask: Callable[..., tuple[Any, bool]], platform: Platform) -> dict[str, Any]:
    """Each declared capability as plain data; None where asking the plugin failed."""
    def graphs() -> str | None:  # the class's name: a declared record is never shown as "unsupported"
        support = platform.graph_support
        return None if support is None else getattr(support.graph_class, "__name__", None) or repr(support.graph_class)

    def ipc() -> dict[str, Any] | None:
        support = platform.ipc_support
        return None if support is None else {"peer_redirect": support.peer_redirect, "note": support.note}

    def linear() -> dict[str, Any]:
        support = platform.linear_support
        return {"name": None} if support is None else {
            "name": support.name, "max_rows": support.max_rows, "graph_capture": support.graph_capture,
            "dtypes": [str(d).removeprefix("torch.") for d in support.dtypes], "note": support.note}

    def compiled() -> dict[str, Any]:
        support = platform.compile_support
        return {"inductor_options": dict(support.inductor_options) if support else {},
                "note": support.note if support else ""}

    def distributed() -> dict[str, Any]:
        support = platform.distributed_support
        return {"backend": platform.dist_backend, "graph_capturable": support.graph_capturable, "note": support.note,
                "communicator": "vendor" if support.communicator is not None else "default"}

    def virtual_memory() -> dict[str, Any]:
        support = platform.virtual_memory_support
        return {"declared": False} if support is None else {
            "declared": True, "graph_memory": support.graph_memory, "not_released": list(support.not_released),
            "note": support.note}

    queries = {"graphs": graphs, "ipc": ipc, "attention": lambda: _attention_rows(platform), "linear": linear,
               "compile": compiled, "distributed": distributed, "virtual_memory": virtual_memory}
    return {name: ask(f"{name.replace('graphs', 'graph')}_support()", query)[0] for name, query in queries.items()}


def collect_info() -> dict[str, Any]:
    """Everything `torchhal info` shows, as plain data.

    A plugin's misbehaviour (raising, exiting, wrong types) becomes a plugin error in
    the data, never an exception; "current" is None with "error" set when no
    platform resolves. Raises PlatformError only for a bad torchhal setting.
    """
    import torch

    import torchhal
    from torchhal.platforms import PLATFORM_ENV, SPI_VERSION, PlatformError, current_platform, how_resolved

    reg = torchhal.registry()
    platforms = [asdict(s) for s in torchhal.list_platforms()]
    info: dict[str, Any] = {"torchhal": torchhal.__version__, "torch": torch.__version__,
                            "spi_version": ".".join(map(str, SPI_VERSION)), "platforms": platforms,
                            "current": None, "error": None}
    try:
        platform = current_platform()
    except PlatformError as exc:
        info["error"] = str(exc)
    else:
        ask = _asker(reg, platform)
        count, devices = _devices(ask, platform)
        others = [p["name"] for p in platforms if p["available"] and p["name"] != platform.name]
        info["current"] = {
            "name": platform.name,
            "how": how_resolved()[0],
            "choose": f"{PLATFORM_ENV}=<name> selects another" + (f": {', '.join(others)}" if others else
                                                                    " (none other is available here)"),
            "distribution": platform.distribution,
            "version": platform.version,
            "runtime": ask("runtime_version()", platform.runtime_version)[0],
            "dist_backend": platform.dist_backend,
            "environment": _environment(platform.visible_devices_env),
            "device_count": count,
            "devices": devices,
            "capabilities": _capabilities(ask, platform),
        }
    # Read last: detection and the queries above can add errors.
    info["plugin_errors"] = [{**asdict(f), "failed_to": f.failed_to} for f in reg.failures]
    info["plugin_notices"] = list(reg.notices)
    return info


def _failed(call: str) -> str:
    return f"({call} failed: see plugin errors)"


def format_info(info: dict[str, Any]) -> str:
    """The text `torchhal info` prints (columns sized to the longest platform name)."""
    lines = [f"torchhal {info['torchhal']}  (torch {info['torch']}, plugin SPI {info['spi_version']})",
             "", "Registered platforms:"]
    width = max((len(p["name"]) for p in info["platforms"]), default=0)
    for p in info["platforms"]:
        state = "available" if p["available"] else f"unavailable: {p['reason']}"
        lines.append(f"  {p['name']:<{width}}  priority {p['priority']:>3}  {p['distribution']} {p['version']}"
                     f"  [{p['source']}]  {state}")
    if not info["platforms"]:
        lines.append("  (none)")
    if info["plugin_errors"]:
        lines += ["", "Plugin errors:"]
        for e in info["plugin_errors"]:
            dist = f" ({e['distribution']})" if e["distribution"] else ""
            lines.append(f"  {e['plugin']}{dist}: failed to {e['failed_to']}: {e['error']}")
    if info["plugin_notices"]:
        lines += ["", "Plugin notices:"] + [f"  {notice}" for notice in info["plugin_notices"]]
    cur = info["current"]
    if cur is None:
        return "\n".join(lines)
    lines += ["", f"Current platform: {cur['name']}  ({cur['how']})", f"  {cur['choose']}",
              f"  runtime: {cur['runtime']}  dist backend: {cur['dist_backend']}"]
    lines += [f"  {k}={v}" for k, v in cur["environment"].items()]
    for d in cur["devices"]:
        dev, mem = d["device"], d["memory"]
        line = f"  device {d['index']}: " + (dev["name"] if dev else _failed("device_info"))
        if mem is None:
            line += "  memory: " + _failed("memory_info")
        else:
            line += f"  free {mem['free'] / GiB:.1f} / {mem['total'] / GiB:.1f} GiB"
            if mem["reserved"] is not None:
                line += f"  reserved {mem['reserved'] / GiB:.2f} GiB"
        lines.append(line)
    count = cur["device_count"]
    if count is None:
        lines.append("  devices: " + _failed("device_count()"))
    elif count > len(cur["devices"]):
        lines.append(f"  ... {count - len(cur['devices'])} more device(s) of {count}, not listed "
                     f"(info lists the first {MAX_LISTED_DEVICES})")
    caps = cur["capabilities"]
    lines.append(f"  graphs: {caps['graphs'] or 'unsupported'}")
    ipc = caps["ipc"]
    lines.append("  ipc: " + (f"{ipc['note']} (peer redirect: {ipc['peer_redirect']})" if ipc else "unsupported"))
    distributed = caps["distributed"]
    if distributed is None:
        lines.append("  distributed: " + _failed("distributed_support()"))
    else:
        communicator = ("the vendor's" if distributed["communicator"] == "vendor"
                        else "torchhal's default (torch.distributed)")
        lines.append(f"  distributed: {distributed['backend']} backend, {communicator} communicator, collectives "
                     f"{'graph-capturable' if distributed['graph_capturable'] else 'not graph-captured'}"
                     + (f"; {distributed['note']}" if distributed["note"] else ""))
    attention = caps["attention"]
    if attention is None:
        lines.append("  attention: " + _failed("attention_support()"))
    for rank, row in enumerate(attention or []):
        label = "attention:" if rank == 0 else "           "
        why = "platform backend" if rank < len(attention) - 1 else "portable reference, used when none above runs"
        dims = ",".join(map(str, row["head_dims"])) if row["head_dims"] is not None else "any"
        blocks = ",".join(map(str, row["block_sizes"])) if row["block_sizes"] is not None else "any"
        lines.append(f"  {label} {rank + 1}. {row['name']} ({why}; {'/'.join(row['dtypes'])}, head dims {dims}, "
                     f"block sizes {blocks}{', graph capture' if row['graph_capture'] else ''})"
                     + (f": {row['platform_note']}" if row["platform_note"] else ""))
    linear = caps["linear"]
    if linear is None:
        lines.append("  linear: " + _failed("linear_support()"))
    elif linear["name"] is None:
        lines.append("  linear: F.linear (the platform supplies no linear kernel)")
    else:
        lines.append(f"  linear: {linear['name']} for inputs of at most {linear['max_rows']} row(s), F.linear above "
                     f"({'/'.join(linear['dtypes'])}{', graph capture' if linear['graph_capture'] else ''})")
    compiled = caps["compile"]
    if compiled is None:
        lines.append("  compile: " + _failed("compile_support()"))
    elif not compiled["inductor_options"]:
        lines.append("  compile: inductor's defaults (the platform asks for no options)")
    else:
        options = ", ".join(f"{k}={v!r}" for k, v in compiled["inductor_options"].items())
        lines.append(f"  compile: inductor options {options}" + (f" ({compiled['note']})" if compiled["note"] else ""))
    regions = caps["virtual_memory"]
    if regions is None:
        lines.append("  virtual memory: " + _failed("virtual_memory_support()"))
    elif not regions["declared"]:
        lines.append("  virtual memory: none (an engine sleeps by host offload and captures its graphs again on wake)")
    else:
        graphs_too = "graph memory too" if regions["graph_memory"] else "not graph memory"
        lines.append(f"  virtual memory: {regions['note'] or 'declared'} ({graphs_too}; sleep keeps the graphs)")
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace) -> int:
    """Exit 0 when a platform resolves (plugin errors are shown, not fatal), else 2."""
    from torchhal.platforms import PlatformError

    try:
        info = collect_info()
    except PlatformError as exc:  # a bad torchhal setting, e.g. TORCHHAL_DETECT_TIMEOUT
        return refuse("info", str(exc))
    emit(json.dumps(info, indent=2, default=str) if args.json else format_info(info))
    if info["error"] is not None:
        return refuse("info", info["error"])
    return 0


def add_command(sub: Any) -> None:
    info = sub.add_parser("info", help="registered platforms, the current one, its devices")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)
