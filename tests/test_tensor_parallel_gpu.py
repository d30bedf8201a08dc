"""Tensor parallel on real accelerators (markers gpu and multi_gpu; skipped without them).

One device: a group of one rank on the platform's own backend (NCCL on CUDA) is the
single-device engine: the same tokens as no group, with captured decode graphs.
Two devices: TP=2 through the launcher, one rank per device: fp32 tokens equal TP=1's, and in
bf16 the captured decode graphs (the collectives inside the graph, where the platform declares
them capturable) give the eager path's tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import torchhal
from tests.hf_models import PROMPTS, save_hf_model

platform = torchhal.current_platform()
on_accelerator = platform.device_type != "cpu"
NEW_TOKENS = 24


def engine_config(dtype: torch.dtype, graphs: bool) -> Any:
    from torchhal.core.engine import DecodeGraphConfig, EngineConfig

    decode = DecodeGraphConfig(batch_buckets=(1, 2, 4), context_buckets=(64,)) if graphs else None
    return EngineConfig(dtype=dtype, max_kv_slots=4096, decode_graphs=decode)


def rank_tokens(path: str, dtype_name: str, graphs: bool) -> tuple[list[list[int]], int]:
    """One launched rank: join the group (torchrun's variables, set by the launcher), load this
    rank's shard, generate. Returns the tokens and the decode graph replays."""
    from torchhal.core.engine import GenerationEngine
    from torchhal.distributed import init_group

    group = init_group()
    try:
        engine = GenerationEngine.from_checkpoint(path, engine_config(getattr(torch, dtype_name), graphs), group=group)
        tokens = [list(r.output) for r in engine.generate(PROMPTS, NEW_TOKENS)]
        replays = engine.decode_runner.steps if engine.decode_runner is not None else 0
        return tokens, replays
    finally:
        group.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("tp_gpu")
    # 4 query heads / 2 KV heads: TP=2 splits both.
    save_hf_model("llama3", directory, seed=3)
    return directory


@pytest.mark.gpu
@pytest.mark.skipif(not on_accelerator, reason="needs an accelerator (none here)")
def test_a_group_of_one_rank_is_the_single_device_engine(checkpoint: Path) -> None:
    from torchhal.core.engine import GenerationEngine
    from torchhal.distributed import init_group

    config = engine_config(torch.bfloat16, graphs=True)
    alone = GenerationEngine.from_checkpoint(checkpoint, config)
    expected = [list(r.output) for r in alone.generate(PROMPTS, NEW_TOKENS)]
    del alone
    group = init_group(rank=0, world_size=1, local_rank=0)
    try:
        assert group.comm.device == platform.device(0)
        engine = GenerationEngine.from_checkpoint(checkpoint, config, group=group)
        assert engine.group is None, "a group of one rank is no group: today's engine"
        assert [list(r.output) for r in engine.generate(PROMPTS, NEW_TOKENS)] == expected
        assert engine.decode_runner is not None and engine.decode_runner.steps > 0
    finally:
        group.close()


@pytest.mark.multi_gpu
@pytest.mark.skipif(not on_accelerator or platform.device_count() < 2, reason="needs two accelerator devices")
def test_tp2_tokens_across_devices(checkpoint: Path) -> None:
    from torchhal.distributed import launch

    single, _ = launch(rank_tokens, 1, (str(checkpoint), "float32", False), timeout=300)[0]
    fp32 = launch(rank_tokens, 2, (str(checkpoint), "float32", False), timeout=300)
    assert all(tokens == single for tokens, _ in fp32), "TP=2 fp32 tokens must equal TP=1's"
    eager = launch(rank_tokens, 2, (str(checkpoint), "bfloat16", False), timeout=300)
    graphs = launch(rank_tokens, 2, (str(checkpoint), "bfloat16", True), timeout=300)
    assert all(replays > 0 for _, replays in graphs), "decode graphs were not replayed under TP=2"
    assert eager[0][0] == eager[1][0] == graphs[0][0] == graphs[1][0]
