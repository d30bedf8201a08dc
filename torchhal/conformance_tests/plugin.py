"""pytest plugin that turns the conformance tests into a vendor report.

Loaded through the `pytest11` entry point; inert unless conformance tests run.
It selects the profile's groups, gates undeclared capabilities, applies the
vendor's expectation file, and ends with a table per group and a verdict.
"""

from __future__ import annotations

import json
import os
import platform as host
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import torchhal
from torchhal.conformance_tests import EXIT_CODES, GROUPS, NOT_REQUIRED_PREFIXES, PROFILES, SUITE_VERSION
from torchhal.platforms import (
    PLATFORM_ENV,
    Platform,
    PlatformError,
    PlatformUnavailableError,
    RegisteredPlatform,
)
from torchhal.platforms.testing import describe_error, isolated

EXPECT_CATEGORIES = ("temporary", "unsupported", "permanent")
#: PluginFailure stages that leave a plugin unregistered: the name it would have had is unknown.
LOAD_STAGES = ("import", "register", "validate", "version", "conflict")


@dataclass
class Record:
    id: str
    group: str
    outcome: str = "passed"  # passed | failed | skipped | xfailed | xpassed | error
    duration_s: float = 0.0
    measured: dict[str, Any] = field(default_factory=dict)
    skip_reason: str | None = None
    message: str | None = None


@dataclass
class Selection:
    """What ran of the profile when a selection left tests out (the report's `selection`)."""

    selected: int
    in_profile: int
    keyword: str | None = None  # -k
    markers: str | None = None  # -m
    deselect: list[str] = field(default_factory=list)  # --deselect
    #: Groups of the profile no test of which was collected (pytest given some of the suite's files).
    groups_not_collected: list[str] = field(default_factory=list)

    def note(self) -> str:
        """The verdict's parenthesis after the profile: `21 of 73 tests selected`."""
        if self.groups_not_collected:
            return (f"{self.selected} test(s) selected; group(s) {', '.join(self.groups_not_collected)} "
                    "not collected")
        return f"{self.selected} of {self.in_profile} tests selected"

    def how(self) -> str:
        """The options that made the selection, as typed."""
        parts = [f"-k {self.keyword!r}" if self.keyword else "", f"-m {self.markers!r}" if self.markers else "",
                 *(f"--deselect {d}" for d in self.deselect)]
        return " ".join(p for p in parts if p) or "the test paths given to pytest"


@dataclass
class SuiteState:
    platform_name: str
    device: int
    profile: str
    expectations: dict[str, dict[str, str]]
    records: dict[str, Record] = field(default_factory=dict)
    header: dict[str, Any] = field(default_factory=dict)
    #: (verdict class, verdict line), set when the session finishes with conformance tests.
    outcome: tuple[str, str] | None = None
    json_error: str | None = None
    #: Conformance tests of the profile collected, and their groups, before any selection (-k, -m, --deselect).
    in_profile: int = 0
    groups_collected: set[str] = field(default_factory=set)
    #: Set when a selection left out tests of the profile: such a run makes no conformance claim.
    selection: Selection | None = None

    @property
    def platform_chosen_automatically(self) -> bool:
        return not self.platform_name


class ConformanceUsageError(ValueError):
    """A bad --expect file, report path, platform name or device index: said in one line before any test runs."""


STATE_KEY = pytest.StashKey[SuiteState]()
_STATE: SuiteState | None = None  # report hooks get no config: the session's state, set at configure


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("torchhal", "torchhal conformance")
    group.addoption("--torchhal-platform", default=None, help="platform to test (default: the current one)")
    group.addoption("--torchhal-device", type=int, default=0, help="device index to test")
    group.addoption("--torchhal-profile", default="core", choices=sorted(PROFILES), help="core or full")
    group.addoption("--torchhal-expect", default=None, help="vendor expectation file (TOML or YAML)")
    group.addoption("--torchhal-json", default=None, help="write the JSON report here")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance(group): a torchhal conformance test of one capability group")
    # Stripped as platform selection strips it: "cpu " names cpu there too.
    name = (config.getoption("--torchhal-platform") or os.environ.get("TORCHHAL_PLATFORM") or "").strip()
    global _STATE
    expect_path = config.getoption("--torchhal-expect")
    try:
        expectations = load_expectations(expect_path) if expect_path else {}
        for option in ("--torchhal-json", "--junitxml"):
            path = config.getoption(option, default=None)
            if path:
                check_report_path(path, option)
        if _collecting_conformance(config):  # other pytest sessions never resolve a platform here
            check_target(config.getoption("--torchhal-platform") or "", config.getoption("--torchhal-device"),
                         "--torchhal-platform", "--torchhal-device")
    except ConformanceUsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[STATE_KEY] = _STATE = SuiteState(
        platform_name=name,
        device=config.getoption("--torchhal-device"),
        profile=config.getoption("--torchhal-profile"),
        expectations=expectations,
    )


def load_expectations(path: str) -> dict[str, dict[str, str]]:
    """Test id -> {reason, category}. TOML or YAML, chosen by the file's extension.

    Raises ConformanceUsageError, naming the file and what to fix, for a missing,
    unreadable, malformed or wrong-shaped file.
    """
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConformanceUsageError(f"--expect {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConformanceUsageError(f"--expect {path}: cannot read it ({exc})") from None
    data: Any
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ConformanceUsageError(
                f"--expect {path}: YAML needs PyYAML (pip install pyyaml), or write the file as TOML"
            ) from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            reason = " ".join(str(exc).split())
            raise ConformanceUsageError(f"--expect {path}: not valid YAML: {reason}") from None
    else:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover
            import tomli as tomllib
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConformanceUsageError(f"--expect {path}: not valid TOML: {exc}") from None
    if not isinstance(data, dict):
        raise ConformanceUsageError(
            f"--expect {path}: the top level is a {type(data).__name__}; it must map test ids "
            "('group::test_name') to entries with a 'reason' and a 'category'"
        )
    out = {}
    for test_id, entry in data.items():
        if not isinstance(test_id, str) or "::" not in test_id:
            raise ConformanceUsageError(
                f"--expect {path}: key {test_id!r} is not a test id; write it as 'group::test_name'"
            )
        if not isinstance(entry, dict) or not entry.get("reason"):
            raise ConformanceUsageError(f"--expect {path}: entry {test_id!r} needs a 'reason' (and a 'category')")
        category = entry.get("category", "temporary")
        if category not in EXPECT_CATEGORIES:
            raise ConformanceUsageError(
                f"--expect {path}: entry {test_id!r} has category {category!r}; "
                f"use one of {', '.join(EXPECT_CATEGORIES)}"
            )
        out[test_id] = {"reason": str(entry["reason"]), "category": category}
    return out


def check_report_path(path: str, option: str) -> None:
    """Fail now, before any test runs, if a report cannot be written to `path`."""
    target = Path(path)
    if target.is_dir():
        raise ConformanceUsageError(f"{option} {path}: is a directory; give a file path")
    existed = target.exists()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("a"):
            pass
    except OSError as exc:
        raise ConformanceUsageError(f"{option} {path}: cannot write the report there ({exc.strerror or exc})") from None
    if not existed:
        target.unlink()  # only probed: the report itself is written at the end


def check_target(name: str, device: int, platform_option: str, device_option: str) -> None:
    """Fail now, before any test runs, on a platform name no plugin provides, a bad torchhal
    setting (TORCHHAL_DETECT_TIMEOUT, TORCHHAL_PLUGINS) or a device index the platform does
    not have: a mistake in the command, not the plugin's failure.

    `name` "" means TORCHHAL_PLATFORM, else the current platform. A name no plugin registers
    is refused even when a plugin failed to load (the line names that plugin and its error, in
    case it was the one meant): a typo must not run the suite. The plugin's own trouble stays
    the suite's to report: a platform unavailable here (INCOMPLETE), a device_count() that
    raises or counts none."""
    if device < 0:
        raise ConformanceUsageError(f"{device_option} {device} is out of range: device indices start at 0")
    env_name = os.environ.get(PLATFORM_ENV, "").strip()
    requested, named_by = (name, f"{platform_option} {name!r}") if name else (env_name, f"{PLATFORM_ENV}={env_name!r}")
    try:
        reg = torchhal.registry()
        if requested and requested not in reg.platforms and requested not in reg.excluded:
            replaced = reg.replacement_note(requested)
            if replaced is not None:
                raise ConformanceUsageError(f"{named_by}: {replaced}")
            unregistered = f"{named_by} is not a registered platform (registered: {', '.join(reg.names())})"
            failed = [" ".join(str(f).split()) for f in reg.failures if f.stage in LOAD_STAGES]  # one line
            if failed:  # the platform it would have registered is unknown: it may be the one meant
                raise ConformanceUsageError(
                    f"{unregistered}; name one of them, or, if {requested!r} is the platform of a plugin that "
                    f"failed to load, fix that plugin (torchhal info shows it): {'; '.join(failed)}"
                )
            raise ConformanceUsageError(
                f"{unregistered}; name one of them, or install the plugin that provides {requested!r} (torchhal "
                "info lists them)"
            )
        platform = torchhal.get_platform(requested) if requested else torchhal.current_platform()
    except PlatformUnavailableError:
        return
    except PlatformError as exc:  # a bad setting; the platform layer's message names it and the fix
        raise ConformanceUsageError(str(exc)) from None
    count, _ = isolated(platform.device_count)  # raising or exiting is a plugin bug: the device tests report it
    if isinstance(count, int) and 0 < count <= device:
        raise ConformanceUsageError(f"{device_option} {device} is out of range: platform {platform.name!r} has "
                                    f"{count} device(s) here, 0..{count - 1}")


def conformance_id(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("conformance")
    if marker is None:
        return None
    return f"{marker.args[0]}::{item.name}"


@pytest.hookimpl(tryfirst=True)  # before -k, -m and --deselect: counts the whole profile
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = config.stash[STATE_KEY]
    groups = PROFILES[state.profile]
    keep, drop = [], []
    seen_ids = set()
    for item in items:
        test_id = conformance_id(item)
        if test_id is None:
            keep.append(item)
            continue
        seen_ids.add(test_id)
        group = test_id.split("::")[0]
        if group not in groups:
            drop.append(item)
            continue
        keep.append(item)
        expected = state.expectations.get(test_id)
        if expected:
            item.add_marker(pytest.mark.xfail(reason=f"{expected['category']}: {expected['reason']}", strict=True))
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    profile_ids = [test_id for item in keep if (test_id := conformance_id(item)) is not None]
    state.in_profile = len(profile_ids)
    state.groups_collected = {test_id.split("::")[0] for test_id in profile_ids}
    if seen_ids:
        for unknown in sorted(set(state.expectations) - seen_ids):
            warnings.warn(f"expectation file entry {unknown!r} matches no conformance test", stacklevel=1)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Record a selection: a run of part of the profile is reported as such, never as the verdict."""
    state = session.config.stash.get(STATE_KEY, None)
    if state is None:
        return
    if not state.in_profile:
        return  # not a conformance session, or nothing to select from (NO TESTS RAN says so)
    ran = sum(conformance_id(item) is not None for item in session.items)
    # pytest given some of the suite's files collects only their groups: a selection too.
    missing = [g for g in PROFILES[state.profile] if g not in state.groups_collected]
    if ran < state.in_profile or missing:
        config = session.config
        state.selection = Selection(
            selected=ran, in_profile=state.in_profile,
            keyword=config.getoption("keyword", default="") or None,
            markers=config.getoption("markexpr", default="") or None,
            deselect=[str(d) for d in config.getoption("deselect", default=None) or []],
            groups_not_collected=missing,
        )


# -- fixtures -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def suite(request: pytest.FixtureRequest) -> SuiteState:
    return request.config.stash[STATE_KEY]


@pytest.fixture(scope="session")
def registered(suite: SuiteState) -> RegisteredPlatform:
    """The plugin under test, whether or not it is available here."""
    reg = torchhal.registry()
    name = suite.platform_name or _current_name()
    if name not in reg.platforms:
        pytest.fail(f"platform {name!r} is not registered; registered: {', '.join(reg.names())}")
    return reg.platforms[name]


def _current_name() -> str:
    try:
        return torchhal.current_platform().name
    except PlatformError as exc:
        pytest.fail(f"no current platform: {exc}")


@pytest.fixture(scope="session")
def platform(registered: RegisteredPlatform) -> Platform:
    try:
        return torchhal.get_platform(registered.plugin.name)
    except PlatformError as exc:
        pytest.skip(f"platform unavailable: {exc}")


@pytest.fixture(scope="session")
def device_index(platform: Platform, suite: SuiteState) -> int:
    count, error = isolated(platform.device_count)  # a sys.exit() here would end the session
    if error is not None:
        pytest.fail(f"device_count() failed: {describe_error(error)}")
    if not isinstance(count, int):
        pytest.fail(f"device_count() returned {count!r}; it must be an int")
    if not 0 <= suite.device < count:
        pytest.fail(f"--torchhal-device {suite.device} is out of range (0..{count - 1})")
    platform.set_device(suite.device)
    return suite.device


@pytest.fixture
def measure(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Tests put measured values here; they land in the JSON report."""
    values: dict[str, Any] = {}
    request.node.user_properties.append(("measured", values))
    return values


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(1234)


# -- gating --------------------------------------------------------------------------


def pytest_runtest_setup(item: pytest.Item) -> None:
    test_id = conformance_id(item)
    if test_id is None:
        return
    group = test_id.split("::")[0]
    if group not in ("graphs", "ipc", "distributed", "attention", "linear", "compile"):
        return
    state = item.config.stash[STATE_KEY]
    try:
        platform = torchhal.get_platform(state.platform_name or _current_name())
    except PlatformError as exc:
        pytest.skip(f"platform unavailable: {exc}")
    if group == "graphs" and platform.graph_support is None:
        pytest.skip("undeclared: the platform declares no graph support")
    if group == "ipc" and platform.ipc_support is None:
        pytest.skip("undeclared: the platform declares no IPC support")
    if group == "attention" and platform.attention_support is None:
        pytest.skip("undeclared: the platform declares no attention backend (the reference serves it)")
    if group == "linear" and platform.linear_support is None:
        pytest.skip("undeclared: the platform declares no linear kernel (F.linear serves it)")
    if group == "compile" and platform.compile_support is None:
        pytest.skip("undeclared: the platform asks for no inductor options")
    if group == "distributed":
        import torch.distributed as dist

        # The torch build, not the plugin: required, so the verdict is INCOMPLETE, never CONFORMANT. A declared
        # backend this process lacks is the plugin's failure (test_the_declared_dist_backend_is_available).
        if not dist.is_available():
            pytest.skip("torch.distributed unavailable: this torch build has none (torch.distributed.is_available() "
                        "is False); run the suite under a torch build with distributed support")


# -- reporting -----------------------------------------------------------------------


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    state = _STATE
    if state is None:
        return
    properties = dict(report.user_properties)
    test_id = properties.get("_conformance_id")
    if not isinstance(test_id, str):
        return
    record = state.records.setdefault(test_id, Record(test_id, test_id.split("::")[0]))
    record.duration_s += report.duration
    for key, value in report.user_properties:
        if key == "measured" and isinstance(value, dict):
            record.measured.update(value)
    if report.skipped:
        if hasattr(report, "wasxfail"):
            record.outcome = "xfailed"
            record.message = report.wasxfail
        else:
            record.outcome = "skipped"
            longrepr = report.longrepr
            record.skip_reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            record.skip_reason = record.skip_reason.removeprefix("Skipped: ")
    elif report.failed:
        if report.when == "call" and "XPASS(strict)" in str(report.longrepr):
            record.outcome = "xpassed"  # strict xfail that passed
            record.message = "expected to fail (expectation file) but passed: remove the entry"
        else:
            record.outcome = "failed" if report.when == "call" else "error"
            record.message = failure_message(report)
    elif report.passed and report.when == "call" and record.outcome not in ("failed", "error"):
        record.outcome = "passed"


def failure_message(report: pytest.TestReport) -> str | None:
    """The assertion's or exception's own message, not pytest's `file:line: AssertionError`."""
    if not report.longrepr:
        return None
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None and crash.message else str(report.longrepr)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None
    first = lines[0]
    for prefix in ("AssertionError: ", "Failed: "):
        first = first.removeprefix(prefix)
    if first == "AssertionError" and len(lines) > 1:  # a bare assert: pytest's explanation follows
        first = lines[1]
    return first[:500]


def pytest_itemcollected(item: pytest.Item) -> None:
    test_id = conformance_id(item)
    if test_id:
        item.user_properties.append(("_conformance_id", test_id))


def pytest_report_header(config: pytest.Config) -> list[str]:
    state = config.stash[STATE_KEY]
    if not _collecting_conformance(config):
        return []
    state.header = header_facts(state)
    h = state.header
    return [
        f"torchhal conformance suite {SUITE_VERSION} (profile {state.profile})",
        f"platform: {h['platform']} from {h['distribution']} {h['version']}",
        f"torch {h['torch']} ({', '.join(f'{k} {v}' for k, v in h['torch_build'].items())}); runtime: {h['runtime']}",
        f"device {state.device}: {h['device_name']}",
        "environment: " + (", ".join(f"{k}={v}" for k, v in h["environment"].items()) or "(none set)"),
    ]


def _collecting_conformance(config: pytest.Config) -> bool:
    args = " ".join(str(a) for a in config.args)
    return "conformance_tests" in args or bool(config.getoption("--torchhal-platform"))


def header_facts(state: SuiteState) -> dict[str, Any]:
    reg = torchhal.registry()
    name = state.platform_name
    if not name:
        try:
            name = torchhal.current_platform().name
        except PlatformError as exc:
            name = f"<none: {exc}>"
    facts: dict[str, Any] = {
        "suite_version": SUITE_VERSION,
        "profile": state.profile,
        "platform": name,
        "torch": torch.__version__,
        # Every version string the torch build reports (git, CUDA/HIP/XPU runtime …), named by torch itself.
        "torch_build": {k: v for k, v in vars(torch.version).items() if not k.startswith("_") and isinstance(v, str)},
        "python": sys.version.split()[0],
        "host": host.node(),
        "distribution": "?",
        "version": "?",
        "runtime": None,
        "device_name": None,
        "environment": {},
    }
    entry = reg.platforms.get(name)
    if entry is not None:
        facts["distribution"], facts["version"] = entry.distribution, entry.version
        env_names = {k for k in os.environ if k.startswith("TORCHHAL_")} | set(entry.plugin.visible_devices_env)
        facts["environment"] = {k: os.environ[k] for k in sorted(env_names) if k in os.environ}

        def ask(call: Callable[[], Any]) -> Any:
            """The plugin's answer, or what went wrong: the report must print for a plugin that raises or exits."""
            result, error = isolated(call)
            return result if error is None else f"<unavailable: {describe_error(error)}>"

        platform = ask(lambda: torchhal.get_platform(name))
        if isinstance(platform, Platform):
            facts["runtime"] = ask(platform.runtime_version) if callable(platform.runtime_version) else None
            facts["device_name"] = ask(lambda: platform.device_info(state.device).name)
        else:
            facts["device_name"] = platform
    return facts


def plugin_failures() -> list[str]:
    """Every plugin that failed to import, register, validate or detect, as one line each."""
    return [str(f) for f in torchhal.registry().failures]


def verdict_class(state: SuiteState, failures: list[str]) -> tuple[str, str]:
    """(class, verdict line); the class is a key of EXIT_CODES."""
    records = list(state.records.values())
    bad = [r for r in records if r.outcome in ("failed", "error", "xpassed")]
    incomplete = [
        r for r in records if r.outcome == "skipped" and not (r.skip_reason or "").startswith(NOT_REQUIRED_PREFIXES)
    ]
    if not records:
        return "NO TESTS RAN", "NO TESTS RAN"
    # A selection keeps its class (and exit code) but says so in the line: never the bare verdict.
    scope = state.profile if state.selection is None else f"{state.profile}, {state.selection.note()}"
    if bad:
        return "NOT CONFORMANT", f"NOT CONFORMANT ({scope}): {len(bad)} required test(s) failed"
    if failures and state.platform_chosen_automatically:
        # The platform was picked without a failed plugin that may have been the one meant.
        tested = state.header.get("platform", "?") if state.header else "?"
        return "PLUGIN FAILURES", (
            f"PLUGIN FAILURES ({scope}): {len(failures)} installed plugin(s) failed, so "
            f"{tested} was tested instead; fix them or name the platform with --platform"
        )
    if incomplete:
        return "INCOMPLETE", f"INCOMPLETE ({scope}): {len(incomplete)} required test(s) could not run"
    return "CONFORMANT", f"CONFORMANT ({scope})"


def is_conformant(state: SuiteState) -> bool:
    """The claim a report makes: every required test of the whole profile passed (no selection)."""
    return state.outcome is not None and state.outcome[0] == "CONFORMANT" and state.selection is None


def finished_outcome() -> tuple[str, str] | None:
    """The (verdict class, line) of the last conformance session in this process, if it reached one."""
    return _STATE.outcome if _STATE is not None else None


def verdict(state: SuiteState) -> tuple[bool, str]:
    cls, text = verdict_class(state, plugin_failures())
    return cls == "CONFORMANT" and state.selection is None, text


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Decide the verdict, write the JSON report, and exit with the verdict's code."""
    state = session.config.stash.get(STATE_KEY, None)
    if state is None or not (state.records or _collecting_conformance(session.config)):
        return  # not a conformance run
    if exitstatus in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.INTERNAL_ERROR, pytest.ExitCode.USAGE_ERROR):
        return  # no verdict: pytest's own code says why
    if not state.header:
        state.header = header_facts(state)
    failures = plugin_failures()
    state.outcome = verdict_class(state, failures)
    json_path = session.config.getoption("--torchhal-json")
    if json_path:
        try:
            write_report(state, json_path)
        except OSError as exc:
            state.json_error = f"cannot write the JSON report to {json_path}: {exc.strerror or exc}"
    session.exitstatus = EXIT_CODES[state.outcome[0]]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(STATE_KEY, None)
    if state is None or state.outcome is None:
        return
    tr = terminalreporter
    tr.section("torchhal conformance")
    failures = plugin_failures()
    if failures:
        # First: a failed plugin may be the platform the vendor meant to test.
        tr.write_line(f"PLUGIN FAILURES ({len(failures)}):", red=True, bold=True)
        for line in failures:
            tr.write_line(f"  {line}", red=True)
        tr.write_line("")
    columns = ("passed", "failed", "skipped", "xfailed", "total")
    tr.write_line(f"{'group':<12}" + "".join(f"{c:>9}" for c in columns))
    for group in GROUPS:
        recs = [r for r in state.records.values() if r.group == group]
        if not recs:
            continue
        counts = {
            "passed": sum(r.outcome == "passed" for r in recs),
            "failed": sum(r.outcome in ("failed", "error", "xpassed") for r in recs),
            "skipped": sum(r.outcome == "skipped" for r in recs),
            "xfailed": sum(r.outcome == "xfailed" for r in recs),
            "total": len(recs),
        }
        tr.write_line(f"{group:<12}" + "".join(f"{counts[c]:>9}" for c in columns))
    for r in state.records.values():
        if r.outcome == "skipped":
            tr.write_line(f"  skipped {r.id}: {r.skip_reason}")
        elif r.outcome in ("failed", "error", "xpassed"):
            tr.write_line(f"  {r.outcome.upper()} {r.id}: {r.message}")
    cls, text = state.outcome
    ok = is_conformant(state)
    selection = state.selection
    tr.write_line("")
    if selection is not None:
        tr.write_line(f"selection: {selection.how()} ({selection.note()}, profile {state.profile}): not a "
                      "conformance verdict; run without a selection for one", yellow=True)
    passed_selection = cls == "CONFORMANT" and not ok
    tr.write_line(f"VERDICT: {text}", bold=True, green=ok, yellow=passed_selection, red=not ok and not passed_selection)
    tr.write_line(f"exit code: {EXIT_CODES[cls]}")
    json_path = config.getoption("--torchhal-json")
    if state.json_error:
        tr.write_line(f"torchhal conformance: {state.json_error}", red=True)
    elif json_path:
        tr.write_line(f"JSON report: {json_path}")


def write_report(state: SuiteState, path: str) -> None:
    assert state.outcome is not None
    cls, text = state.outcome
    report = {
        "suite_version": SUITE_VERSION,
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": state.header or header_facts(state),
        "profile": state.profile,
        "conformant": is_conformant(state),
        "verdict": text,
        "verdict_class": cls,
        "exit_code": EXIT_CODES[cls],
        # None for a run of the whole profile; else what was selected: `conformant` is then false.
        "selection": None if state.selection is None else {**asdict(state.selection), "how": state.selection.how()},
        "plugin_failures": [{**asdict(f), "message": str(f)} for f in torchhal.registry().failures],
        "tests": [vars(r) for r in state.records.values()],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2, default=str))
