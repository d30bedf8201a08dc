"""Tiny Stable Diffusion pipelines (random weights, built from configs) for the residency tests."""

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from diffusers_flux import flux_pipeline  # noqa: E402


def sd_pipeline(scheduler):
    """A StableDiffusionPipeline on the tiny Flux pipeline's CLIP encoder, tokenizer and VAE, with a
    tiny UNet: the pipeline family whose schedulers (Heun, PNDM) and classifier-free guidance call
    the denoiser and the text encoder otherwise than once per step and once per call."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    flux = flux_pipeline()
    torch.manual_seed(1)
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, norm_num_groups=4, attention_head_dim=2).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # steps_offset of a scheduler made from its defaults
        pipe = StableDiffusionPipeline(vae=flux.vae, text_encoder=flux.text_encoder, tokenizer=flux.tokenizer,
                                       unet=unet, scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def with_safety_checker(pipe):
    """The pipeline with a tiny CLIP safety checker, which diffusers runs after the VAE and leaves
    out of model_cpu_offload_seq."""
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor

    torch.manual_seed(2)
    tower = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = CLIPConfig(text_config=tower, vision_config={**tower, "image_size": 32, "patch_size": 8},
                        projection_dim=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the image processor's backend note
        pipe.register_modules(safety_checker=StableDiffusionSafetyChecker(config).eval(),
                              feature_extractor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32))
    return pipe


def sd_kwargs(steps=3, guidance=7.5):
    # guidance above 1: the text encoder runs a second time, for the (empty) negative prompt
    return {"prompt": "a photo of an astronaut riding a horse", "num_inference_steps": steps, "height": 32,
            "width": 32, "guidance_scale": guidance, "output_type": "pt", "generator": torch.Generator().manual_seed(0)}


SD_OFFLOADED = {"text_encoder": "offload", "unet": "offload", "vae": "offload"}


def sd_controlnet_pipeline(scheduler):
    """sd_pipeline with a ControlNet made from its UNet: its `image` is a control image the VAE never encodes."""
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

    base = sd_pipeline(scheduler)
    torch.manual_seed(9)
    controlnet = ControlNetModel.from_unet(base.unet, conditioning_embedding_out_channels=(4, 8)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no safety checker
        pipe = StableDiffusionControlNetPipeline(**{k: v for k, v in base.components.items() if k != "image_encoder"},
                                                 controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def flux_control_pipeline():
    """The tiny Flux pipeline as a FluxControlPipeline: the VAE encodes its control image before the transformer."""
    from diffusers import FluxControlPipeline, FluxTransformer2DModel
    from diffusers_flux import _rope_axes

    base = flux_pipeline()
    torch.manual_seed(3)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=32, out_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=_rope_axes(16)).eval()
    parts = ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    pipe = FluxControlPipeline(transformer=transformer, **{k: v for k, v in base.components.items() if k in parts})
    pipe.set_progress_bar_config(disable=True)
    return pipe
