"""The engine serving loaded HF checkpoints: pause/continue, weight updates by HF name, sleep/wake,
all token-exact against transformers' greedy generate (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hf_models import PROMPTS, hf_greedy, save_hf_model
from torchhal.core.engine import EngineConfig, GenerationEngine
from torchhal.core.model.checkpoint import iter_checkpoint_tensors, load_checkpoint

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[list[int]]]]:
    """Two Qwen3 checkpoints (q/k norms, GQA, tied head) of the same shape, different weights."""
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        directory = tmp_path_factory.mktemp(f"qwen3_{name}")
        hf = save_hf_model("qwen3", directory, seed=seed)
        out[name] = (directory, hf_greedy(hf, PROMPTS, NEW_TOKENS))
    assert out["a"][1] != out["b"][1]
    return out


def serve(directory: Path) -> GenerationEngine:
    model, _ = load_checkpoint(directory)
    return GenerationEngine(EngineConfig(max_kv_slots=1024), model=model)


def run_all(engine: GenerationEngine, rids: list[int]) -> list[list[int]]:
    while any(rid not in engine.results for rid in rids):
        engine.step()
    return [list(engine.results.pop(rid).output) for rid in rids]


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_and_continue_mid_flight_keeps_tokens_exact(checkpoints, mode):
    directory, expected = checkpoints["a"]
    engine = serve(directory)
    rids = [engine.add_request(p, NEW_TOKENS) for p in PROMPTS[:2]]
    for _ in range(5):
        engine.step()
    engine.pause_generation(mode)
    assert engine.step() == []  # paused: nothing runs
    engine.continue_generation()
    rids += [engine.add_request(p, NEW_TOKENS) for p in PROMPTS[2:]]  # join after the pause
    assert run_all(engine, rids) == expected


def test_weight_update_from_a_second_checkpoint_by_hf_name(checkpoints):
    engine = serve(checkpoints["a"][0])
    assert engine.generate(PROMPTS, NEW_TOKENS)[0].output == tuple(checkpoints["a"][1][0])
    result = engine.update_weights_from_tensors(iter_checkpoint_tensors(checkpoints["b"][0]), flush_cache=True)
    assert result.weight_version == 1
    assert [list(r.output) for r in engine.generate(PROMPTS, NEW_TOKENS)] == checkpoints["b"][1]


@pytest.mark.parametrize("sharded", [False, True])
def test_weight_update_from_disk_reads_a_checkpoint_directory(checkpoints, tmp_path, sharded):
    engine = serve(checkpoints["a"][0])
    assert [list(r.output) for r in engine.generate(PROMPTS, NEW_TOKENS)] == checkpoints["a"][1]
    second = checkpoints["b"][0]
    if sharded:  # the same weights as "b", saved in shards
        second = tmp_path / "b_sharded"
        save_hf_model("qwen3", second, seed=1, max_shard_size="20KB")
        assert (second / "model.safetensors.index.json").is_file()
    result = engine.update_weights_from_disk(str(second))
    assert result.updated == len(list(engine.model.named_parameters()))
    assert [list(r.output) for r in engine.generate(PROMPTS, NEW_TOKENS)] == checkpoints["b"][1]


def test_sleep_and_wake_serve_the_same_tokens(checkpoints):
    directory, expected = checkpoints["a"]
    engine = serve(directory)
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # still tied
    assert [list(r.output) for r in engine.generate(PROMPTS, NEW_TOKENS)] == expected


def test_graph_runner_path_serves_the_same_tokens(checkpoints):
    """The graph runner's bucketed, padded path (emulated: no graphs on CPU) over the loaded model."""
    from torchhal.core.graphs import GraphRunner

    directory, expected = checkpoints["a"]
    model, _ = load_checkpoint(directory)

    def graphs(engine: GenerationEngine) -> GraphRunner:
        return GraphRunner(engine.model, engine.platform, engine.device_index, hidden_size=model.config.hidden_size,
                           dtype=torch.float32, buckets=(8, 16, 64), emulate=True)

    engine = GenerationEngine(EngineConfig(max_kv_slots=1024), model=model, runner_factory=graphs)
    assert isinstance(engine.runner, GraphRunner)
    assert [list(r.output) for r in engine.generate(PROMPTS, NEW_TOKENS)] == expected


def test_a_device_the_platform_lacks_is_refused_before_any_weight_is_read(checkpoints, monkeypatch):
    """EngineConfig.device past the platform's devices: a ValueError naming it and the range,
    from GenerationEngine and from from_checkpoint, which reads nothing first."""
    import torchhal.core.model.checkpoint as checkpoint

    def no_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("from_checkpoint read the checkpoint before refusing the device")

    monkeypatch.setattr(checkpoint, "load_checkpoint", no_read)
    config = EngineConfig(max_kv_slots=1024, device=3)  # the CPU platform has one device
    with pytest.raises(ValueError, match=r"EngineConfig.device = 3, but platform 'cpu' has 1 device\(s\); pass 0..0"):
        GenerationEngine.from_checkpoint(checkpoints["a"][0], config)
    with pytest.raises(ValueError, match="EngineConfig.device = 3"):
        GenerationEngine(config)


def test_a_device_against_the_groups_is_refused_before_any_weight_is_read(checkpoints, monkeypatch):
    """With a group, the rank's device is the group's; a config naming another is refused, by
    from_checkpoint before it reads anything."""
    import torchhal
    import torchhal.core.model.checkpoint as checkpoint
    from torchhal.distributed import DeviceGroup, RankPlacement

    def no_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("from_checkpoint read the checkpoint before refusing the device")

    monkeypatch.setattr(checkpoint, "load_checkpoint", no_read)
    platform = torchhal.current_platform()
    # A stand-in group whose rank the platform places on device 1 (the CPU has only device 0,
    # which the config names: a real device, just not the rank's).
    monkeypatch.setattr(platform, "device_for_rank", lambda local_rank, local_world_size: 1)
    group = DeviceGroup("two", RankPlacement(1, 2, 1, 2), platform, platform.device(0),  # type: ignore[arg-type]
                        comm=None, host=None, timeout=None)  # its communicators are never reached
    with pytest.raises(ValueError, match="EngineConfig.device = 0 but the group puts rank 1 on device 1"):
        GenerationEngine.from_checkpoint(checkpoints["a"][0], EngineConfig(max_kv_slots=1024, device=0),
                                         group=group)  # type: ignore[arg-type]
