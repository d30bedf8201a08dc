"""Hostile input to the residency manager and the diffusers adapter, on the CPU platform.

Each refusal comes before anything is attached, moved or started (the modules keep their
storage and train/eval flags, the manager serves the next request), and a failure inside
the manager's own bookkeeping or the platform's OOM rule never leaves it stuck in a request.
"""

import copy
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchhal.core.residency import (
    ComponentUse,
    LayerwiseStrategy,
    OffloadStrategy,
    RequestFailed,
    ResidencyManager,
    ResidencyStrategy,
    ResidentStrategy,
    Stage,
)
from torchhal.platforms import TorchhalPluginWarning, hookimpl
from torchhal.plugins.cpu import CpuPlatform

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ONE_USE = [Stage("encode", (ComponentUse("enc"),))]


class Stack(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def snapshot(*modules: nn.Module) -> list[tuple[int, bool]]:
    """Each parameter's storage and each submodule's train flag: what attaching would change."""
    return [(p.data_ptr(), True) for m in modules for p in m.parameters()] + [
        (0, sub.training) for m in modules for sub in m.modules()]


def serves(manager: ResidencyManager) -> None:
    """The manager runs a whole request and can be closed: nothing was left half-started."""
    with torch.no_grad(), manager.request(ONE_USE), manager.use_component("enc") as enc:
        enc(torch.randn(1, 4))
    assert manager.in_use is None and not manager.components["enc"].on_device
    manager.close()


# -- the log ---------------------------------------------------------------------------------------

def test_a_log_without_info_is_refused_at_construction():
    enc = nn.Linear(4, 4)
    before = snapshot(enc)
    with pytest.raises(TypeError, match=r"log must be a logging.Logger \(anything with an .info method\) or None, "
                                        r"got <_io.TextIOWrapper .*; e.g. log=logging.getLogger"):
        ResidencyManager({"enc": enc}, {"enc": "offload"}, log=sys.stderr)
    assert snapshot(enc) == before
    serves(ResidencyManager({"enc": enc}, {"enc": "offload"}, log=logging.getLogger("residency-hostile")))


def test_a_request_whose_start_event_fails_is_not_started():
    class FailsOnce:
        failed = False

        def info(self, *args: object) -> None:
            if not self.failed:
                self.failed = True
                raise OSError("log disk full")

    manager = ResidencyManager({"enc": nn.Linear(4, 4)}, {"enc": "offload"}, log=FailsOnce())
    with pytest.raises(OSError, match="log disk full"), manager.request(ONE_USE):
        pass
    serves(manager)  # not stuck in a request that never started: it runs one and closes


# -- finish_request during a use -------------------------------------------------------------------

def test_finish_request_during_a_use_is_refused_and_changes_nothing():
    manager = ResidencyManager({"enc": nn.Linear(4, 4)}, {"enc": "offload"})
    manager.begin_request(ONE_USE)
    manager.begin_use("enc")
    events = len(manager.trace.events)
    with pytest.raises(RuntimeError, match=r"finish_request\(\) while 'enc' is in use; end_use\('enc'\) first"):
        manager.finish_request()
    assert manager.in_use == "enc" and manager.components["enc"].on_device  # not released under the use
    assert len(manager.trace.events) == events
    manager.end_use("enc")
    manager.finish_request()
    serves(manager)


# -- what the constructor is given -----------------------------------------------------------------

@pytest.mark.parametrize(("components", "placements", "error", "message"), [
    ([("enc", "module")], {}, TypeError, r"components must be a dict of component name -> nn.Module.*got a list"),
    ({"enc": "module"}, None, TypeError, r"placements must be a dict .*got None; pass \{\} to keep every"),
    ({"enc": "module"}, ["enc"], TypeError, r"placements must be a dict .*got \['enc'\]"),
    ({"enc": "module", "oops": torch.randn(3)}, {}, TypeError, r"component 'oops' is a Tensor, not an nn.Module"),
    ({"enc": "module", "gone": None}, {"gone": "offload"}, TypeError, r"component 'gone' is a NoneType"),
    ({"enc": "module", 3: "module"}, {}, TypeError, r"component name 3 must be a non-empty str"),
    ({"enc": "module", "mixed": "mixed"}, {"mixed": "offload"}, ValueError,
     r"component 'mixed': the offloaded module moves as one block of one dtype but holds torch.float16 and "
     r"torch.float32; cast the component to one dtype first"),
    ({"enc": "module", "act": nn.ReLU()}, {"act": "offload"}, ValueError,
     r"component 'act': the offloaded module has no parameters to move; leave it resident"),
    ({"enc": "module", "stack": "mixed-stack"}, {"stack": LayerwiseStrategy(1)}, ValueError,
     r"component 'stack': streamed layer 1 moves as one block of one dtype but holds torch.float16 and torch.float32"),
])
def test_bad_components_and_placements_are_refused_before_anything_is_touched(components, placements, error, message):
    enc = nn.Linear(4, 4).train()
    stack = Stack()
    stack.layers[1].bias.data = stack.layers[1].bias.data.half()
    made = {"module": enc, "mixed": nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).half()).train(),
            "mixed-stack": stack.train()}
    if isinstance(components, dict):
        components = {name: made.get(value, value) if isinstance(value, str) else value
                      for name, value in components.items()}
    modules = [m for m in (components.values() if isinstance(components, dict) else ()) if isinstance(m, nn.Module)]
    before = snapshot(*modules)
    with pytest.raises(error, match=message):
        ResidencyManager(components, placements)
    assert snapshot(*modules) == before  # same storage, still in train mode
    assert all(not layer._forward_pre_hooks for layer in stack.layers)


class LosesTheDevice(ResidencyStrategy):
    """A third-party strategy whose attach fails after the components before it were attached."""

    def attach(self, manager: object, component: object) -> None:
        raise RuntimeError("device lost during attach")


class KeepsItsComponent(ResidentStrategy):
    """Resident (its own answer is always "on the device"), and keeps the state it served."""

    def attach(self, manager: Any, component: Any) -> None:
        super().attach(manager, component)
        self.component = component


def test_a_failed_construction_leaves_no_component_reading_on_device():
    kept = KeepsItsComponent()
    with pytest.raises(RuntimeError, match="device lost during attach"):
        ResidencyManager({"enc": nn.Linear(4, 4), "last": nn.Linear(4, 4)}, {"enc": kept, "last": LosesTheDevice()})
    assert not kept.component.on_device  # detached by the undo: back on the host


def test_a_failing_attach_leaves_the_modules_as_they_were_given():
    enc, stack = nn.Linear(4, 4).train(), Stack().train()
    values = [p.detach().clone() for m in (enc, stack) for p in m.parameters()]
    with pytest.raises(RuntimeError, match="device lost during attach"):
        ResidencyManager({"enc": enc, "stack": stack, "last": nn.Linear(4, 4)},
                         {"enc": "offload", "stack": LayerwiseStrategy(1), "last": LosesTheDevice()})
    assert all(sub.training for m in (enc, stack) for sub in m.modules())  # still in train mode
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in stack.layers)
    params = [p for m in (enc, stack) for p in m.parameters()]
    assert all(torch.equal(p, value) for p, value in zip(params, values, strict=True))


def with_buffers() -> tuple[nn.Module, Stack]:
    """An encoder and a layer stack, each holding a buffer beside its parameters, in train mode."""
    enc = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    stack = Stack().train()
    stack.register_buffer("scale", torch.full((4,), 2.0))
    return enc, stack


def as_given(*modules: nn.Module) -> list[tuple[object, ...]]:
    """What a failed construction must leave as it was: each parameter's and buffer's value,
    device, dtype and requires_grad, and each submodule's train flag."""
    tensors = [(name, t.detach().clone(), t.device, t.dtype, t.requires_grad)
               for m in modules for name, t in (*m.named_parameters(), *m.named_buffers())]
    return tensors + [(sub.training,) for m in modules for sub in m.modules()]


def assert_as_given(before: list[tuple[object, ...]], *modules: nn.Module) -> None:
    now = as_given(*modules)
    assert len(now) == len(before)
    for was, is_now in zip(before, now, strict=True):
        if len(was) == 1:
            assert was == is_now  # train flag
        else:
            assert was[0] == is_now[0] and torch.equal(was[1], is_now[1]), was[0]  # type: ignore[arg-type]
            assert was[2:] == is_now[2:], (was[0], was[2:], is_now[2:])


TWO_USES = [Stage("encode", (ComponentUse("enc"),)), Stage("denoise", (ComponentUse("stack"),))]


def serves_both(manager: ResidencyManager, enc: nn.Module, stack: nn.Module, expected: torch.Tensor) -> None:
    """A request through both components gives the unmanaged output; then the manager closes."""
    x = torch.arange(8.0).view(2, 4)
    with torch.no_grad(), manager.request(TWO_USES):
        with manager.use_component("enc") as module:
            hidden = module(x)
        with manager.use_component("stack") as module:
            out = module(hidden) * stack.scale
    assert torch.equal(out, expected)
    manager.close()


def unmanaged(enc: nn.Module, stack: nn.Module) -> torch.Tensor:
    enc_copy, stack_copy = copy.deepcopy(enc).eval(), copy.deepcopy(stack).eval()
    with torch.no_grad():
        return stack_copy(enc_copy(torch.arange(8.0).view(2, 4))) * stack_copy.scale


class OffloadOomAfterItsBlock(OffloadStrategy):
    """Runs out of memory once after its pinned block was made: the component is half attached."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail

    def attach(self, manager: Any, component: Any) -> None:
        super().attach(manager, component)
        if self.fail:
            self.fail = False
            raise torch.OutOfMemoryError("simulated: out of memory after the offload block")


class LayerwiseOomAtLayer2(LayerwiseStrategy):
    """Runs out of memory once while hooking layer 2: buffers placed, blocks made, layers 0 and 1 hooked."""

    def __init__(self, fail: bool) -> None:
        super().__init__(1)
        self.fail = fail

    def _before_layer(self, manager: Any, component: Any, index: int) -> Any:
        if index == 2 and self.fail:
            self.fail = False
            raise torch.OutOfMemoryError("simulated: out of memory at layer 2")
        return super()._before_layer(manager, component, index)


@pytest.mark.parametrize("fails", ["offload part way", "layerwise part way", "a later component"])
def test_a_construction_that_fails_is_undone_and_the_same_strategies_serve_again(fails):
    enc, stack = with_buffers()
    expected = unmanaged(enc, stack)
    placements: dict[str, ResidencyStrategy] = {
        "enc": OffloadOomAfterItsBlock(fail=fails == "offload part way"),
        "stack": LayerwiseOomAtLayer2(fail=fails == "layerwise part way")}
    components: dict[str, nn.Module] = {"enc": enc, "stack": stack}
    if fails == "a later component":  # both attached fully before it raised
        components["last"], placements["last"] = nn.Linear(4, 4), LosesTheDevice()
    before = as_given(enc, stack)
    with pytest.raises((torch.OutOfMemoryError, RuntimeError), match="simulated|device lost during attach"):
        ResidencyManager(components, placements)
    assert_as_given(before, enc, stack)  # values, devices, dtypes, train flags
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in stack.layers)
    assert placements["enc"].block is None and placements["stack"].hooks == []  # type: ignore[attr-defined]
    # the same placements, strategy objects and all, serve a manager now
    again = {"enc": placements["enc"], "stack": placements["stack"]}
    serves_both(ResidencyManager({"enc": enc, "stack": stack}, again), enc, stack, expected)


class DetachAssumesAFullAttach(ResidencyStrategy):
    """A strategy whose detach assumes a full attach: it raises in attach before its state
    exists, and its detach then fails on the missing state."""

    def attach(self, manager: Any, component: Any) -> None:
        raise torch.OutOfMemoryError("simulated: out of memory before the block")

    def detach(self, manager: Any, component: Any) -> None:
        self.block.release()  # type: ignore[attr-defined]  # never set: attach raised first


def test_an_undo_step_that_raises_is_reported_and_the_rest_still_undone():
    # An undo that stops at the failing detach loses the attach's error to an AttributeError,
    # and leaves the layerwise component its hooks and its strategy taken.
    enc, stack = with_buffers()
    expected = unmanaged(enc, stack)
    placements: dict[str, ResidencyStrategy] = {"stack": LayerwiseStrategy(1), "enc": OffloadStrategy(),
                                                "last": DetachAssumesAFullAttach()}
    before = as_given(enc, stack)
    with pytest.warns(RuntimeWarning, match=r"^undoing a failed ResidencyManager construction: "
                                            r"DetachAssumesAFullAttach.detach of 'last' raised AttributeError"), \
            pytest.raises(torch.OutOfMemoryError, match="simulated: out of memory before the block"):
        ResidencyManager({"stack": stack, "enc": enc, "last": nn.Linear(4, 4)}, placements)
    assert_as_given(before, enc, stack)
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in stack.layers)
    again = {"enc": placements["enc"], "stack": placements["stack"]}
    serves_both(ResidencyManager({"enc": enc, "stack": stack}, again), enc, stack, expected)


class BuffersToTheHost(ResidencyStrategy):
    """Stands in for a strategy that moves buffers to the manager's device: CPU-only torch has no
    second device with values, so the buffers are given on meta and attach moves them to the host
    (parameters take the same path back; a Parameter cannot be set to meta data, and
    tests/test_gpu_residency.py gives them on the GPU)."""

    def attach(self, manager: Any, component: Any) -> None:
        for sub in component.module.modules():
            for key, buf in sub._buffers.items():
                sub._buffers[key] = torch.zeros_like(buf, device="cpu")


def test_a_failed_construction_puts_buffers_back_on_the_device_they_were_given_on():
    given = nn.BatchNorm1d(4).to_empty(device="meta")
    given.weight, given.bias = nn.Parameter(torch.ones(4)), nn.Parameter(torch.zeros(4))
    with pytest.raises(RuntimeError, match="device lost during attach"):
        ResidencyManager({"given": given, "last": nn.Linear(4, 4)},
                         {"given": BuffersToTheHost(), "last": LosesTheDevice()})
    assert [b.device.type for b in given.buffers()] == ["meta"] * 3
    assert [p.device.type for p in given.parameters()] == ["cpu"] * 2


def test_after_close_the_strategies_serve_another_manager():
    enc, stack = with_buffers()
    expected = unmanaged(enc, stack)
    placements = {"enc": OffloadStrategy(), "stack": LayerwiseStrategy(1)}
    first = ResidencyManager({"enc": enc, "stack": stack}, placements)
    copied = first.copied_bytes()
    serves_both(first, enc, stack, expected)
    assert first.copied_bytes() != copied and first.copied_bytes()["stack"] > 0  # the counts outlive close
    serves_both(ResidencyManager({"enc": enc, "stack": stack}, placements), enc, stack, expected)


@pytest.mark.parametrize("share", ["module", "layer", "tied weight"])
def test_a_weight_two_components_hold_is_refused_where_either_would_move_it(share):
    enc, stack = nn.Linear(4, 4).train(), Stack().train()
    if share == "module":
        components: dict[str, nn.Module] = {"enc": enc, "again": enc}
        message = (r"components 'enc' and 'again' are the same Linear, and 'again' would move it: a weight two "
                   r"components hold must stay resident in both; leave 'again' resident, or pass the module "
                   r"holding it once")
        placements = {"again": "offload"}
    elif share == "layer":
        components = {"stack": stack, "layer": stack.layers[1]}
        message = (r"components 'stack' and 'layer' share a parameter \('layers.1.weight' of 'stack', 'weight' of "
                   r"'layer'\), and 'stack' would move it")
        placements = {"stack": "layerwise"}
    else:
        head = nn.Linear(4, 4)
        head.weight = enc.weight
        components = {"enc": enc, "head": head}
        message = (r"components 'enc' and 'head' share a parameter \('weight' of 'enc', 'weight' of 'head'\), and "
                   r"'enc' and 'head' would move it")
        placements = {"enc": "offload", "head": "offload"}
    modules = list(components.values())
    before = snapshot(*modules)
    with pytest.raises(ValueError, match=message):
        ResidencyManager(components, placements)
    assert snapshot(*modules) == before  # same storage, still in train mode
    assert all(not layer._forward_pre_hooks for layer in stack.layers)


def test_a_weight_two_components_hold_serves_both_while_resident():
    # A controlnet built from its transformer's own blocks shares them: refusing every sharing
    # would make such pipelines unmanageable whatever their placements.
    enc, stack = with_buffers()
    expected = unmanaged(enc, stack)
    shared = nn.Module()
    shared.proj = enc  # the second component holds the first's module
    manager = ResidencyManager({"enc": enc, "stack": stack, "shared": shared}, {"stack": "layerwise"})
    serves_both(manager, enc, stack, expected)


# -- stages ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "uses", "message"), [
    ("denoise", ComponentUse("unet"), r"stage 'denoise': uses must be a tuple of ComponentUse records, got the "
                                      r"single use of 'unet'; pass uses=\(use,\)$"),
    ("denoise", "unet", r"stage 'denoise': uses must be a tuple of ComponentUse records, got 'unet'; pass e.g. "
                        r"uses=\(ComponentUse\('unet'\),\)$"),
    ("denoise", None, r"stage 'denoise': uses must be a tuple of ComponentUse records, got None"),
    ("", (ComponentUse("unet"),), r"Stage name must be a non-empty str such as 'denoise', got ''$"),
    (3, (ComponentUse("unet"),), r"Stage name must be a non-empty str such as 'denoise', got 3$"),
    (None, (), r"Stage name must be a non-empty str such as 'denoise', got None$"),
    ("decode", (), r"stage 'decode' has no uses; a stage declares the component uses it makes: pass at least one "
                   r"ComponentUse, or leave the stage out$"),
    ("decode", [], r"stage 'decode' has no uses"),
])
def test_a_bad_stage_is_refused_naming_the_value_and_the_fix(name, uses, message):
    with pytest.raises(ValueError, match=message):
        Stage(name, uses)
    assert Stage("denoise", [ComponentUse("unet")]).uses == (ComponentUse("unet"),)  # any sequence becomes a tuple


# -- flags and the device index --------------------------------------------------------------------

@pytest.mark.parametrize(("keyword", "value", "error", "message"), [
    ("empty_after_every_use", "no", TypeError, "empty_after_every_use = 'no' must be True or False"),
    ("record_trace", "no", TypeError, "record_trace = 'no' must be True or False"),
    ("device_index", 7, ValueError, r"device_index = 7, but platform 'cpu' has 1 device\(s\); pass 0..0, or None"),
])
def test_bad_flags_and_device_indexes_are_refused_at_construction(keyword, value, error, message):
    enc = nn.Linear(4, 4)
    before = snapshot(enc)
    with pytest.raises(error, match=message):
        ResidencyManager({"enc": enc}, {"enc": "offload"}, **{keyword: value})
    assert snapshot(enc) == before


def test_a_bad_request_declaration_is_refused_and_the_manager_still_serves():
    manager = ResidencyManager({"enc": nn.Linear(4, 4)}, {"enc": "offload"})
    with pytest.raises(TypeError, match="warmup = 'no' must be True or False"):
        manager.begin_request(ONE_USE, warmup="no")
    for stages in (ONE_USE[0], None, "encode", (s for s in ONE_USE)):
        with pytest.raises(TypeError, match="a request is declared as a list of Stage records, got"):
            manager.begin_request(stages)
    assert manager.trace.of_kind("request_start") == []  # none was started
    serves(manager)


# -- a platform whose OOM rule fails ---------------------------------------------------------------

class BrokenOomRule(CpuPlatform):
    """The CPU platform, preferred, with an OOM rule that itself raises (a plugin bug)."""

    name = "brokenoomrule"
    priority = 500

    def is_out_of_memory(self, error: BaseException) -> bool:
        raise TypeError("isinstance() arg 2 must be a type, a tuple of types, or a union")


@pytest.mark.parametrize("where", ["request", "use_component"])
def test_a_failing_oom_rule_lets_the_callers_error_through_and_the_request_is_abandoned(make_registry, where):
    class Registers:
        @hookimpl
        def torchhal_register_platforms(self):
            return [BrokenOomRule()]

    make_registry(Registers())
    manager = ResidencyManager({"enc": nn.Linear(4, 4)}, {"enc": "offload"})
    assert manager.platform.name == "brokenoomrule"
    with pytest.warns(TorchhalPluginWarning, match="'brokenoomrule': is_out_of_memory raised TypeError.*"
                                                   "the KeyError it was asked about is handled as not out of memory"):
        with pytest.raises(KeyError, match="the caller's own error"), manager.request(ONE_USE):
            if where == "request":
                raise KeyError("the caller's own error")
            with manager.use_component("enc"):
                raise KeyError("the caller's own error")
    assert manager.in_use is None and not manager.components["enc"].on_device  # abandoned: weights went home
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a request without an error never asks the rule
        serves(manager)


# -- the log and custom schedules through the diffusers adapter ------------------------------------

def flux():
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(EXAMPLES))
    from diffusers_flux import call_kwargs, flux_pipeline

    return flux_pipeline, call_kwargs


OFFLOADED = {"text_encoder": "offload", "text_encoder_2": "offload", "vae": "offload", "transformer": "offload"}


def test_a_managed_pipeline_refuses_a_log_without_info_and_stays_a_plain_pipeline():
    flux_pipeline, call_kwargs = flux()
    from torchhal.core.residency.diffusers import ManagedPipeline

    pipe = flux_pipeline()
    with pytest.raises(TypeError, match="log must be a logging.Logger"):
        ManagedPipeline(pipe, OFFLOADED, log=sys.stderr)
    assert "forward" not in pipe.transformer.__dict__ and not hasattr(pipe.vae, "_hf_hook")
    managed = ManagedPipeline(pipe, OFFLOADED)  # not half-managed: it can be managed now
    managed(**call_kwargs())
    managed.close()


def test_custom_sigmas_run_as_many_denoising_steps_as_they_give():
    flux_pipeline, call_kwargs = flux()
    from torchhal.core.residency.diffusers import ManagedPipeline

    sigmas = [1.0, 0.75, 0.5, 0.25]
    expected = flux_pipeline()(**call_kwargs(steps=2), sigmas=sigmas).images  # diffusers runs 4 steps, not 2
    managed = ManagedPipeline(flux_pipeline(), OFFLOADED)
    assert torch.equal(managed(**call_kwargs(steps=2), sigmas=sigmas).images, expected)
    assert managed.manager.trace.last_request()[-1]["uses_run"] == 2 + 4 + 1  # two encoders, four steps, the VAE
    managed.close()


# -- dtypes a use casts in place, layers named twice, custom trace fields --------------------------

class Projected(nn.Module):
    """A weight outside the layer list (resident under layerwise) in front of a stack."""

    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(4, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x.to(self.proj_in.weight.dtype))
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("placement", ["resident", "layerwise"])
def test_a_use_without_a_dtype_runs_as_registered_after_one_with_a_dtype(placement):
    model = Projected()
    strategy = LayerwiseStrategy(1) if placement == "layerwise" else ResidentStrategy()
    manager = ResidencyManager({"m": model}, {"m": strategy})
    stages = [Stage("cast", (ComponentUse("m", phase="bf16", dtype=torch.bfloat16),)),
              Stage("plain", (ComponentUse("m", phase="plain"),))]
    x = torch.randn(2, 4)
    with torch.no_grad(), manager.request(stages):
        with manager.use_component("m", "bf16") as m:
            assert m(x).dtype == torch.bfloat16
        with manager.use_component("m", "plain") as m:
            assert m.proj_in.weight.dtype == torch.float32  # cast back, not left in bfloat16
            assert m(x).dtype == torch.float32
    manager.close()
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # close leaves it as registered


def layers_named_twice(case: str) -> tuple[nn.Module, tuple[str, ...]]:
    """A module and layer lists in which some layer's weights are streamed twice."""
    model = nn.Module()
    if case == "one list twice":
        model.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        return model, ("layers", "layers")
    if case == "one layer repeated":
        one = nn.Linear(4, 4)
        model.layers = nn.ModuleList([one, one, one])
        return model, ("layers",)
    model.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4)) for _ in range(2)])  # "a list inside another"
    model.inner = nn.ModuleList([model.layers[0][0], model.layers[1][0]])
    return model, ("layers", "inner")


@pytest.mark.parametrize("case", ["one list twice", "one layer repeated", "a list inside another"])
def test_layerwise_refuses_layers_that_hold_the_same_weights(case):
    model, layers = layers_named_twice(case)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"component 'm': streamed layers 0 and \d hold the same weights .*"
                                         r"name each layer once"):
        ResidencyManager({"m": model}, {"m": LayerwiseStrategy(1, layers)})
    assert snapshot(model) == before


def test_a_trace_with_a_strategys_own_fields_exports_as_json(tmp_path):
    import json

    manager = ResidencyManager({"enc": nn.Linear(4, 4)}, {"enc": "offload"})
    manager.event("cast", "enc", dtype=torch.bfloat16)  # a custom strategy may report any value
    path = tmp_path / "trace.json"
    manager.trace.export(str(path))
    events = json.loads(path.read_text())
    assert [e["dtype"] for e in events if e["kind"] == "cast"] == ["torch.bfloat16"]
    manager.close()


def test_positional_arguments_set_the_uses_as_keywords_do():
    flux_pipeline, call_kwargs = flux()
    from diffusers import FluxImg2ImgPipeline

    from torchhal.core.residency.diffusers import ManagedPipeline

    def img2img():
        pipe = FluxImg2ImgPipeline(**flux_pipeline().components)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    image = torch.linspace(0, 1, 3 * 32 * 32).view(1, 3, 32, 32)
    keywords = {**call_kwargs(steps=2), "strength": 0.5}
    expected = img2img()(**keywords, image=image).images
    keywords["generator"] = torch.Generator().manual_seed(0)
    order = ("prompt", "prompt_2", "negative_prompt", "negative_prompt_2", "true_cfg_scale", "image")
    defaults = {"prompt_2": None, "negative_prompt": None, "negative_prompt_2": None, "true_cfg_scale": 1.0,
                "image": image}  # FluxImg2ImgPipeline.__call__'s first parameters
    positional = [keywords.pop(name) if name in keywords else defaults[name] for name in order]
    managed = ManagedPipeline(img2img(), OFFLOADED)
    # bound to their parameters as keywords are: the call runs as the plain pipeline's does
    assert torch.equal(managed(*positional, **keywords).images, expected)
    assert managed.manager.trace.last_request()[-1]["uses_run"] == 2 + 1 + 1 + 1
    managed.close()


def test_components_called_outside_a_pipeline_call_run_as_a_request_of_their_own():
    flux_pipeline, call_kwargs = flux()
    from torchhal.core.residency.diffusers import ManagedPipeline

    plain, pipe = flux_pipeline(), flux_pipeline()
    managed = ManagedPipeline(pipe, OFFLOADED)
    prompt = call_kwargs()["prompt"]
    with torch.no_grad():
        expected = plain.encode_prompt(prompt=prompt, prompt_2=None, max_sequence_length=16)
        embeds = pipe.encode_prompt(prompt=prompt, prompt_2=None, max_sequence_length=16)  # precomputed prompts
        latents = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
        decoded = pipe.vae.decode(latents).sample  # latents from an output_type="latent" call
        assert torch.equal(decoded, plain.vae.decode(latents).sample)
    assert all(torch.equal(a, b) for a, b in zip(embeds, expected, strict=True))
    trace = managed.manager.trace
    assert [e["uses"] for e in trace.of_kind("request_start")] == [1, 1, 1]  # CLIP, T5, the VAE: one use each
    assert [e["component"] for e in trace.of_kind("release")] == ["text_encoder", "text_encoder_2", "vae"]
    assert not managed.manager.in_request and not any(c.on_device for c in managed.manager.components.values())
    managed(**call_kwargs())  # and the pipeline's own calls are served as before
    managed.close()


def test_a_pipeline_that_declares_no_component_order_asks_for_stages():
    flux_pipeline, call_kwargs = flux()
    from torchhal.core.residency.diffusers import ManagedPipeline

    pipe = flux_pipeline()
    pipe.model_cpu_offload_seq = None  # what DiffusionPipeline itself sets: a subclass that declares none
    managed = ManagedPipeline(pipe, OFFLOADED)
    with pytest.raises(ValueError, match="FluxPipeline.model_cpu_offload_seq does not name 'transformer'; pass "
                                         "stages= to the call"):
        managed(**call_kwargs())
    with pytest.raises(TypeError, match="got the single stage 'all'; pass \\[stage\\]"):
        managed(stages=Stage("all", (ComponentUse("transformer"),)), **call_kwargs())
    assert managed.manager.trace.of_kind("request_start") == []  # neither call started a request
    managed.close()


def test_one_module_under_two_component_names_is_refused():
    flux_pipeline, _ = flux()
    from torchhal.core.residency.diffusers import ManagedPipeline

    pipe = flux_pipeline()
    pipe.text_encoder_2 = pipe.text_encoder
    before = own_attributes_of(pipe.text_encoder)
    with pytest.raises(ValueError, match="components 'text_encoder' and 'text_encoder_2' are the same module; "
                                         "a managed pipeline tells uses apart by the component instance called"):
        ManagedPipeline(pipe, {"vae": "offload"})
    assert own_attributes_of(pipe.text_encoder) == before


def own_attributes_of(module: nn.Module) -> set[str]:
    return {name for name in ("forward", "encode", "decode", "_hf_hook") if name in module.__dict__}


def test_the_trace_keeps_the_newest_events_only(monkeypatch):
    # Recorded by default, an unbounded trace grows by ~0.5 MiB a Flux-sized request, for ever.
    from torchhal.core.residency.trace import ResidencyTrace

    monkeypatch.setattr(ResidencyTrace, "MAX_EVENTS", 40)
    manager = ResidencyManager({"a": torch.nn.Linear(4, 4)}, {"a": "offload"})
    stage = [Stage("s", (ComponentUse("a", memory_intensive=True),))]
    for _ in range(30):
        with torch.no_grad(), manager.request(stage), manager.use_component("a") as module:
            module(torch.randn(1, 4))
    events = manager.trace.events
    assert 30 <= len(events) <= 40
    assert events[-1]["kind"] == "request_end" and manager.trace.last_request()[0]["kind"] == "request_start"
    assert all(a["t"] <= b["t"] for a, b in zip(events, events[1:], strict=False))  # the newest, in order
    manager.close()


def test_a_log_that_fails_on_request_end_leaves_the_request_ended():
    # An event sent before the request is marked ended would leave it running: the next
    # request and close() refused for ever ("a request is already running").
    import json

    class Log:
        def info(self, fmt, line):
            if json.loads(line)["kind"] == "request_end":
                raise OSError("log handler failed")

    manager = ResidencyManager({"a": torch.nn.Linear(4, 4)}, {"a": "offload"}, log=Log())
    stage = [Stage("s", (ComponentUse("a", memory_intensive=True),))]
    with pytest.raises(OSError, match="log handler failed"):
        with torch.no_grad(), manager.request(stage), manager.use_component("a") as module:
            module(torch.randn(1, 4))
    assert not manager.in_request and not manager.components["a"].on_device
    manager.trace.log = None
    with torch.no_grad(), manager.request(stage), manager.use_component("a") as module:
        module(torch.randn(1, 4))
    manager.close()


@pytest.mark.parametrize("placement", ["resident", "offload"])
def test_a_use_dtype_casts_floating_buffers_with_the_weights(placement):
    # Casting only the parameters leaves a BatchNorm's statistics (or a position table) in
    # float32, and the forward fails ("expected scalar type BFloat16 but found Float").
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        expected = copy.deepcopy(net).to(torch.bfloat16)(x.bfloat16())
    manager = ResidencyManager({"net": net}, {"net": placement})
    stage = [Stage("s", (ComponentUse("net", dtype=torch.bfloat16),))]
    with torch.no_grad(), manager.request(stage), manager.use_component("net") as module:
        assert torch.equal(module(x.bfloat16()), expected)
    manager.close()
    assert {str(b.dtype) for b in net[1].buffers() if b.dtype.is_floating_point} == {"torch.float32"}
    assert net[1].num_batches_tracked.dtype == torch.int64  # not floating: never cast


@pytest.mark.parametrize("strategy_class", [ResidentStrategy, OffloadStrategy])
def test_a_strategy_serving_a_live_managers_component_is_refused_by_another_manager(strategy_class):
    # A second attach of a serving ResidentStrategy would replace the first component's registered
    # dtypes: the first manager's uses would ignore their dtype and its close could not cast back.
    strategy = strategy_class()
    first = ResidencyManager({"a": nn.Linear(4, 4)}, {"a": strategy})
    with pytest.raises(ValueError, match=f"this {strategy_class.__name__} already serves a component; pass a new "
                                         "one for 'b'"):
        ResidencyManager({"b": nn.Linear(4, 4)}, {"b": strategy})
    stage = [Stage("s", (ComponentUse("a", dtype=torch.bfloat16),))]
    with torch.no_grad(), first.request(stage), first.use_component("a") as module:
        assert module.weight.dtype == torch.bfloat16
    first.close()
    second = ResidencyManager({"b": nn.Linear(4, 4)}, {"b": strategy})  # free again once the first closed
    second.close()


@pytest.mark.parametrize("placement", ["resident", "offload", "layerwise"])
def test_a_component_on_the_meta_device_is_refused_by_name_before_anything_moves(placement):
    # Unrefused, each strategy fails inside attach on torch's "Cannot copy out of meta tensor",
    # naming no component, and the rollback warns about its own failing steps.
    with torch.device("meta"):
        stack = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    other = nn.Linear(4, 4)
    strategy: Any = placement
    if placement == "layerwise":
        holder = nn.Module()
        holder.layers = stack
        stack, strategy = holder, LayerwiseStrategy(0, "layers")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"component 'c' has '(layers\.)?0\.weight' on the meta device "
                                             r"\(no data\); load its weights before registering it"):
            ResidencyManager({"o": other, "c": stack}, {"o": "offload", "c": strategy})
    assert other.weight.device.type == "cpu" and other.weight.is_leaf  # nothing was attached


# -- cleanup that fails: the other steps still run, the caller's own error is the one raised ---------

class ReleaseFails(OffloadStrategy):
    """An offload whose release raises while `failing` (a device fault, a custom strategy's bug)."""

    failing = True

    def release(self, manager: Any, component: Any) -> int:
        if self.failing:
            raise RuntimeError("release failed: device busy")
        return super().release(manager, component)


def two_uses() -> list[Stage]:
    # "other" is prefetched while "enc" runs: on the device when the request fails
    return [Stage("s", (ComponentUse("enc"), ComponentUse("other", memory_intensive=True)))]


@pytest.mark.parametrize("error", [KeyError("the caller's own error"),
                                   torch.OutOfMemoryError("simulated: tried to allocate 3 GiB")])
def test_a_release_failing_while_a_request_fails_leaves_the_request_ended_and_its_error_raised(error):
    # The release's error must not replace the caller's (an OOM would be no RequestFailed and
    # empty nothing), nor a release that keeps failing leave the manager inside the request for
    # good (every later request, finish_request() and close() refused).
    strategy = ReleaseFails()
    manager = ResidencyManager({"enc": nn.Linear(4, 4), "other": nn.Linear(4, 4)},
                               {"enc": strategy, "other": "offload"})
    expected = RequestFailed if isinstance(error, torch.OutOfMemoryError) else KeyError
    with warnings.catch_warnings(record=True) as caught, \
            pytest.raises(expected, match="the caller's own error|out of memory"):
        warnings.simplefilter("always")
        with manager.request(two_uses()), manager.use_component("enc"):
            assert manager.components["other"].on_device
            raise error
    # Both of enc's releases failed and were told, each naming its cleanup: the use's, then the request's.
    assert [str(w.message) for w in caught if w.category is RuntimeWarning] == [
        "ending a failed use: releasing 'enc' raised RuntimeError: release failed: device busy",
        "abandoning a failed request: ReleaseFails.release of 'enc' raised RuntimeError: release failed: device busy",
    ]
    assert not manager.in_request and manager.in_use is None
    assert not manager.components["other"].on_device  # released although enc's release failed first
    if expected is RequestFailed:
        assert [e["reason"] for e in manager.trace.of_kind("empty_cache")][-1] == "oom"
    strategy.failing = False
    with torch.no_grad(), manager.request(two_uses()):
        for name in ("enc", "other"):
            with manager.use_component(name) as module:
                module(torch.randn(1, 4))
    manager.close()
    assert not manager.components["enc"].attached


class DetachFails(OffloadStrategy):
    failing = True

    def detach(self, manager: Any, component: Any) -> None:
        if self.failing:
            raise RuntimeError("detach failed: device busy")
        super().detach(manager, component)


def test_a_detach_failing_at_close_gives_every_other_component_back_and_close_retries_it():
    # A close() that stops at the failing detach leaves the components after it attached
    # (their hooks on, their device copies held) until close() is called again.
    strategies = {"a": OffloadStrategy(), "b": DetachFails(), "c": LayerwiseStrategy(1)}
    manager = ResidencyManager({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4), "c": Stack()}, strategies)
    with pytest.raises(RuntimeError, match=r"^close\(\) could not detach 'b': RuntimeError: detach failed: device "
                                           r"busy; every other component was given back and the cache emptied: call "
                                           r"close\(\) again to retry$"):
        manager.close()
    assert [name for name, state in manager.components.items() if state.attached] == ["b"]
    assert strategies["c"].hooks == [] and strategies["a"].block is None  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="this ResidencyManager is closed"):
        manager.begin_request(ONE_USE)
    strategies["b"].failing = False  # type: ignore[attr-defined]
    manager.close()  # retries the detach that failed, and only it
    assert not any(state.attached for state in manager.components.values())
    assert manager.close() is None


def test_a_log_failing_at_close_leaves_the_device_given_back():
    # A "release" event the log refuses must not stop close() with the other components
    # attached, on every retry: the device would never be given back.
    class RefusesClose:
        def info(self, message: str, line: str) -> None:
            if '"why": "close"' in line or '"where": "close"' in line:
                raise OSError("log disk full")

    manager = ResidencyManager({"a": nn.Linear(4, 4), "b": Stack()}, {"a": "offload", "b": LayerwiseStrategy(1)},
                               log=RefusesClose())
    with pytest.warns(RuntimeWarning) as caught:
        manager.close()
    assert [str(w.message) for w in caught] == [
        f"closing the ResidencyManager: {what} raised OSError: log disk full"
        for what in ("the release event of 'a'", "the release event of 'b'", "the empty_cache event")]
    assert not any(state.attached for state in manager.components.values())
    assert manager.close() is None


@pytest.mark.parametrize(("component", "phase", "message"), [
    (["enc"], None, r"begin_use\(\['enc'\]\): the component is named by a str, e.g. begin_use\('enc'\)"),
    ("enc", 3, r"begin_use\('enc', phase=3\): phase must be a str \(as declared in ComponentUse\) or None"),
])
def test_begin_use_refuses_a_name_or_phase_of_the_wrong_type_and_the_request_goes_on(component, phase, message):
    # Unchecked, a list fails with "unhashable type: 'list'", and phase=3 matches a use declared with none.
    manager = ResidencyManager({"enc": nn.Linear(4, 4)}, {"enc": "offload"})
    manager.begin_request(ONE_USE)
    with pytest.raises(TypeError, match=message):
        manager.begin_use(component, phase)
    assert manager.in_use is None and not manager.components["enc"].on_device
    manager.begin_use("enc")
    manager.end_use("enc")
    manager.finish_request()
    serves(manager)


@pytest.mark.parametrize("layers_attr", [5, None, {"layers"}, b"layers", ()])
def test_layers_attr_that_names_no_module_list_is_refused_naming_the_parameter(layers_attr) -> None:
    with pytest.raises(ValueError, match=r"layers_attr must name the nn.ModuleList\(s\) to stream"):
        LayerwiseStrategy(layers_attr=layers_attr)


def test_a_numpy_prefetch_count_is_a_count() -> None:
    numpy = pytest.importorskip("numpy")
    strategy = LayerwiseStrategy(prefetch_layers=numpy.int64(2), layers_attr=["blocks", "layers"])
    assert strategy.prefetch_layers == 2 and type(strategy.prefetch_layers) is int
    assert strategy.layers_attr == ("blocks", "layers")
