"""docs/spi-reference.md, Methods: `Platform` adds the default device index and index
validation, "so a plugin receives a valid `index`". Every index-taking call refuses a bad index,
naming it, before the plugin (or an observer) sees anything; only set_device did before."""

import enum
import re

import pytest
import torch

import torchhal
import torchhal.platforms.testing
from torchhal.platforms import DeviceInfo, MemoryInfo, PeakMemory, PluginContractError, ReleasePoint, hookimpl

from .test_selection import plugin_module


class OneDevice(torchhal.plugins.cpu.CpuPlatform):
    """One device; records every index a call hands it."""

    name = "onedev"
    priority = 10

    def __init__(self, count=1):
        self.count = count
        self.seen = []
        self.counted = 0

    def device_count(self):
        self.counted += 1
        return self.count

    def _record(self, call, index):
        self.seen.append((call, index))

    def set_device(self, index):
        self._record("set_device", index)

    def synchronize(self, index):
        self._record("synchronize", index)

    def device_info(self, index):
        self._record("device_info", index)
        return DeviceInfo(index, "dev", 1 << 21)

    def memory_info(self, index):
        self._record("memory_info", index)
        return MemoryInfo(index, 1 << 20, 1 << 21)

    def empty_cache(self, index):
        self._record("empty_cache", index)

    def peak_memory(self, index):
        self._record("peak_memory", index)
        return PeakMemory(index, None, None)

    def reset_peak_memory(self, index):
        self._record("reset_peak_memory", index)

    def new_stream(self, index):
        self._record("new_stream", index)

    def current_stream(self, index):
        self._record("current_stream", index)


CALLS = {
    "set_device": lambda p, i: p.set_device(i),
    "device": lambda p, i: p.device(i),
    "synchronize": lambda p, i: p.synchronize(i),
    "device_info": lambda p, i: p.device_info(i),
    "memory_info": lambda p, i: p.memory_info(i),
    "empty_cache": lambda p, i: p.empty_cache(ReleasePoint.USER, index=i),
    "peak_memory": lambda p, i: p.peak_memory(i),
    "reset_peak_memory": lambda p, i: p.reset_peak_memory(i),
    "report_out_of_memory": lambda p, i: p.report_out_of_memory(MemoryError(), "test", index=i),
    "new_stream": lambda p, i: p.new_stream(i),
    "current_stream": lambda p, i: p.current_stream(i),
}


class Slot(enum.IntEnum):
    FIRST = 0


@pytest.fixture
def platform(make_registry):
    """The one-device platform, with an observer of every hook an index reaches."""
    observed = []

    class Observer:
        @hookimpl
        def torchhal_cache_emptied(self, device):
            observed.append(device)

        @hookimpl
        def torchhal_out_of_memory(self, device):
            observed.append(device)

    make_registry(plugin_module(OneDevice()), Observer())
    platform = torchhal.get_platform("onedev")
    platform.observed = observed
    return platform


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize(("index", "error", "says"), [
    (7, ValueError, r"device index 7 is out of range for platform 'onedev' with 1 device\(s\); use 0\.\.0"),
    (1, ValueError, "device index 1 is out of range"),
    (-1, ValueError, "device index -1 is out of range"),
    ("0", TypeError, r"device index '0' \(str\) for platform 'onedev' is not an int; use 0\.\.0"),
    (0.0, TypeError, r"device index 0\.0 \(float\)"),
    (True, TypeError, r"device index True \(bool\)"),
])
def test_a_bad_index_is_refused_before_the_plugin_sees_it(platform, call, index, error, says):
    plugin = torchhal.platforms.testing.plugin_under_test(platform)
    CALLS[call](platform, 0)  # a valid index first: the device count is then known (the fast path)
    plugin.seen.clear()
    platform.observed.clear()
    with pytest.raises(error, match=says):
        CALLS[call](platform, index)
    assert plugin.seen == [] and platform.observed == []  # state intact: nothing reached plugin or observers


@pytest.mark.parametrize("call", [call for call in CALLS if call != "device"])
def test_a_valid_index_reaches_the_plugin_as_a_plain_int(platform, call):
    plugin = torchhal.platforms.testing.plugin_under_test(platform)
    for index in (0, Slot.FIRST) if call == "set_device" else (0, Slot.FIRST, None):  # None: the current device
        CALLS[call](platform, index)
    reached = [index for _, index in plugin.seen] + platform.observed
    assert reached and all(type(index) is int and index == 0 for index in reached)


def test_set_device_takes_no_default_and_device_names_the_index(make_registry):
    make_registry()
    with pytest.raises(TypeError, match=r"device index None \(NoneType\) for platform 'cpu' is not an int; use 0\.\.0"):
        torchhal.get_platform("cpu").set_device(None)  # type: ignore[arg-type]
    assert [torchhal.get_platform("cpu").device(i) for i in (0, Slot.FIRST, None)] == [torch.device("cpu", 0)] * 3


def test_the_device_count_is_asked_once_not_per_call(platform):
    plugin = torchhal.platforms.testing.plugin_under_test(platform)
    for _ in range(5):
        platform.memory_info(0)
        platform.current_stream(0)
    assert plugin.counted == 1
    plugin.count = 2  # a device appears: an index above the count seen is asked again
    platform.synchronize(1)
    assert plugin.counted == 2 and plugin.seen[-1] == ("synchronize", 1)


@pytest.mark.parametrize("count", ["1", -1, 1.0, None])
def test_a_device_count_that_is_not_an_int_is_a_contract_error_naming_the_platform(platform, count):
    plugin = torchhal.platforms.testing.plugin_under_test(platform)
    plugin.count = count
    says = rf"platform 'onedev': device_count\(\) returned {re.escape(repr(count))}; it must return an int >= 0"
    with pytest.raises(PluginContractError, match=says):
        platform.memory_info(0)
    with pytest.raises(PluginContractError, match=says):
        platform.device_count()
