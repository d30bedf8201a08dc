"""graphs (if declared): capture and replay through the platform (contract 4)."""

from __future__ import annotations

import pytest
import torch

from ._helpers import fill_cache, spies

pytestmark = pytest.mark.conformance("graphs")


def _capture(platform, device_index, graph, pool, fn):
    support = platform.graph_support
    stream = platform.new_stream(device_index)
    stream.wait_stream(platform.current_stream(device_index))
    with platform.use_stream(stream):
        fn()  # warm up outside the graph, on the capture stream
    platform.current_stream(device_index).wait_stream(stream)
    with support.capture(graph, pool, stream):
        out = fn()
    platform.current_stream(device_index).wait_stream(stream)
    return out


def test_capture_and_replay_with_new_inputs(platform, device_index):
    support = platform.graph_support
    device = platform.device(device_index)
    static_in = torch.randn(256, 256, device=device)
    weight = torch.randn(256, 256, device=device)
    graph = support.graph_class()
    static_out = _capture(platform, device_index, graph, support.new_pool(), lambda: torch.relu(static_in @ weight) + 1)
    for _ in range(3):
        fresh = torch.randn(256, 256, device=device)
        static_in.copy_(fresh)
        graph.replay()
        platform.synchronize(device_index)
        torch.testing.assert_close(static_out, torch.relu(fresh @ weight) + 1)


def test_two_graphs_share_one_pool(platform, device_index):
    support = platform.graph_support
    device = platform.device(device_index)
    pool = support.new_pool()
    x = torch.randn(1024, device=device)
    g1, g2 = support.graph_class(), support.graph_class()
    out1 = _capture(platform, device_index, g1, pool, lambda: x * 2)
    out2 = _capture(platform, device_index, g2, pool, lambda: x + 3)
    x.copy_(torch.arange(1024, dtype=torch.float32, device=device))
    g1.replay()
    g2.replay()
    platform.synchronize(device_index)
    torch.testing.assert_close(out1, x * 2)
    torch.testing.assert_close(out2, x + 3)


def test_capture_keeps_the_cache(platform, device_index, measure):
    support = platform.graph_support
    device = platform.device(device_index)
    fill_cache(platform, device_index)
    before = platform.memory_info(device_index).reserved
    x = torch.randn(1024, device=device)
    with spies(platform, ("empty_cache",)) as calls:
        _capture(platform, device_index, support.graph_class(), support.new_pool(), lambda: x * 2)
    after = platform.memory_info(device_index).reserved
    measure.update(reserved_before=before, reserved_after=after)
    assert calls == [], f"capture called {calls}"
    if before is not None and after is not None:
        assert after >= before, "capture emptied the allocator cache"


def test_capturing_flag(platform, device_index):
    support = platform.graph_support
    seen = []
    x = torch.randn(16, device=platform.device(device_index))

    def work():
        seen.append(support.is_capturing())
        return x * 2

    assert support.is_capturing() is False
    _capture(platform, device_index, support.graph_class(), support.new_pool(), work)
    assert seen == [False, True]
    assert support.is_capturing() is False
