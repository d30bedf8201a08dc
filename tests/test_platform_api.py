import pytest
import torch
import torch.distributed as dist

import torchhal
from torchhal.platforms import MemoryInfo, ReleasePoint, hookimpl
from torchhal.platforms.testing import plugin_under_test
from torchhal.plugins.cpu import CpuPlatform

from .test_selection import plugin_module


class CountingCpu(CpuPlatform):
    """CPU platform that reports a fake cache, to see what the Platform layer calls."""

    name = "counting"
    priority = 10

    def __init__(self):
        self.calls = []
        self.reserved = 4096

    def memory_info(self, index):
        self.calls.append("memory_info")
        return MemoryInfo(index, 1000, 2000, self.reserved, 1024)

    def empty_cache(self, index):
        self.calls.append("empty_cache")
        released, self.reserved = self.reserved - 1024, 1024
        return released


def test_empty_cache_requires_a_release_point(make_registry):
    make_registry(plugin_module(CountingCpu()))
    platform = torchhal.current_platform()
    with pytest.raises(TypeError, match="'oom'.*must be a ReleasePoint.*ReleasePoint.OOM"):
        platform.empty_cache("oom")
    assert plugin_under_test(platform).calls == []  # state left intact


def test_empty_cache_fires_the_observer_with_reason_and_bytes(make_registry):
    seen = []

    class Observer:
        @hookimpl
        def torchhal_cache_emptied(self, platform, device, reason, bytes_released):
            seen.append((platform.name, device, reason, bytes_released))

    make_registry(plugin_module(CountingCpu()), Observer())
    released = torchhal.current_platform().empty_cache(ReleasePoint.WEIGHT_UPDATE)
    assert released == 3072
    assert seen == [("counting", 0, ReleasePoint.WEIGHT_UPDATE, 3072)]


def test_memory_info_only_observes(make_registry):
    make_registry(plugin_module(CountingCpu()))
    platform = torchhal.current_platform()
    before = platform.memory_info()
    after = platform.memory_info(0)
    assert plugin_under_test(platform).calls == ["memory_info", "memory_info"]
    assert before.reserved == after.reserved == 4096


def test_no_memory_query_takes_an_empty_cache_flag():
    import inspect

    for name in ("memory_info", "available_memory"):
        assert "empty_cache" not in inspect.signature(getattr(torchhal.Platform, name)).parameters


def test_set_device_out_of_range_names_the_value(make_registry):
    make_registry()
    with pytest.raises(ValueError, match="device index 3 is out of range.*use 0..0"):
        torchhal.current_platform().set_device(3)


def test_available_memory_min_across_a_gloo_group(make_registry, tmp_path):
    make_registry(plugin_module(CountingCpu()))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = dist.new_group([0], backend="gloo")
        assert torchhal.current_platform().available_memory(group) == 1000
    finally:
        dist.destroy_process_group()


def test_oom_types_and_report(make_registry):
    seen = []

    class Observer:
        @hookimpl
        def torchhal_out_of_memory(self, device, error, context):
            seen.append((device, str(error), context))

    make_registry(Observer())
    platform = torchhal.current_platform()
    error = torch.OutOfMemoryError("boom")
    assert platform.is_out_of_memory(error) and not platform.is_out_of_memory(ValueError())
    platform.report_out_of_memory(error, "unit test")
    assert seen == [(0, "boom", "unit test")]
