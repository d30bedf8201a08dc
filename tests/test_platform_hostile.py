"""A third-party plugin's class attributes and facts under hostile values: a bad plugin is
reported and dropped (or refused at its first read) and never takes the other platforms down."""

import re

import pytest
import torch

import torchhal
from torchhal.platforms import PlatformPlugin, PluginContractError, TorchhalPluginWarning, manager
from torchhal.platforms.testing import patched_plugin

from .test_manager import failures_by_stage
from .test_selection import fake_platform, plugin_module


def plugin_with(name: str, **attributes):
    platform = fake_platform(name, 10)
    for attribute, value in attributes.items():
        setattr(type(platform), attribute, value)
    return platform


@pytest.mark.parametrize("attribute, value, message", [
    ("replaces", ["cpu"], r"\.replaces is \['cpu'\]; it must be None or one platform name"),
    ("replaces", "Not A Name", r"\.replaces is 'Not A Name'"),
    ("visible_devices_env", None, r"\.visible_devices_env is None; it must be a tuple of environment variable"),
    ("visible_devices_env", "MY_VISIBLE_DEVICES", r"\.visible_devices_env is 'MY_VISIBLE_DEVICES'"),
    ("visible_devices_env", ("OK", 3), r"\.visible_devices_env is \('OK', 3\)"),
])
def test_a_bad_class_attribute_drops_that_plugin_and_every_other_platform_still_resolves(
        make_registry, attribute, value, message):
    with pytest.warns(TorchhalPluginWarning):
        reg = make_registry(plugin_module(plugin_with("vendor", **{attribute: value})))
    failure = failures_by_stage(reg)[("test-plugin-0", "validate")]
    assert re.search(message, failure.error), failure.error
    assert reg.names() == ["cpu"]
    assert torchhal.current_platform().name == "cpu"


def test_a_list_of_visible_devices_variables_is_taken_as_a_tuple(make_registry):
    # Not what the SPI says (the conformance suite's attribute clause flags it), but harmless.
    make_registry(plugin_module(plugin_with("vendor", visible_devices_env=["VENDOR_VISIBLE_DEVICES"])))
    assert torchhal.get_platform("vendor").visible_devices_env == ("VENDOR_VISIBLE_DEVICES",)


def test_two_plugins_replacing_one_platform_are_both_dropped_and_it_stays():
    reg = manager.PlatformRegistry(manager.new_plugin_manager())
    reg.load_builtins(["torchhal.plugins.cpu"])
    reg.add_plugin(plugin_module(plugin_with("cpu", replaces="cpu")), "vendor-a-plugin", "vendor-a", "1.0")
    reg.add_plugin(plugin_module(plugin_with("fastcpu", replaces="cpu")), "vendor-b-plugin", "vendor-b", "2.0")
    with pytest.warns(TorchhalPluginWarning):
        reg.collect_platforms()
    failures = failures_by_stage(reg)
    for source in ("vendor-a-plugin", "vendor-b-plugin"):
        conflict = failures[(source, "conflict")]
        assert "distribution vendor-a" in conflict.error and "distribution vendor-b" in conflict.error
    assert reg.names() == ["cpu"]
    assert reg.platforms["cpu"].builtin


def test_one_replacement_still_displaces_the_platform():
    reg = manager.PlatformRegistry(manager.new_plugin_manager())
    reg.load_builtins(["torchhal.plugins.cpu"])
    reg.add_plugin(plugin_module(plugin_with("fastcpu", replaces="cpu")), "vendor-b-plugin", "vendor-b", "2.0")
    reg.collect_platforms()
    assert reg.names() == ["fastcpu"] and not reg.failures


@pytest.mark.parametrize("builtins, rival, dropped_as", [
    (("torchhal.plugins.cpu",), "fastcpu", "platform name 'fastcpu' is registered by"),  # two plugins, one name
    (("torchhal.plugins.cpu", "torchhal.plugins.cuda"), "cuda", "torchhal's built-in 'cuda' platform"),
], ids=["name-conflict", "builtin-name"])
def test_a_replacer_that_is_itself_dropped_replaces_nothing(builtins, rival, dropped_as):
    reg = manager.PlatformRegistry(manager.new_plugin_manager())
    reg.load_builtins(builtins)
    reg.add_plugin(plugin_module(plugin_with(rival, replaces="cpu")), "vendor-a-plugin", "vendor-a", "1.0")
    if rival == "fastcpu":
        reg.add_plugin(plugin_module(fake_platform("fastcpu", 10)), "vendor-b-plugin", "vendor-b", "2.0")
    with pytest.warns(TorchhalPluginWarning):
        reg.collect_platforms()
    assert "cpu" in reg.names() and reg.platforms["cpu"].builtin and "cpu" not in reg.replaced
    assert [f.error for f in reg.failures if f.stage == "conflict" and dropped_as in f.error]


def spi_default_oom_platform(make_registry, oom_error_types):
    """A platform that keeps the SPI's own `is_out_of_memory` (the CPU plugin defines its own)."""
    vendor = plugin_with("vendor", is_out_of_memory=PlatformPlugin.is_out_of_memory,
                         oom_error_types=lambda self: oom_error_types)
    make_registry(plugin_module(vendor))
    return torchhal.get_platform("vendor")


@pytest.mark.parametrize("answer", [[MemoryError], (MemoryError, "oom"), (ValueError(),), MemoryError])
def test_oom_error_types_that_are_not_a_tuple_of_exception_classes_are_a_contract_error(make_registry, answer):
    platform = spi_default_oom_platform(make_registry, answer)
    with pytest.raises(PluginContractError, match=r"platform 'vendor': oom_error_types\(\) returned .*; it must "
                                                  r"return a tuple of BaseException subclasses"):
        _ = platform.oom_error_types  # the first read asks the plugin
    # The SPI's default is_out_of_memory reads the checked fact: a contract error naming the
    # plugin, not a TypeError from isinstance() in the middle of the caller's error handling.
    with pytest.raises(PluginContractError, match="platform 'vendor'"):
        platform.is_out_of_memory(RuntimeError("boom"))


def test_the_spi_default_is_out_of_memory_uses_the_declared_types(make_registry):
    platform = spi_default_oom_platform(make_registry, (MemoryError, torch.OutOfMemoryError))
    assert platform.is_out_of_memory(torch.OutOfMemoryError("out of memory"))
    assert not platform.is_out_of_memory(RuntimeError("boom"))


def test_a_plugin_that_defines_is_out_of_memory_keeps_its_own():
    platform = torchhal.get_platform("cpu")
    with patched_plugin(platform, is_out_of_memory=lambda error: isinstance(error, KeyError)):
        assert platform.is_out_of_memory(KeyError("x"))
        assert not platform.is_out_of_memory(torch.OutOfMemoryError("out of memory"))


@pytest.mark.parametrize("local_rank, local_world_size", [(-1, 2), (2, 2), (True, 2), (0, 0), (0.0, 1), ("0", 1)])
def test_device_for_rank_refuses_a_rank_outside_its_host(local_rank, local_world_size):
    """A plugin's default once returned -1 for local rank -1: a device index nothing has."""
    platform = torchhal.current_platform()
    with pytest.raises(ValueError, match=re.escape(f"device_for_rank({local_rank!r}, {local_world_size!r}): need "
                                                   "integers with 0 <= local_rank < local_world_size")):
        platform.device_for_rank(local_rank, local_world_size)


def test_device_for_rank_gives_the_plugin_plain_ints():
    np = pytest.importorskip("numpy")
    platform = torchhal.current_platform()
    seen = []
    original = platform._plugin.device_for_rank

    def spy(local_rank, local_world_size):
        seen.append((type(local_rank), type(local_world_size)))
        return original(local_rank, local_world_size)

    with patched_plugin(platform, device_for_rank=spy):
        assert platform.device_for_rank(np.int64(0), np.int32(1)) == platform.device_for_rank(0, 1)
    assert seen == [(int, int), (int, int)]
