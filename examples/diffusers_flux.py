"""A real diffusers FluxPipeline (random weights, no download) under the residency manager.

Needs diffusers and transformers, which torchhal does not install by itself:

    pip install -e '.[diffusers]'
    python examples/diffusers_flux.py --transformer layerwise

Builds the pipeline from configs (CLIP and T5 text encoders from transformers, a Flux
transformer, an AutoencoderKL, word-level tokenizers built in memory), hands its
components to `ManagedPipeline` and runs the pipeline's own `__call__`.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

WORDS = "a photo of an astronaut riding horse on the moon cat dog red blue sky".split()


@dataclass(frozen=True)
class FluxSize:
    """Sizes of a random Flux pipeline; `tiny` runs in well under a second on a CPU."""

    hidden_heads: int = 2  # transformer: attention heads x head dim = hidden size
    head_dim: int = 16
    double_layers: int = 1
    single_layers: int = 2
    text_hidden: int = 32  # CLIP and T5 width (T5 output is the transformer's joint attention dim)
    text_layers: int = 2
    vae_channels: tuple[int, ...] = (8, 16)
    clip_tokens: int = 77
    t5_tokens: int = 16
    latent_channels: int = 4


TINY = FluxSize()
#: ~2.1 B parameters (4.3 GB in bf16) at Flux's hidden size 3072: 4 double-stream and 8 single-stream blocks.
BENCH = FluxSize(hidden_heads=24, head_dim=128, double_layers=4, single_layers=8, text_hidden=1024,
                 text_layers=6, vae_channels=(128, 256, 512, 512), clip_tokens=77, t5_tokens=256, latent_channels=16)


def _tokenizer(max_length: int):  # noqa: ANN202 (transformers is optional)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                                   eos_token="[EOS]", model_max_length=max_length)


def flux_pipeline(size: FluxSize = TINY, dtype: torch.dtype = torch.float32, seed: int = 0):  # noqa: ANN201
    """A FluxPipeline with random weights on the host, built from configs only."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    vocab = len(WORDS) + 3
    heads = max(2, size.text_hidden // 64)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab, hidden_size=size.text_hidden, intermediate_size=4 * size.text_hidden,
        num_hidden_layers=size.text_layers, num_attention_heads=heads, max_position_embeddings=size.clip_tokens,
        bos_token_id=0, eos_token_id=2, pad_token_id=0, projection_dim=size.text_hidden))
    t5 = T5EncoderModel(T5Config(
        vocab_size=vocab, d_model=size.text_hidden, d_kv=size.text_hidden // heads, d_ff=4 * size.text_hidden,
        num_layers=size.text_layers, num_heads=heads, pad_token_id=0, eos_token_id=2))
    latent_channels = size.latent_channels
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=size.double_layers,
        num_single_layers=size.single_layers, attention_head_dim=size.head_dim,
        num_attention_heads=size.hidden_heads, joint_attention_dim=size.text_hidden,
        pooled_projection_dim=size.text_hidden, guidance_embeds=True,
        axes_dims_rope=_rope_axes(size.head_dim))
    blocks = len(size.vae_channels)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * blocks,
        up_block_types=["UpDecoderBlock2D"] * blocks, block_out_channels=list(size.vae_channels),
        layers_per_block=1, latent_channels=latent_channels, norm_num_groups=min(32, size.vae_channels[0] // 2),
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=0.3611)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=clip,
                        tokenizer=_tokenizer(size.clip_tokens), text_encoder_2=t5,
                        tokenizer_2=_tokenizer(size.t5_tokens), transformer=transformer)
    modules: tuple[Any, ...] = (clip, t5, transformer, vae)  # their stubs type .to and .eval apart
    for module in modules:
        if dtype != torch.float32:
            module.to(dtype)
        module.eval()
    pipe.set_progress_bar_config(disable=True)  # type: ignore[attr-defined]  # DiffusionPipeline's, untyped
    return pipe


def _rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Flux splits a head's rotary dims over (index, height, width): 16/56/56 of 128."""
    side = (head_dim * 7 // 16) // 2 * 2
    return head_dim - 2 * side, side, side


def call_kwargs(size: FluxSize = TINY, steps: int = 2, resolution: int = 32, seed: int = 0) -> dict:
    """One text-to-image request; the same arguments give the same image."""
    return {"prompt": "a photo of an astronaut riding a horse on the moon", "num_inference_steps": steps,
            "height": resolution, "width": resolution, "guidance_scale": 3.5, "max_sequence_length": size.t5_tokens,
            "output_type": "pt", "generator": torch.Generator().manual_seed(seed)}


def main() -> None:
    from torchhal.core.residency.diffusers import ManagedPipeline

    parser = argparse.ArgumentParser()
    parser.add_argument("--transformer", choices=["resident", "offload", "layerwise"], default="layerwise")
    args = parser.parse_args()
    missing = [name for name in ("diffusers", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"this example needs {' and '.join(missing)}: pip install -e '.[diffusers]'")
    pipe = flux_pipeline()
    managed = ManagedPipeline(pipe, {"text_encoder": "offload", "text_encoder_2": "offload",
                                     "transformer": args.transformer, "vae": "offload"})
    image = managed(**call_kwargs()).images
    empties = managed.manager.trace.of_kind("empty_cache")
    print(f"image {tuple(image.shape)}; empties: {', '.join(e['where'] for e in empties)}")
    managed.close()


if __name__ == "__main__":
    main()
