"""graphs (if declared): capture and replay through the platform (contract 4)."""

from __future__ import annotations

import pytest
import torch

from ._helpers import capture, fill_cache, spies

pytestmark = pytest.mark.conformance("graphs")


def test_capture_and_replay_with_new_inputs(platform, device_index):
    device = platform.device(device_index)
    static_in = torch.randn(256, 256, device=device)
    weight = torch.randn(256, 256, device=device)
    graph, static_out = capture(platform, device_index, lambda: torch.relu(static_in @ weight) + 1)
    for _ in range(3):
        fresh = torch.randn(256, 256, device=device)
        static_in.copy_(fresh)
        graph.replay()
        platform.synchronize(device_index)
        torch.testing.assert_close(static_out, torch.relu(fresh @ weight) + 1)


def test_two_graphs_share_one_pool(platform, device_index):
    device = platform.device(device_index)
    pool = platform.graph_support.new_pool()
    x = torch.randn(1024, device=device)
    g1, out1 = capture(platform, device_index, lambda: x * 2, pool)
    g2, out2 = capture(platform, device_index, lambda: x + 3, pool)
    x.copy_(torch.arange(1024, dtype=torch.float32, device=device))
    g1.replay()
    g2.replay()
    platform.synchronize(device_index)
    torch.testing.assert_close(out1, x * 2)
    torch.testing.assert_close(out2, x + 3)


def test_capture_keeps_the_cache(platform, device_index, measure):
    fill_cache(platform, device_index)
    before = platform.memory_info(device_index).reserved
    x = torch.randn(1024, device=platform.device(device_index))
    with spies(platform, ("empty_cache",)) as calls:
        capture(platform, device_index, lambda: x * 2)
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
    capture(platform, device_index, work)
    assert seen == [False, True]
    assert support.is_capturing() is False
