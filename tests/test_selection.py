import subprocess
import sys

import pytest

import torchhal
from torchhal.platforms import (
    Availability,
    PlatformUnavailableError,
    UnknownPlatformError,
    hookimpl,
)
from torchhal.plugins.cpu import CpuPlatform


def plugin_module(*platforms):
    class Module:
        @hookimpl
        def torchhal_register_platforms(self):
            return list(platforms)

    return Module()


def fake_platform(name, priority, available=True):
    cls = type(
        f"Fake{name.title()}",
        (CpuPlatform,),
        {
            "name": name,
            "priority": priority,
            "is_available": lambda self: Availability(available, "fake says so" if available else "fake: no device"),
        },
    )
    return cls()


def test_cpu_is_the_default(make_registry):
    make_registry()
    assert torchhal.current_platform().name == "cpu"
    how, where = torchhal.how_resolved()
    assert "highest priority available: cpu" in how
    assert "test_selection.py" in where


def test_highest_priority_available_wins_and_unavailable_is_skipped(make_registry):
    make_registry(plugin_module(fake_platform("alpha", 10), fake_platform("beta", 20, available=False)))
    platform = torchhal.current_platform()
    assert platform.name == "alpha"
    assert "over cpu (0)" in torchhal.how_resolved()[0]


def test_equal_priority_resolves_by_the_tie_rule_and_says_so(make_registry):
    make_registry(plugin_module(fake_platform("beta", 10), fake_platform("alpha", 10)))
    assert torchhal.current_platform().name == "alpha"
    assert f"tied with beta: broken by the tie rule ({torchhal.TIE_RULE})" in torchhal.how_resolved()[0]


def test_env_selects_by_name(make_registry, monkeypatch):
    make_registry(plugin_module(fake_platform("alpha", 10)))
    monkeypatch.setenv("TORCHHAL_PLATFORM", "cpu")
    assert torchhal.current_platform().name == "cpu"
    assert torchhal.how_resolved()[0] == "TORCHHAL_PLATFORM=cpu"


def test_env_unknown_name_lists_known(make_registry, monkeypatch):
    make_registry(plugin_module(fake_platform("alpha", 10)))
    monkeypatch.setenv("TORCHHAL_PLATFORM", "nope")
    with pytest.raises(UnknownPlatformError, match="'nope'.*alpha, cpu"):
        torchhal.current_platform()


def test_env_naming_a_replaced_platform_names_the_platform_that_replaced_it(make_registry, monkeypatch):
    fastcpu = type("FastCpu", (type(fake_platform("fastcpu", 10)),), {"replaces": "cpu"})()
    make_registry(plugin_module(fastcpu))
    monkeypatch.setenv("TORCHHAL_PLATFORM", "cpu")
    with pytest.raises(UnknownPlatformError) as err:
        torchhal.current_platform()
    assert str(err.value) == (
        "platform 'cpu' was replaced by platform 'fastcpu' (plugin 'test-plugin-0', distribution <in-process>), "
        "which declares `replaces = 'cpu'`; name 'fastcpu' instead, or uninstall <in-process> to get 'cpu' back "
        "(registered platforms: fastcpu)")


def test_env_known_but_unavailable_says_why(make_registry, monkeypatch):
    make_registry(plugin_module(fake_platform("beta", 10, available=False)))
    monkeypatch.setenv("TORCHHAL_PLATFORM", "beta")
    with pytest.raises(PlatformUnavailableError, match="'beta' is not available: fake: no device"):
        torchhal.current_platform()


def test_current_platform_is_cached(make_registry):
    make_registry()
    first = torchhal.current_platform()
    assert torchhal.current_platform() is first
    assert torchhal.get_platform("cpu") is first


def test_list_platforms_reports_reasons(make_registry):
    make_registry(plugin_module(fake_platform("beta", 10, available=False)))
    statuses = {s.name: s for s in torchhal.list_platforms()}
    assert statuses["beta"].available is False
    assert statuses["beta"].reason == "fake: no device"
    assert statuses["cpu"].available is True
    assert statuses["cpu"].distribution == "torchhal"


def test_import_resolves_nothing_and_imports_no_vendor_runtime():
    code = (
        "import sys, torchhal\n"
        "from torchhal.platforms import selection\n"
        "assert selection._current is None and selection._registry is None\n"
        "import torch\n"
        "assert not torch.cuda.is_initialized()\n"
        "bad = [m for m in ('torch_npu', 'torch_musa', 'intel_extension_for_pytorch', 'pynvml',"
        " 'torchhal.plugins.cuda') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"
