"""`torchhal info`: the registered platforms, the current one and its devices."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torchhal
from torchhal.cli.output import emit, refuse
from torchhal.platforms import (
    SPI_VERSION,
    PlatformError,
    current_platform,
    how_resolved,
    list_platforms,
    registry,
)

GiB = 1 << 30


def _environment(platform_env: tuple[str, ...] = ()) -> dict[str, str]:
    names = sorted({k for k in os.environ if k.startswith("TORCHHAL_")} | set(platform_env))
    return {k: os.environ[k] for k in names if k in os.environ}


def _plugin_query(reg: Any, platform: Any, label: str, call: Callable[..., Any], *args: Any) -> tuple[Any, bool]:
    """(result, True), or (None, False) with a "query" failure recorded: a plugin never ends `info`."""
    from torchhal.platforms.errors import describe_error, isolated
    from torchhal.platforms.records import PluginFailure

    result, error = isolated(call, *args)
    if error is None:
        return result, True
    failure = PluginFailure(platform.name, "query", f"{label}: {describe_error(error)}", platform.distribution)
    reg.record_failure(failure)
    return None, False


def _device_rows(reg: Any, platform: Any) -> list[dict[str, Any]]:
    from torchhal.platforms.records import DeviceInfo

    def count() -> int:
        n = platform.device_count()
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise TypeError(f"returned {n!r}; it must be an int >= 0")
        return n

    def device_info(index: int) -> dict[str, Any]:
        d = platform.device_info(index)
        if not isinstance(d, DeviceInfo):
            raise TypeError(f"returned {type(d).__name__} {d!r}; it must return a torchhal.DeviceInfo")
        return asdict(d)

    def memory_info(index: int) -> dict[str, Any]:
        return asdict(platform.memory_info(index))

    n, ok = _plugin_query(reg, platform, "device_count()", count)
    devices = []
    for index in range(n if ok else 0):
        d, d_ok = _plugin_query(reg, platform, f"device_info({index})", device_info, index)
        m, m_ok = _plugin_query(reg, platform, f"memory_info({index})", memory_info, index)
        devices.append({"index": index, "device": d if d_ok else None, "memory": m if m_ok else None})
    return devices


def _attention_rows(platform: Any) -> list[dict[str, Any]]:
    """The attention backends in the order selection tries them: the platform's, then the reference.
    An engine takes the first whose capability runs its model (`Platform.choose_attention`)."""
    rows = []
    support = platform.attention_support
    declared = len(support.backends) if support is not None else 0
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


def _graphs_row(platform: Any) -> str | None:
    """The graph class's name, or None where the platform declares no graphs: a declared
    record is named whatever its class, never shown as "unsupported"."""
    support = platform.graph_support
    if support is None:
        return None
    return getattr(support.graph_class, "__name__", None) or repr(support.graph_class)


def _linear_row(platform: Any) -> dict[str, Any]:
    """The platform's linear kernel for few-row inputs, or a row saying F.linear serves every linear."""
    support = platform.linear_support
    if support is None:
        return {"name": None}
    return {"name": support.name, "max_rows": support.max_rows,
            "dtypes": [str(d).removeprefix("torch.") for d in support.dtypes],
            "graph_capture": support.graph_capture, "note": support.note}


def _compile_row(platform: Any) -> dict[str, Any]:
    """The inductor options the platform asks for compiled layers ({} : inductor's defaults)."""
    support = platform.compile_support
    if support is None:
        return {"inductor_options": {}, "note": ""}
    return {"inductor_options": dict(support.inductor_options), "note": support.note}


def collect_info() -> dict[str, Any]:
    """Everything `torchhal info` shows, as plain data.

    A plugin's misbehaviour (raising, exiting, wrong types) becomes a plugin error in
    the data, never an exception; "current" is None with "error" set when no
    platform resolves. Raises PlatformError only for a bad torchhal setting.
    """
    import torch

    reg = registry()
    info: dict[str, Any] = {
        "torchhal": torchhal.__version__,
        "torch": torch.__version__,
        "spi_version": ".".join(map(str, SPI_VERSION)),
        "platforms": [asdict(s) for s in list_platforms()],
        "current": None,
        "error": None,
    }
    try:
        platform = current_platform()
    except PlatformError as exc:
        info["error"] = str(exc)
        platform = None
    if platform is not None:
        how, where = how_resolved()
        runtime, _ = _plugin_query(reg, platform, "runtime_version()", platform.runtime_version)
        graphs, graphs_ok = _plugin_query(reg, platform, "graph_support()", lambda: _graphs_row(platform))
        ipc, ipc_ok = _plugin_query(reg, platform, "ipc_support()", lambda: platform.ipc_support)
        attention, attention_ok = _plugin_query(reg, platform, "attention_support()", lambda: _attention_rows(platform))
        linear, linear_ok = _plugin_query(reg, platform, "linear_support()", lambda: _linear_row(platform))
        compiled, compile_ok = _plugin_query(reg, platform, "compile_support()", lambda: _compile_row(platform))
        distributed, distributed_ok = _plugin_query(reg, platform, "distributed_support()",
                                                    lambda: platform.distributed_support)
        info["current"] = {
            "name": platform.name,
            "how": how,
            "resolved_at": where,
            "distribution": platform.distribution,
            "version": platform.version,
            "runtime": runtime,
            "dist_backend": platform.dist_backend,
            "environment": _environment(platform.visible_devices_env),
            "devices": _device_rows(reg, platform),
            "capabilities": {
                "graphs": graphs if graphs_ok else None,
                "ipc": (
                    {"peer_redirect": getattr(ipc, "peer_redirect", None), "note": getattr(ipc, "note", "")}
                    if ipc_ok and ipc
                    else None
                ),
                "attention": attention if attention_ok else None,
                "linear": linear if linear_ok else None,
                "compile": compiled if compile_ok else None,
                "distributed": (
                    {"backend": platform.dist_backend,
                     "communicator": "vendor" if distributed.communicator is not None else "default",
                     "graph_capturable": distributed.graph_capturable, "note": distributed.note}
                    if distributed_ok and distributed is not None
                    else None
                ),
            },
        }
    # Read last: detection and the queries above can add errors.
    info["plugin_errors"] = [{**asdict(f), "failed_to": f.failed_to} for f in reg.failures]
    info["plugin_notices"] = list(reg.notices)
    return info


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
    lines += ["", f"Current platform: {cur['name']}  ({cur['how']})",
              f"  resolved at: {cur['resolved_at']}",
              f"  runtime: {cur['runtime']}  dist backend: {cur['dist_backend']}"]
    lines += [f"  {k}={v}" for k, v in cur["environment"].items()]
    for d in cur["devices"]:
        dev, mem = d["device"], d["memory"]
        line = f"  device {d['index']}: " + (dev["name"] if dev else "(device_info failed: see plugin errors)")
        if mem is None:
            line += "  memory: (memory_info failed: see plugin errors)"
        else:
            line += f"  free {mem['free'] / GiB:.1f} / {mem['total'] / GiB:.1f} GiB"
            if mem["reserved"] is not None:
                line += f"  reserved {mem['reserved'] / GiB:.2f} GiB"
        lines.append(line)
    caps = cur["capabilities"]
    lines.append(f"  graphs: {caps['graphs'] or 'unsupported'}")
    ipc = caps["ipc"]
    lines.append("  ipc: " + (f"{ipc['note']} (peer redirect: {ipc['peer_redirect']})" if ipc else "unsupported"))
    distributed = caps["distributed"]
    if distributed is None:
        lines.append("  distributed: (distributed_support() failed: see plugin errors)")
    else:
        communicator = ("the vendor's" if distributed["communicator"] == "vendor"
                        else "torchhal's default (torch.distributed)")
        lines.append(f"  distributed: {distributed['backend']} backend, {communicator} communicator, collectives "
                     f"{'graph-capturable' if distributed['graph_capturable'] else 'not graph-captured'}"
                     + (f"; {distributed['note']}" if distributed["note"] else ""))
    attention = caps["attention"]
    if attention is None:
        lines.append("  attention: (attention_support() failed: see plugin errors)")
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
        lines.append("  linear: (linear_support() failed: see plugin errors)")
    elif linear["name"] is None:
        lines.append("  linear: F.linear (the platform supplies no linear kernel)")
    else:
        lines.append(f"  linear: {linear['name']} for inputs of at most {linear['max_rows']} row(s), F.linear above "
                     f"({'/'.join(linear['dtypes'])}{', graph capture' if linear['graph_capture'] else ''})")
    compiled = caps["compile"]
    if compiled is None:
        lines.append("  compile: (compile_support() failed: see plugin errors)")
    elif not compiled["inductor_options"]:
        lines.append("  compile: inductor's defaults (the platform asks for no options)")
    else:
        options = ", ".join(f"{k}={v!r}" for k, v in compiled["inductor_options"].items())
        lines.append(f"  compile: inductor options {options}" + (f" ({compiled['note']})" if compiled["note"] else ""))
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace) -> int:
    """Exit 0 when a platform resolves (plugin errors are shown, not fatal), else 2."""
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
