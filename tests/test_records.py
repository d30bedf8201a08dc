"""The capability records a plugin declares check their fields where they are made: a hole in a
declared capability is named at the plugin, not met as "'NoneType' object is not callable" inside
the first graph capture or IPC open."""

import contextlib
import dataclasses

import pytest

import torchhal
from torchhal.cli.info import collect_info, format_info
from torchhal.platforms import GraphSupport, IpcEvents, IpcSupport
from torchhal.plugins.cpu import CpuPlatform

from .test_selection import plugin_module


class FakeGraph:
    def replay(self) -> None: ...


def capture(graph: object, pool: object, stream: object) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


GRAPHS = {"graph_class": FakeGraph, "new_pool": object, "capture": capture, "is_capturing": lambda: False}
EVENTS = {"new": lambda device: object(), "export": lambda event: b"x" * 64, "open": lambda *handle: object(),
          "handle_nbytes": 64}
IPC = {"share": lambda tensor: None, "open": lambda handle, device: None, "peer_redirect": False}


@pytest.mark.parametrize(("field", "value", "must"), [
    ("graph_class", None, "a class whose instances are graphs"),
    ("graph_class", FakeGraph(), "a class whose instances are graphs"),
    ("new_pool", None, "a function returning a memory-pool handle"),
    ("capture", "capture", r"a function capture\(graph, pool, stream\)"),
    ("is_capturing", "no", "a function returning True while the current stream captures"),
])
def test_graph_support_names_a_field_that_is_not_what_it_must_be(field, value, must):
    with pytest.raises(TypeError, match=rf"^GraphSupport\.{field} is {value!r}; it must be {must}"):
        GraphSupport(**{**GRAPHS, field: value})


@pytest.mark.parametrize(("field", "value", "must"), [
    ("share", None, "a function of a tensor returning an IpcHandle"),
    ("open", 3, r"a function \(IpcHandle, consumer device\) returning a tensor"),
    ("peer_redirect", 1, "True or False"),
    ("peer_redirect", "yes", "True or False"),
    ("note", None, "a str"),
    ("events", {}, "None or an IpcEvents"),
])
def test_ipc_support_names_a_field_that_is_not_what_it_must_be(field, value, must):
    with pytest.raises(TypeError, match=rf"^IpcSupport\.{field} is {value!r}; it must be {must}"):
        IpcSupport(**{**IPC, field: value})


@pytest.mark.parametrize(("field", "value", "error", "must"), [
    ("new", None, TypeError, "a function of a device index"),
    ("export", b"handle", TypeError, "a function of an event"),
    ("open", None, TypeError, r"a function \(handle bytes, producer device, consumer device\)"),
    ("handle_nbytes", "64", TypeError, "an int"),
    ("handle_nbytes", True, TypeError, "an int"),
    ("handle_nbytes", 0, ValueError, r"in 1\.\.256"),
    ("handle_nbytes", 257, ValueError, r"in 1\.\.256"),
])
def test_ipc_events_name_a_field_that_is_not_what_it_must_be(field, value, error, must):
    with pytest.raises(error, match=rf"^IpcEvents\.{field} is {value!r}; it must be {must}"):
        IpcEvents(**{**EVENTS, field: value})


def test_good_records_are_accepted_as_given():
    assert GraphSupport(**GRAPHS).graph_class is FakeGraph
    events = IpcEvents(**EVENTS)
    support = IpcSupport(**IPC, note="host memory", events=events)
    assert support.events is events and dataclasses.replace(support, events=None).events is None
    assert CpuPlatform().ipc_support().peer_redirect is False  # the built-in's own record


class HalfGraphs(CpuPlatform):
    """Declares graphs, but without a pool factory or a capture flag."""

    name = "halfgraphs"
    priority = -1

    def graph_support(self):
        return GraphSupport(graph_class=FakeGraph, new_pool=None, capture=capture, is_capturing="no")


class Graphs(CpuPlatform):
    name = "graphs"
    priority = -1

    def graph_support(self):
        return GraphSupport(**GRAPHS)


def test_info_names_a_broken_graph_declaration_instead_of_reporting_graphs_unsupported(make_registry, monkeypatch):
    make_registry(plugin_module(HalfGraphs()))
    monkeypatch.setenv("TORCHHAL_PLATFORM", "halfgraphs")
    with pytest.warns(torchhal.TorchhalPluginWarning, match="graph_support"):
        info = collect_info()
    [error] = [e for e in info["plugin_errors"] if e["stage"] == "query"]
    assert error["error"] == ("graph_support(): TypeError: GraphSupport.new_pool is None; it must be a function "
                              "returning a memory-pool handle, e.g. torch.cuda.graph_pool_handle")


def test_info_names_the_declared_graph_class(make_registry, monkeypatch):
    make_registry(plugin_module(Graphs()))
    monkeypatch.setenv("TORCHHAL_PLATFORM", "graphs")
    info = collect_info()
    assert info["current"]["capabilities"]["graphs"] == "FakeGraph"
    assert "  graphs: FakeGraph" in format_info(info).splitlines()
