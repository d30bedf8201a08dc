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

from dataclasses import dataclass

from torchhal.core.model.config import ModelConfig


@dataclass(frozen=True)
class TensorParallelPlan:
    """How `config` splits over `world_size` ranks; one rank's slices via the `*_rows` methods."""

    config: ModelConfig
    world_size: int

    def __post_init__(self) -> None:
        check_tensor_parallel(self.config, self.world_size)

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
        return -(-self.config.vocab_size // self.world_size)  # ceil: the last rank's tail is padding

    def head_range(self, rank: int) -> range:
        """The query heads `rank` computes."""
        per = self.heads_per_rank
        return range(rank * per, (rank + 1) * per)

    def kv_head_range(self, rank: int) -> range:
        """The KV heads `rank` holds (one replicated head when KV heads are fewer than ranks)."""
        first = rank // self.kv_replicas * self.kv_heads_per_rank
        return range(first, first + self.kv_heads_per_rank)

    def intermediate_range(self, rank: int) -> range:
        per = self.intermediate_per_rank
        return range(rank * per, (rank + 1) * per)

    def vocab_range(self, rank: int) -> range:
        """The vocabulary rows `rank` holds that exist (the shard's padding rows excluded)."""
        per = self.vocab_per_rank
        return range(min(rank * per, self.config.vocab_size), min((rank + 1) * per, self.config.vocab_size))

    def rank_config(self) -> ModelConfig:
        """The shapes one rank's decoder has: its heads, KV heads, MLP width and vocabulary shard."""
        from dataclasses import replace

        return replace(
            self.config, num_heads=self.heads_per_rank, num_kv_heads=self.kv_heads_per_rank,
            intermediate_size=self.intermediate_per_rank, vocab_size=self.vocab_per_rank,
            head_dim=self.config.head_dim,
        )


def check_tensor_parallel(config: ModelConfig, world_size: object) -> None:
    """Refuse a split `TensorParallelPlan` cannot make (ValueError naming the sizes and the fix)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor-parallel size {world_size!r} must be a positive integer")
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
    if problems:
        sizes = [n for n in range(1, heads + 1) if _splits(config, n)]
        raise ValueError(
            f"cannot split this model over {world_size} ranks: {'; '.join(problems)}; "
            f"choose a tensor-parallel size from {sizes}"
        )


def _splits(config: ModelConfig, world_size: int) -> bool:
    kv = config.num_kv_heads
    return (config.num_heads % world_size == 0 and config.intermediate_size % world_size == 0
            and (kv % world_size == 0 if kv >= world_size else world_size % kv == 0))
