"""Residency manager decisions on the CPU platform.

On CPU, host and device are the same memory, so moves are real copies between
host buffers: these tests prove the decisions (what moves, when, what is kept,
prefetched and emptied, with which reason) and that streamed weights compute
the same outputs. They do not prove copy/compute overlap or device memory
savings: benchmarks/residency_pipeline.py measures those on a GPU.
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from torchhal.core.residency import (
    ComponentUse,
    LayerwiseStrategy,
    RequestFailed,
    ResidencyManager,
    ResidencyStrategy,
    Stage,
    Strategy,
    UndeclaredUse,
)
from torchhal.platforms import ReleasePoint, hookimpl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from diffusion_pipeline import default_placements, make_components, run_request, stages  # noqa: E402


@pytest.fixture
def observed(make_registry):
    seen = {"empties": [], "moves": []}

    class Observer:
        @hookimpl
        def torchhal_cache_emptied(self, reason):
            seen["empties"].append(reason)

        @hookimpl
        def torchhal_component_moved(self, component, source, destination, nbytes):
            seen["moves"].append((component, destination, nbytes))

    make_registry(Observer())
    return seen


def kinds(manager, kind):
    return manager.trace.of_kind(kind)


def resident_reference(tokens, steps=3):
    manager = ResidencyManager(make_components(), {})
    return run_request(manager, tokens, steps)


def test_layerwise_and_offload_compute_the_same_outputs(observed):
    tokens = torch.randn(8, 256)
    expected = resident_reference(tokens)
    manager = ResidencyManager(make_components(), default_placements("layerwise", prefetch_layers=2))
    torch.testing.assert_close(run_request(manager, tokens, 3), expected)
    torch.testing.assert_close(run_request(manager, tokens, 3), expected)  # a second request too
    manager = ResidencyManager(make_components(), default_placements("offload"))
    torch.testing.assert_close(run_request(manager, tokens, 3), expected)


@pytest.mark.parametrize(("encoder_intensive", "emptied_after"), [
    (True, ["text_encoder", "transformer", "vae"]),
    (False, ["transformer", "vae"]),  # an undeclared component's release is not a release point
])
def test_empties_only_after_memory_intensive_releases_never_at_stage_boundaries(
    observed, encoder_intensive, emptied_after
):
    manager = ResidencyManager(make_components(), default_placements("layerwise"))
    run_request(manager, torch.randn(4, 256), 3, encoder_memory_intensive=encoder_intensive)
    trace = manager.trace.events
    empties = [i for i, e in enumerate(trace) if e["kind"] == "empty_cache"]
    assert [trace[i - 1]["kind"] for i in empties] == ["release"] * len(emptied_after)
    assert [trace[i - 1]["component"] for i in empties] == emptied_after
    assert [trace[i]["where"] for i in empties] == ["component_release"] * len(emptied_after)
    assert observed["empties"] == [ReleasePoint.COMPONENT_RELEASE] * len(emptied_after)
    released = [e["component"] for e in trace if e["kind"] == "release"]
    assert released == ["text_encoder", "transformer", "vae"]  # released either way


def test_without_release_points_nothing_is_emptied_and_prefetch_still_runs(observed):
    tokens = torch.randn(4, 256)
    expected = resident_reference(tokens)
    manager = ResidencyManager(make_components(), default_placements("offload"), empty_on_release=False)
    torch.testing.assert_close(run_request(manager, tokens, 3), expected)
    assert observed["empties"] == [] and kinds(manager, "empty_cache") == []
    assert [e["component"] for e in kinds(manager, "release")] == ["text_encoder", "transformer", "vae"]
    assert [p["component"] for p in kinds(manager, "prefetch")] == ["transformer", "text_encoder"]
    with pytest.raises(TypeError, match="empty_on_release = 0 must be True or False"):
        ResidencyManager(make_components(), {}, empty_on_release=0)  # type: ignore[arg-type]


def test_baseline_mode_empties_after_every_use(observed):
    manager = ResidencyManager(make_components(), default_placements("layerwise"), empty_after_every_use=True)
    run_request(manager, torch.randn(4, 256), 3)
    assert [e["where"] for e in kinds(manager, "empty_cache")] == ["every_use"] * 5


def test_keep_prefetch_and_release_decisions(observed):
    manager = ResidencyManager(make_components(), default_placements("offload"))
    run_request(manager, torch.randn(4, 256), 3)
    keeps = [e["component"] for e in kinds(manager, "keep")]
    assert keeps == ["transformer", "transformer"]  # consecutive denoise steps keep it
    prefetches = [e for e in kinds(manager, "prefetch")]
    # once per request: the next memory-intensive use (transformer), then the preferred text encoder
    assert [p["component"] for p in prefetches] == ["transformer", "text_encoder"]
    assert prefetches[1]["why"] == "preferred ready after request"
    released = [e["component"] for e in kinds(manager, "release")]
    assert released == ["text_encoder", "transformer", "vae"]
    assert manager.components["text_encoder"].on_device  # prepared for the next request
    assert not manager.components["vae"].on_device
    moved_to_device = {c for c, dest, _ in observed["moves"] if dest != "host"}
    assert moved_to_device == {"text_encoder", "transformer", "vae"}


def test_warmup_keeps_components_that_ask_for_it(observed):
    manager = ResidencyManager(make_components(), default_placements("offload"))
    run_request(manager, torch.randn(4, 256), 2, warmup=True)
    assert manager.components["transformer"].on_device
    assert any(e["why"] == "keep_ready_after_warmup" for e in kinds(manager, "keep"))


def test_layerwise_releases_each_layer_and_keeps_non_layer_weights(observed):
    components = make_components(layers=4)
    manager = ResidencyManager(components, {"transformer": LayerwiseStrategy(prefetch_layers=1)})
    transformer = manager.components["transformer"].strategy
    with manager.request([Stage("s", (ComponentUse("transformer", memory_intensive=True),))]):
        with manager.use_component("transformer") as module:
            module(torch.randn(2, 256))
        assert not any(b.on_device for b in transformer.blocks)  # each layer released after use
    # the release reports every streamed layer once: four layers' bytes left the device
    assert kinds(manager, "release")[0]["nbytes"] == sum(b.nbytes for b in transformer.blocks)
    assert components["transformer"].proj_in.weight.device.type == manager.device.type


def test_oom_fails_the_request_empties_once_and_the_next_request_succeeds(observed, monkeypatch):
    components = make_components()
    manager = ResidencyManager(components, default_placements("offload"))
    real_forward = components["vae"].forward

    def oom(x):
        raise torch.OutOfMemoryError("simulated: tried to allocate 3 GiB")

    monkeypatch.setattr(components["vae"], "forward", oom)
    with pytest.raises(RequestFailed, match="out of memory.*3 GiB"):
        run_request(manager, torch.randn(4, 256), 2)
    assert observed["empties"].count(ReleasePoint.OOM) == 1
    assert not any(c.on_device for c in manager.components.values())
    monkeypatch.setattr(components["vae"], "forward", real_forward)
    run_request(manager, torch.randn(4, 256), 2)


def test_no_component_reads_on_device_after_close_whatever_its_strategy(observed):
    # A resident strategy's own answer is "always on the device"; after close() it is not.
    manager = ResidencyManager(make_components(), {**default_placements("layerwise"), "vae": Strategy.RESIDENT})
    run_request(manager, torch.randn(4, 256), 2)
    assert manager.components["vae"].on_device
    manager.close()
    assert not [name for name, c in manager.components.items() if c.on_device]


def test_misuse_is_refused_with_clear_errors(observed):
    manager = ResidencyManager(make_components(), default_placements())
    with pytest.raises(RuntimeError, match="outside a request"):
        manager.begin_use("vae")
    manager.begin_request(stages(2))
    with pytest.raises(RuntimeError, match="declared next use is 'text_encoder'"):
        manager.begin_use("vae")
    with pytest.raises(ValueError, match="unknown component 'unet'"):
        manager.begin_use("unet")
    with pytest.raises(RuntimeError, match="already running, and requests do not nest"):
        manager.begin_request(stages(2))
    with pytest.raises(ValueError, match="unknown components \\['ghost'\\]"):
        ResidencyManager(make_components(), {"ghost": Strategy.OFFLOAD})
    with pytest.raises(ValueError, match="no non-empty nn.ModuleList 'blocks'"):
        ResidencyManager(make_components(), {"vae": LayerwiseStrategy(layers_attr="blocks")})


def test_a_use_can_ask_for_another_dtype_without_touching_the_host_copy(observed):
    components = make_components(layers=4)
    host_before = {name: p.detach().clone() for name, p in components["vae"].named_parameters()}
    manager = ResidencyManager(components, {"vae": Strategy.OFFLOAD, "transformer": Strategy.LAYERWISE,
                                            "text_encoder": Strategy.RESIDENT})
    uses = [Stage("s", (ComponentUse("text_encoder", dtype=torch.float64),
                        ComponentUse("transformer", dtype=torch.float64),
                        ComponentUse("vae", dtype=torch.float64)))]
    x = torch.randn(4, 256, dtype=torch.float64)
    with manager.request(uses), torch.no_grad():
        for name in ("text_encoder", "transformer", "vae"):
            with manager.use_component(name) as module:
                x = module(x)  # a float32 weight against float64 activations would raise
                assert module.proj_in.weight.dtype == torch.float64
                if name != "transformer":  # layerwise layers are back on the host after the forward
                    assert all(p.dtype == torch.float64 for p in module.layers[0].parameters())
    assert x.dtype == torch.float64
    # offload: the host copy kept its dtype and values; the next plain use is float32 again
    vae = components["vae"]
    assert all(torch.equal(p, host_before[name]) for name, p in vae.named_parameters())
    with manager.request([Stage("s", (ComponentUse("vae"),))]), manager.use_component("vae") as module:
        assert module.proj_in.weight.dtype == torch.float32
    # resident weights are cast in place (their device copy is the only one)
    assert components["text_encoder"].proj_in.weight.dtype == torch.float64


def test_a_bad_dtype_is_refused_before_the_request_starts(observed):
    manager = ResidencyManager(make_components(), default_placements())
    with pytest.raises(ValueError, match="declares dtype torch.int8.*floating torch.dtype"):
        manager.begin_request([Stage("s", (ComponentUse("vae", dtype=torch.int8),))])
    run_request(manager, torch.randn(4, 256), 2)  # nothing was started: the manager still serves


class RecordingStrategy(ResidencyStrategy):
    """A third-party strategy: pretends to move 100 bytes, records what it is asked."""

    prefetchable = True
    keepable = True

    def __init__(self):
        self.calls, self.loaded = [], False

    def attach(self, manager, component):
        self.calls.append(("attach", component.name))

    def load(self, manager, component, stream):
        self.calls.append(("load", "prefetch" if stream is not None else "now"))
        if self.loaded:
            return 0
        self.loaded = True
        return 100

    def release(self, manager, component):
        self.calls.append(("release",))
        was, self.loaded = self.loaded, False
        return 100 if was else 0

    def on_device(self, component):
        return self.loaded


def test_a_custom_strategy_plugs_in_and_gets_the_same_decisions(observed):
    strategy = RecordingStrategy()
    placements = {**default_placements("layerwise"), "vae": strategy}
    manager = ResidencyManager(make_components(), placements)
    run_request(manager, torch.randn(4, 256), 2)
    # prefetched once (the next memory-intensive use), found ready, released at its end
    # (and asked again at request end, where nothing is left)
    assert strategy.calls == [("attach", "vae"), ("load", "prefetch"), ("load", "now"), ("release",), ("release",)]
    assert [e["nbytes"] for e in kinds(manager, "prefetch") if e["component"] == "vae"] == [100]
    events = manager.trace.events
    release = next(i for i, e in enumerate(events) if e["kind"] == "release" and e["component"] == "vae")
    assert events[release + 1]["kind"] == "empty_cache"  # its release is a release point
    vae_moves = [(destination, nbytes) for component, destination, nbytes in observed["moves"] if component == "vae"]
    assert vae_moves == [(str(manager.device), 100), ("host", 100)]
    # it does not count its own copies: the manager counts what its load calls returned
    assert manager.last_request_h2d_bytes["vae"] == 100


def test_an_unknown_strategy_name_is_refused_clearly(observed):
    with pytest.raises(ValueError, match="'vae': unknown strategy 'offlaod'; use one of resident, offload, layerwise"):
        ResidencyManager(make_components(), {"vae": "offlaod"})
    # the class, not an instance of it
    with pytest.raises(ValueError, match="'vae': unknown strategy <class .*LayerwiseStrategy'>; .* or a "
                                         "ResidencyStrategy instance"):
        ResidencyManager(make_components(), {"vae": LayerwiseStrategy})


def test_close_gives_everything_back_and_leaves_plain_modules(observed):
    tokens = torch.randn(4, 256)
    components = make_components()
    manager = ResidencyManager(components, default_placements("layerwise"))
    run_request(manager, tokens, 2)
    manager.begin_request(stages(2))
    with pytest.raises(RuntimeError, match="close\\(\\) during a request"):
        manager.close()
    manager.finish_request()  # the refused close left the request usable
    observed["empties"].clear()
    manager.close()
    assert observed["empties"] == [ReleasePoint.COMPONENT_RELEASE]
    assert kinds(manager, "empty_cache")[-1]["where"] == "close"
    assert not any(c.on_device for c in manager.components.values())
    layers = components["transformer"].layers
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in layers)
    # The modules are plain host modules again: same outputs as never-managed ones.
    reference = make_components()
    with torch.no_grad():
        torch.testing.assert_close(components["transformer"](tokens), reference["transformer"](tokens))
    with pytest.raises(RuntimeError, match="closed; build a new one"):
        manager.begin_request(stages(2))
    assert manager.close() is None  # closing twice is harmless


def test_stage_tracing_only_observes_and_trace_exports(observed, tmp_path):
    manager = ResidencyManager(make_components(), default_placements("offload"))
    run_request(manager, torch.randn(4, 256), 2)
    stage_events = kinds(manager, "stage")
    assert [e["stage"] for e in stage_events] == ["encode", "denoise", "decode"]
    manager.trace.export(str(tmp_path / "trace.json"))
    assert json.loads((tmp_path / "trace.json").read_text())[0]["kind"] == "request_start"
    pytest.importorskip("matplotlib")
    manager.trace.plot_memory_timeline(str(tmp_path / "timeline.png"))
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_logging_writes_one_json_line_per_event_and_tracing_can_be_off(observed, caplog):
    import logging

    logger = logging.getLogger("residency-test")
    with caplog.at_level(logging.INFO, logger="residency-test"):
        manager = ResidencyManager(make_components(), default_placements("offload"), record_trace=False, log=logger)
        run_request(manager, torch.randn(4, 256), 2)
    assert manager.trace.events == []
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(line.startswith("torchhal.residency {") for line in lines)
    assert json.loads(lines[0].split(" ", 1)[1])["kind"] == "request_start"
    silent = ResidencyManager(make_components(), default_placements("offload"), record_trace=False)
    run_request(silent, torch.randn(4, 256), 2)
    assert silent.trace.events == [] and observed["empties"]  # still empties, just untraced


# -- knobs are checked when the manager is built ------------------------------------------

@pytest.mark.parametrize(("prefetch", "message"), [
    (1.5, "prefetch_layers must be an int .*got 1.5; use e.g. prefetch_layers=1"),
    (True, "prefetch_layers must be an int .*got True"),
    ("2", "prefetch_layers must be an int .*got '2'"),
    (-1, "prefetch_layers -1 must be >= 0"),
])
def test_a_bad_prefetch_layers_is_refused_at_construction(prefetch, message):
    with pytest.raises(ValueError, match=message):
        LayerwiseStrategy(prefetch_layers=prefetch)


def test_prefetch_beyond_the_layer_count_is_refused_before_anything_moves(observed):
    components = make_components(layers=4)
    host_before = {name: {k: p.data_ptr() for k, p in m.named_parameters()} for name, m in components.items()}
    placements = {"text_encoder": Strategy.OFFLOAD, "transformer": LayerwiseStrategy(prefetch_layers=2000)}
    with pytest.raises(ValueError, match="prefetch_layers=2000 for 'transformer', which streams 4 layers.*"
                                         "use prefetch_layers <= 3"):
        ResidencyManager(components, placements)
    # nothing was attached: same storages, no hooks, nothing reported moved
    assert {name: {k: p.data_ptr() for k, p in m.named_parameters()} for name, m in components.items()} == host_before
    assert all(not layer._forward_pre_hooks for layer in components["transformer"].layers)
    assert observed["moves"] == []
    ResidencyManager(components, {"transformer": LayerwiseStrategy(prefetch_layers=3)})  # the bound itself is fine


def test_a_mixed_dtype_offload_is_refused_before_any_component_is_attached(observed):
    components = make_components(layers=4)
    components["vae"].layers[0].up.weight.data = components["vae"].layers[0].up.weight.data.double()
    placements = {"transformer": LayerwiseStrategy(1), "vae": Strategy.OFFLOAD}  # vae: two dtypes
    with pytest.raises(ValueError, match="one dtype"):
        ResidencyManager(components, placements)
    assert all(not layer._forward_pre_hooks for layer in components["transformer"].layers)


def test_declarations_are_checked_when_written():
    with pytest.raises(TypeError, match=r"ComponentUse\('vae'\).memory_intensive = 'yes' must be True or False"):
        ComponentUse("vae", memory_intensive="yes")
    with pytest.raises(ValueError, match="component must be a component name"):
        ComponentUse(3)
    with pytest.raises(ValueError, match="uses must be ComponentUse records"):
        Stage("decode", ("vae",))
    with pytest.raises(ValueError, match="same strategy object"):
        shared = LayerwiseStrategy(1)
        ResidencyManager(make_components(), {"transformer": shared, "vae": shared})
    with pytest.raises(TypeError, match="stage 'denoise': exact = 'no' must be True or False"):
        Stage("denoise", (ComponentUse("transformer"),), exact="no")  # type: ignore[arg-type]


# -- stages that are not exact: uses in any order and count, none included -----------------

def _use(manager, component, tokens):
    with manager.use_component(component) as module:
        return module(tokens)


def _forecast(decode_exact=False):
    intensive = {"memory_intensive": True}
    return [Stage("encode", (ComponentUse("text_encoder", **intensive),), exact=False),
            Stage("denoise", (ComponentUse("transformer", **intensive),), exact=False),
            Stage("decode", (ComponentUse("vae", **intensive),), exact=decode_exact)]


def test_a_stage_that_is_not_exact_takes_its_uses_any_number_of_times(observed):
    manager = ResidencyManager(make_components(), default_placements("offload"), empty_on_release=False)
    tokens = torch.randn(4, 256)
    with torch.no_grad():
        for encodes, steps in ((2, 3), (0, 1)):  # a negative prompt encoded too; prompt embeddings given
            start = len(manager.trace.events)
            with manager.request(_forecast()):
                for component in ["text_encoder"] * encodes + ["transformer"] * steps + ["vae"]:
                    _use(manager, component, tokens)
            events = manager.trace.events[start:]
            assert events[-1]["uses_run"] == encodes + steps + 1
            # each component came in once and left once however often it ran: kept between its uses
            brought = [e["component"] for e in events if e["kind"] in ("prepare", "prefetch")]
            assert sorted(brought) == sorted({"transformer", "vae"} | ({"text_encoder"} if encodes else set()))
            assert [e["component"] for e in events if e["kind"] == "release"] == (
                ["text_encoder"] * bool(encodes) + ["transformer", "vae"])
            assert {e["why"] for e in events if e["kind"] == "keep"} == {"may be needed by the next use"}
    assert not any(c.on_device for c in manager.components.values())
    # the stages still run in their order: an earlier stage's component after a later one began is refused
    with manager.request(_forecast()), torch.no_grad():
        _use(manager, "transformer", tokens)
        with pytest.raises(UndeclaredUse, match=r"begin_use\('text_encoder', phase=None\) but the declared next "
                                                r"use is one of 'transformer', 'vae'") as raised:
            manager.begin_use("text_encoder")
        assert raised.value.allowed == ("transformer", "vae") and raised.value.expected == "transformer"
        _use(manager, "vae", tokens)  # the refusal changed nothing: the request goes on
    # an exact stage cannot be skipped, and ends the uses an earlier inexact stage allows
    manager.begin_request(_forecast(decode_exact=True))
    _use(manager, "vae", tokens)  # the encode and denoise stages may not run at all
    with pytest.raises(UndeclaredUse, match="after the request's declared uses ran out"):
        manager.begin_use("vae")
    manager.finish_request()


def test_a_component_kept_for_a_use_that_does_not_come_leaves_when_another_begins(observed):
    manager = ResidencyManager(make_components(), default_placements("offload"))  # releases empty the cache
    tokens = torch.randn(4, 256)
    stages = [Stage(s.name, tuple(replace(u, allow_prefetch=False) for u in s.uses), exact=s.exact)
              for s in _forecast()]  # each component comes in at its use: the order below is the manager's
    seen_on_device: dict[str, bool] = {}
    with manager.request(stages), torch.no_grad():
        _use(manager, "text_encoder", tokens)
        assert manager.components["text_encoder"].on_device  # kept: it may run again for a negative prompt
        with manager.use_component("transformer") as transformer:
            seen_on_device["text_encoder"] = manager.components["text_encoder"].on_device
            transformer(tokens)
        _use(manager, "vae", tokens)
    assert seen_on_device == {"text_encoder": False}  # gone before the transformer came in
    events = manager.trace.last_request()
    order = [(e["kind"], e["component"]) for e in events if e["kind"] in ("release", "prepare", "empty_cache")]
    assert order[:4] == [("prepare", "text_encoder"), ("release", "text_encoder"), ("empty_cache", None),
                         ("prepare", "transformer")]
    # the last use's component, kept too, leaves at the request's end as at its use's end: a release point
    assert order[-2:] == [("release", "vae"), ("empty_cache", None)]
    assert [e["where"] for e in events if e["kind"] == "empty_cache"] == ["component_release"] * 3
    assert observed["empties"] == [ReleasePoint.COMPONENT_RELEASE] * 3


# -- release points: where the cache is emptied, and where it must not be -----------------

def test_a_resident_component_is_never_released_so_never_emptied_for(observed):
    manager = ResidencyManager(make_components(), {})  # all resident, every use memory-intensive
    run_request(manager, torch.randn(4, 256), 3)
    assert kinds(manager, "release") == []
    assert observed["empties"] == []


def test_request_end_empties_once_when_a_prepared_component_goes_unused(observed):
    manager = ResidencyManager(make_components(), default_placements("offload"))
    run_request(manager, torch.randn(4, 256), 2)  # leaves the text encoder prepared
    assert manager.components["text_encoder"].on_device
    observed["empties"].clear()
    without_encoder = [Stage("decode", (ComponentUse("vae", memory_intensive=True),))]
    for _ in range(2):
        start = len(manager.trace.events)
        with manager.request(without_encoder), torch.no_grad(), manager.use_component("vae") as vae:
            vae(torch.randn(4, 256))
        events = manager.trace.events[start:]
        ends = [i for i, e in enumerate(events) if e["kind"] == "empty_cache" and e["where"] == "request_end"]
        if _ == 0:  # the unused text encoder goes home at request end: one empty, right after
            assert len(ends) == 1 and events[ends[0] - 1]["kind"] == "release"
            assert events[ends[0] - 1]["component"] == "text_encoder"
            assert not manager.components["text_encoder"].on_device
        else:  # gating: nothing left to release, no request-end empty
            assert ends == []
    assert observed["empties"] == [ReleasePoint.COMPONENT_RELEASE] * 3  # vae, request end, vae


def test_without_release_points_the_request_end_does_not_empty_either(observed):
    manager = ResidencyManager(make_components(), default_placements("offload"), empty_on_release=False)
    run_request(manager, torch.randn(4, 256), 2)  # leaves the text encoder prepared
    without_encoder = [Stage("decode", (ComponentUse("vae", memory_intensive=True),))]
    with manager.request(without_encoder), torch.no_grad(), manager.use_component("vae") as vae:
        vae(torch.randn(4, 256))
    assert not manager.components["text_encoder"].on_device  # the unused encoder went home ...
    assert observed["empties"] == [] and kinds(manager, "empty_cache") == []  # ... into the allocator's cache


def test_request_end_keeps_warm_components_without_emptying(observed):
    manager = ResidencyManager(make_components(), default_placements("offload"))
    run_request(manager, torch.randn(4, 256), 2, warmup=True)
    assert [e["where"] for e in kinds(manager, "empty_cache")] == ["component_release", "component_release"]
    assert manager.components["transformer"].on_device  # kept, so not released, so no request-end empty


@pytest.mark.parametrize("failing", ["vae", "transformer"])
def test_an_oom_inside_a_use_empties_exactly_once_with_reason_oom(observed, monkeypatch, failing):
    components = make_components()
    manager = ResidencyManager(components, default_placements("layerwise"))

    def oom(*args):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(components[failing].layers[-1], "forward", oom)
    with pytest.raises(RequestFailed):
        run_request(manager, torch.randn(4, 256), 2)
    ordered = [(e["where"], e["reason"]) for e in kinds(manager, "empty_cache")]
    emptied_before = [("component_release", "component_release")] * (2 if failing == "vae" else 1)
    assert ordered == [*emptied_before, ("oom", "oom")]  # the failing use's release is not a second empty
    assert failing in {e["component"] for e in kinds(manager, "release")}  # but it did go home
    assert not any(c.on_device for c in manager.components.values())


def test_an_oom_outside_request_keeps_the_release_point(observed, monkeypatch):
    # begin_request/finish_request by hand: nobody else will empty, so the release point stays.
    components = make_components()
    manager = ResidencyManager(components, default_placements("offload"))
    monkeypatch.setattr(components["vae"], "forward", lambda x: (_ for _ in ()).throw(torch.OutOfMemoryError("x")))
    manager.begin_request([Stage("decode", (ComponentUse("vae", memory_intensive=True),))])
    with pytest.raises(torch.OutOfMemoryError), manager.use_component("vae") as vae:
        vae(torch.randn(4, 256))
    assert observed["empties"] == [ReleasePoint.COMPONENT_RELEASE]


def test_another_error_inside_a_use_keeps_its_release_point_and_the_manager_serves(observed, monkeypatch):
    components = make_components()
    manager = ResidencyManager(components, default_placements("offload"))
    real_forward = components["vae"].forward
    monkeypatch.setattr(components["vae"], "forward", lambda x: (_ for _ in ()).throw(KeyError("bug")))
    with pytest.raises(KeyError):
        run_request(manager, torch.randn(4, 256), 2)
    assert ReleasePoint.OOM not in observed["empties"]
    assert not any(c.on_device for c in manager.components.values())
    monkeypatch.setattr(components["vae"], "forward", real_forward)
    torch.testing.assert_close(run_request(manager, torch.randn(4, 256).zero_(), 2),
                               resident_reference(torch.zeros(4, 256), 2))


def test_layer_buffers_are_a_ring_of_the_largest_layer_or_each_layers_own_size(observed):
    components = make_components(layers=4)
    transformer = components["transformer"]
    transformer.layers[3] = torch.nn.LayerNorm(256)  # layers of different sizes: the last one is small
    seen: dict[str, list[int]] = {}
    for buffers in ("ring", "exact"):
        strategy = LayerwiseStrategy(prefetch_layers=1, buffers=buffers)
        manager = ResidencyManager({"transformer": transformer}, {"transformer": strategy})
        seen[buffers] = []
        def storage_bytes(module, args, i, s=strategy, b=buffers):
            storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in s.blocks[i].params}
            seen[b].append(sorted(storages.values()))

        hooks = [layer.register_forward_pre_hook(lambda m, a, i=i, f=storage_bytes: f(m, a, i))
                 for i, layer in enumerate(transformer.layers)]
        stage = [Stage("s", (ComponentUse("transformer", memory_intensive=True),))]
        with manager.request(stage), manager.use_component("transformer") as module:
            module(torch.randn(2, 256))
        for h in hooks:
            h.remove()
        blocks = strategy.blocks  # close() frees the strategy: its blocks go with it
        sizes = [b.numel * 4 for b in blocks]
        assert not any(b.on_device for b in blocks) and strategy.ring == []
        manager.close()
        if buffers == "ring":  # every layer lands in one slot of the largest layer
            assert seen["ring"] == [[max(sizes)]] * 4
        else:  # each layer at its own size: a head of whole granules, the rest in own allocations
            from torchhal.core.residency.weights import GRANULE

            layouts = [b.layout(torch.float32) for b in blocks]
            own = [sorted(([lay.head_numel * 4] if lay.head_numel else [])
                          + [p.numel() * 4 for p, o in zip(b.params, lay.offsets, strict=True) if o is None])
                   for b, lay in zip(blocks, layouts, strict=True)]
            assert seen["exact"] == own and sizes[3] < sizes[0]
            # a block layer (2 MiB + biases) packs its weights into one granule; the LayerNorm is all tail
            assert GRANULE in seen["exact"][0] and seen["exact"][3] == sorted(p.numel() * 4 for p in blocks[3].params)


class SkippingStack(torch.nn.Module):
    """Layers a forward may skip, as diffusers' SD3 transformer does under skip-layer guidance."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(6))

    def forward(self, x: torch.Tensor, skip: tuple[int, ...] = ()) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            if index not in skip:
                x = layer(x)
        return x


@pytest.mark.parametrize("buffers", ["ring", "exact"])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_layers_a_forward_skips_do_not_leave_other_layers_weights_behind(buffers, prefetch):
    # A skipped layer that is prefetched runs no after-hook: left pointing at its ring slot,
    # which a later layer fills, the next forward would run it with that layer's weights.
    torch.manual_seed(0)
    stack = SkippingStack().eval()
    x = torch.randn(2, 8)
    calls = [(1,), (), (2, 3), (), (5,), ()]
    with torch.no_grad():
        expected = [stack(x, skip) for skip in calls]
    strategy = LayerwiseStrategy(prefetch_layers=prefetch, layers_attr="layers", buffers=buffers)
    manager = ResidencyManager({"stack": stack}, {"stack": strategy})
    stage = [Stage("denoise", (ComponentUse("stack"),), exact=False)]
    got = []
    with torch.no_grad(), manager.request(stage):
        for skip in calls:
            with manager.use_component("stack") as module:
                got.append(module(x, skip))
    manager.close()
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_released_block_waits_for_a_prefetch_nobody_waited_for(observed):
    from torchhal.core.residency import WeightBlock
    from torchhal.platforms import current_platform

    platform = current_platform()
    block = WeightBlock([torch.nn.Parameter(torch.randn(8))], platform, platform.device(0))

    class Pending:
        waited_on = None

        def wait(self, stream):
            Pending.waited_on = stream

    block.load(platform.new_stream(0))
    block.ready = Pending()
    assert block.release() == 32
    assert Pending.waited_on is not None  # compute waited before the buffer went back to the allocator
    assert block.copied_bytes == 32


def _odd_params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*shape)) for shape in ((3, 5), (7,), (2, 2, 2))]


def _storage(t):
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def _block_of(params):
    """A WeightBlock of `params` on the current platform's device 0, with the parameters'
    values before it took them and its element count."""
    from torchhal.core.residency import WeightBlock
    from torchhal.platforms import current_platform

    platform = current_platform()
    originals = [p.detach().clone() for p in params]
    block = WeightBlock(params, platform, platform.device(0))
    return block, originals, sum(p.numel() for p in params)


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_block_smaller_than_a_granule_gives_each_parameter_its_own_allocation(prefetch):
    # Below one allocator granule there is no head to pack into: one tensor per parameter,
    # the requests the module's own move makes.
    params = _odd_params()
    block, originals, numel = _block_of(params)
    assert block.layout(torch.float32).head_numel == 0 and block.layout(torch.bfloat16).head_numel == 0
    host_storage = _storage(block.host)
    assert all(_storage(p.data) == host_storage for p in params)  # at rest: views of the pinned buffer

    def load(dtype=None):
        block.load(block.platform.new_stream(0) if prefetch else None, dtype=dtype)
        block.wait()

    load()
    storages = [_storage(p.data) for p in params]
    assert len({ptr for ptr, _ in storages}) == len(params) and host_storage not in storages
    assert [size for _, size in storages] == [p.numel() * 4 for p in params]
    assert [p.data.storage_offset() for p in params] == [0] * len(params)
    assert [_storage(t) for t in block.device_tensors] == storages
    for p, original in zip(params, originals, strict=True):
        torch.testing.assert_close(p.data, original, rtol=0, atol=0)
    assert block.on_device and block.device_dtype == torch.float32
    assert block.nbytes == numel * 4 and block.copied_bytes == numel * 4

    assert block.release() == numel * 4
    assert not block.on_device and block.device_dtype is None
    assert all(_storage(p.data) == host_storage for p in params)
    load()  # and again after a release
    for p, original in zip(params, originals, strict=True):
        torch.testing.assert_close(p.data, original, rtol=0, atol=0)
    assert block.copied_bytes == 2 * numel * 4
    block.release()

    load(torch.bfloat16)  # a converting load: own bf16 tensors, the host keeps float32
    assert [_storage(p.data)[1] for p in params] == [p.numel() * 2 for p in params]
    assert len({_storage(p.data)[0] for p in params}) == len(params)
    for p, original in zip(params, originals, strict=True):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p.data, original.to(torch.bfloat16), rtol=0, atol=0)
    assert block.device_dtype == torch.bfloat16 and block.nbytes == numel * 2
    assert block.copied_bytes == 2 * numel * 4 + numel * 2
    assert block.release() == numel * 2
    assert block.host.dtype == torch.float32
    for p, original in zip(params, originals, strict=True):
        torch.testing.assert_close(p.data, original, rtol=0, atol=0)  # full precision back


def _packed_params():
    # fp32 bytes: C 1.6 MB, E 28, A 2.8 MB, D 160 kB, B 2,000,004 (not a multiple of 16): 6.56 MB,
    # three granules. In block order, so placement must sort by size.
    torch.manual_seed(0)
    numels = {"C": 400_000, "E": 7, "A": 700_000, "D": 40_000, "B": 500_001}
    return {name: torch.nn.Parameter(torch.randn(n)) for name, n in numels.items()}


def _head_and_tail(block):
    """(head storage (ptr, nbytes), {parameter index: byte offset in the head}, tail storages)."""
    storages = [_storage(p.data) for p in block.params]
    shared = [s for s in storages if storages.count(s) > 1]
    head = shared[0] if shared else None
    offsets = {i: p.data.data_ptr() - head[0] for i, p in enumerate(block.params) if _storage(p.data) == head}
    tail = [s for s in storages if s != head]
    return head, offsets, tail


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_block_over_a_granule_packs_its_largest_parameters_into_one_head_of_whole_granules(prefetch):
    # One request of whole granules is not rounded by the caching allocator and, released,
    # is one large segment it can carve for other work; the parameters that do not fit get
    # their own tensors.
    from torchhal.core.residency.weights import ALIGNMENT, GRANULE

    named = _packed_params()
    names, params = list(named), list(named.values())
    block, originals, numel = _block_of(params)
    index = {name: i for i, name in enumerate(names)}

    def load(dtype=None):
        block.load(block.platform.new_stream(0) if prefetch else None, dtype=dtype)
        block.wait()

    def check_values(dtype):
        for p, original in zip(params, originals, strict=True):
            assert p.dtype == dtype and p.shape == original.shape
            torch.testing.assert_close(p.data, original.to(dtype), rtol=0, atol=0)

    for round_trip in range(2):  # load, release, load again
        load()
        head, offsets, tail = _head_and_tail(block)
        # floor(6.56 MB / 2 MiB) = 3 granules. Descending first fit: A at 0, B after it, C
        # (1.6 MB) misses the 1.49 MB left, D and E fill that hole; B ends at 4,800,004, so
        # D starts at the next 16-byte boundary.
        assert head[1] == 3 * GRANULE
        assert {names[i]: o for i, o in offsets.items()} == {"A": 0, "B": 2_800_000, "D": 4_800_016, "E": 4_960_016}
        assert all(o % ALIGNMENT == 0 for o in offsets.values())
        assert tail == [(params[index["C"]].data.data_ptr(), 1_600_000)]  # its own storage, at its size
        assert [_storage(t) for t in block.device_tensors] == [_storage(p.data) for p in params]
        check_values(torch.float32)
        assert block.nbytes == numel * 4 and block.copied_bytes == (round_trip + 1) * numel * 4
        assert block.release() == numel * 4
        assert all(_storage(p.data) == _storage(block.host) for p in params)

    load(torch.bfloat16)  # sizes halve: the layout is recomputed for the device dtype
    head, offsets, tail = _head_and_tail(block)
    # floor(3.28 MB / 2 MiB) = 1 granule: A at 0; B and C miss the 697 kB left; D and E fill it
    assert head[1] == GRANULE
    assert {names[i]: o for i, o in offsets.items()} == {"A": 0, "D": 1_400_000, "E": 1_480_000}
    assert sorted(size for _, size in tail) == [800_000, 1_000_002] and len({ptr for ptr, _ in tail}) == 2
    check_values(torch.bfloat16)
    assert block.device_dtype == torch.bfloat16 and block.nbytes == numel * 2
    assert block.copied_bytes == 2 * numel * 4 + numel * 2
    assert block.release() == numel * 2
    assert block.host.dtype == torch.float32
    check_values(torch.float32)  # full precision back


def test_a_head_is_trimmed_to_the_granules_its_parameters_reach_and_equal_sizes_keep_their_order():
    # Two 12 MB weights and their biases (24.0 MB: 11 granules): one weight and the biases fit,
    # the other weight would leave an 11 MB hole in an 11-granule head; trimmed, the head is
    # the 6 granules its parameters reach. Of the equal weights the first in block order is placed.
    from torchhal.core.residency.weights import GRANULE, pack_layout

    layout = pack_layout([3_000_000, 3_000, 3_000_000, 1_000], 4)
    assert layout.head_numel * 4 == 6 * GRANULE
    assert layout.offsets == (0, 3_000_000, None, 3_003_000)
    # nothing placed: no head and every parameter its own tensor
    assert pack_layout([10, 20], 4).head_numel == 0 and pack_layout([10, 20], 4).offsets == (None, None)
    assert pack_layout([GRANULE // 4], 4).offsets == (0,)  # exactly one granule: all head
    assert pack_layout([0, 5], 4).offsets == (None, None)  # an empty parameter alone makes no head


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_block_loaded_into_a_buffer_views_it(prefetch):
    # The layerwise ring path: the parameters are consecutive views of the given buffer.
    params = _odd_params()
    block, originals, numel = _block_of(params)
    slot = torch.full((numel + 9,), -1.0, dtype=torch.bfloat16)  # larger than the block, as a ring slot is
    block.load(block.platform.new_stream(0) if prefetch else None, slot, torch.bfloat16)
    block.wait()
    offsets = [0, 15, 22]
    assert [p.data.data_ptr() for p in params] == [slot.data_ptr() + o * 2 for o in offsets]
    assert all(_storage(p.data) == _storage(slot) for p in params)
    for p, original in zip(params, originals, strict=True):
        torch.testing.assert_close(p.data, original.to(torch.bfloat16), rtol=0, atol=0)
    assert (slot[numel:] == -1).all()  # the tail of the slot untouched
    assert block.nbytes == numel * 2 and block.copied_bytes == numel * 2  # the block's bytes, not the slot's
    assert block.release() == numel * 2
    for p, original in zip(params, originals, strict=True):
        torch.testing.assert_close(p.data, original, rtol=0, atol=0)


def test_layerwise_refuses_unknown_buffer_and_rest_modes():
    with pytest.raises(ValueError, match="buffers='rings': use 'ring'.*or 'exact'"):
        LayerwiseStrategy(1, buffers="rings")
    with pytest.raises(ValueError, match="rest='lazy': use 'resident'.*or 'on_call'"):
        LayerwiseStrategy(1, rest="lazy")


def _intensive(component, **flags):
    return ComponentUse(component, memory_intensive=True, **flags)


def test_a_kept_layerwise_component_preferred_ready_still_leaves_at_the_request_end(observed):
    # a layerwise component cannot be kept ready between requests: preferring it must not leave it held
    manager = ResidencyManager(make_components(), {"transformer": LayerwiseStrategy(1, rest="on_call")})
    streamed = manager.components["transformer"].strategy
    with manager.request([Stage("denoise", (_intensive("transformer", preferred_ready_after_request=True),),
                                exact=False)]), torch.no_grad():
        _use(manager, "transformer", torch.randn(4, 256))
    assert streamed.ring == [] and not any(b.on_device for blocks in streamed.rest_blocks.values() for b in blocks)
    assert [e["component"] for e in kinds(manager, "release")] == ["transformer"]


def test_a_failed_use_is_not_kept_and_keeps_its_release_point(observed, monkeypatch):
    manager = ResidencyManager(make_components(), default_placements("offload"))  # releases empty the cache
    stages = [Stage("denoise", (_intensive("transformer"),), exact=False)]
    with pytest.raises(ValueError, match="bad input"), manager.request(stages), manager.use_component("transformer"):
        raise ValueError("bad input")
    events = [(e["kind"], e.get("where")) for e in manager.trace.last_request() if e["kind"] != "prepare"]
    assert events[1:3] == [("release", None), ("empty_cache", "component_release")]  # as at an exact use's end
    assert kinds(manager, "keep") == []


def test_prefetching_forecasts_from_the_furthest_use_reached(observed):
    manager = ResidencyManager(make_components(), {"text_encoder": "offload", "vae": "offload",
                                                   "transformer": LayerwiseStrategy(1)}, empty_on_release=False)
    stages = [Stage("encode", (_intensive("text_encoder"), _intensive("vae")), exact=False),
              Stage("denoise", (_intensive("transformer"),), exact=False)]
    tokens = torch.randn(4, 256)
    with manager.request(stages), torch.no_grad():
        _use(manager, "vae", tokens)
        _use(manager, "text_encoder", tokens)  # back in the stage: the VAE it passed is not fetched again
        with manager.use_component("transformer") as transformer:
            assert not manager.components["vae"].on_device
            transformer(tokens)
    assert kinds(manager, "prefetch") == []


def test_a_use_declared_with_the_phase_asked_for_is_taken_before_one_declared_with_any():
    manager = ResidencyManager(make_components(), {})
    stages = [Stage("denoise", (ComponentUse("transformer"),), exact=False),
              Stage("refine", (ComponentUse("transformer", phase="refine"), ComponentUse("vae")))]
    tokens = torch.randn(4, 256)
    with manager.request(stages), torch.no_grad():
        _use(manager, "transformer", tokens)
        with manager.use_component("transformer", phase="refine") as transformer:
            transformer(tokens)
        _use(manager, "vae", tokens)  # the exact refine stage was entered: its next use is the VAE
    with manager.request([Stage("denoise", (ComponentUse("transformer", phase="cond"),), exact=False),
                          Stage("decode", (ComponentUse("vae"),))]):
        with pytest.raises(UndeclaredUse, match=r"phase='uncond'\) but the declared next use is one of "
                                                r"'transformer' \(phase 'cond'\), 'vae'; declare"):
            manager.begin_use("transformer", phase="uncond")


def test_the_baseline_empties_once_a_use_in_stages_that_are_not_exact_too(observed):
    manager = ResidencyManager(make_components(), default_placements("offload"), empty_after_every_use=True)
    with manager.request(_forecast()), torch.no_grad():
        for component in ("text_encoder", "transformer", "vae"):
            _use(manager, component, torch.randn(4, 256))
    assert [e["where"] for e in kinds(manager, "empty_cache")] == ["every_use"] * 3


def test_a_kept_component_whose_release_fails_leaves_when_the_use_is_begun_again(observed, monkeypatch):
    manager = ResidencyManager(make_components(), {"text_encoder": LayerwiseStrategy(0, rest="on_call"),
                                                   "transformer": "offload"}, empty_on_release=False)
    encoder = manager.components["text_encoder"].strategy
    release = encoder.release

    def fails_once(*args):
        monkeypatch.setattr(encoder, "release", release)
        raise RuntimeError("device busy")

    def encoder_on_device():
        return any(b.on_device for blocks in encoder.rest_blocks.values() for b in blocks)

    monkeypatch.setattr(encoder, "release", fails_once)
    tokens = torch.randn(4, 256)
    manager.begin_request(_forecast())
    with torch.no_grad():
        _use(manager, "text_encoder", tokens)
        with pytest.raises(RuntimeError, match="device busy"):
            manager.begin_use("transformer")  # the kept encoder's late release raises
        manager.begin_use("transformer")  # begun again: the encoder still leaves first
        assert not encoder_on_device()
        manager.end_use("transformer")
    manager.finish_request()
    assert not encoder_on_device() and not manager.components["transformer"].on_device
