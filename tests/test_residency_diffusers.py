"""A real diffusers FluxPipeline (tiny, random weights) under the residency manager, on CPU.

The pipeline's own __call__ runs with every component managed; each strategy must give
the image of the unmanaged pipeline bit for bit (same kernels, same inputs: on CPU the
moves are copies, so any difference is a bug in what the manager hands the pipeline).
"""

import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from torchhal.core.residency import (  # noqa: E402
    ComponentUse,
    LayerwiseStrategy,
    RequestFailed,
    Stage,
    Strategy,
    UndeclaredUse,
)
from torchhal.core.residency.diffusers import ManagedPipeline, guess_block_lists  # noqa: E402
from torchhal.platforms import ReleasePoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from diffusers_flux import call_kwargs, flux_pipeline  # noqa: E402

from tests.diffusers_pipelines import (  # noqa: E402
    SD_OFFLOADED,
    flux_control_pipeline,
    sd_controlnet_pipeline,
    sd_kwargs,
    sd_pipeline,
    with_safety_checker,
)

ENCODERS = {"text_encoder": Strategy.OFFLOAD, "text_encoder_2": Strategy.OFFLOAD, "vae": Strategy.OFFLOAD}
BLOCKS = ("transformer_blocks", "single_transformer_blocks")


@pytest.fixture(scope="module")
def reference_image():
    return flux_pipeline()(**call_kwargs()).images


@pytest.mark.parametrize("transformer", ["resident", "offload", "layerwise-1", "layerwise-2", "layerwise-on_call"])
def test_each_strategy_gives_the_unmanaged_image_bit_for_bit(reference_image, empties, transformer):
    encoders = {} if transformer == "resident" else ENCODERS
    if transformer == "layerwise-on_call":  # non-layer weights on call, the VAE decoder streamed too
        placement: object = LayerwiseStrategy(1, BLOCKS, rest="on_call")
        encoders = {**ENCODERS, "vae": streamed_vae()}
    elif transformer.startswith("layerwise"):
        placement = LayerwiseStrategy(int(transformer[-1]), BLOCKS)
    else:
        placement = Strategy(transformer)
    pipe = flux_pipeline()
    managed = ManagedPipeline(pipe, {**encoders, "transformer": placement})
    for _ in range(2):  # a second request reuses what the first left behind
        image = managed(**call_kwargs()).images
        assert torch.equal(image, reference_image)
    trace = managed.manager.trace
    assert empties == []  # no release point: every stage is served from the allocator's cache
    if transformer == "resident":
        assert trace.of_kind("release") == []
    else:
        used = [e["component"] for e in trace.last_request() if e["kind"] == "release"]
        assert used == ["text_encoder", "text_encoder_2", "transformer", "vae"]
    if transformer.startswith("layerwise"):
        layers = [e for e in trace.last_request() if e["kind"] in ("prepare", "wait") and "layer" in e]
        assert {e["layer"] for e in layers if e["component"] == "transformer"} == set(range(3))  # 1 double + 2 single
    managed.close()
    # closed: a plain pipeline again, still giving the same image
    assert "forward" not in pipe.transformer.__dict__ and not hasattr(pipe.vae, "_hf_hook")
    assert torch.equal(pipe(**call_kwargs()).images, reference_image)


def test_empty_on_release_empties_after_each_component_that_left(reference_image, empties):
    managed = ManagedPipeline(flux_pipeline(), {**ENCODERS, "transformer": Strategy.OFFLOAD}, empty_on_release=True)
    assert torch.equal(managed(**call_kwargs()).images, reference_image)
    trace = managed.manager.trace
    released = [e["component"] for e in trace.last_request() if e["kind"] == "release"]
    assert released == ["text_encoder", "text_encoder_2", "transformer", "vae"]
    # one release point right after each of them
    assert empties == [ReleasePoint.COMPONENT_RELEASE] * 4
    assert all(e["where"] == "component_release" for e in trace.of_kind("empty_cache"))
    with pytest.raises(TypeError, match="empty_on_release = 'yes' must be True or False"):
        ManagedPipeline(flux_pipeline(), {}, empty_on_release="yes")  # type: ignore[arg-type]


def test_uses_follow_the_call_arguments(empties):
    managed = ManagedPipeline(flux_pipeline(), {**ENCODERS, "transformer": LayerwiseStrategy(1, BLOCKS)})
    derived = managed.stages(num_inference_steps=3)
    names = [[(u.component, u.memory_intensive) for u in s.uses] for s in derived]
    # the VAE may also run before the denoiser (an img2img image, a control image): a use that may not
    # come is not memory-intensive, so it is never the one prefetched
    assert names == [[("text_encoder", True), ("text_encoder_2", True), ("vae", False)], [("transformer", True)],
                     [("vae", True)]]
    assert [s.exact for s in derived] == [False] * 3  # how often each runs is the pipeline's business
    assert [s.name for s in managed.stages(output_type="latent")] == ["encode", "denoise"]
    # prompt embeddings given: the encoders never run, and the image is unchanged
    pipe = flux_pipeline()
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(prompt=call_kwargs()["prompt"], prompt_2=None, max_sequence_length=16)

    def without_prompt():
        return {k: v for k, v in call_kwargs().items() if k != "prompt"}

    expected = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, **without_prompt()).images
    image = managed(prompt_embeds=embeds, pooled_prompt_embeds=pooled, **without_prompt()).images
    assert torch.equal(image, expected)
    assert {e["component"] for e in managed.manager.trace.last_request() if e["kind"] in ("prepare", "prefetch")} == {
        "transformer", "vae"}
    managed.close()


def test_a_call_that_does_not_match_its_declaration_fails_clearly(empties):
    managed = ManagedPipeline(flux_pipeline(), {**ENCODERS, "transformer": Strategy.OFFLOAD})
    encode, _, decode = managed.stages()
    one_step = [Stage("encode", encode.uses), Stage("denoise", (ComponentUse("transformer"),)),
                Stage("decode", decode.uses)]  # exact: one transformer use, then the VAE
    with pytest.raises(RuntimeError, match="begin_use\\('transformer'.*declared next use is 'vae'"):
        managed(stages=one_step, **call_kwargs(steps=2))
    assert not any(c.on_device for n, c in managed.manager.components.items())  # everything went home
    assert torch.equal(managed(**call_kwargs()).images, flux_pipeline()(**call_kwargs()).images)  # still serves


def _uses_run(managed):
    return managed.manager.trace.last_request()[-1]["uses_run"]


@pytest.mark.parametrize(("scheduler", "guidance", "uses"), [
    ("PNDMScheduler", 7.5, 2 + 4 + 1),  # as Stable Diffusion ships: PLMS runs the UNet once more than its steps
    ("HeunDiscreteScheduler", 7.5, 2 + (2 * 3 - 1) + 1),  # second order: twice per step but the last
    ("EulerDiscreteScheduler", 1.0, 1 + 3 + 1),  # no guidance: the text encoder runs once
])
def test_the_denoiser_and_encoders_run_as_often_as_the_pipeline_calls_them(empties, scheduler, guidance, uses):
    import diffusers

    def make():
        options = {"skip_prk_steps": True} if scheduler == "PNDMScheduler" else {}
        return with_safety_checker(sd_pipeline(getattr(diffusers, scheduler)(**options)))

    expected = make()(**sd_kwargs(guidance=guidance))
    managed = ManagedPipeline(make(), SD_OFFLOADED)
    for _ in range(2):
        result = managed(**sd_kwargs(guidance=guidance))
        assert torch.equal(result.images, expected.images)
        assert result.nsfw_content_detected == expected.nsfw_content_detected  # the resident checker ran
        assert _uses_run(managed) == uses
        # each offloaded component came in once, however often it ran
        assert [e["component"] for e in managed.manager.trace.last_request() if e["kind"] == "release"] == [
            "text_encoder", "unet", "vae"]
    managed.close()


def test_img2img_and_true_guidance_run_without_declaring_their_uses(empties):
    from diffusers import FluxImg2ImgPipeline

    def img2img():
        pipe = FluxImg2ImgPipeline(**flux_pipeline().components)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def arguments():  # the VAE encodes the image first; strength 0.5 runs 2 of the 4 steps
        return {**call_kwargs(steps=4), "image": torch.linspace(0, 1, 3 * 32 * 32).view(1, 3, 32, 32),
                "strength": 0.5}

    expected = img2img()(**arguments()).images
    managed = ManagedPipeline(img2img(), {**ENCODERS, "transformer": Strategy.OFFLOAD})
    assert torch.equal(managed(**arguments()).images, expected)
    assert _uses_run(managed) == 2 + 1 + 2 + 1
    managed.close()

    # true classifier-free guidance: the encoders run again for the negative prompt, the transformer twice a step
    def guided():
        return {**call_kwargs(steps=2), "true_cfg_scale": 2.0, "negative_prompt": "a dog"}

    expected = flux_pipeline()(**guided()).images
    managed = ManagedPipeline(flux_pipeline(), {**ENCODERS, "transformer": Strategy.OFFLOAD})
    assert torch.equal(managed(**guided()).images, expected)
    assert _uses_run(managed) == 4 + 2 * 2 + 1
    assert managed.manager.last_request_h2d_bytes["transformer"] == _nbytes(managed.pipeline.transformer)
    managed.close()


def test_a_use_before_the_denoiser_that_may_not_come_is_not_prefetched(empties):
    from diffusers import EulerDiscreteScheduler

    # a control image the VAE never encodes: the UNet is prefetched during the text encoder, and the VAE is
    # not on the device while the UNet runs
    control = {**sd_kwargs(), "image": torch.linspace(0, 1, 3 * 32 * 32).view(1, 3, 32, 32)}
    expected = sd_controlnet_pipeline(EulerDiscreteScheduler())(**control).images
    pipe = sd_controlnet_pipeline(EulerDiscreteScheduler())
    managed = ManagedPipeline(pipe, SD_OFFLOADED)
    vae_during_unet = []
    hook = pipe.unet.conv_in.register_forward_pre_hook(
        lambda module, args: vae_during_unet.append(managed.manager.components["vae"].on_device))
    assert torch.equal(managed(**{**control, "generator": torch.Generator().manual_seed(0)}).images, expected)
    hook.remove()
    assert vae_during_unet == [False] * 3  # one UNet call a step (guidance batches both halves)
    assert [e["component"] for e in managed.manager.trace.last_request() if e["kind"] == "prefetch"] == ["unet"]
    managed.close()

    # a control image the VAE does encode first (FluxControlPipeline): every placement runs it
    def controlled():
        return {**call_kwargs(steps=2), "control_image": torch.linspace(0, 1, 3 * 32 * 32).view(1, 3, 32, 32)}

    expected = flux_control_pipeline()(**controlled()).images
    for placements in ({}, {**ENCODERS, "transformer": Strategy.OFFLOAD}):
        managed = ManagedPipeline(flux_control_pipeline(), placements)
        assert torch.equal(managed(**controlled()).images, expected)
        assert _uses_run(managed) == 2 + 1 + 2 + 1
        managed.close()


def test_a_call_that_departs_from_its_derived_uses_says_what_happened_and_the_fix(empties):
    from diffusers import EulerDiscreteScheduler

    # an offloaded component that model_cpu_offload_seq does not name: its uses cannot be derived
    managed = ManagedPipeline(with_safety_checker(sd_pipeline(EulerDiscreteScheduler())),
                              {**SD_OFFLOADED, "safety_checker": "offload"})
    with pytest.raises(UndeclaredUse, match=r"^StableDiffusionPipeline called 'safety_checker', which the uses "
                                            r"derived for this call do not name \(they follow StableDiffusionPipeline"
                                            r"\.model_cpu_offload_seq = 'text_encoder->image_encoder->unet->vae'\); "
                                            r"leave 'safety_checker' resident .*, or pass stages= to the call "
                                            r"declaring the uses it makes$"):
        managed(**sd_kwargs())
    assert not any(c.on_device for c in managed.manager.components.values())
    managed.close()

    # a component called again after the pipeline moved on: a text encoder inside the denoising loop
    pipe = flux_pipeline()

    def encode_again(pipeline, step, timestep, tensors):
        pipeline.text_encoder(torch.zeros(1, 77, dtype=torch.long))
        return tensors

    managed = ManagedPipeline(pipe, {**ENCODERS, "transformer": Strategy.OFFLOAD})
    with pytest.raises(UndeclaredUse, match=r"^FluxPipeline called 'text_encoder' where the uses derived for this "
                                            r"call allow 'transformer' or 'vae' next \(their stages, encode, denoise, "
                                            r"decode, run in that order\); pass stages= to the call declaring the "
                                            r"uses it makes$") as raised:
        managed(**call_kwargs(), callback_on_step_end=encode_again)
    assert raised.value.allowed == ("transformer", "vae")
    assert not any(c.on_device for c in managed.manager.components.values())
    assert torch.equal(managed(**call_kwargs()).images, flux_pipeline()(**call_kwargs()).images)  # still serves
    managed.close()


def test_an_oom_in_the_denoiser_fails_the_request_and_empties_once(empties, monkeypatch):
    pipe = flux_pipeline()
    managed = ManagedPipeline(pipe, {**ENCODERS, "transformer": LayerwiseStrategy(1, BLOCKS)})
    block = pipe.transformer.single_transformer_blocks[1]

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(block, "forward", oom)
    with pytest.raises(RequestFailed):
        managed(**call_kwargs())
    assert empties.count(ReleasePoint.OOM) == 1
    assert not any(c.on_device for c in managed.manager.components.values())


def test_block_lists_are_guessed_with_a_warning_or_refused_clearly():
    pipe = flux_pipeline()
    with pytest.warns(UserWarning, match="guessed the block lists of FluxTransformer2DModel 'transformer-warned': "
                                         "transformer_blocks, single_transformer_blocks"):
        guess_block_lists(pipe.transformer, "transformer-warned")
    with pytest.warns(UserWarning, match="T5EncoderModel 't5': encoder.block;"):
        assert guess_block_lists(pipe.text_encoder_2, "t5") == ("encoder.block",)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        managed = ManagedPipeline(pipe, {"transformer": "layerwise"})
    assert managed.manager.components["transformer"].strategy.layers_attr == BLOCKS
    managed.close()
    with pytest.raises(ValueError, match="no block list found in Linear 'head'.*layers_attr"):
        guess_block_lists(torch.nn.Linear(2, 2), "head")
    with pytest.raises(ValueError, match="denoiser 'unet' is not a module"):
        ManagedPipeline(flux_pipeline(), {}, denoiser="unet")
    with pytest.raises(ValueError, match="prefetch_layers=3 for 'transformer', which streams 3 layers"):
        ManagedPipeline(flux_pipeline(), {"transformer": LayerwiseStrategy(3, BLOCKS)})


def test_importing_the_residency_package_does_not_import_diffusers():
    import subprocess

    code = ("import sys, torchhal.core.residency, torchhal.core.residency.diffusers; "
            "print('diffusers' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def _nbytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())


def streamed_vae():
    return LayerwiseStrategy(1, ("decoder.up_blocks",), buffers="exact", rest="on_call")


def test_non_layer_weights_follow_the_uses_and_an_uncalled_encoder_never_loads(reference_image, empties):
    pipe = flux_pipeline()
    transformer = LayerwiseStrategy(1, BLOCKS, rest="on_call")
    placements = {"text_encoder": Strategy.OFFLOAD, "text_encoder_2": Strategy.OFFLOAD,
                  "transformer": transformer, "vae": streamed_vae()}
    managed = ManagedPipeline(pipe, placements)
    vae = managed.manager.components["vae"].strategy
    assert set(transformer.rest_blocks) == {"time_text_embed", "context_embedder", "x_embedder", "norm_out",
                                            "proj_out"}  # pos_embed has no weights; no weights at the top
    assert set(vae.rest_blocks) == {"encoder", "decoder.conv_in", "decoder.mid_block", "decoder.conv_norm_out",
                                    "decoder.conv_out"}
    loaded_before_last_block: list[set[str]] = []

    def loaded(strategy):
        return {name for name, blocks in strategy.rest_blocks.items() if all(b.on_device for b in blocks)}

    hook = pipe.transformer.single_transformer_blocks[-1].register_forward_pre_hook(
        lambda m, a: loaded_before_last_block.append(loaded(transformer)))
    for _ in range(2):
        assert torch.equal(managed(**call_kwargs()).images, reference_image)
        # released with the component: nothing of either stays on the device between requests
        assert loaded(transformer) == set() and loaded(vae) == set()
    hook.remove()
    # the modules called before the last block were loaded at their call; norm_out and proj_out run after it
    assert loaded_before_last_block[0] == {"time_text_embed", "context_embedder", "x_embedder"}
    assert all(b.copied_bytes == 0 for b in vae.rest_blocks["encoder"])  # decode never calls the encoder
    # counted copies: the transformer's non-layer weights once a request, its layers every step, the
    # VAE's decoder (not its encoder) once, the text encoders whole
    steps = call_kwargs()["num_inference_steps"]
    layers = sum(_nbytes(getattr(pipe.transformer, b)) for b in BLOCKS)
    expected = {"text_encoder": _nbytes(pipe.text_encoder), "text_encoder_2": _nbytes(pipe.text_encoder_2),
                "transformer": steps * layers + _nbytes(pipe.transformer) - layers,
                "vae": _nbytes(pipe.vae.decoder)}
    assert managed.manager.last_request_h2d_bytes == expected
    end = managed.manager.trace.last_request()[-1]
    assert end["kind"] == "request_end" and end["h2d_bytes"] == sum(expected.values())
    managed.close()
    assert torch.equal(pipe(**call_kwargs()).images, reference_image)  # unwrapped: a plain pipeline again


def test_offload_counts_each_component_once_a_request(empties):
    pipe = flux_pipeline()
    managed = ManagedPipeline(pipe, {**ENCODERS, "transformer": Strategy.OFFLOAD})
    for _ in range(2):  # the second request's prefetches are counted in it, not in the first
        managed(**call_kwargs())
        assert managed.manager.last_request_h2d_bytes == {
            name: _nbytes(getattr(pipe, name)) for name in ("text_encoder", "text_encoder_2", "transformer", "vae")}
    managed.close()


def test_a_bare_layerwise_streams_the_denoiser_through_a_ring_and_others_at_their_own_size():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        managed = ManagedPipeline(flux_pipeline(), {"transformer": "layerwise", "vae": "layerwise"})
    transformer, vae = (managed.manager.components[n].strategy for n in ("transformer", "vae"))
    assert (transformer.layers_attr, transformer.buffers, transformer.rest) == (BLOCKS, "ring", "on_call")
    assert (vae.layers_attr, vae.buffers, vae.rest) == (("decoder.up_blocks",), "exact", "on_call")
    managed.close()


PATCHED = ("forward", "encode", "decode", "_hf_hook")
ABSENT = object()


def own_attributes(pipe):
    """What each component instance has of its own under the names a ManagedPipeline patches."""
    return {(name, attribute): module.__dict__.get(attribute, ABSENT)
            for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)
            for attribute in PATCHED}


def weight_storage(pipe):
    return {(name, param_name): p.data_ptr() for name, module in pipe.components.items()
            if isinstance(module, torch.nn.Module) for param_name, p in module.named_parameters()}


def assert_same_attributes(pipe, before):
    now = own_attributes(pipe)
    assert now.keys() == before.keys()
    assert all(now[key] is before[key] for key in now), [key for key in now if now[key] is not before[key]]


def test_a_managed_pipeline_is_not_wrapped_twice_and_close_restores_exactly(reference_image, empties):
    pipe = flux_pipeline()
    # what the user had on the instances: an own decode and another library's hook object
    pipe.vae.decode = type(pipe.vae).decode.__get__(pipe.vae)
    pipe.transformer._hf_hook = object()
    before = own_attributes(pipe)
    first = ManagedPipeline(pipe, {**ENCODERS, "transformer": Strategy.OFFLOAD})
    during = own_attributes(pipe)
    for placements in ({}, {"transformer": Strategy.OFFLOAD}):
        with pytest.raises(ValueError, match=r"FluxPipeline components \['vae', 'text_encoder', 'text_encoder_2', "
                                             r"'transformer'\] are already managed by another ManagedPipeline; "
                                             r"close\(\) that one first"):
            ManagedPipeline(pipe, placements)
    assert_same_attributes(pipe, during)  # the refusal touched nothing: the first still serves
    assert torch.equal(first(**call_kwargs()).images, reference_image)
    first.close()
    assert_same_attributes(pipe, before)
    assert first.close() is None  # closing twice is fine and changes nothing
    assert_same_attributes(pipe, before)
    second = ManagedPipeline(pipe, {"vae": Strategy.OFFLOAD})  # closed: the pipeline can be managed again
    assert torch.equal(second(**call_kwargs()).images, reference_image)
    second.close()
    assert_same_attributes(pipe, before)
    assert torch.equal(pipe(**call_kwargs()).images, reference_image)


BAD_ARGUMENTS = [
    ((None, {}), TypeError, "pipeline must be a diffusers pipeline .*got NoneType"),
    (("pipe", None), TypeError, r"placements must be a dict of component name -> strategy.*got None; pass \{\}"),
    (("pipe", ["transformer"]), TypeError, r"placements must be a dict .*got \['transformer'\]"),
    # the VAE offloaded: a denoiser checked after the weights moved would leave them moved
    (("pipe", {"vae": "offload"}, "vae"), ValueError,
     r"denoiser 'vae' \(AutoencoderKL\) takes no timestep.*one of \['transformer'\]"),
    (("pipe", {"vae": "offload"}, "text_encoder_2"), ValueError,
     r"denoiser 'text_encoder_2' \(T5EncoderModel\) takes no timestep"),
    (("pipe", {"vae": "offload"}, "scheduler"), ValueError,
     r"denoiser 'scheduler' is not a module.*one of \['transformer'\]"),
    (("pipe", {}, 3), ValueError, r"denoiser 3 is not a module"),
    (("pipe", {"tokenizer": "offload"}), ValueError, r"placements name unknown components \['tokenizer'\]"),
    (("pipe", {"vae": "streamed"}), ValueError, r"component 'vae': unknown strategy 'streamed'"),
]


def test_bad_arguments_are_refused_at_construction_naming_them(empties):
    pipe = flux_pipeline()
    before = own_attributes(pipe)
    weights = weight_storage(pipe)
    for args, error, message in BAD_ARGUMENTS:
        pipeline, placements, *denoiser = args
        with pytest.raises(error, match=message):
            ManagedPipeline(pipe if pipeline == "pipe" else pipeline, placements,
                            **({"denoiser": denoiser[0]} if denoiser else {}))
    for flag in ("prefetch", "record_trace", "empty_on_release"):
        with pytest.raises(TypeError, match=f"{flag} = 'yes' must be True or False"):
            ManagedPipeline(pipe, {"vae": "offload"}, **{flag: "yes"})
    assert_same_attributes(pipe, before)  # nothing was wrapped or attached
    assert weight_storage(pipe) == weights  # and no weight was moved into a host buffer
    managed = ManagedPipeline(pipe, {"vae": "offload"}, denoiser="transformer")  # and it can still be managed
    managed.close()
