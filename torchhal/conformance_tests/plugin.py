"""pytest plugin that turns the conformance tests into a vendor report.

`torchhal conformance` loads it; plain pytest loads it with `-p torchhal.conformance_tests.plugin`.
It checks the command's inputs before any test runs, selects the profile's groups, gates
undeclared capabilities, applies the vendor's expectation file, and ends with a table per
group and a verdict, which the JSON and JUnit reports carry too.

PYTEST_DONT_REWRITE: the CLI imports this module (to check its inputs) before pytest loads it,
too late for pytest to rewrite its asserts, which it would warn about on every run.
"""

from __future__ import annotations

import json
import os
import platform as host
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from _pytest.junitxml import LogXML, xml_key  # pytest's JUnit writer: the verdict is added as it writes

import torchhal
from torchhal.conformance_tests import EXIT_CODES, GROUPS, NOT_REQUIRED_PREFIXES, PROFILES, SUITE_VERSION
from torchhal.platforms import (
    PLATFORM_ENV,
    Platform,
    PlatformError,
    PlatformRegistry,
    PlatformUnavailableError,
    RegisteredPlatform,
)
from torchhal.platforms.testing import describe_error, isolated

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EXPECT_CATEGORIES = ("temporary", "unsupported", "permanent")
#: PluginFailure stages that leave a plugin unregistered: the name it would have had is unknown.
LOAD_STAGES = ("import", "register", "validate", "version", "conflict")
FAILED = ("failed", "error", "xpassed")
#: Optional groups: the capability the platform declares for each, and what its absence means.
DECLARED = {
    "graphs": ("graph_support", "the platform declares no graph support"),
    "ipc": ("ipc_support", "the platform declares no IPC support"),
    "attention": ("attention_support", "the platform declares no attention backend (the reference serves it)"),
    "linear": ("linear_support", "the platform declares no linear kernel (F.linear serves it)"),
    "compile": ("compile_support", "the platform asks for no inductor options"),
    "virtual_memory": ("virtual_memory_support", "the platform declares no virtual memory (engines sleep by host "
                                                 "offload)"),
}
VERDICT_TESTCASE = "torchhal_conformance::verdict"


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
    #: pytest node id -> conformance test id ("group::test_name") of each test of the profile collected,
    #: before any selection (-k, -m, --deselect).
    test_ids: dict[str, str] = field(default_factory=dict)
    header: dict[str, Any] = field(default_factory=dict)
    #: (verdict class, verdict line), set when the run finishes.
    outcome: tuple[str, str] | None = None
    json_error: str | None = None
    #: Set when a selection left out tests of the profile: such a run makes no conformance claim.
    selection: Selection | None = None

    @property
    def platform_chosen_automatically(self) -> bool:
        return not self.platform_name


_STATE: SuiteState | None = None  # set at configure; report hooks get no config to find it by


def suite_state() -> SuiteState:
    assert _STATE is not None, "pytest_configure sets the state before any other hook runs"
    return _STATE


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("torchhal", "torchhal conformance")
    group.addoption("--torchhal-platform", default=None, help="platform to test (default: the current one)")
    group.addoption("--torchhal-device", type=int, default=0, help="device index to test")
    group.addoption("--torchhal-profile", default="core", choices=sorted(PROFILES), help="core or full")
    group.addoption("--torchhal-expect", default=None, help="vendor expectation file (TOML or YAML)")
    group.addoption("--torchhal-json", default=None, help="write the JSON report here")


def pytest_configure(config: pytest.Config) -> None:
    """The command's inputs, checked before any test runs (a pytest.UsageError names the value and the fix)."""
    global _STATE
    config.addinivalue_line("markers", "conformance(group): a torchhal conformance test of one capability group")
    platform, device = config.getoption("--torchhal-platform") or "", config.getoption("--torchhal-device")
    expect = config.getoption("--torchhal-expect")
    expectations = load_expectations(expect) if expect else {}
    for option in ("--torchhal-json", "--junitxml"):
        if path := config.getoption(option, default=None):
            check_report_path(path, option)
    check_target(platform, device, "--torchhal-platform", "--torchhal-device")
    # Stripped as platform selection strips it: "cpu " names cpu there too.
    _STATE = SuiteState(platform_name=(platform or os.environ.get(PLATFORM_ENV) or "").strip(), device=device,
                        profile=config.getoption("--torchhal-profile"), expectations=expectations)


def load_expectations(path: str) -> dict[str, dict[str, str]]:
    """Test id -> {reason, category}. TOML or YAML, chosen by the file's extension. A missing,
    unreadable, malformed or wrong-shaped file is a pytest.UsageError naming the file and the fix;
    so is one nested past Python's recursion limit, or a YAML alias bomb (no value of the file is
    turned into text unless it is a str)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = "no such file" if isinstance(exc, FileNotFoundError) else f"cannot read it ({exc})"
        raise pytest.UsageError(f"--expect {path}: {why}") from None
    kind = "YAML" if path.endswith((".yaml", ".yml")) else "TOML"
    parse, errors = _parser(kind, path)
    try:
        data = parse(text) or {}
    except errors as exc:
        why = "nested too deeply to read" if isinstance(exc, RecursionError) else " ".join(str(exc).split())
        raise pytest.UsageError(f"--expect {path}: not valid {kind}: {why}") from None
    problem = _expectations_problem(data)
    if problem is not None:
        raise pytest.UsageError(f"--expect {path}: {problem}")
    return {test_id: {"reason": entry["reason"], "category": entry.get("category", "temporary")}
            for test_id, entry in data.items()}


def _parser(kind: str, path: str) -> tuple[Callable[[str], Any], tuple[type[Exception], ...]]:
    """The function that reads an expectation file of `kind`, and the errors it raises for bad text
    (RecursionError for text nested past Python's recursion limit)."""
    if kind == "TOML":
        return tomllib.loads, (tomllib.TOMLDecodeError, RecursionError)
    try:
        import yaml
    except ImportError:
        raise pytest.UsageError(f"--expect {path}: YAML needs PyYAML (pip install pyyaml), or write the file "
                                "as TOML") from None
    return yaml.safe_load, (yaml.YAMLError, RecursionError)


def _expectations_problem(data: object) -> str | None:
    """What is wrong with an expectation file's data, naming no more of a value that is not a str
    than its type (printing a YAML alias bomb would expand it)."""
    if not isinstance(data, dict):
        return (f"the top level is a {type(data).__name__}; it must map test ids ('group::test_name') to entries "
                "with a 'reason' and a 'category'")
    for test_id, entry in data.items():
        if not isinstance(test_id, str) or "::" not in test_id:
            shown = repr(test_id) if isinstance(test_id, (str, int, float)) else f"of type {type(test_id).__name__}"
            return f"key {shown} is not a test id; write it as 'group::test_name'"
        if not isinstance(entry, dict) or not isinstance(entry.get("reason"), str) or not entry["reason"]:
            return f"entry {test_id!r} needs a 'reason' (text) and a 'category'"
        category = entry.get("category", "temporary")
        if category not in EXPECT_CATEGORIES:
            shown = repr(category) if isinstance(category, str) else f"of type {type(category).__name__}"
            return f"entry {test_id!r} has category {shown}; use one of {', '.join(EXPECT_CATEGORIES)}"
    return None


def check_report_path(path: str, option: str) -> None:
    """Fail now, before any test runs, if a report cannot be written to `path`."""
    target = Path(path)
    if target.is_dir():
        raise pytest.UsageError(f"{option} {path}: is a directory; give a file path")
    existed = target.exists()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("a"):
            pass
    except OSError as exc:
        raise pytest.UsageError(f"{option} {path}: cannot write the report there ({exc.strerror or exc})") from None
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
        raise pytest.UsageError(f"{device_option} {device} is out of range: device indices start at 0")
    env_name = os.environ.get(PLATFORM_ENV, "").strip()
    requested, named_by = (name, f"{platform_option} {name!r}") if name else (env_name, f"{PLATFORM_ENV}={env_name!r}")
    try:
        reg = torchhal.registry()
        if requested and requested not in reg.platforms and requested not in reg.excluded:
            raise pytest.UsageError(_not_registered(reg, requested, named_by))
        platform = torchhal.get_platform(requested) if requested else torchhal.current_platform()
    except PlatformUnavailableError:
        return
    except PlatformError as exc:  # a bad setting; the platform layer's message names it and the fix
        raise pytest.UsageError(str(exc)) from None
    count, _ = isolated(platform.device_count)  # raising or exiting is a plugin bug: the device tests report it
    if isinstance(count, int) and 0 < count <= device:
        raise pytest.UsageError(f"{device_option} {device} is out of range: platform {platform.name!r} has "
                                f"{count} device(s) here, 0..{count - 1}")


def _not_registered(reg: PlatformRegistry, requested: str, named_by: str) -> str:
    replaced = reg.replacement_note(requested)
    if replaced is not None:
        return f"{named_by}: {replaced}"
    unregistered = f"{named_by} is not a registered platform (registered: {', '.join(reg.names())}); name one of them"
    failed = [" ".join(str(f).split()) for f in reg.failures if f.stage in LOAD_STAGES]  # one line each
    if failed:  # the platform it would have registered is unknown: it may be the one meant
        return (f"{unregistered}, or, if {requested!r} is the platform of a plugin that failed to load, fix that "
                f"plugin (torchhal info shows it): {'; '.join(failed)}")
    return f"{unregistered}, or install the plugin that provides {requested!r} (torchhal info lists them)"


def conformance_id(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("conformance")
    return None if marker is None else f"{marker.args[0]}::{item.name}"


def group_of(test_id: str) -> str:
    return test_id.split("::")[0]


@pytest.hookimpl(tryfirst=True)  # before -k, -m and --deselect: counts the whole profile
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = suite_state()
    ids = {item: test_id for item in items if (test_id := conformance_id(item)) is not None}
    dropped = {item for item, test_id in ids.items() if group_of(test_id) not in PROFILES[state.profile]}
    if dropped:
        config.hook.pytest_deselected(items=[item for item in items if item in dropped])
        items[:] = [item for item in items if item not in dropped]
    state.test_ids = {item.nodeid: test_id for item, test_id in ids.items() if item not in dropped}
    for item in items:
        if expected := state.expectations.get(state.test_ids.get(item.nodeid, "")):
            item.add_marker(pytest.mark.xfail(reason=f"{expected['category']}: {expected['reason']}", strict=True))
    if ids:
        for unknown in sorted(set(state.expectations) - set(ids.values())):
            warnings.warn(f"expectation file entry {unknown!r} matches no conformance test", stacklevel=1)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Record a selection: a run of part of the profile is reported as such, never as the verdict."""
    state = suite_state()
    if not state.test_ids:
        return  # nothing to select from (NO TESTS RAN says so)
    ran = sum(item.nodeid in state.test_ids for item in session.items)
    # pytest given some of the suite's files collects only their groups: a selection too.
    collected = {group_of(test_id) for test_id in state.test_ids.values()}
    missing = [group for group in PROFILES[state.profile] if group not in collected]
    if ran < len(state.test_ids) or missing:
        config = session.config
        state.selection = Selection(
            selected=ran, in_profile=len(state.test_ids),
            keyword=config.getoption("keyword", default="") or None,
            markers=config.getoption("markexpr", default="") or None,
            deselect=[str(d) for d in config.getoption("deselect", default=None) or []],
            groups_not_collected=missing,
        )


# -- fixtures -----------------------------------------------------------------------


def tested_name() -> str:
    """The platform under test: named (option or TORCHHAL_PLATFORM), else the current one."""
    try:
        return suite_state().platform_name or torchhal.current_platform().name
    except PlatformError as exc:
        pytest.fail(f"no current platform: {exc}")


def tested_platform() -> Platform:
    try:
        return torchhal.get_platform(tested_name())
    except PlatformError as exc:
        pytest.skip(f"platform unavailable: {exc}")


@pytest.fixture(scope="session")
def suite() -> SuiteState:
    return suite_state()


@pytest.fixture(scope="session")
def registered() -> RegisteredPlatform:
    """The plugin under test, whether or not it is available here (check_target refused any other name)."""
    return torchhal.registry().platforms[tested_name()]


@pytest.fixture(scope="session")
def platform() -> Platform:
    return tested_platform()


@pytest.fixture(scope="session")
def device_index(platform: Platform, suite: SuiteState) -> int:
    count, error = isolated(platform.device_count)  # a sys.exit() here would end the run
    if error is not None:
        pytest.fail(f"device_count() failed: {describe_error(error)}")
    assert count is not None, "Platform checked device_count()'s answer: an int"
    if suite.device >= count:  # check_target refused a negative index
        pytest.fail(f"device_count() returned {count!r}, which has no device {suite.device}; it must be the "
                    "number of devices this process sees")
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
    group = test_id and group_of(test_id)
    if group in DECLARED:
        fact, undeclared = DECLARED[group]
        if getattr(tested_platform(), fact) is None:
            pytest.skip(f"undeclared: {undeclared}")
    elif group == "distributed":
        tested_platform()
        # The torch build, not the plugin: required, so the verdict is INCOMPLETE, never CONFORMANT. A declared
        # backend this process lacks is the plugin's failure (test_the_declared_dist_backend_is_available).
        if not torch.distributed.is_available():
            pytest.skip("torch.distributed unavailable: this torch build has none (torch.distributed.is_available() "
                        "is False); run the suite under a torch build with distributed support")


# -- reporting -----------------------------------------------------------------------


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    state = suite_state()
    test_id = state.test_ids.get(report.nodeid)
    if test_id is None:
        return
    record = state.records.setdefault(test_id, Record(test_id, group_of(test_id)))
    record.duration_s += report.duration
    properties: dict[str, Any] = dict(report.user_properties)  # the `measure` fixture's values
    record.measured.update(properties.get("measured", {}))
    if report.skipped:
        if hasattr(report, "wasxfail"):
            record.outcome, record.message = "xfailed", report.wasxfail
        else:
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            record.outcome, record.skip_reason = "skipped", reason.removeprefix("Skipped: ")
    elif report.failed:
        if report.when == "call" and "XPASS(strict)" in str(report.longrepr):
            record.outcome = "xpassed"  # strict xfail that passed
            record.message = "expected to fail (expectation file) but passed: remove the entry"
        else:
            record.outcome = "failed" if report.when == "call" else "error"
            record.message = failure_message(report)


def failure_message(report: pytest.TestReport) -> str | None:
    """The assertion's or exception's own message, not pytest's `file:line: AssertionError`."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None and crash.message else str(report.longrepr)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None
    first = lines[0].removeprefix("AssertionError: ").removeprefix("Failed: ")
    if first == "AssertionError" and len(lines) > 1:  # a bare assert: pytest's explanation follows
        first = lines[1]
    return first[:500]


def pytest_report_header(config: pytest.Config) -> list[str]:
    state = suite_state()
    state.header = h = header_facts(state)
    return [
        f"torchhal conformance suite {SUITE_VERSION} (profile {state.profile})",
        f"platform: {h['platform']} from {h['distribution']} {h['version']}",
        f"torch {h['torch']} ({', '.join(f'{k} {v}' for k, v in h['torch_build'].items())}); runtime: {h['runtime']}",
        f"device {state.device}: {h['device_name']}",
        "environment: " + (", ".join(f"{k}={v}" for k, v in h["environment"].items()) or "(none set)"),
    ]


def header_facts(state: SuiteState) -> dict[str, Any]:
    try:
        name = state.platform_name or torchhal.current_platform().name
    except PlatformError as exc:
        name = f"<none: {exc}>"
    facts: dict[str, Any] = {
        "suite_version": SUITE_VERSION, "profile": state.profile, "platform": name, "torch": torch.__version__,
        # Every version string the torch build reports (git, CUDA/HIP/XPU runtime …), named by torch itself.
        "torch_build": {k: v for k, v in vars(torch.version).items() if not k.startswith("_") and isinstance(v, str)},
        "python": sys.version.split()[0], "host": host.node(), "distribution": "?", "version": "?",
        "runtime": None, "device_name": None, "environment": {},
    }
    entry = torchhal.registry().platforms.get(name)
    if entry is None:
        return facts
    facts["distribution"], facts["version"] = entry.distribution, entry.version
    env_names = {k for k in os.environ if k.startswith("TORCHHAL_")} | set(entry.plugin.visible_devices_env)
    facts["environment"] = {k: os.environ[k] for k in sorted(env_names) if k in os.environ}

    def ask(call: Callable[[], Any]) -> Any:
        """The plugin's answer, or what went wrong: the report must print for a plugin that raises or exits."""
        result, error = isolated(call)
        return result if error is None else f"<unavailable: {describe_error(error)}>"

    platform = ask(lambda: torchhal.get_platform(name))
    if isinstance(platform, Platform):
        facts["runtime"] = ask(platform.runtime_version)
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
    if not records:
        return "NO TESTS RAN", "NO TESTS RAN"
    bad = [r for r in records if r.outcome in FAILED]
    incomplete = [
        r for r in records if r.outcome == "skipped" and not (r.skip_reason or "").startswith(NOT_REQUIRED_PREFIXES)
    ]
    # A selection keeps its class (and exit code) but says so in the line: never the bare verdict.
    scope = state.profile if state.selection is None else f"{state.profile}, {state.selection.note()}"
    if bad:
        return "NOT CONFORMANT", f"NOT CONFORMANT ({scope}): {len(bad)} required test(s) failed"
    if failures and state.platform_chosen_automatically:
        # The platform was picked without a failed plugin that may have been the one meant.
        return "PLUGIN FAILURES", (
            f"PLUGIN FAILURES ({scope}): {len(failures)} installed plugin(s) failed, so "
            f"{state.header.get('platform', '?')} was tested instead; fix them or name the platform with --platform"
        )
    if incomplete:
        return "INCOMPLETE", f"INCOMPLETE ({scope}): {len(incomplete)} required test(s) could not run"
    return "CONFORMANT", f"CONFORMANT ({scope})"


def is_conformant(state: SuiteState) -> bool:
    """The claim a report makes: every required test of the whole profile passed (no selection)."""
    return state.outcome is not None and state.outcome[0] == "CONFORMANT" and state.selection is None


def finished_outcome() -> tuple[str, str] | None:
    """The (verdict class, line) of the last run in this process, if it reached one."""
    return _STATE.outcome if _STATE is not None else None


@pytest.hookimpl(tryfirst=True)  # before pytest's JUnit writer writes its file
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Decide the verdict, write it into the reports, and exit with the verdict's code."""
    if exitstatus in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.INTERNAL_ERROR, pytest.ExitCode.USAGE_ERROR):
        return  # no verdict: pytest's own code says why
    state = suite_state()
    state.header = state.header or header_facts(state)
    state.outcome = verdict_class(state, plugin_failures())
    json_path = session.config.getoption("--torchhal-json")
    if json_path:
        try:
            write_report(state, json_path)
        except OSError as exc:
            state.json_error = f"cannot write the JSON report to {json_path}: {exc.strerror or exc}"
    junit = session.config.stash.get(xml_key, None)
    if junit is not None:
        junit_verdict(junit, state)
    session.exitstatus = EXIT_CODES[state.outcome[0]]


def junit_verdict(junit: LogXML, state: SuiteState) -> None:
    """The verdict as suite properties and as a testcase that fails unless the class is CONFORMANT,
    so a dashboard counting failures shows an INCOMPLETE or PLUGIN FAILURES run as failed."""
    assert state.outcome is not None
    cls, text = state.outcome
    for name, value in (("verdict", text), ("verdict_class", cls), ("conformant", is_conformant(state)),
                        ("exit_code", EXIT_CODES[cls])):
        junit.add_global_property(f"torchhal_{name}", value)
    failed = cls != "CONFORMANT"
    for when in ("call", "teardown"):
        outcome: Literal["passed", "failed"] = "failed" if failed and when == "call" else "passed"
        longrepr = text if outcome == "failed" else None
        junit.pytest_runtest_logreport(pytest.TestReport(
            VERDICT_TESTCASE, ("torchhal_conformance", None, "verdict"), {}, outcome, longrepr, when))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = suite_state()
    if state.outcome is None:
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
    columns = ("passed", "failed", "skipped", "xfailed")
    tr.write_line(f"{'group':<12}" + "".join(f"{c:>9}" for c in (*columns, "total")))
    for group in GROUPS:
        counts = Counter("failed" if r.outcome in FAILED else r.outcome
                         for r in state.records.values() if r.group == group)
        if counts:
            tr.write_line(f"{group:<12}" + "".join(f"{counts[c]:>9}" for c in columns) + f"{counts.total():>9}")
    for r in state.records.values():
        if r.outcome == "skipped":
            tr.write_line(f"  skipped {r.id}: {r.skip_reason}")
        elif r.outcome in FAILED:
            tr.write_line(f"  {r.outcome.upper()} {r.id}: {r.message}")
    cls, text = state.outcome
    ok = is_conformant(state)
    passed_selection = cls == "CONFORMANT" and not ok
    tr.write_line("")
    if state.selection is not None:
        tr.write_line(f"selection: {state.selection.how()} ({state.selection.note()}, profile {state.profile}): "
                      "not a conformance verdict; run without a selection for one", yellow=True)
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
        "environment": state.header,
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
    Path(path).write_text(json.dumps(report, indent=2, default=str))
