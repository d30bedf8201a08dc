import inspect

import pytest
import torch
import torch.distributed as dist

import torchhal
from torchhal.platforms import (
    SPI_ATTRIBUTES,
    SPI_METHODS,
    MemoryInfo,
    PeakMemory,
    Platform,
    PlatformPlugin,
    ReleasePoint,
    hookimpl,
)
from torchhal.platforms.testing import patched_plugin, plugin_under_test
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


def test_available_memory_takes_a_communicator_and_reduces_with_min(make_registry):
    """Through the Communicator protocol: one all_reduce(op="min") on a CPU int64 tensor."""
    make_registry(plugin_module(CountingCpu()))
    calls = []

    class OtherRankHasLess:
        rank, world_size, device, graph_capturable = 0, 2, torch.device("cpu"), False

        def all_reduce(self, tensor, op="sum"):
            calls.append((tensor.device.type, tensor.dtype, op))
            return tensor.clamp_(max=600)

        def all_gather(self, tensor, dim=0, sizes=None): ...
        def broadcast(self, tensor, src): ...
        def send(self, tensor, dst): ...
        def recv(self, tensor, src): ...

    assert torchhal.current_platform().available_memory(OtherRankHasLess()) == 600
    assert calls == [("cpu", torch.int64, "min")]
    with pytest.raises(TypeError, match=r"available_memory\(group=42\): pass a torchhal.distributed.Communicator"):
        torchhal.current_platform().available_memory(42)


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


# -- one SPI, one API ---------------------------------------------------------------------

#: SPI methods the API does not expose: detection is the registry's, the module the plugin's own.
PLUGIN_ONLY = {"is_available", "device_module"}


def test_the_spi_lists_are_read_from_the_plugin_class():
    methods = [n for n, v in vars(PlatformPlugin).items() if callable(v) and not n.startswith("_")]
    assert list(SPI_METHODS) == methods
    assert set(PlatformPlugin.__abstractmethods__) <= set(SPI_METHODS)
    assert {"name", "device_type", "priority", "dist_backend", "visible_devices_env"} <= set(SPI_ATTRIBUTES)


def test_every_spi_method_reaches_engines_through_the_api():
    assert {name for name in SPI_METHODS if not hasattr(Platform, name)} == PLUGIN_ONLY


def test_the_plugin_and_device_module_are_not_public():
    assert not hasattr(Platform, "plugin") and not hasattr(Platform, "device_module")
    platform = torchhal.get_platform("cpu")
    assert not hasattr(platform, "plugin") and not hasattr(platform, "device_module")


def test_pass_throughs_are_the_plugins_bound_methods(make_registry):
    make_registry(plugin_module(CountingCpu()))
    platform = torchhal.current_platform()
    plugin = plugin_under_test(platform)
    for name in ("current_device", "runtime_version", "is_out_of_memory", "pin_memory", "use_stream", "new_event",
                 "can_access_peer"):
        assert vars(platform)[name] == getattr(plugin, name), name  # bound once, no wrapper per call
        api = inspect.signature(getattr(PlatformPlugin, name)).parameters
        assert list(inspect.signature(getattr(platform, name)).parameters) == list(api)[1:], name


def test_facts_are_asked_once():
    asked = []

    class Asking(CpuPlatform):
        name = "asking"

        def graph_support(self):
            asked.append("graph_support")
            return None

    platform = Platform(Asking(), torchhal.registry().pm, "test", "0")
    assert platform.graph_support is None and platform.graph_support is None
    assert asked == ["graph_support"]


def test_patched_plugin_is_seen_by_every_call_and_restored(make_registry):
    make_registry(plugin_module(CountingCpu()))
    platform = torchhal.current_platform()
    pinned = MemoryInfo(0, 7, 8)
    with pytest.raises(RuntimeError, match="inside"):
        with patched_plugin(platform, memory_info=lambda index: pinned, device_count=lambda: 3):
            assert platform.available_memory() == 7 and platform.device_count() == 3
            raise RuntimeError("inside")
    assert platform.device_count() == 1 and platform.memory_info().free == 1000
    assert "memory_info" not in vars(plugin_under_test(platform))
    with pytest.raises(AssertionError, match="'?memory_infox'? is not an SPI method"):
        with patched_plugin(platform, memory_infox=lambda index: pinned):
            pass


def test_peak_memory_and_peers_on_the_host(make_registry):
    make_registry()
    platform = torchhal.current_platform()
    platform.reset_peak_memory()
    assert platform.peak_memory() == PeakMemory(0, None, None)
    assert platform.can_access_peer(0, 0) is False


def test_the_ipc_redirect_switch_refuses_what_the_plugin_does_not_declare(make_registry):
    make_registry()
    platform = torchhal.current_platform()
    with pytest.raises(ValueError, match="'cpu' does not declare peer-redirected IPC"):
        platform.set_ipc_peer_redirect(True)
    with pytest.raises(TypeError, match="pass True or False"):
        platform.set_ipc_peer_redirect("no")  # type: ignore[arg-type]
    platform.set_ipc_peer_redirect(False)
    assert platform.ipc_support is not None and not platform.ipc_support.peer_redirect
