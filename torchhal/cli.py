"""`torchhal info | conformance | plugin new`: the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torchhal
from torchhal.platforms import PlatformError, current_platform, how_resolved, list_platforms, registry

GiB = 1 << 30


def _environment(platform_env: tuple[str, ...] = ()) -> dict[str, str]:
    names = sorted({k for k in os.environ if k.startswith("TORCHHAL_")} | set(platform_env))
    return {k: os.environ[k] for k in names if k in os.environ}


def collect_info() -> dict[str, Any]:
    """Everything `torchhal info` shows, as plain data. Raises PlatformError if none resolves."""
    import torch

    reg = registry()
    info: dict[str, Any] = {
        "torchhal": torchhal.__version__,
        "torch": torch.__version__,
        "platforms": [asdict(s) for s in list_platforms()],
    }
    platform = current_platform()
    how, where = how_resolved()
    devices = []
    for index in range(platform.device_count()):
        d = platform.device_info(index)
        m = platform.memory_info(index)
        devices.append({"device": asdict(d), "memory": asdict(m)})
    graphs, ipc = platform.graph_support, platform.ipc_support
    info["current"] = {
        "name": platform.name,
        "how": how,
        "resolved_at": where,
        "distribution": platform.distribution,
        "version": platform.version,
        "runtime": platform.runtime_version(),
        "dist_backend": platform.dist_backend,
        "environment": _environment(platform.visible_devices_env),
        "devices": devices,
        "capabilities": {
            "graphs": graphs.graph_class.__name__ if graphs else None,
            "ipc": ({"peer_redirect": ipc.peer_redirect, "note": ipc.note} if ipc else None),
        },
    }
    # Read last: detection above can add errors.
    info["plugin_errors"] = [asdict(f) for f in reg.failures]
    return info


def _print_info(info: dict[str, Any]) -> None:
    print(f"torchhal {info['torchhal']}  (torch {info['torch']})")
    print("\nRegistered platforms:")
    for p in info["platforms"]:
        state = "available" if p["available"] else f"unavailable: {p['reason']}"
        print(f"  {p['name']:<6} priority {p['priority']:>3}  {p['distribution']} {p['version']}"
              f"  [{p['source']}]  {state}")
    if info["plugin_errors"]:
        print("\nPlugin errors:")
        for e in info["plugin_errors"]:
            dist = f" ({e['distribution']})" if e["distribution"] else ""
            print(f"  {e['plugin']}{dist}: failed to {e['stage']}: {e['error']}")
    cur = info["current"]
    print(f"\nCurrent platform: {cur['name']}  ({cur['how']})")
    print(f"  resolved at: {cur['resolved_at']}")
    print(f"  runtime: {cur['runtime']}  dist backend: {cur['dist_backend']}")
    for k, v in cur["environment"].items():
        print(f"  {k}={v}")
    for d in cur["devices"]:
        dev, mem = d["device"], d["memory"]
        line = f"  device {dev['index']}: {dev['name']}  free {mem['free'] / GiB:.1f} / {mem['total'] / GiB:.1f} GiB"
        if mem["reserved"] is not None:
            line += f"  reserved {mem['reserved'] / GiB:.2f} GiB"
        print(line)
    caps = cur["capabilities"]
    print(f"  graphs: {caps['graphs'] or 'unsupported'}")
    ipc = caps["ipc"]
    print("  ipc: " + (f"{ipc['note']} (peer redirect: {ipc['peer_redirect']})" if ipc else "unsupported"))


def cmd_info(args: argparse.Namespace) -> int:
    try:
        info = collect_info()
    except PlatformError as exc:
        print(f"torchhal: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(info, sys.stdout, indent=2, default=str)
        print()
    else:
        _print_info(info)
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
