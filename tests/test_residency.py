"""Residency manager decisions on the CPU platform.

On CPU, host and device are the same memory, so moves are real copies between
host buffers: these tests prove the decisions (what moves, when, what is kept,
prefetched and emptied, with which reason) and that streamed weights compute
the same outputs. They do not prove copy/compute overlap or device memory
savings: benchmarks/residency_pipeline.py measures those on a GPU.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from torchhal.core.residency import ComponentUse, Placement, RequestFailed, ResidencyManager, Stage, Strategy
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
    return [e for e in manager.trace if e["kind"] == kind]


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
    trace = manager.trace
    empties = [i for i, e in enumerate(trace) if e["kind"] == "empty_cache"]
    assert [trace[i - 1]["kind"] for i in empties] == ["release"] * len(emptied_after)
    assert [trace[i - 1]["component"] for i in empties] == emptied_after
    assert [trace[i]["where"] for i in empties] == ["component_release"] * len(emptied_after)
    assert observed["empties"] == [ReleasePoint.COMPONENT_RELEASE] * len(emptied_after)
    released = [e["component"] for e in trace if e["kind"] == "release"]
    assert released == ["text_encoder", "transformer", "vae"]  # released either way


def test_baseline_mode_empties_at_every_stage_boundary(observed):
    manager = ResidencyManager(make_components(), default_placements("layerwise"), empty_at_stage_boundaries=True)
    run_request(manager, torch.randn(4, 256), 3)
    assert [e["where"] for e in kinds(manager, "empty_cache")] == ["stage_boundary"] * 5


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
    manager = ResidencyManager(components, {"transformer": Placement(Strategy.LAYERWISE, prefetch_layers=1)})
    transformer = manager.components["transformer"]
    with manager.request([Stage("s", (ComponentUse("transformer", memory_intensive=True),))]):
        with manager.use_component("transformer") as module:
            module(torch.randn(2, 256))
        assert not any(b.on_device for b in transformer.blocks)  # each layer released after use
    assert kinds(manager, "release")[0]["layers"] == 4
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
    assert not any(c.on_device for c in manager.components.values() if c.blocks)
    monkeypatch.setattr(components["vae"], "forward", real_forward)
    run_request(manager, torch.randn(4, 256), 2)


def test_misuse_is_refused_with_clear_errors(observed):
    manager = ResidencyManager(make_components(), default_placements())
    with pytest.raises(RuntimeError, match="outside a request"):
        manager.begin_use("vae")
    manager.begin_request(stages(2))
    with pytest.raises(RuntimeError, match="declared next use is 'text_encoder'"):
        manager.begin_use("vae")
    with pytest.raises(ValueError, match="unknown component 'unet'"):
        manager.begin_use("unet")
    with pytest.raises(RuntimeError, match="already running"):
        manager.begin_request(stages(2))
    with pytest.raises(ValueError, match="unknown components \\['ghost'\\]"):
        ResidencyManager(make_components(), {"ghost": Strategy.OFFLOAD})
    with pytest.raises(ValueError, match="no non-empty nn.ModuleList 'blocks'"):
        ResidencyManager(make_components(), {"vae": Placement(Strategy.LAYERWISE, layers_attr="blocks")})


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
    assert not any(b.on_device for c in manager.components.values() for b in c.blocks)
    layers = components["transformer"].layers
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in layers)
    # The modules are plain host modules again: same outputs as never-managed ones.
    reference = make_components()
    with torch.no_grad():
        torch.testing.assert_close(components["transformer"](tokens), reference["transformer"](tokens))
    with pytest.raises(RuntimeError, match="closed; build a new one"):
        manager.begin_request(stages(2))
    assert manager.close() is None  # closing twice is harmless


def test_stage_profiling_only_observes_and_trace_exports(observed, tmp_path):
    manager = ResidencyManager(make_components(), default_placements("offload"))
    run_request(manager, torch.randn(4, 256), 2)
    stage_events = kinds(manager, "stage")
    assert [e["stage"] for e in stage_events] == ["encode", "denoise", "decode"]
    manager.export_trace(str(tmp_path / "trace.json"))
    assert json.loads((tmp_path / "trace.json").read_text())[0]["kind"] == "request_start"
    pytest.importorskip("matplotlib")
    manager.plot_memory_timeline(str(tmp_path / "timeline.png"))
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_logging_writes_one_json_line_per_event_and_tracing_can_be_off(observed, caplog):
    import logging

    logger = logging.getLogger("residency-test")
    with caplog.at_level(logging.INFO, logger="residency-test"):
        manager = ResidencyManager(make_components(), default_placements("offload"), record_trace=False, log=logger)
        run_request(manager, torch.randn(4, 256), 2)
    assert manager.trace == []
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(line.startswith("torchhal.residency {") for line in lines)
    assert json.loads(lines[0].split(" ", 1)[1])["kind"] == "request_start"
    silent = ResidencyManager(make_components(), default_placements("offload"), record_trace=False)
    run_request(silent, torch.randn(4, 256), 2)
    assert silent.trace == [] and observed["empties"]  # still empties, just untraced
