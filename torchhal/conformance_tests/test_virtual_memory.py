"""virtual_memory (if declared): tagged regions released and restored under the same addresses
(contract 10).

A release gives the region's physical memory back (the device's free memory, as the
non-emptying `memory_info` sees it, rises by what the release returns: at least half of it, the
best of eight cycles, so another process allocating meanwhile does not decide the verdict); a restore maps memory
again under the same addresses; a backup comes back bit for bit, and what is written into it
while released comes back too; a graph whose memory lives in a region, captured before a
release, replays correctly after the restore; a hundred cycles leak nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest
import torch

from ._helpers import MiB, capture

pytestmark = pytest.mark.conformance("virtual_memory")

SIZE = 64 * MiB  # far above any allocation granularity, small for any device
RELEASED = 256 * MiB  # what the free-memory clause releases: well above what the OS's counters drift by
TAG = "conformance"


@pytest.fixture
def regions(platform: Any, device_index: int) -> Iterator[Any]:
    made = platform.virtual_memory_support.new_regions(device_index)
    yield made
    for tag in (TAG, "conformance_graphs"):
        made.restore(tag)  # a clause that failed with its region released leaves it usable for the next


def _free(platform: Any, device_index: int) -> int:
    """The device's free memory; where the device's memory is the host's (the platform reports no
    allocator of its own: `reserved` is None), what this process does not hold of it. A host's
    free memory moves with every process on it, and a virtual machine's can lag the pages given
    back by seconds; the memory a process stops holding it gives back at once."""
    info = platform.memory_info(device_index)
    if info.reserved is None:
        return int(info.total) - psutil.Process().memory_info().rss
    return int(info.free)


def _filled(platform: Any, device_index: int, tensor: torch.Tensor) -> torch.Tensor:
    """Random bytes in every page of `tensor` (zeros would hide a region that reads as new)."""
    generator = torch.Generator(device=tensor.device).manual_seed(tensor.numel())
    tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8, device=tensor.device, generator=generator))
    platform.synchronize(device_index)
    return tensor


def _best_rise(platform: Any, device_index: int, release: Callable[[], int], restore: Callable[[], int],
               tries: int = 8) -> tuple[int, int]:
    """The bytes a release returns and the largest rise of free memory it was seen to cause, over
    `tries` release/restore cycles: another process allocating meanwhile lowers one reading, not
    every one (a host's free memory moves with every process on it)."""
    released, rises = 0, []
    for _ in range(tries):
        before = _free(platform, device_index)
        released = release()
        rises.append(_free(platform, device_index) - before)
        restore()
    return released, max(rises)


def test_a_release_gives_the_memory_back_under_kept_addresses(platform, device_index, regions, measure):
    tensor = _filled(platform, device_index, regions.allocate(TAG, RELEASED))
    address = tensor.data_ptr()

    def restore_and_touch() -> int:  # pages not written since the restore may not be memory yet
        restored = regions.restore(TAG)
        _filled(platform, device_index, tensor)
        return restored

    released, rise = _best_rise(platform, device_index, lambda: regions.release(TAG, backup=False),
                                restore_and_touch)
    measure.update(released_bytes=released, free_memory_rise_bytes=rise)
    assert released >= RELEASED, f"release returned {released} bytes for a region of {RELEASED}"
    assert rise >= released // 2, (  # a release gives back about all of it, a non-release none
        f"releasing {released} bytes raised the device's free memory by {rise} bytes (best of 8): the physical "
        "memory did not go back to the device")
    assert tensor.data_ptr() == address and regions.region_bytes(TAG) >= RELEASED, "the region moved on restore"
    tensor.fill_(7)  # usable where it was
    platform.synchronize(device_index)
    assert bool((tensor == 7).all())


def test_a_backup_comes_back_bit_for_bit_and_takes_what_was_written_while_released(platform, device_index, regions):
    tensor = _filled(platform, device_index, regions.allocate(TAG, SIZE))
    address, expected = tensor.data_ptr(), tensor.to("cpu", copy=True)  # a copy on the host too
    regions.release(TAG, backup=True)
    assert regions.released(TAG)
    backup = regions.host_copy(tensor[: 1 << 20])
    backup[:16] = torch.arange(16, dtype=torch.uint8)  # an update made while released lands in the backup
    expected[:16] = torch.arange(16, dtype=torch.uint8)
    regions.restore(TAG)
    platform.synchronize(device_index)
    assert not regions.released(TAG) and tensor.data_ptr() == address
    assert torch.equal(tensor.cpu(), expected), "the restored region does not hold what its backup held"


def test_a_graph_on_region_memory_replays_after_the_restore(platform, device_index, regions, measure):
    if platform.graph_support is None:
        pytest.skip("not applicable: the platform declares no graph support")
    device = platform.device(device_index)
    data = regions.allocate(TAG, SIZE).view(torch.float32)[: 256 * 256].view(256, 256)
    data.copy_(torch.randn(256, 256, device=device))
    pool = regions.graph_pool("conformance_graphs")
    if pool is None and platform.virtual_memory_support.graph_memory:
        pytest.fail("graph_memory is True but graph_pool() answered None")
    graph, out = capture(platform, device_index, lambda: torch.relu(data @ data) + 1, pool)
    platform.synchronize(device_index)
    expected = (torch.relu(data @ data) + 1).to("cpu", copy=True)
    graph_bytes = regions.region_bytes("conformance_graphs")
    regions.release(TAG, backup=True)
    released, rise = 0, 0
    if pool is not None:
        before = _free(platform, device_index)
        released = regions.release("conformance_graphs", backup=False)
        rise = _free(platform, device_index) - before
        assert released >= graph_bytes > 0, f"the graph's region held {graph_bytes} bytes, {released} were released"
        assert rise >= released // 2, f"releasing the graph's {released} bytes raised free memory by {rise}"
        regions.restore("conformance_graphs")
    regions.restore(TAG)
    measure.update(graph_region_bytes=graph_bytes, graph_free_memory_rise_bytes=rise)
    out.zero_()
    graph.replay()
    platform.synchronize(device_index)
    torch.testing.assert_close(out.cpu(), expected, msg="a graph captured before the release replays wrong after it")


def test_a_hundred_cycles_leak_nothing(platform, device_index, regions, measure):
    tensor = _filled(platform, device_index, regions.allocate(TAG, SIZE))
    expected, held = tensor[:: 4096].to("cpu", copy=True), regions.region_bytes(TAG)
    before = _free(platform, device_index)
    for cycle in range(100):
        regions.release(TAG, backup=cycle % 2 == 0)  # the backup is made once and reused
        regions.restore(TAG)
        if cycle % 2 == 0:
            assert torch.equal(tensor[:: 4096].cpu(), expected), f"cycle {cycle}: the backup came back changed"
        tensor[:: 4096].copy_(expected.to(tensor.device))
    platform.synchronize(device_index)
    lost = before - _free(platform, device_index)
    measure.update(free_memory_lost_bytes=lost)
    assert regions.region_bytes(TAG) == held, "the region grew or shrank over the cycles"
    assert lost < 2 * SIZE, f"100 release/restore cycles of a {SIZE}-byte region lost {lost} bytes of free memory"
