"""Tensor parallel under hostile input: arguments of the wrong kind are refused where they are
given, and ranks that disagree (a config, a weight batch one rank refuses) refuse together
instead of computing different models."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy
import pytest
import torch

from torchhal.core.engine import EngineConfig, GenerationEngine
from torchhal.core.model import LlamaDecoder, ModelConfig
from torchhal.core.model.checkpoint import load_checkpoint
from torchhal.core.model.parallel import RankShard, TensorParallelPlan

from .hf_models import PROMPTS
from .test_tensor_parallel import NEW_TOKENS, run_group, save

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                     intermediate_size=48)


@pytest.mark.parametrize("tensor_parallel, message", [
    ((2, 0), r"the plan is 2; pass \(TensorParallelPlan\(config, world_size\), rank\) or a RankShard \(\(world_size, "
             r"rank\) is load_checkpoint's form\)"),
    ((TensorParallelPlan(CONFIG, 2),), r"tensor_parallel = \(TensorParallelPlan"),
    (TensorParallelPlan(CONFIG, 2), r"tensor_parallel = TensorParallelPlan"),
    ({"plan": 1}, r"tensor_parallel = \{'plan': 1\}"),
])
def test_a_tensor_parallel_argument_of_the_wrong_form_names_the_forms(tensor_parallel, message):
    with pytest.raises(TypeError, match=message):
        LlamaDecoder(CONFIG, tensor_parallel=tensor_parallel)


@pytest.mark.parametrize("config, world_size, error, message", [
    (None, 2, TypeError, "config is a NoneType, not a ModelConfig"),
    (CONFIG, numpy.float64(2), ValueError, r"tensor-parallel size np.float64\(2.0\) must be a positive int \(it is a "
                                           r"float64"),
    (CONFIG, True, ValueError, r"tensor-parallel size True must be a positive int \(it is a bool"),
    (CONFIG, 0, ValueError, r"tensor-parallel size 0 must be a positive int"),
])
def test_a_plan_of_the_wrong_kind_is_refused_naming_it(config, world_size, error, message):
    with pytest.raises(error, match=message):
        TensorParallelPlan(config, world_size)


def test_an_engine_refuses_a_shard_without_its_group_before_touching_it():
    shard = LlamaDecoder(CONFIG, tensor_parallel=(TensorParallelPlan(CONFIG, 2), 1))
    before = {name: param.clone() for name, param in shard.named_parameters()}
    with pytest.raises(ValueError, match=r"rank 1 of a 2-way tensor-parallel shard, but the engine's group has 1 "
                                         r"rank\(s\); pass group=init_group\(world_size=2"):
        GenerationEngine(EngineConfig(dtype=torch.bfloat16), model=shard)
    assert all(param.dtype == torch.float32 for param in shard.parameters()), "the refused model was cast"
    assert shard.kv is None
    assert all(torch.equal(before[name], param) for name, param in shard.named_parameters() if param.isfinite().all())


def test_a_checkpoint_shard_without_its_group_is_refused(tmp_path: Path):
    path = save("gqa", tmp_path / "model")
    shard, _ = load_checkpoint(path, tensor_parallel=(2, 0))
    with pytest.raises(ValueError, match="rank 0 of a 2-way tensor-parallel shard"):
        GenerationEngine(EngineConfig(), model=shard)


@pytest.mark.parametrize("group", ["not a group", 42])
def test_a_group_of_the_wrong_type_is_refused_before_any_weight_is_read(tmp_path: Path, monkeypatch, group):
    from torchhal.core.model import checkpoint

    path = save("gqa", tmp_path / "model")
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(TypeError, match=f"group is a {type(group).__name__}; pass the DeviceGroup from "
                                        r"torchhal.distributed.init_group"):
        GenerationEngine.from_checkpoint(path, group=group)
    with pytest.raises(TypeError, match=f"group is a {type(group).__name__}"):
        GenerationEngine(EngineConfig(), group=group)


def test_ranks_that_disagree_refuse_together(tmp_path: Path) -> None:
    """TP=2 (gqa: intermediate 96, so rank 1 holds down_proj's columns 48..95): a NaN in
    column 95 is in rank 1's slice only; every rank must refuse the batch and keep its
    tokens. Then the final norm (held whole) given other values on rank 1, and generate /
    add_request called with other arguments on rank 1: refused on every rank. Then configs
    that differ (max_kv_slots), then a closed group: refused before a weight is read."""
    path = save("gqa", tmp_path / "model")
    prompts = PROMPTS[:2]
    job = dict(kind="disagreement", name="disagreement", path=str(path), prompts=prompts, new_tokens=NEW_TOKENS,
               weight="model.layers.0.mlp.down_proj.weight", nan_at=[0, 95])
    ranks = run_group(2, [job], tmp_path, timeout_s=8.0)
    for rank, results in enumerate(ranks):
        out = results["disagreement"]
        expected = "holds NaN" if rank == 1 else r"rank(s) [1] of the group refused it"
        assert expected in out["update"], f"rank {rank}: {out['update']}"
        assert out["version"] == 0
        assert out["after"] == out["before"], f"rank {rank}: the refused update changed the model"
        assert "rank(s) [1] of the group were given other values than rank 0 for the weights every rank holds " \
               "whole (model.norm.weight)" in out["replicated"], f"rank {rank}: {out['replicated']}"
        assert out["replicated_version"] == 0
        for call in ("generate", "add_request"):
            assert f"{call}() was called with other arguments on rank(s) [1] than on rank 0" in out[call], out[call]
        assert out["pending_after_calls"] is None, out["pending_after_calls"]
        assert out["after_calls"] == out["before"], f"rank {rank}: a refused call changed what the ranks serve"
        assert "EngineConfig differs between the group's ranks in max_kv_slots (this rank: " \
               f"{256 if rank == 0 else 512})" in out["config"], out["config"]
        assert out["closed"].startswith("CollectiveError") and "closed" in out["closed"], out["closed"]
        assert out["reads_after_close"] == 0, f"rank {rank}: a closed group read weights before refusing"


def test_a_rank_that_cannot_build_its_engine_alone_takes_its_peers_with_it(tmp_path: Path) -> None:
    """Rank 1's checkpoint directory missing, then its shard failing to load: rank 1 raises its
    own error and rank 0 a ValueError naming rank 1, at once (before, rank 0 waited in its next
    collective until the group's timeout, then failed there); the group still serves."""
    path = save("gqa", tmp_path / "model")
    job = dict(kind="lonely_refusal", name="lonely", path=str(path), prompts=PROMPTS[:2], new_tokens=NEW_TOKENS)
    ranks = run_group(2, [job], tmp_path, timeout_s=30.0)
    zero, one = ranks[0]["lonely"], ranks[1]["lonely"]
    assert one["missing"].startswith("CheckpointError") and "-missing" in one["missing"], one["missing"]
    assert zero["missing"].startswith("ValueError: rank(s) [1] of the group refused their engine arguments"), \
        zero["missing"]
    assert one["load"] == "CheckpointError: a shard damaged on this host", one["load"]
    assert zero["load"].startswith("ValueError: rank(s) [1] of the group could not load the checkpoint"), zero["load"]
    assert zero["tokens"] == one["tokens"] and all(len(t) == NEW_TOKENS for t in zero["tokens"])


class PeerHost:
    """The host communicator of a 2-rank group whose other rank built its engine with `peer`."""

    world_size = 2

    def __init__(self, peer: EngineConfig, peer_refused: bool = False) -> None:
        self.peer, self.peer_refused = peer, peer_refused

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        from torchhal.core.engine.ranks import config_digests

        flag = torch.tensor([[int(self.peer_refused)]], dtype=torch.int64)  # the peer's own problem, if any
        return torch.cat([tensor, torch.cat([config_digests(self.peer), flag], dim=1)], dim)


class Backend:
    """A compile backend object: its repr holds its address, which differs between processes."""

    def __call__(self, graph, inputs):  # pragma: no cover - never compiled here
        return graph


def agree(mine: EngineConfig, peer: EngineConfig) -> None:
    from types import SimpleNamespace

    from torchhal.core.engine.ranks import agree_on_config

    agree_on_config(mine, SimpleNamespace(world_size=2, host=PeerHost(peer)))  # type: ignore[arg-type]


@pytest.mark.parametrize("mine, peer", [
    (EngineConfig(compile_layers=Backend()), EngineConfig(compile_layers=Backend())),
    (EngineConfig(compile_layers=functools.partial(Backend(), mode="x")),
     EngineConfig(compile_layers=functools.partial(Backend(), mode="x"))),
    (EngineConfig(device=0), EngineConfig(device=1)),  # each rank's own device
])
def test_configs_equal_in_every_rank_agree(mine: EngineConfig, peer: EngineConfig) -> None:
    agree(mine, peer)


def test_a_shard_of_another_rank_is_refused_on_every_rank_at_once(tmp_path: Path) -> None:
    """Rank 1 given rank 0's shard: rank 1 names the fix, rank 0 refuses in the same collective
    (not after the group's timeout in its next one), and the right shards then serve."""
    path = save("gqa", tmp_path / "model")
    job = dict(kind="wrong_shard", name="wrong", path=str(path), prompts=PROMPTS[:2], new_tokens=NEW_TOKENS)
    ranks = run_group(2, [job], tmp_path, timeout_s=8.0)
    whole = GenerationEngine.from_checkpoint(path, EngineConfig(dtype=torch.float32, max_batch_tokens=8,
                                                                kv_block_size=4, max_kv_slots=512))
    expected = [list(r.output) for r in whole.generate(PROMPTS[:2], NEW_TOKENS)]
    assert ranks[0]["wrong"]["refused"] == ("rank(s) [1] of the group refused their engine arguments (their error "
                                            "says why); every rank refuses alike")
    assert ranks[1]["wrong"]["refused"].startswith("the model is rank 0's tensor-parallel shard, but this engine is "
                                                   "rank 1; load this rank's shard (load_checkpoint(..., "
                                                   "tensor_parallel=(2, 1))")
    for rank in ranks:
        assert rank["wrong"]["seconds"] < 8.0  # refused in the agreement, not at the group's timeout
        assert rank["wrong"]["tokens"] == expected


def test_a_rank_refuses_its_own_problem_and_the_others_refuse_with_it() -> None:
    from types import SimpleNamespace

    from torchhal.core.engine.ranks import agree_on_config

    config = EngineConfig()
    with pytest.raises(ValueError, match=r"^rank\(s\) \[1\] of the group refused their engine arguments"):
        agree_on_config(config, SimpleNamespace(world_size=2, host=PeerHost(config, peer_refused=True)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^this rank's own problem$"):
        agree_on_config(config, SimpleNamespace(world_size=2, host=PeerHost(config)),  # type: ignore[arg-type]
                        problem="this rank's own problem")
    with pytest.raises(ValueError, match="^alone$"):
        agree_on_config(config, None, problem="alone")  # no group: refused at once


def test_configs_that_differ_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"differs between the group's ranks in kv_fraction \(this rank: 0.3\)"):
        agree(EngineConfig(kv_fraction=0.3), EngineConfig(kv_fraction=0.5))


class PeerModelHost:
    """The host communicator of a 2-rank group whose other rank passed a model of `peer_config`
    and the same EngineConfig, and refused it (it sees the difference too)."""

    world_size = 2

    def __init__(self, config: EngineConfig, peer_config: ModelConfig) -> None:
        self.config, self.peer_config = config, peer_config

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        from torchhal.core.engine.ranks import config_digests, model_digests

        peer_model = model_digests(LlamaDecoder(self.peer_config))
        if tensor.shape == peer_model.shape:
            return torch.cat([tensor, peer_model], dim)
        return torch.cat([tensor, torch.cat([config_digests(self.config), torch.ones(1, 1, dtype=torch.int64)], 1)],
                         dim)


@pytest.mark.parametrize("field, mine, peer", [
    ("rope_theta", 10000.0, 500.0),  # no collective differs: both ranks would compute a model that is neither
    ("num_layers", 1, 2),  # the collectives differ: gloo aborts the process
    ("vocab_size", 64, 66),
])
def test_ranks_whose_models_differ_refuse_naming_the_field_before_touching_the_model(field, mine, peer) -> None:
    from torchhal.distributed import DeviceGroup, RankPlacement
    from torchhal.platforms import current_platform

    config = EngineConfig(dtype=torch.bfloat16)
    model = LlamaDecoder(dataclasses.replace(CONFIG, **{field: mine}))
    platform = current_platform()
    group = DeviceGroup("tp", RankPlacement(0, 2, 0, 1), platform, platform.device(0), comm=None,  # type: ignore[arg-type]
                        host=PeerModelHost(config, dataclasses.replace(CONFIG, **{field: peer})),  # type: ignore[arg-type]
                        timeout=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"the model differs between the group's ranks in {field} \(this rank: "
                                         rf"{mine}\); every rank must load the same checkpoint"):
        GenerationEngine(config, model=model, group=group)
    assert all(param.dtype == torch.float32 for param in model.parameters()), "the refused model was cast"
    assert model.kv is None and model.shard is None


def test_ranks_whose_models_agree_find_no_problem() -> None:
    from types import SimpleNamespace

    from torchhal.core.engine.ranks import shard_problem

    host = PeerModelHost(EngineConfig(), CONFIG)
    assert shard_problem(LlamaDecoder(CONFIG), SimpleNamespace(world_size=2, rank=0, host=host)) is None  # type: ignore[arg-type]


def test_a_numpy_size_and_rank_make_the_plain_plan() -> None:
    """numpy's integers are taken here as the group and the engine take them."""
    plan = TensorParallelPlan(CONFIG, numpy.int64(2))
    assert plan == TensorParallelPlan(CONFIG, 2) and type(plan.world_size) is int
    shard = RankShard(plan, numpy.int32(1))
    assert shard == RankShard(plan, 1) and type(shard.rank) is int
    assert plan.head_range(numpy.int64(1)) == plan.head_range(1)
