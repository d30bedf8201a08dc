import warnings

import pytest

import torchhal
from torchhal.platforms import PluginConflictError, PluginContractError, TorchhalPluginWarning, hookimpl, manager
from torchhal.plugins.cpu import CpuPlatform

from .test_selection import fake_platform, plugin_module


def failures_by_stage(reg):
    return {(e.plugin, e.stage): e for e in reg.failures}


def test_builtin_that_fails_to_import_is_reported_and_others_work(make_registry):
    with pytest.warns(TorchhalPluginWarning, match="torchhal.plugins.nonexistent"):
        reg = make_registry(builtins=("torchhal.plugins.cpu", "torchhal.plugins.nonexistent"))
    err = failures_by_stage(reg)[("torchhal.plugins.nonexistent", "import")]
    assert "ModuleNotFoundError" in err.error
    assert torchhal.current_platform().name == "cpu"


def test_is_available_that_raises_is_isolated(make_registry):
    class Exploding(CpuPlatform):
        name = "exploding"
        priority = 50

        def is_available(self):
            raise RuntimeError("driver crashed")

    reg = make_registry(plugin_module(Exploding()))
    with pytest.warns(TorchhalPluginWarning, match="exploding.*detect.*driver crashed"):
        assert torchhal.current_platform().name == "cpu"
    assert ("exploding", "detect") in failures_by_stage(reg)
    status = {s.name: s for s in torchhal.list_platforms()}["exploding"]
    assert not status.available and "driver crashed" in status.reason


def test_is_available_returning_a_bool_is_a_detect_error(make_registry):
    class Sloppy(CpuPlatform):
        name = "sloppy"
        priority = 50

        def is_available(self):
            return True

    reg = make_registry(plugin_module(Sloppy()))
    with pytest.warns(TorchhalPluginWarning, match="returned bool"):
        assert torchhal.current_platform().name == "cpu"
    assert ("sloppy", "detect") in failures_by_stage(reg)


def test_a_result_that_is_not_a_platform_plugin_is_rejected_by_name(make_registry):
    with pytest.warns(TorchhalPluginWarning):
        reg = make_registry(plugin_module("not a plugin", fake_platform("good", 1)))
    [failure] = [e for e in reg.failures if e.stage == "validate"]
    assert failure.error == ("torchhal_register_platforms returned str 'not a plugin'; return instances of "
                             "torchhal.PlatformPlugin")
    assert reg.names() == ["cpu", "good"]  # its other platform registers


def test_a_bad_platform_name_is_refused_where_the_class_is_defined():
    with pytest.raises(PluginContractError, match=r"^BadName: name is 'Bad Name'; it must be a lowercase identifier"):
        type("BadName", (CpuPlatform,), {"name": "Bad Name"})


def test_registration_hook_that_raises_is_isolated(make_registry):
    class Broken:
        @hookimpl
        def torchhal_register_platforms(self):
            raise ValueError("config file missing")

    with pytest.warns(TorchhalPluginWarning, match="config file missing"):
        reg = make_registry(Broken())
    assert reg.names() == ["cpu"]


def test_duplicate_names_conflict_naming_both_distributions():
    class Dist1:
        @hookimpl
        def torchhal_register_platforms(self):
            return [fake_platform("twin", 10)]

    reg = manager.PlatformRegistry(manager.PluginManager())
    reg.add_plugin(Dist1(), "vendor-a-plugin", "vendor-a", "1.0")
    reg.add_plugin(plugin_module(fake_platform("twin", 10)), "vendor-b-plugin", "vendor-b", "2.0")
    with pytest.warns(TorchhalPluginWarning):
        reg.collect_platforms()
    conflict = failures_by_stage(reg)[("twin", "conflict")]
    assert "distribution vendor-a" in conflict.error and "distribution vendor-b" in conflict.error
    assert "replaces" in conflict.error
    assert "twin" not in reg.names()
    torchhal.use_registry(reg)
    with pytest.raises(PluginConflictError, match="vendor-a"):
        torchhal.get_platform("twin")


def test_replaces_resolves_a_conflict():
    replacement = fake_platform("cpu", 0)
    type(replacement).replaces = "cpu"
    reg = manager.PlatformRegistry(manager.PluginManager())
    reg.load_builtins(["torchhal.plugins.cpu"])
    reg.add_plugin(plugin_module(replacement), "better-cpu", "better-cpu-dist", "1.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg.collect_platforms()
    assert reg.platforms["cpu"].distribution == "better-cpu-dist"


def test_hook_typo_is_rejected_with_a_hint(make_registry):
    class Typo:
        @hookimpl
        def torchhal_register_platfroms(self):
            return []

    with pytest.warns(TorchhalPluginWarning, match="did you mean 'torchhal_register_platforms'"):
        reg = make_registry(Typo())
    assert reg.failures[0].stage == "register"


def test_observer_that_raises_does_not_stop_the_engine(make_registry):
    seen = []

    class Good:
        @hookimpl
        def torchhal_cache_emptied(self, reason):
            seen.append(reason)

    class Bad:
        @hookimpl
        def torchhal_cache_emptied(self, platform):
            raise RuntimeError("observer bug")

    make_registry(Good(), Bad())
    with pytest.warns(TorchhalPluginWarning, match="observer bug"):
        torchhal.current_platform().empty_cache(torchhal.ReleasePoint.USER)
    assert seen == [torchhal.ReleasePoint.USER]
