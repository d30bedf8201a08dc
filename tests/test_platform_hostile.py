"""A third-party plugin's class attributes and facts under hostile values: a bad plugin is
reported and dropped (or refused at its first read) and never takes the other platforms down."""

import re

import pytest
import torch

import torchhal
from torchhal.platforms import PlatformPlugin, PluginContractError, TorchhalPluginWarning, UnknownPlatformError, manager
from torchhal.platforms.testing import patched_plugin
from torchhal.plugins.cpu import CpuPlatform

from .test_manager import failures_by_stage
from .test_selection import fake_platform, plugin_module


def plugin_with(name: str, **attributes):
    platform = fake_platform(name, 10)
    for attribute, value in attributes.items():
        setattr(type(platform), attribute, value)
    return platform


class EvilStr(str):
    """A platform name whose hash and equality are the plugin's own code."""

    def __hash__(self):
        raise RuntimeError("hash of a hostile name")

    def __eq__(self, other):
        raise RuntimeError("equality of a hostile name")


@pytest.mark.parametrize("attribute, value, message", [
    ("name", EvilStr("evil"), r"name is 'evil'; it must be a lowercase identifier"),
    ("name", "Not A Name", r"name is 'Not A Name'; it must be a lowercase identifier"),
    ("name", property(lambda self: "vendor"), r"name is <property .*>; it must be a lowercase identifier"),
    ("priority", True, r"\(platform 'vendor'\): priority is True; it must be an int"),
    ("device_type", "", r"device_type is ''; it must be a str"),
    ("dist_backend", None, r"dist_backend is None; it must be a str"),
    ("replaces", ["cpu"], r"replaces is \['cpu'\]; it must be None or one platform name"),
    ("replaces", "Not A Name", r"replaces is 'Not A Name'"),
    ("visible_devices_env", None, r"visible_devices_env is None; it must be a tuple of environment variable"),
    ("visible_devices_env", "MY_VISIBLE_DEVICES", r"visible_devices_env is 'MY_VISIBLE_DEVICES'"),
    ("visible_devices_env", ("OK", 3), r"visible_devices_env is \('OK', 3\)"),
    ("ipc_peer_redirect", 1, r"ipc_peer_redirect is 1; it must be True or False"),
])
def test_a_bad_class_attribute_is_refused_where_the_class_is_defined(attribute, value, message):
    with pytest.raises(PluginContractError, match=message):
        type("Vendor", (CpuPlatform,), {"name": "vendor", attribute: value})


def test_a_platform_class_without_a_required_attribute_is_refused_but_a_shared_base_is_not():
    class SharedBase(PlatformPlugin):  # no name: a base of platforms, checked on what it sets
        dist_backend = "gloo"

    says = r"Half \(platform 'half'\): device_type is not set; it must be a str"
    with pytest.raises(PluginContractError, match=says):
        type("Half", (SharedBase,), {"name": "half"})


HOSTILE_MODULE = """
from torchhal.platforms import hookimpl
from torchhal.plugins.cpu import CpuPlatform

class {cls}(CpuPlatform):
    name = {name}
    {attribute} = {value}

@hookimpl
def torchhal_register_platforms():
    return [{cls}()]
"""


@pytest.mark.parametrize("attribute, value, says", [
    ("visible_devices_env", "'MYACCEL_VISIBLE_DEVICES'", "visible_devices_env is 'MYACCEL_VISIBLE_DEVICES'"),
    ("priority", "'high'", "priority is 'high'"),
])
def test_a_plugin_with_a_bad_class_attribute_fails_to_import_and_naming_its_platform_says_why(
        make_registry, tmp_path, monkeypatch, attribute, value, says):
    (tmp_path / "badattr.py").write_text(HOSTILE_MODULE.format(cls="BareStringEnv", name="'myaccel'",
                                                               attribute=attribute, value=value))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(TorchhalPluginWarning, match=says):
        reg = make_registry(builtins=("torchhal.plugins.cpu", "badattr"))
    assert [(f.plugin, f.stage) for f in reg.failures] == [("badattr", "import")]
    assert torchhal.current_platform().name == "cpu"  # the other platforms resolve
    torchhal.use_registry(reg)
    monkeypatch.setenv("TORCHHAL_PLATFORM", "myaccel")
    failed = rf"PluginContractError: BareStringEnv \(platform 'myaccel'\): {says}"
    with pytest.raises(UnknownPlatformError, match=f"'myaccel' is not registered: .*failed to import: {failed}") as err:
        torchhal.current_platform()
    assert "install the plugin" not in str(err.value)


def test_a_hostile_name_never_reaches_the_host(make_registry, tmp_path, monkeypatch):
    """A name whose __hash__ raises took `torchhal info` and current_platform() down: refused at import."""
    (tmp_path / "evilname.py").write_text(
        "class EvilStr(str):\n    def __hash__(self):\n        raise RuntimeError('no hash')\n"
        + HOSTILE_MODULE.format(cls="Evil", name="EvilStr('evil')", attribute="priority", value="1"))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(TorchhalPluginWarning, match="name is 'evil'; it must be a lowercase identifier"):
        reg = make_registry(builtins=("torchhal.plugins.cpu", "evilname"))
    assert reg.names() == ["cpu"] and torchhal.current_platform().name == "cpu"


def test_a_list_of_visible_devices_variables_is_taken_as_a_tuple(make_registry):
    # Not what the SPI says (the conformance suite's attribute clause flags it), but harmless.
    make_registry(plugin_module(plugin_with("vendor", visible_devices_env=["VENDOR_VISIBLE_DEVICES"])))
    assert torchhal.get_platform("vendor").visible_devices_env == ("VENDOR_VISIBLE_DEVICES",)


def test_two_plugins_replacing_one_platform_are_both_dropped_and_it_stays():
    reg = manager.PlatformRegistry(manager.PluginManager())
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
    reg = manager.PlatformRegistry(manager.PluginManager())
    reg.load_builtins(["torchhal.plugins.cpu"])
    reg.add_plugin(plugin_module(plugin_with("fastcpu", replaces="cpu")), "vendor-b-plugin", "vendor-b", "2.0")
    reg.collect_platforms()
    assert reg.names() == ["fastcpu"] and not reg.failures


@pytest.mark.parametrize("builtins, rival, dropped_as", [
    (("torchhal.plugins.cpu",), "fastcpu", "platform name 'fastcpu' is registered by"),  # two plugins, one name
    (("torchhal.plugins.cpu", "torchhal.plugins.cuda"), "cuda", "torchhal's built-in 'cuda' platform"),
], ids=["name-conflict", "builtin-name"])
def test_a_replacer_that_is_itself_dropped_replaces_nothing(builtins, rival, dropped_as):
    reg = manager.PlatformRegistry(manager.PluginManager())
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
