"""The plugin host: one bad plugin never takes the host down, and is always named.

Hostile plugins run in-process through `make_registry`, and through a real entry
point (tests/plugin_dist/hostile, mode from TORCHHAL_HOSTILE_MODE) under `torchhal info`.
"""

import json
import os
import re
import subprocess
import sys
import threading
import time
import warnings

import pytest

import torchhal
from torchhal.platforms import (
    Availability,
    MemoryInfo,
    PeakMemory,
    PluginConflictError,
    PluginContractError,
    TorchhalPluginWarning,
    UnknownPlatformError,
    hookimpl,
    manager,
)
from torchhal.platforms.testing import plugin_under_test
from torchhal.plugins.cpu import CpuPlatform

from .conftest import PLUGIN_DIST
from .test_selection import fake_platform, plugin_module

HOSTILE = PLUGIN_DIST / "hostile"


def run_info(mode: str, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """`torchhal info` in a fresh process with the hostile distribution installed."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHHAL_")}
    full_env["PYTHONPATH"] = os.pathsep.join([str(HOSTILE), full_env.get("PYTHONPATH", "")])
    full_env["TORCHHAL_HOSTILE_MODE"] = mode
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "torchhal.cli", "info", *args],
        capture_output=True, text=True, env=full_env, timeout=timeout,
    )


def errors_of(reg, stage=None):
    return [f for f in reg.failures if stage is None or f.stage == stage]


# -- BaseException isolation --------------------------------------------------------------


class Exiting(CpuPlatform):
    name = "exiting"
    priority = 50

    def is_available(self):
        sys.exit(5)


def test_sys_exit_in_is_available_is_isolated_and_named(make_registry):
    reg = make_registry(plugin_module(Exiting()))
    with pytest.warns(TorchhalPluginWarning, match=r"'exiting'.*detect: called sys.exit\(5\)"):
        assert torchhal.current_platform().name == "cpu"
    assert [f.plugin for f in errors_of(reg, "detect")] == ["exiting"]


def test_sys_exit_in_the_register_hook_is_isolated(make_registry):
    class ExitsOnRegister:
        @hookimpl
        def torchhal_register_platforms(self):
            raise SystemExit("no licence")

    with pytest.warns(TorchhalPluginWarning, match="called sys.exit\\('no licence'\\)"):
        reg = make_registry(ExitsOnRegister())
    assert errors_of(reg, "register")[0].plugin == "test-plugin-0"
    assert reg.names() == ["cpu"]


def test_a_builtin_that_exits_at_import_is_isolated(make_registry, tmp_path, monkeypatch):
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(TorchhalPluginWarning, match=r"exits_at_import.*import: called sys.exit\(3\)"):
        reg = make_registry(builtins=("torchhal.plugins.cpu", "exits_at_import"))
    assert reg.names() == ["cpu"]


@pytest.mark.parametrize("hook, fire", [
    ("torchhal_platform_activated", lambda: torchhal.current_platform()),
    ("torchhal_cache_emptied", lambda: torchhal.current_platform().empty_cache(torchhal.ReleasePoint.USER)),
])
def test_sys_exit_in_an_observer_is_warned_about_and_the_host_goes_on(make_registry, hook, fire):
    class ExitingObserver:
        pass

    setattr(ExitingObserver, hook, hookimpl(lambda self: sys.exit(7)))
    make_registry(ExitingObserver())
    with pytest.warns(TorchhalPluginWarning, match=rf"observer 'test-plugin-0' failed in {hook}: called sys.exit\(7\)"):
        fire()
    assert torchhal.current_platform().name == "cpu"


def test_keyboard_interrupt_is_not_swallowed(make_registry):
    class Interrupted(CpuPlatform):
        name = "interrupted"
        priority = 50

        def is_available(self):
            raise KeyboardInterrupt

    make_registry(plugin_module(Interrupted()))
    with pytest.raises(KeyboardInterrupt):
        torchhal.current_platform()


def test_a_hanging_detection_times_out_by_name(make_registry, monkeypatch):
    monkeypatch.setenv("TORCHHAL_DETECT_TIMEOUT", "0.2")

    class Hanging(CpuPlatform):
        name = "hanging"
        priority = 50

        def is_available(self):
            import threading

            threading.Event().wait(5)  # longer than the limit; a daemon thread, abandoned
            return Availability.yes()

    reg = make_registry(plugin_module(Hanging()))
    timed_out = r"'hanging'.*did not return within 0.2 s \(TORCHHAL_DETECT_TIMEOUT\)"
    with pytest.warns(TorchhalPluginWarning, match=timed_out):
        assert torchhal.current_platform().name == "cpu"
    status = {s.name: s for s in torchhal.list_platforms()}["hanging"]
    assert not status.available and "timed out" in status.reason
    assert reg.detect_timeout == 0.2


class CallsBack(CpuPlatform):
    """A host-backed simulator whose is_available() asks torchhal about the CPU platform."""

    name = "asim"  # sorts before "cpu": detected first, while the CPU's answer is not cached yet
    priority = -1

    def __init__(self, ask):
        self.ask = ask
        self.returned = threading.Event()

    def is_available(self):
        try:
            return self.ask()
        finally:
            self.returned.set()


CALLS_BACK = r"'asim'.*failed to detect: is_available\(\) calls back into torchhal \(torchhal\.platforms\.{}\(\) from "


def test_is_available_calling_back_into_torchhal_is_a_named_detect_failure_not_a_timeout(make_registry, monkeypatch):
    # Detection holds selection's lock and the registry's: the call back waits for it forever.
    monkeypatch.setenv("TORCHHAL_DETECT_TIMEOUT", "3")
    sim = CallsBack(lambda: torchhal.registry().availability("cpu"))
    reg = make_registry(plugin_module(sim))
    start = time.monotonic()
    with pytest.warns(TorchhalPluginWarning, match=CALLS_BACK.format("selection\\.registry") + r".*test_plugin_host"):
        assert torchhal.current_platform().name == "cpu"
    assert time.monotonic() - start < 2  # found while it waits, not at the 3 s limit
    assert "is_available() must not call torchhal's platform API" in reg.availability("asim").reason
    assert sim.returned.wait(5)  # the abandoned probe ends once detection let go of the locks


def test_without_a_detect_limit_a_call_back_is_named_instead_of_hanging(monkeypatch):
    monkeypatch.setenv("TORCHHAL_DETECT_TIMEOUT", "0")
    holder = {}
    sim = CallsBack(lambda: holder["registry"].availability("cpu"))
    reg = holder["registry"] = manager.build_registry(
        ("torchhal.plugins.cpu",), entry_points=False, extra=[(plugin_module(sim), "sim")])
    answers = []
    worker = threading.Thread(target=lambda: answers.append(reg.availability("asim")), daemon=True)
    with pytest.warns(TorchhalPluginWarning, match=CALLS_BACK.format("manager\\.availability")):
        worker.start()
        worker.join(10)  # a daemon: were it to hang, only this registry's lock stays held
    assert answers and not answers[0], "detection hung on the registry lock its own probe waits for"
    assert [f.stage for f in reg.failures] == ["detect"] and reg.availability("cpu")
    assert sim.returned.wait(5)


@pytest.mark.parametrize("raw", ["soon", "nan", "inf", "-inf"])
def test_a_bad_detect_timeout_is_a_clear_error(monkeypatch, raw):
    monkeypatch.setenv("TORCHHAL_DETECT_TIMEOUT", raw)
    with pytest.raises(torchhal.PlatformError, match=f"TORCHHAL_DETECT_TIMEOUT='{raw}' is not a number"):
        manager.build_registry(entry_points=False)


def test_detect_timeout_zero_means_no_limit(monkeypatch):
    monkeypatch.setenv("TORCHHAL_DETECT_TIMEOUT", "0")
    assert manager.build_registry(("torchhal.plugins.cpu",), entry_points=False).detect_timeout is None


def test_the_allow_list_may_name_a_builtin_which_always_loads():
    with pytest.warns(TorchhalPluginWarning, match="'ghost'"):
        reg = manager.build_registry(("torchhal.plugins.cpu",), allow=frozenset({"cpu", "ghost"}))
    assert "cpu" in reg.names()
    # Only the name that is neither a built-in nor an installed entry point is a failure.
    assert [(f.plugin, f.stage) for f in reg.failures] == [("ghost", "import")]


# -- names: built-ins, impostors, ties, validation --------------------------------------------


def test_a_third_party_cpu_does_not_displace_the_builtin(make_registry):
    impostor = fake_platform("cpu", 100)
    with pytest.warns(TorchhalPluginWarning, match="built-in 'cpu' platform; the built-in is kept"):
        reg = make_registry(plugin_module(impostor))
    assert reg.platforms["cpu"].builtin and reg.platforms["cpu"].distribution == "torchhal"
    [conflict] = errors_of(reg, "conflict")
    assert conflict.plugin == "test-plugin-0" and "replaces = 'cpu'" in conflict.error
    assert torchhal.current_platform().name == "cpu"
    assert type(plugin_under_test(torchhal.current_platform())) is CpuPlatform


def test_replaces_still_displaces_a_builtin(make_registry):
    better = fake_platform("cpu", 0)
    type(better).replaces = "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg = make_registry(plugin_module(better))
    assert not reg.platforms["cpu"].builtin


def test_equal_priority_ties_go_to_the_first_name(make_registry):
    make_registry(plugin_module(fake_platform("beta", 10), fake_platform("alpha", 10)))
    assert torchhal.current_platform().name == "alpha"
    how = torchhal.how_resolved()[0]
    assert "tied with beta" in how and torchhal.TIE_RULE in how and "over cpu (0)" in how


def test_equal_priority_ties_go_to_the_builtin_first(make_registry):
    make_registry(plugin_module(fake_platform("aaa", 0)))  # sorts before "cpu", same priority
    assert torchhal.current_platform().name == "cpu"
    assert "tied with aaa: broken by the tie rule (built-in platforms first" in torchhal.how_resolved()[0]


def replacing(name, replaces):
    platform = fake_platform(name, 0)
    type(platform).replaces = replaces  # each fake has a class of its own
    return platform


@pytest.mark.parametrize("reverse", [False, True], ids=["chain-order", "reverse-order"])
def test_a_replaced_replacer_replaces_nothing(make_registry, reverse):
    # C replaces B, B replaces cpu: B is not registered, so its `replaces` does not apply.
    plugins = [plugin_module(replacing("tunedcpu", "cpu")), plugin_module(replacing("tunedcpu2", "tunedcpu"))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg = make_registry(*(plugins[::-1] if reverse else plugins))
    assert reg.names() == ["cpu", "tunedcpu2"] and list(reg.replaced) == ["tunedcpu"]
    assert torchhal.get_platform("cpu") is torchhal.current_platform()
    with pytest.raises(UnknownPlatformError, match="platform 'tunedcpu' was replaced by platform 'tunedcpu2' "):
        torchhal.get_platform("tunedcpu")


def test_in_a_chain_of_replacements_the_top_stays_and_every_second_one_below_it(make_registry):
    reg = make_registry(plugin_module(replacing("b", "cpu"), replacing("c", "b"), replacing("d", "c")))
    assert reg.names() == ["b", "d"]
    assert {gone: reg.plugin.name for gone, reg in reg.replaced.items()} == {"c": "d", "cpu": "b"}


@pytest.mark.parametrize("names", [("simx", "simy"), ("sima", "simb", "simc")])
def test_platforms_replacing_one_another_in_a_cycle_are_a_conflict_naming_each(make_registry, names):
    cycle = [replacing(name, names[(i + 1) % len(names)]) for i, name in enumerate(names)]
    with pytest.warns(TorchhalPluginWarning, match="they replace one another in a cycle"):
        reg = make_registry(*(plugin_module(platform) for platform in cycle))
    assert reg.names() == ["cpu"] and not reg.replaced
    conflicts = errors_of(reg, "conflict")
    assert sorted(f.plugin for f in conflicts) == [f"test-plugin-{i}" for i in range(len(names))]
    for i, name in enumerate(names):
        declares = f"platform {name!r} (plugin 'test-plugin-{i}', distribution <in-process>) declares `replaces = "
        assert all(declares in f.error and name in f.involves for f in conflicts)
        with pytest.raises(PluginConflictError, match="none applies and all are dropped. Uninstall one of them"):
            torchhal.get_platform(name)


def test_one_plugin_returning_a_platform_twice_is_told_to_return_one_instance(make_registry):
    twice = type(fake_platform("myaccel", -1))
    with pytest.warns(TorchhalPluginWarning, match="returned platform 'myaccel' 2 times"):
        reg = make_registry(plugin_module(twice(), fake_platform("other", -1), twice()))
    [conflict] = errors_of(reg, "conflict")
    assert conflict.plugin == "test-plugin-0" and "uninstall" not in str(conflict)
    assert conflict.error == ("plugin 'test-plugin-0' returned platform 'myaccel' 2 times from "
                              "torchhal_register_platforms; return one instance (one platform serves all its "
                              "devices: each call takes the device index)")
    assert reg.names() == ["cpu", "other"]  # its other platforms register
    with pytest.raises(PluginConflictError, match="returned platform 'myaccel' 2 times"):
        torchhal.get_platform("myaccel")


@pytest.mark.parametrize("bad", ["evil\n", "Evil", "1abc", "a-b", ""])
def test_names_must_match_in_full(bad):
    with pytest.raises(PluginContractError, match="name is .*; it must be a lowercase identifier"):
        fake_platform(bad, 1)


@pytest.mark.parametrize("flag", ["wrapper", "hookwrapper"])
@pytest.mark.parametrize("hook", ["torchhal_cache_emptied", "torchhal_engine_event", "torchhal_register_platforms"])
def test_a_hook_wrapper_is_refused_at_registration_naming_the_hook(make_registry, flag, hook):
    seen = []

    def wrapper(self):
        seen.append(hook)
        yield

    tracer = type("Tracer", (), {
        hook: hookimpl(**{flag: True})(wrapper),
        "torchhal_platform_activated": hookimpl(lambda self: seen.append("activated")),
    })()
    says = rf"'test-plugin-0'.*failed to register: implements '{hook}' \({flag}=True\) as a hook wrapper"
    with pytest.warns(TorchhalPluginWarning, match=says):
        reg = make_registry(tracer)
    [failure] = errors_of(reg, "register")
    assert failure.error.endswith("declare it with a plain @torchhal.hookimpl (an observer is called after the "
                                  "event, with its arguments)")
    platform = torchhal.current_platform()  # refused whole, like any plugin that fails to register
    platform.empty_cache(torchhal.ReleasePoint.USER)
    assert seen == [] and not platform.traces_events and reg.names() == ["cpu"]


@pytest.mark.parametrize("flag", ["wrapper", "hookwrapper"])
def test_a_wrapper_that_is_not_a_generator_gets_torchhals_message_not_pluggys(make_registry, flag):
    """pluggy refuses a plain function marked as a wrapper by telling the vendor to make it a
    generator, the wrong way: torchhal never runs wrappers, so its own refusal comes first."""
    tracer = type("Tracer", (), {"torchhal_cache_emptied": hookimpl(**{flag: True})(lambda self, **kw: None)})()
    with pytest.warns(TorchhalPluginWarning, match=rf"implements 'torchhal_cache_emptied' \({flag}=True\)"):
        reg = make_registry(tracer)
    [failure] = errors_of(reg, "register")
    assert "generator" not in failure.error and "declare it with a plain @torchhal.hookimpl" in failure.error
    assert reg.names() == ["cpu"]


def test_an_object_with_no_hooks_is_reported(make_registry):
    class Nothing:
        pass

    with pytest.warns(TorchhalPluginWarning, match="implements no torchhal hook"):
        reg = make_registry(Nothing())
    assert errors_of(reg, "register")[0].plugin == "test-plugin-0"


def test_unknown_platform_after_a_failed_import_says_so(make_registry, monkeypatch):
    with pytest.warns(TorchhalPluginWarning):
        make_registry(builtins=("torchhal.plugins.cpu", "torchhal.plugins.nonexistent"))
    monkeypatch.setenv("TORCHHAL_PLATFORM", "nonexistent")
    says = "'nonexistent' is not registered: .*failed to import: ModuleNotFoundError"
    with pytest.raises(UnknownPlatformError, match=says) as err:
        torchhal.current_platform()
    assert "install the plugin" not in str(err.value)


# -- records are validated where they enter -------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"free": 1.5}, TypeError, r"MemoryInfo.free is 1.5; it must be an int"),
        ({"total": None}, TypeError, "MemoryInfo.total is None"),
        ({"free": "1"}, TypeError, "MemoryInfo.free is '1'"),
        ({"free": -1}, ValueError, "MemoryInfo.free is -1; it must be >= 0"),
        ({"reserved": -5}, ValueError, "MemoryInfo.reserved is -5"),
        ({"allocated": 2.0}, TypeError, "MemoryInfo.allocated is 2.0"),
        ({"free": True}, TypeError, "MemoryInfo.free is True"),
        ({"estimated": 1}, TypeError, "MemoryInfo.estimated is 1"),
    ],
)
def test_memory_info_rejects_wrong_fields(fields, error, message):
    with pytest.raises(error, match=message):
        MemoryInfo(**{"device": 0, "free": 1, "total": 2, **fields})


def test_records_accept_good_values_and_store_int_subclasses_as_int():
    import enum

    class Size(enum.IntEnum):
        GIB = 1 << 30

    info = MemoryInfo(0, Size.GIB, 2 << 30, None, 0, estimated=True)
    assert type(info.free) is int and info.free == 1 << 30
    assert MemoryInfo(0, 0, 0).used == 0
    with pytest.raises(ValueError, match="PeakMemory.reserved is -1"):
        PeakMemory(0, -1, None)
    assert PeakMemory(0, None, None).reserved is None


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"name": None}, TypeError, r"DeviceInfo.name is None; it must be a str"),
        ({"name": 7}, TypeError, r"DeviceInfo.name is 7; it must be a str"),
        ({"total_memory": 1.5}, TypeError, r"DeviceInfo.total_memory is 1.5; it must be an int"),
        ({"index": -1}, ValueError, "DeviceInfo.index is -1; it must be >= 0"),
        ({"capability": (9, "0")}, TypeError, r"DeviceInfo.capability is \(9, '0'\); it must be None or \(major"),
        ({"capability": [9, 0]}, TypeError, r"DeviceInfo.capability is \[9, 0\]"),
        ({"extra": [1, 2]}, TypeError, r"DeviceInfo.extra is \[1, 2\]; it must be a dict of str to str"),
        ({"extra": {"cores": 8}}, TypeError, r"DeviceInfo.extra is \{'cores': 8\}"),
    ],
)
def test_device_info_rejects_wrong_fields(fields, error, message):
    from torchhal.platforms import DeviceInfo

    with pytest.raises(error, match=message):
        DeviceInfo(**{"index": 0, "name": "accel", "total_memory": 1 << 30, **fields})


def test_memory_info_of_the_wrong_type_is_a_named_plugin_error(make_registry, monkeypatch):
    class Sloppy(CpuPlatform):
        name = "sloppy"
        priority = 50

        def memory_info(self, index):
            return {"free": 1}

    make_registry(plugin_module(Sloppy()))
    says = r"platform 'sloppy': memory_info\(\) returned \{'free': 1\}; it must return a MemoryInfo"
    with pytest.raises(PluginContractError, match=says):
        torchhal.current_platform().memory_info(0)


# -- torchhal info under hostile plugins (real entry points) ----------------------------------


def test_info_survives_sys_exit_at_import_and_names_it():
    out = run_info("exit-import", "--json")
    assert out.returncode == 0, out.stderr
    errors = {(e["plugin"], e["stage"]): e["error"] for e in json.loads(out.stdout)["plugin_errors"]}
    assert errors[("hostile", "import")] == "called sys.exit(3)"


@pytest.mark.parametrize(("mode", "stage", "code"), [("exit-register", "register", 4), ("exit-detect", "detect", 5)])
def test_info_survives_sys_exit_in_register_and_detect(mode, stage, code):
    out = run_info(mode)
    assert out.returncode == 0, out.stderr
    assert f"hostile (torchhal-hostile): failed to {stage}: called sys.exit({code})" in out.stdout
    assert "Current platform: cpu" in out.stdout


def test_info_reports_a_hanging_detection_by_name_within_the_limit():
    # The probe sleeps 30 s; with a 1 s limit info finishes long before (the subprocess
    # timeout turns a hang into a failure).
    out = run_info("hang-detect", timeout=25, TORCHHAL_DETECT_TIMEOUT="1")
    assert out.returncode == 0, out.stderr
    assert "hostile (torchhal-hostile): failed to detect: is_available() did not return within 1 s" in out.stdout
    assert "Current platform: cpu" in out.stdout


def test_info_keeps_the_builtin_cpu_against_an_impostor():
    out = run_info("impostor-cpu")
    assert out.returncode == 0, out.stderr
    assert "Current platform: cpu" in out.stdout
    assert "hostile (torchhal-hostile): failed to register a unique name: registers platform name 'cpu'" in out.stdout


def test_info_names_an_entry_point_that_registers_nothing():
    out = run_info("ok", "--json")
    info = json.loads(out.stdout)
    [empty] = [e for e in info["plugin_errors"] if e["plugin"] == "emptyns"]
    assert empty["distribution"] == "torchhal-hostile"
    assert empty["error"].startswith("module 'torchhal_emptyns' (a namespace package: no __init__.py) implements no")
    assert info["current"]["name"] == "hostile"


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("memory-str", "memory_info(0): PluginContractError: platform 'hostile': memory_info() returned 'lots'; it "
                       "must return a MemoryInfo"),
        ("memory-none", "memory_info() returned None"),
        ("memory-float", "MemoryInfo.free is 1610612736.0; it must be an int"),
        ("memory-negative", "MemoryInfo.free is -1; it must be >= 0"),
        ("memory-raises", "memory_info(0): RuntimeError: hostile memory query crashed"),
        ("memory-exit", "memory_info(0): called sys.exit(6)"),
        ("count-raises", "device_count(): RuntimeError: hostile driver lost its devices"),
    ],
)
def test_info_never_prints_a_traceback_for_bad_answers(mode, says):
    out = run_info(mode)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert "Registered platforms:" in out.stdout and "Current platform: hostile" in out.stdout
    assert "hostile (torchhal-hostile): failed to answer a query: " in out.stdout
    assert says in out.stdout


def test_info_with_no_platform_still_shows_the_table_and_errors():
    out = run_info("ok", TORCHHAL_PLATFORM="emptyns")
    assert out.returncode == 2
    assert "Registered platforms:" in out.stdout and "emptyns (torchhal-hostile)" in out.stdout
    says = "'emptyns' is not registered: plugin 'emptyns' (distribution torchhal-hostile) failed to register"
    assert says in out.stderr
    assert "Traceback" not in out.stderr


def test_platform_env_for_an_entry_point_excluded_by_the_allow_list_says_so():
    out = run_info("ok", TORCHHAL_PLATFORM="hostile", TORCHHAL_PLUGINS="emptyns")
    assert out.returncode == 2
    assert ("entry point 'hostile' of distribution torchhal-hostile is installed but excluded by "
            "TORCHHAL_PLUGINS=emptyns") in out.stderr
    assert "install the plugin" not in out.stderr


def test_platform_env_for_a_plugin_whose_import_failed_gives_the_import_error():
    out = run_info("exit-import", TORCHHAL_PLATFORM="hostile")
    assert out.returncode == 2
    says = "'hostile' is not registered: plugin 'hostile' (distribution torchhal-hostile) failed to import"
    assert says + ": called sys.exit(3)" in out.stderr
    assert "install the plugin" not in out.stderr


@pytest.mark.parametrize("group", ["torchhal.platforms", "torch_hal", "TorchHAL"])
def test_an_entry_point_in_a_near_miss_group_is_a_notice_naming_the_right_group(tmp_path, group):
    """A plugin registered under a group torchhal does not read would be silently absent: `info`
    would list nothing and conformance would say to install a plugin that is installed."""
    from .conftest import run_cli

    info = tmp_path / "torchhal_mybad-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchhal-mybad\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\nmybad = tests.attention_broken\n")
    out = run_cli("info", env={"PYTHONPATH": f"{tmp_path}:{PLUGIN_DIST.parent.parent}"})
    assert out.returncode == 0, out.stderr
    notice = (f"distribution 'torchhal-mybad' declares entry point 'mybad' in group {group!r}, which torchhal does "
              "not read: plugins register under group 'torchhal' ([project.entry-points.torchhal] in pyproject.toml)")
    assert notice in " ".join(out.stdout.split()), out.stdout


# -- a plugin that hangs, floods or breaks the host's own calls --------------------------------


def waiting_line(mode: str, *command: str) -> str:
    """Start `torchhal COMMAND` with the hostile plugin hanging in `mode`: the stderr line in which
    the host names what it waits on ("" if it never does). The process is ended either way."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHHAL_")}
    env.update(PYTHONPATH=os.pathsep.join([str(HOSTILE), str(PLUGIN_DIST.parent.parent), env.get("PYTHONPATH", "")]),
               TORCHHAL_HOSTILE_MODE=mode, TORCHHAL_DETECT_TIMEOUT="1")
    proc = subprocess.Popen([sys.executable, "-m", "torchhal.cli", *command], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    safety = threading.Timer(120, proc.kill)  # a host that never speaks up fails here, not by hanging the suite
    safety.start()
    try:
        assert proc.stderr is not None
        return next((line for line in proc.stderr if "torchhal is waiting on" in line), "")
    finally:
        safety.cancel()
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("mode, what", [
    ("hang-import", "its import"),
    ("hang-register", "its torchhal_register_platforms()"),
    ("hang-count", "device_count()"),
    ("hang-memory", "memory_info(0)"),
])
def test_info_names_a_plugin_it_waits_on_and_how_to_skip_it(mode, what):
    line = waiting_line(mode, "info")
    assert (f"torchhal is waiting on plugin 'hostile' (torchhal-hostile): {what} has not returned after 1 s "
            "(TORCHHAL_DETECT_TIMEOUT) and may hang; to skip it, set TORCHHAL_PLUGINS to the entry points to load "
            "without it: TORCHHAL_PLUGINS=emptyns") in line, line


@pytest.mark.parametrize("mode", ["hang-import", "hang-register"])
def test_conformance_names_a_plugin_it_waits_on(mode):
    line = waiting_line(mode, "conformance", "--platform", "cpu", "-k", "contract")
    assert "torchhal is waiting on plugin 'hostile' (torchhal-hostile)" in line and "TORCHHAL_PLUGINS=" in line, line


def test_a_builtin_the_host_waits_on_is_named_as_one(make_registry, tmp_path, monkeypatch):
    (tmp_path / "slow_builtin.py").write_text("import time\ntime.sleep(2)\n")  # a plugin with no hook, slow to import
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TORCHHAL_DETECT_TIMEOUT", "0.05")
    with pytest.warns(TorchhalPluginWarning) as caught:
        make_registry(builtins=("torchhal.plugins.cpu", "slow_builtin"))
    said = [str(w.message) for w in caught if "waiting on" in str(w.message)]
    assert said == ["torchhal is waiting on plugin 'slow_builtin' (torchhal): its import has not returned after "
                    "0.05 s (TORCHHAL_DETECT_TIMEOUT) and may hang; it is one of torchhal's built-in plugins, which "
                    "always load: report it"]


def test_info_lists_a_bounded_number_of_devices_and_says_how_many_more():
    out = run_info("count-huge", timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("  device ")]
    assert len(rows) == 64 and rows[-1].startswith("  device 63: ")
    assert f"  ... {10**12 - 64} more device(s) of {10**12}, not listed (info lists the first 64)" in out.stdout
    listed = json.loads(run_info("count-huge", "--json").stdout)["current"]
    assert listed["device_count"] == 10**12 and len(listed["devices"]) == 64


def test_info_survives_a_plugin_whose_dir_raises():
    out = run_info("dir-raises")
    assert out.returncode == 0, out.stderr
    assert "hostile (torchhal-hostile): failed to register: RuntimeError: hostile __dir__" in out.stdout
    assert "Current platform: cpu" in out.stdout and "Traceback" not in out.stderr


class HostileObject:
    """A plugin object with hooks whose own dunder methods raise."""

    torchhal_register_platforms = hookimpl(lambda self: [fake_platform("hostileobj", 1)])

    def __init__(self, raising: str) -> None:
        self.raising = raising

    def __dir__(self):
        if self.raising == "__dir__":
            raise RuntimeError("hostile __dir__")
        return super().__dir__()

    def __hash__(self):
        if self.raising == "__hash__":
            raise RuntimeError("hostile __hash__")
        return id(self)


@pytest.mark.parametrize("raising, says", [
    ("__dir__", "RuntimeError: hostile __dir__"),
    ("__hash__", "the plugin object is not hashable; pluggy keeps plugins in sets"),
])
def test_a_plugin_object_whose_own_methods_raise_is_its_register_failure(make_registry, raising, says):
    with pytest.warns(TorchhalPluginWarning, match=re.escape(says)):
        reg = make_registry(HostileObject(raising), plugin_module(fake_platform("good", 1)))
    assert [(f.plugin, f.stage) for f in reg.failures] == [("test-plugin-0", "register")]
    assert reg.names() == ["cpu", "good"] and torchhal.current_platform().name == "good"


def test_info_tells_a_user_how_to_choose_another_platform_not_where_it_resolved_the_current_one():
    out = run_info("ok")
    assert out.returncode == 0, out.stderr
    assert "resolved at" not in out.stdout and "torchhal/cli/info.py" not in out.stdout
    assert "  TORCHHAL_PLATFORM=<name> selects another: cpu" in out.stdout


def test_the_call_site_that_resolved_the_platform_is_the_callers_not_torchhals(make_registry):
    from torchhal.cli.info import collect_info

    make_registry()
    collect_info()  # resolves the current platform from inside torchhal
    assert "tests/test_plugin_host.py" in torchhal.how_resolved()[1]
