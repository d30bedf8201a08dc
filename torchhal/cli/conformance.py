"""`torchhal conformance`: run the vendor conformance suite on a platform."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from torchhal.cli.output import GuardedStdout, refuse
from torchhal.conformance_tests import EXIT_CODES

#: The suite's own pytest configuration (shipped beside it): the run never reads the
#: caller's pytest.ini / pyproject.toml / conftest, wherever it is started from.
SUITE_CONFIG = "pytest.ini"
SUITE_PLUGIN = "torchhal.conformance_tests.plugin"


def cmd_conformance(args: argparse.Namespace) -> int:
    """Run the suite; the exit code is the verdict's (torchhal.conformance_tests.EXIT_CODES)."""
    try:
        import pytest
    except ImportError:  # the suite runs on pytest, an optional dependency of torchhal
        return refuse("conformance", "the conformance suite runs on pytest, which is not installed: "
                      "pip install 'torchhal[conformance]'")

    from torchhal import conformance_tests
    from torchhal.conformance_tests import plugin as suite_plugin

    # Bad inputs are refused in one line in the command's own words, before pytest starts (its
    # configure checks them for plain pytest, in pytest's words). The report paths are probed
    # last: probing makes their missing folders, which a refusal must not leave.
    try:
        if args.expect:
            suite_plugin.load_expectations(args.expect)
        check_distinct_files(("--expect", args.expect), ("--json", args.json), ("--junit", args.junit))
        suite_plugin.check_target(args.platform or "", args.device, "--platform", "--device")
        for option, path in (("--json", args.json), ("--junit", args.junit)):
            if path:
                suite_plugin.check_report_path(path, option)
    except pytest.UsageError as exc:
        return refuse("conformance", str(exc))

    package_dir = os.path.dirname(conformance_tests.__file__)
    argv = [package_dir, "-c", os.path.join(package_dir, SUITE_CONFIG), "--rootdir", package_dir, "-v",
            "-p", SUITE_PLUGIN, "--torchhal-profile", args.profile, "--torchhal-device", str(args.device)]
    for option, value in (("--torchhal-platform", args.platform), ("--torchhal-expect", args.expect),
                          ("--torchhal-json", args.json), ("--junitxml", args.junit), ("-k", args.k)):
        if value:
            argv += [option, value]
    # A reader that went away (`| head`) or a full disk must not end the run with a traceback: the
    # suite finishes the tests needed for a --json/--junit report, else stops after the current one.
    stdout = GuardedStdout(sys.stdout)
    reports = [path for path in (args.json, args.junit) if path]
    sys.stdout = stdout  # type: ignore[assignment]
    try:
        code = pytest.main(argv, plugins=[] if reports else [_StopWhenUnread(stdout)])
    finally:
        sys.stdout = stdout.stream
    outcome = suite_plugin.finished_outcome()
    if stdout.error is not None:
        written = [path for path in reports if os.path.exists(path)]
        return refuse("conformance", f"cannot write the output: {stdout.error.strerror or stdout.error}"
                      + (f"; verdict {outcome[0]}, report written to {' and '.join(written)}"
                         if outcome is not None and written else ""))
    if outcome is not None:
        return EXIT_CODES[outcome[0]]
    if code == pytest.ExitCode.USAGE_ERROR:
        return EXIT_CODES["USAGE ERROR"]
    return EXIT_CODES["SUITE ERROR"]  # no verdict: pytest said why above


def check_distinct_files(*named: tuple[str, str | None]) -> None:
    """Refuse two options naming one file: a report written over the expectation file (or
    over the other report) would destroy it. `named`: (option, path or None) pairs."""
    import pytest

    seen: dict[str, tuple[str, str]] = {}  # real path -> the first option naming it, as written there
    for option, path in named:
        if not path:
            continue
        real = os.path.realpath(path)
        if real in seen:
            first, written = seen[real]
            what = ("the report would overwrite the expectations: give the report its own file" if first == "--expect"
                    else "one report would overwrite the other: give each its own file")
            raise pytest.UsageError(f"{first} and {option} both name {written}; {what}")
        seen[real] = (option, path)


class _StopWhenUnread:
    """pytest plugin: end the run after the current test once stdout is gone (nothing else to write)."""

    def __init__(self, stdout: GuardedStdout) -> None:
        self.stdout = stdout

    def pytest_runtest_teardown(self, item: Any) -> None:
        if self.stdout.error is not None:
            item.session.shouldstop = "cannot write the output"


def add_command(sub: Any) -> None:
    conf = sub.add_parser("conformance", help="run the conformance suite on a platform")
    conf.add_argument("--platform", help="platform name (default: the current platform)")
    conf.add_argument("--device", type=int, default=0, help="device index to test (default 0)")
    conf.add_argument("--profile", choices=("core", "full"), default="core",
                      help="core: contract, device, memory; full: every declared capability")
    conf.add_argument("--expect", help="vendor expectation file (TOML or YAML)")
    conf.add_argument("--json", help="write the JSON report to this path")
    conf.add_argument("--junit", help="write a JUnit XML report to this path")
    conf.add_argument("-k", help="only tests matching this pytest -k expression (a selection: the verdict line "
                      "says how many of the profile's tests ran, and the report does not claim conformance)")
    conf.set_defaults(func=cmd_conformance)
