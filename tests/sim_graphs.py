"""A CPU platform whose graphs record and replay nothing: enough to count captures and to see
what a capture that fails leaves behind, on a machine without an accelerator."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torchhal
from torchhal.platforms import GraphSupport, Platform, hookimpl
from torchhal.plugins.cpu import CpuPlatform


class SimGraph:
    def replay(self) -> None:
        pass


@contextlib.contextmanager
def sim_capture(graph: SimGraph, pool: object, stream: object) -> Iterator[None]:
    yield


class SimGraphsPlatform(CpuPlatform):
    """The CPU platform (its virtual memory included) with graph support."""

    name = "simgraphs"
    priority = -1

    def graph_support(self) -> GraphSupport:
        return GraphSupport(graph_class=SimGraph, new_pool=object, capture=sim_capture, is_capturing=lambda: False)


class SimGraphsWithoutRegions(SimGraphsPlatform):
    """Graphs but no virtual memory: an engine sleeps by host offload."""

    def virtual_memory_support(self) -> None:
        return None


def sim_graphs_platform(make_registry: Callable[..., object], cls: type[SimGraphsPlatform] = SimGraphsPlatform
                        ) -> Platform:
    """Register `cls` in a fresh registry (the `make_registry` fixture) and return its platform."""

    class Registration:
        @hookimpl
        def torchhal_register_platforms(self) -> list[CpuPlatform]:
            return [cls()]

    make_registry(Registration())
    return torchhal.get_platform("simgraphs")
