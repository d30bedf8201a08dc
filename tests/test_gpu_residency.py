"""Residency manager on a real GPU (marker gpu): streamed weights, memory bounds, release points."""

import gc
import sys
from pathlib import Path

import pytest
import torch

import torchhal
from torchhal.core.residency import (
    ComponentUse,
    LayerwiseStrategy,
    OffloadStrategy,
    ResidencyManager,
    ResidencyStrategy,
    Stage,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from diffusion_pipeline import default_placements, make_components, run_request  # noqa: E402

has_gpu = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu, reason="needs a GPU (none here)")]
MiB = 1 << 20


def test_offload_and_layerwise_match_resident_on_the_device():
    tokens = torch.randn(64, 512, device="cuda")
    expected = run_request(ResidencyManager(make_components(512, 6), {}), tokens, 3)
    component_bytes = {
        name: sum(p.numel() * p.element_size() for p in module.parameters())
        for name, module in make_components(512, 6).items()
    }
    for transformer in ("offload", "layerwise"):
        base = torch.cuda.memory_allocated()  # other tests in this process hold memory too
        manager = ResidencyManager(make_components(512, 6), default_placements(transformer, prefetch_layers=2))
        assert manager.components["vae"].strategy.block.host.is_pinned()
        for _ in range(2):
            torch.testing.assert_close(run_request(manager, tokens, 3), expected)
        torch.cuda.synchronize()
        # Between requests only the text encoder (prepared for the next request) and the
        # transformer's non-layer weights may stay on the device, plus the returned output.
        allowed = component_bytes["text_encoder"] + component_bytes["transformer"] // 2
        assert torch.cuda.memory_allocated() - base < allowed
        del manager


def test_layerwise_peak_stays_within_2p_plus_1_layers():
    torchhal.current_platform().empty_cache(torchhal.ReleasePoint.USER)
    components = {"transformer": make_components(1024, 8)["transformer"]}
    layer_bytes = sum(p.numel() * p.element_size() for p in components["transformer"].layers[0].parameters())
    manager = ResidencyManager(components, {"transformer": LayerwiseStrategy(prefetch_layers=1)})
    x = torch.randn(16, 1024, device="cuda")
    stage = [Stage("s", (ComponentUse("transformer", memory_intensive=True),))]
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad(), manager.request(stage), manager.use_component("transformer") as model:
        model(x)
    activations = 4 * 16 * 4096 * 4  # a few [16, 4096] fp32 intermediates
    assert torch.cuda.max_memory_allocated() - base <= 3 * layer_bytes + activations + MiB
    assert torch.cuda.memory_allocated() - base < layer_bytes  # every layer released


def test_reserved_drops_only_at_the_release_point():
    manager = ResidencyManager(make_components(1024, 4), default_placements("offload"))
    run_request(manager, torch.randn(32, 1024, device="cuda"), 2)
    empties = manager.trace.of_kind("empty_cache")
    assert empties and all(e["where"] == "component_release" for e in empties)
    assert all(e["bytes_released"] is not None for e in empties)


def test_close_returns_device_memory_to_where_it_started():
    gc.collect()  # earlier tests' cyclic garbage would otherwise be freed mid-test, below the base
    torch.cuda.synchronize()
    torchhal.current_platform().empty_cache(torchhal.ReleasePoint.USER)
    base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    manager = ResidencyManager(make_components(1024, 4), default_placements("layerwise"))
    run_request(manager, torch.randn(32, 1024, device="cuda"), 2)  # ends with the text encoder prepared
    assert torch.cuda.memory_allocated() > base_allocated + MiB
    manager.close()
    assert torch.cuda.memory_allocated() == base_allocated
    assert torch.cuda.memory_reserved() <= base_reserved


@pytest.mark.parametrize("shapes", [((2048, 1536), (256, 1024)), ((1000, 3000), (1, 145_728))],
                         ids=["whole_granules", "rounded_weight"])
def test_a_block_loaded_without_a_buffer_allocates_no_more_than_the_modules_own_move(shapes):
    # whole_granules: 12 MiB + 1 MiB + 10 KiB. The 12 MiB weight fills a head of 6 granules,
    # the rest are small own tensors: every request is exact, as the module's own move's are.
    # rounded_weight: weights of 12,000,000 and 582,912 B, biases of 12,000 and 582,912 B.
    # The module's own move rounds the first weight's segment up to 12 MiB and keeps the
    # remainder (< 1 MiB) inside the block, counted as allocated; packed, the two weights
    # fill a head of exactly 6 granules, which nothing rounds.
    from torchhal.core.residency import WeightBlock
    from torchhal.core.residency.weights import GRANULE

    def module():
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(*shape) for shape in shapes))

    exact = sum(p.numel() * p.element_size() for p in module().parameters())
    assert exact > GRANULE

    def allocated_by(move):
        gc.collect()
        torch.cuda.synchronize()
        torchhal.current_platform().empty_cache(torchhal.ReleasePoint.USER)
        before = torch.cuda.memory_allocated()
        kept = move()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before, kept

    own_move, moved = allocated_by(lambda: module().to("cuda"))
    platform = torchhal.current_platform()
    host = module()
    block = WeightBlock(list(host.parameters()), platform, platform.device(0))
    layout = block.layout(torch.float32)
    assert layout.head_numel * 4 == 6 * GRANULE
    loaded, _ = allocated_by(lambda: block.load(platform.new_stream(0)))
    assert loaded <= own_move
    if shapes[0] == (2048, 1536):
        assert loaded == own_move == exact
    block.wait()
    head = {p.untyped_storage().data_ptr() for p, o in zip(host.parameters(), layout.offsets, strict=True)
            if o is not None}
    assert len(head) == 1 and next(host.parameters()).untyped_storage().nbytes() == 6 * GRANULE
    for p, q in zip(host.parameters(), moved.parameters(), strict=True):
        assert p.device.type == "cuda"
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    block.release()


def test_a_failed_construction_puts_components_given_on_the_gpu_back_there():
    class LosesTheDevice(ResidencyStrategy):
        def attach(self, manager: object, component: object) -> None:
            raise RuntimeError("device lost during attach")

    given = {"enc": torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)).cuda(),
             "stack": make_components(512, 3)["transformer"].cuda()}
    values = {(name, key): t.detach().clone() for name, m in given.items()
              for key, t in (*m.named_parameters(), *m.named_buffers())}
    placements = {"enc": OffloadStrategy(), "stack": LayerwiseStrategy(1)}
    with pytest.raises(RuntimeError, match="device lost during attach"):
        ResidencyManager({**given, "last": torch.nn.Linear(4, 4)}, {**placements, "last": LosesTheDevice()})
    for name, module in given.items():  # detach moved them to the host; the rollback moved them back
        for key, t in (*module.named_parameters(), *module.named_buffers()):
            assert t.device.type == "cuda" and torch.equal(t, values[(name, key)]), (name, key)
    ResidencyManager(given, placements).close()  # the same strategies serve again


def test_a_prefetched_component_arrives_in_the_dtype_its_use_asks_for():
    components = make_components(512, 4, dtype=torch.bfloat16)
    reference = {name: module.float().cuda() for name, module in make_components(512, 4, dtype=torch.bfloat16).items()}
    manager = ResidencyManager(components, default_placements("layerwise"))
    uses = [Stage("s", (ComponentUse("transformer", memory_intensive=True, dtype=torch.float32),
                        ComponentUse("vae", memory_intensive=True, dtype=torch.float32)))]
    x = torch.randn(64, 512, device="cuda")
    with torch.no_grad(), manager.request(uses):
        with manager.use_component("transformer") as transformer:
            hidden = transformer(x)
        assert [e["component"] for e in manager.trace.of_kind("prefetch")] == ["vae"]
        with manager.use_component("vae") as vae:
            out = vae(hidden)
        expected = reference["vae"](reference["transformer"](x))
    torch.testing.assert_close(out, expected)  # bf16 weights widened exactly; fp32 compute
    assert components["vae"].proj_in.weight.dtype == torch.bfloat16  # host copy unchanged
    manager.close()


def test_a_diffusers_pipeline_under_the_manager_matches_resident_on_the_device():
    pytest.importorskip("diffusers")
    from diffusers_flux import call_kwargs, flux_pipeline

    from torchhal.core.residency.diffusers import ManagedPipeline

    expected = flux_pipeline().to("cuda")(**call_kwargs()).images
    for transformer in ("offload", LayerwiseStrategy(1, ("transformer_blocks", "single_transformer_blocks"))):
        pipe = flux_pipeline()
        managed = ManagedPipeline(pipe, {"text_encoder": "offload", "text_encoder_2": "offload", "vae": "offload",
                                         "transformer": transformer})
        for _ in range(2):
            image = managed(**call_kwargs()).images
            assert image.device.type == "cuda"  # latents and inputs were put on the device
            torch.testing.assert_close(image, expected, rtol=0, atol=1e-5)  # same kernels; allow reduction order
        # between requests every offloaded or streamed weight is back on the host
        assert pipe.vae.decoder.conv_in.weight.device.type == "cpu"
        assert pipe.transformer.single_transformer_blocks[0].proj_out.weight.device.type == "cpu"
        managed.close()


def test_a_diffusers_pipeline_with_weights_on_call_matches_resident_and_leaves_nothing_behind():
    pytest.importorskip("diffusers")
    from diffusers_flux import call_kwargs, flux_pipeline

    from torchhal.core.residency.diffusers import ManagedPipeline

    expected = flux_pipeline().to("cuda")(**call_kwargs()).images
    pipe = flux_pipeline()
    managed = ManagedPipeline(pipe, {
        "text_encoder": "offload", "text_encoder_2": "offload",
        "transformer": LayerwiseStrategy(1, ("transformer_blocks", "single_transformer_blocks"), rest="on_call"),
        "vae": LayerwiseStrategy(1, ("decoder.up_blocks",), buffers="exact", rest="on_call")})
    seen = {}
    # while the decoder's last up block runs, its weights are on the device and the encoder's are not
    hook = pipe.vae.decoder.up_blocks[-1].register_forward_pre_hook(lambda m, a: seen.update(
        up=next(m.parameters()).device.type, mid=pipe.vae.decoder.mid_block.resnets[0].conv1.weight.device.type,
        encoder=pipe.vae.encoder.conv_in.weight.device.type,
        embedder=pipe.transformer.x_embedder.weight.device.type))
    for _ in range(2):
        image = managed(**call_kwargs()).images
        torch.testing.assert_close(image, expected, rtol=0, atol=1e-5)
        # the transformer's non-block weights and the VAE decoder left with their components
        assert pipe.transformer.x_embedder.weight.device.type == "cpu"
        assert pipe.vae.decoder.mid_block.resnets[0].conv1.weight.device.type == "cpu"
    hook.remove()
    assert seen == {"up": "cuda", "mid": "cuda", "encoder": "cpu", "embedder": "cpu"}
    assert managed.manager.last_request_h2d_bytes["vae"] == sum(
        p.numel() * p.element_size() for p in pipe.vae.decoder.parameters())
    managed.close()


def test_stable_diffusion_with_guidance_and_a_multistep_scheduler_matches_resident_on_the_device():
    pytest.importorskip("diffusers")
    from diffusers import PNDMScheduler

    from tests.diffusers_pipelines import SD_OFFLOADED, sd_kwargs, sd_pipeline, with_safety_checker
    from torchhal.core.residency.diffusers import ManagedPipeline

    def make():  # as Stable Diffusion ships: PLMS steps, guidance 7.5, a safety checker left resident
        return with_safety_checker(sd_pipeline(PNDMScheduler(skip_prk_steps=True)))

    expected = make().to("cuda")(**sd_kwargs()).images
    pipe = make()
    managed = ManagedPipeline(pipe, SD_OFFLOADED)
    for _ in range(2):
        image = managed(**sd_kwargs()).images
        torch.testing.assert_close(image, expected, rtol=0, atol=1e-5)
        assert managed.manager.trace.last_request()[-1]["uses_run"] == 2 + 4 + 1
        assert pipe.unet.conv_in.weight.device.type == "cpu"  # offloaded again between requests
    managed.close()

