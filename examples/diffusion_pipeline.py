"""A small diffusion-style pipeline on the residency manager (sizes configurable).

    python examples/diffusion_pipeline.py --hidden 256 --layers 4 --steps 4

Text encoder -> DiT-like transformer denoised over several steps -> VAE-like
decoder, each a real nn.Module, placed by strategy (resident, offload, layerwise).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from torchhal.core.residency import ComponentUse, LayerwiseStrategy, PlacementSpec, ResidencyManager, Stage, Strategy


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.proj_in = nn.Linear(hidden, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for layer in self.layers:
            x = layer(x)
        return x


def make_components(hidden: int = 256, layers: int = 4, dtype: torch.dtype = torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    return {
        "text_encoder": Stack(hidden, max(1, layers // 2)).to(dtype),
        "transformer": Stack(hidden, layers).to(dtype),
        "vae": Stack(hidden, max(1, layers // 2)).to(dtype),
    }


def stages(denoise_steps: int, encoder_memory_intensive: bool = True) -> list[Stage]:
    # The text encoder is as large as the VAE: its release leaves a block big enough to
    # matter, so it is a release point too (declared otherwise, activations get carved
    # from its cached block and the VAE needs a fresh one).
    return [
        Stage("encode", (ComponentUse("text_encoder", memory_intensive=encoder_memory_intensive,
                                      preferred_ready_after_request=True),)),
        Stage("denoise", tuple(ComponentUse("transformer", phase=f"step{i}", memory_intensive=True,
                                            keep_ready_after_warmup=True) for i in range(denoise_steps))),
        Stage("decode", (ComponentUse("vae", memory_intensive=True),)),
    ]


def run_request(
    manager: ResidencyManager,
    tokens: torch.Tensor,
    denoise_steps: int,
    warmup: bool = False,
    encoder_memory_intensive: bool = True,
) -> torch.Tensor:
    with manager.request(stages(denoise_steps, encoder_memory_intensive), warmup=warmup), torch.no_grad():
        with manager.trace.stage("encode"), manager.use_component("text_encoder") as encoder:
            context = encoder(tokens)
        latent = torch.zeros_like(context)
        with manager.trace.stage("denoise"):
            for step in range(denoise_steps):
                with manager.use_component("transformer", f"step{step}") as transformer:
                    latent = latent - 0.1 * transformer(latent + context)
        with manager.trace.stage("decode"), manager.use_component("vae") as vae:
            return vae(latent)


def default_placements(transformer: str = "layerwise", prefetch_layers: int = 1) -> dict[str, PlacementSpec]:
    streamed: PlacementSpec = (LayerwiseStrategy(prefetch_layers) if Strategy(transformer) is Strategy.LAYERWISE
                               else Strategy(transformer))
    return {"text_encoder": Strategy.OFFLOAD, "transformer": streamed, "vae": Strategy.OFFLOAD}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--transformer", choices=[s.value for s in Strategy], default="layerwise")
    args = parser.parse_args()
    manager = ResidencyManager(make_components(args.hidden, args.layers), default_placements(args.transformer))
    tokens = torch.randn(16, args.hidden, device=manager.device)
    out = run_request(manager, tokens, args.steps)
    empties = manager.trace.of_kind("empty_cache")
    print(f"output {tuple(out.shape)}; {len(manager.trace.events)} trace events; empties: "
          + ", ".join(f"{e['where']}" for e in empties))


if __name__ == "__main__":
    main()
