"""Hostile input to the residency manager and the diffusers adapter, on the CPU platform.

Each refusal comes before anything is attached, moved or started (the modules keep their
storage and train/eval flags, the manager serves the next request), and a failure inside
the manager's own bookkeeping never leaves it stuck in a request.
"""

import logging
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from torchhal.core.residency import ComponentUse, ResidencyManager, Stage

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ONE_USE = [Stage("encode", (ComponentUse("enc"),))]


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


# -- 1. the log -------------------------------------------------------------------------------

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


# -- 2. finish_request during a use -----------------------------------------------------------

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


# -- 1 through the diffusers adapter ------------------------------------------------------------

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
