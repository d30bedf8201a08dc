"""Tensor-parallel sharding of the Llama-family decoder: which slice of each weight a rank holds.

Megatron's layout, the one vLLM and SGLang use:
- attention: query heads split evenly across ranks; KV heads split too, or, when there are
  fewer KV heads than ranks, each KV head replicated on `world_size / num_kv_heads` ranks
  (the rank's query heads read exactly the KV head they share in the full model);
- q/k/v and gate/up projections column-parallel (a rank's rows of the weight), o and down
  projections row-parallel (a rank's columns), followed by one all-reduce each;
- embedding and LM head vocabulary-parallel: a rank holds `vocab_per_rank` rows, the last
  rank's tail padded with zero rows, so every shard has one shape (collectives need it).

`TensorParallelPlan` is the arithmetic; it refuses a model that cannot be split before
anything starts, naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from torchhal.core.model.config import ModelConfig
from torchhal.values import as_index, ceil_div, short_repr


@dataclass(frozen=True)
class TensorParallelPlan:
    """How `config` splits over `world_size` ranks; one rank's slices via the `*_rows` methods."""

    config: ModelConfig
    world_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "world_size", check_tensor_parallel(self.config, self.world_size))

    @property
    def heads_per_rank(self) -> int:
        return self.config.num_heads // self.world_size

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.config.num_kv_heads // self.world_size)

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head (1: KV heads are split, not replicated)."""
        return max(1, self.world_size // self.config.num_kv_heads)

    @property
    def intermediate_per_rank(self) -> int:
        return self.config.intermediate_size // self.world_size

    @property
    def vocab_per_rank(self) -> int:
        return ceil_div(self.config.vocab_size, self.world_size)  # ceil: the last rank's tail is padding

    # A rank's slices (a rank of this plan: the loader and the engine's group give it).
    def head_range(self, rank: int) -> range:
        """The query heads `rank` computes."""
        return range(rank * self.heads_per_rank, (rank + 1) * self.heads_per_rank)

    def kv_head_range(self, rank: int) -> range:
        """The KV heads `rank` holds (one replicated head when KV heads are fewer than ranks)."""
        first = rank // self.kv_replicas * self.kv_heads_per_rank
        return range(first, first + self.kv_heads_per_rank)

    def intermediate_range(self, rank: int) -> range:
        return range(rank * self.intermediate_per_rank, (rank + 1) * self.intermediate_per_rank)

    def vocab_range(self, rank: int) -> range:
        """The vocabulary rows `rank` holds that exist (the shard's padding rows excluded)."""
        per, vocab = self.vocab_per_rank, self.config.vocab_size
        return range(min(rank * per, vocab), min((rank + 1) * per, vocab))

    def rank_config(self) -> ModelConfig:
        """The shapes one rank's decoder has: its heads, KV heads, MLP width and vocabulary shard."""
        return replace(
            self.config, num_heads=self.heads_per_rank, num_kv_heads=self.kv_heads_per_rank,
            intermediate_size=self.intermediate_per_rank, vocab_size=self.vocab_per_rank,
        )


def check_tensor_parallel(config: ModelConfig, world_size: object) -> int:
    """`world_size` as a plain int (any integer but a bool); a split `TensorParallelPlan` cannot
    make is refused (ValueError naming the sizes and the fix)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"tensor-parallel plan: config is a {type(config).__name__}, not a ModelConfig; pass the "
                        "model's config (model.config, or config_from_hf(config.json's dict) from "
                        "torchhal.core.model.checkpoint)")
    size = as_index(world_size)
    if size is None or size < 1:
        raise ValueError(f"tensor-parallel size {short_repr(world_size)} must be a positive int (it is a "
                         f"{type(world_size).__name__}; pass an integer such as 2)")
    problems = _split_problems(config, size)
    if problems:
        sizes = [n for n in range(1, config.num_heads + 1) if not _split_problems(config, n)]
        raise ValueError(
            f"cannot split this model over {size} ranks: {'; '.join(problems)}; "
            f"choose a tensor-parallel size from {sizes}"
        )
    return size


def _split_problems(config: ModelConfig, world_size: int) -> list[str]:
    """Why `config` cannot be split over `world_size` ranks (empty: it can)."""
    problems = []
    heads, kv = config.num_heads, config.num_kv_heads
    if heads % world_size:
        problems.append(f"num_attention_heads = {heads} is not divisible by {world_size}")
    if kv >= world_size and kv % world_size:
        problems.append(f"num_key_value_heads = {kv} is not divisible by {world_size}")
    if kv < world_size and world_size % kv:
        problems.append(f"{world_size} ranks cannot share num_key_value_heads = {kv} evenly "
                        f"(replication needs {world_size} to be a multiple of {kv})")
    if config.intermediate_size % world_size:
        problems.append(f"intermediate_size = {config.intermediate_size} is not divisible by {world_size}")
    return problems


@dataclass(frozen=True)
class ShardSlice:
    """The part of a full HF tensor one rank holds: indices [start, stop) of the `full` ones
    along `dim`, followed by zero padding up to `size` (only the vocabulary's last shard has any)."""

    dim: int
    start: int
    stop: int
    size: int
    full: int

    @property
    def count(self) -> int:
        return self.stop - self.start


# HF parameter name suffix -> (dim, which range): column-parallel weights are sliced by rows
# (dim 0), row-parallel ones by columns (dim 1); anything not listed is replicated.
_SLICED: dict[str, tuple[int, str]] = {
    "self_attn.q_proj.weight": (0, "heads"), "self_attn.q_proj.bias": (0, "heads"),
    "self_attn.k_proj.weight": (0, "kv_heads"), "self_attn.k_proj.bias": (0, "kv_heads"),
    "self_attn.v_proj.weight": (0, "kv_heads"), "self_attn.v_proj.bias": (0, "kv_heads"),
    "self_attn.o_proj.weight": (1, "heads"),
    "mlp.gate_proj.weight": (0, "intermediate"), "mlp.up_proj.weight": (0, "intermediate"),
    "mlp.down_proj.weight": (1, "intermediate"),
    "model.embed_tokens.weight": (0, "vocab"), "lm_head.weight": (0, "vocab"),
}


@dataclass(frozen=True)
class RankShard:
    """One rank's share of a model: `plan` and this `rank`. Maps every HF parameter name to the
    slice of the full tensor the rank holds (`slice_of`); the loader, the decoder and weight
    updates all go through it, so they cannot disagree on the layout."""

    plan: TensorParallelPlan
    rank: int

    def __post_init__(self) -> None:
        rank = as_index(self.rank)
        assert isinstance(self.plan, TensorParallelPlan), f"the plan is {self.plan!r}"
        assert rank is not None and 0 <= rank < self.plan.world_size, f"rank {self.rank!r} of {self.plan.world_size}"
        object.__setattr__(self, "rank", rank)

    @classmethod
    def of(cls, tensor_parallel: RankShard | tuple[TensorParallelPlan, int]) -> RankShard:
        """A `RankShard` as given, or made from `(plan, rank)`: the one check of the decoder's
        `tensor_parallel` argument."""
        if isinstance(tensor_parallel, RankShard):
            return tensor_parallel
        if not (isinstance(tensor_parallel, tuple) and len(tensor_parallel) == 2):
            raise TypeError(f"tensor_parallel = {short_repr(tensor_parallel)}; pass (TensorParallelPlan(config, "
                            "world_size), rank) or a RankShard")
        if not isinstance(tensor_parallel[0], TensorParallelPlan):
            raise TypeError(f"tensor_parallel: the plan is {short_repr(tensor_parallel[0])}; pass (TensorParallelPlan("
                            "config, world_size), rank) or a RankShard ((world_size, rank) is load_checkpoint's form)")
        return cls(*tensor_parallel)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def slice_of(self, name: str) -> ShardSlice | None:
        """The slice of HF tensor `name` this rank holds; None when every rank holds all of it."""
        # A layer's tensors are named model.layers.<N>.<suffix>: the rule is the suffix's.
        rule = _SLICED.get(name.split(".", 3)[-1] if name.startswith("model.layers.") else name)
        if rule is None:
            return None
        dim, kind = rule
        plan, config, d = self.plan, self.plan.config, self.plan.config.head_dim
        if kind == "heads":
            heads = plan.head_range(self.rank)
            return ShardSlice(dim, heads.start * d, heads.stop * d, len(heads) * d, config.num_heads * d)
        if kind == "kv_heads":
            kv = plan.kv_head_range(self.rank)
            return ShardSlice(dim, kv.start * d, kv.stop * d, len(kv) * d, config.num_kv_heads * d)
        if kind == "intermediate":
            part = plan.intermediate_range(self.rank)
            return ShardSlice(dim, part.start, part.stop, len(part), config.intermediate_size)
        vocab = plan.vocab_range(self.rank)
        return ShardSlice(dim, vocab.start, vocab.stop, plan.vocab_per_rank, config.vocab_size)

    def full_shape(self, name: str, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The whole HF tensor's shape, of which this rank holds a shard of `local_shape`."""
        part = self.slice_of(name)
        if part is None:
            return local_shape
        return local_shape[: part.dim] + (part.full,) + local_shape[part.dim + 1 :]

    def take(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full tensor `full` (a view where no padding is needed)."""
        part = self.slice_of(name)
        if part is None:
            return full
        piece = full.narrow(part.dim, part.start, part.count)
        if part.size == part.count:
            return piece
        pad = list(piece.shape)
        pad[part.dim] = part.size - part.count
        return torch.cat((piece, piece.new_zeros(pad)), part.dim)
