"""device: counting, selecting and synchronising devices; the OOM type."""

from __future__ import annotations

import types

import pytest
import torch

from torchhal.platforms import DeviceInfo
from torchhal.platforms.testing import plugin_under_test

pytestmark = pytest.mark.conformance("device")


def test_count_current_and_set(platform, device_index):
    count = platform.device_count()
    assert count >= 1
    assert platform.current_device() == device_index
    platform.set_device(device_index)
    assert platform.current_device() == device_index
    with pytest.raises(ValueError, match="out of range"):
        platform.set_device(count)


def test_device_module_matches_the_platform(platform, device_index):
    assert isinstance(plugin_under_test(platform).device_module(), types.ModuleType)
    tensor = torch.ones(8, device=platform.device(device_index))
    assert tensor.device.type == platform.device_type
    assert (tensor.device.index or 0) == device_index
    info = platform.device_info(device_index)
    assert isinstance(info, DeviceInfo), f"device_info returned {type(info).__name__}, not DeviceInfo"
    assert info.total_memory > 0 and info.name, f"device_info needs a name and total_memory > 0: {info!r}"


def test_synchronize_waits_for_queued_work(platform, device_index):
    x = torch.randn(512, 512, device=platform.device(device_index))
    for _ in range(5):
        x = x @ x / 512
    platform.synchronize(device_index)
    assert torch.isfinite(x.to("cpu")).all()


def test_streams_and_events(platform, device_index):
    stream = platform.new_stream(device_index)
    event = platform.new_event()
    x = torch.ones(1024, device=platform.device(device_index))
    with platform.use_stream(stream):
        y = x * 2
        event.record(stream)
    event.wait(platform.current_stream(device_index))
    platform.synchronize(device_index)
    assert float(y.sum().to("cpu")) == 2048.0


def test_oversized_allocation_raises_the_oom_type(platform, device_index, measure):
    total = platform.memory_info(device_index).total
    nbytes = total * 8
    measure["requested_bytes"] = nbytes
    with pytest.raises(Exception) as caught:
        torch.empty(nbytes, dtype=torch.uint8, device=platform.device(device_index))
    assert platform.is_out_of_memory(caught.value), f"{type(caught.value).__name__}: {caught.value}"
    measure["raised"] = type(caught.value).__name__
