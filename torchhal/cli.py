"""`torchhal info | conformance | plugin new`: the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torchhal
from torchhal._generate import add_generate_command
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
    from torchhal.platforms.manager import describe_error, isolated
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
        graphs, graphs_ok = _plugin_query(reg, platform, "graph_support()", lambda: platform.graph_support)
        ipc, ipc_ok = _plugin_query(reg, platform, "ipc_support()", lambda: platform.ipc_support)
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
                "graphs": getattr(getattr(graphs, "graph_class", None), "__name__", None) if graphs_ok else None,
                "ipc": (
                    {"peer_redirect": getattr(ipc, "peer_redirect", None), "note": getattr(ipc, "note", "")}
                    if ipc_ok and ipc
                    else None
                ),
            },
        }
    # Read last: detection and the queries above can add errors.
    info["plugin_errors"] = [{**asdict(f), "failed_to": f.failed_to} for f in reg.failures]
    info["plugin_notices"] = list(reg.notices)
    return info


def _print_info(info: dict[str, Any]) -> None:
    print(f"torchhal {info['torchhal']}  (torch {info['torch']}, plugin SPI {info['spi_version']})")
    print("\nRegistered platforms:")
    for p in info["platforms"]:
        state = "available" if p["available"] else f"unavailable: {p['reason']}"
        print(f"  {p['name']:<6} priority {p['priority']:>3}  {p['distribution']} {p['version']}"
              f"  [{p['source']}]  {state}")
    if not info["platforms"]:
        print("  (none)")
    if info["plugin_errors"]:
        print("\nPlugin errors:")
        for e in info["plugin_errors"]:
            dist = f" ({e['distribution']})" if e["distribution"] else ""
            print(f"  {e['plugin']}{dist}: failed to {e['failed_to']}: {e['error']}")
    if info["plugin_notices"]:
        print("\nPlugin notices:")
        for notice in info["plugin_notices"]:
            print(f"  {notice}")
    cur = info["current"]
    if cur is None:
        return
    print(f"\nCurrent platform: {cur['name']}  ({cur['how']})")
    print(f"  resolved at: {cur['resolved_at']}")
    print(f"  runtime: {cur['runtime']}  dist backend: {cur['dist_backend']}")
    for k, v in cur["environment"].items():
        print(f"  {k}={v}")
    for d in cur["devices"]:
        dev, mem = d["device"], d["memory"]
        line = f"  device {d['index']}: " + (dev["name"] if dev else "(device_info failed: see plugin errors)")
        if mem is None:
            line += "  memory: (memory_info failed: see plugin errors)"
        else:
            line += f"  free {mem['free'] / GiB:.1f} / {mem['total'] / GiB:.1f} GiB"
            if mem["reserved"] is not None:
                line += f"  reserved {mem['reserved'] / GiB:.2f} GiB"
        print(line)
    caps = cur["capabilities"]
    print(f"  graphs: {caps['graphs'] or 'unsupported'}")
    ipc = caps["ipc"]
    print("  ipc: " + (f"{ipc['note']} (peer redirect: {ipc['peer_redirect']})" if ipc else "unsupported"))


def cmd_info(args: argparse.Namespace) -> int:
    """Exit 0 when a platform resolves (plugin errors are shown, not fatal), else 2."""
    try:
        info = collect_info()
    except PlatformError as exc:  # a bad torchhal setting, e.g. TORCHHAL_DETECT_TIMEOUT
        print(f"torchhal: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(info, sys.stdout, indent=2, default=str)
        print()
    else:
        _print_info(info)
    if info["error"] is not None:
        print(f"torchhal: {info['error']}", file=sys.stderr)
        return 2
    return 0


def cmd_conformance(args: argparse.Namespace) -> int:
    """Run the suite; the exit code is the verdict's (torchhal.conformance_tests.EXIT_CODES)."""
    import importlib.metadata as metadata

    import pytest

    from torchhal import conformance_tests
    from torchhal.conformance_tests import EXIT_CODES
    from torchhal.conformance_tests import plugin as suite_plugin
    from torchhal.conformance_tests.plugin import ConformanceUsageError, check_report_path, load_expectations

    # Bad inputs are one line now, not a pytest INTERNALERROR or a traceback after the verdict.
    try:
        if args.expect:
            load_expectations(args.expect)
        if args.json:
            check_report_path(args.json, "--json")
        if args.junit:
            check_report_path(args.junit, "--junit")
    except ConformanceUsageError as exc:
        print(f"torchhal conformance: {exc}", file=sys.stderr)
        return EXIT_CODES["USAGE ERROR"]

    package_dir = os.path.dirname(conformance_tests.__file__)
    argv = [package_dir, "-c", os.devnull, "--rootdir", package_dir, "-p", "no:cacheprovider", "-v",
            "--torchhal-profile", args.profile, "--torchhal-device", str(args.device)]
    if not any(ep.value == "torchhal.conformance_tests.plugin" for ep in metadata.entry_points(group="pytest11")):
        argv += ["-p", "torchhal.conformance_tests.plugin"]  # running from a source tree
    if args.platform:
        argv += ["--torchhal-platform", args.platform]
    if args.expect:
        argv += ["--torchhal-expect", args.expect]
    if args.json:
        argv += ["--torchhal-json", args.json]
    if args.junit:
        argv += ["--junitxml", args.junit]
    if args.k:
        argv += ["-k", args.k]
    code = pytest.main(argv)
    outcome = suite_plugin.finished_outcome()
    if outcome is not None:
        return EXIT_CODES[outcome[0]]
    if code == pytest.ExitCode.USAGE_ERROR:
        return EXIT_CODES["USAGE ERROR"]
    return EXIT_CODES["SUITE ERROR"]  # no verdict: pytest said why above


def cmd_plugin_new(args: argparse.Namespace) -> int:
    from torchhal.plugin_template import TemplateError, write_plugin

    try:
        target = write_plugin(args.name, args.dir)
    except (TemplateError, OSError) as exc:
        print(f"torchhal plugin new: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the {args.name} plugin distribution to {target}")
    print(f"next: fill in the TODOs, pip install -e {target}, torchhal conformance --platform {args.name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchhal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="registered platforms, the current one, its devices")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)
    conf = sub.add_parser("conformance", help="run the conformance suite on a platform")
    conf.add_argument("--platform", help="platform name (default: the current platform)")
    conf.add_argument("--device", type=int, default=0, help="device index to test (default 0)")
    conf.add_argument("--profile", choices=("core", "full"), default="core",
                      help="core: contract, device, memory; full: every declared capability")
    conf.add_argument("--expect", help="vendor expectation file (TOML or YAML)")
    conf.add_argument("--json", help="write the JSON report to this path")
    conf.add_argument("--junit", help="write a JUnit XML report to this path")
    conf.add_argument("-k", help="only tests matching this pytest -k expression")
    conf.set_defaults(func=cmd_conformance)
    add_generate_command(sub)
    plugin = sub.add_parser("plugin", help="tools for plugin authors")
    plugin_sub = plugin.add_subparsers(dest="plugin_command", required=True)
    new = plugin_sub.add_parser("new", help="write a platform plugin distribution to start from")
    new.add_argument("name", help="platform name, a lowercase identifier (e.g. myaccel)")
    new.add_argument("--dir", type=Path, help="where to write it (default: ./torchhal-NAME)")
    new.set_defaults(func=cmd_plugin_new)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
