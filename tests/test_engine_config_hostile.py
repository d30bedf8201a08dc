"""Hostile engine configuration and model use: refused at the boundary with a message naming
the bad value and the fix, before the user's model is moved, cast or read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine, PrefillGraphConfig
from torchhal.core.model import AttentionMetadata, ModelConfig, ReferenceDecoder

SMALL = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=48, max_position=256)


def params_snapshot(model: torch.nn.Module) -> dict[str, tuple[torch.dtype, torch.Tensor]]:
    return {name: (p.dtype, p.detach().clone()) for name, p in model.named_parameters()}


def assert_untouched(model: torch.nn.Module, before: dict[str, tuple[torch.dtype, torch.Tensor]]) -> None:
    for name, p in model.named_parameters():
        dtype, values = before[name]
        assert p.dtype == dtype == torch.float32 and torch.equal(p.detach(), values), name
    assert model.kv is None  # type: ignore[attr-defined]


# -- 1. EngineConfig.dtype ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, "float16", None])
def test_an_unsupported_dtype_is_refused_by_the_config_naming_it_and_the_choices(dtype: object) -> None:
    model = ReferenceDecoder(SMALL)
    before = params_snapshot(model)
    with pytest.raises(ValueError, match=rf"EngineConfig\.dtype = {dtype!r} must be one of torch\.float32, "
                                         r"torch\.float16, torch\.bfloat16"):
        GenerationEngine(EngineConfig(dtype=dtype, max_kv_slots=512), model=model)  # type: ignore[arg-type]
    assert_untouched(model, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_supported_dtypes_are_accepted(dtype: torch.dtype) -> None:
    assert EngineConfig(dtype=dtype).dtype is dtype


# -- 2. graph configs ----------------------------------------------------------------------------
@pytest.mark.parametrize("make", [DecodeGraphConfig, PrefillGraphConfig])
@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_graph_emulate_must_be_a_real_bool(make: type, value: object) -> None:
    with pytest.raises(TypeError, match=rf"{make.__name__}\.emulate = {value!r} must be True or False"):
        make(emulate=value)


@pytest.mark.parametrize("buckets, usable", [
    ((128, 2**40), (128, 256)),  # allocating a 2**40-token bucket's table rows used to fail
    ((128, 100_000, 257), (128, 256)),
    (DecodeGraphConfig().context_buckets, (128, 256)),  # the defaults reach 4096: a short model still runs
    ((64, 128), (64, 128)),
])
def test_context_buckets_past_max_position_are_lowered_to_it(buckets: tuple[int, ...],
                                                             usable: tuple[int, ...]) -> None:
    settings = DecodeGraphConfig(batch_buckets=(1, 2), context_buckets=buckets, emulate=True)
    engine = GenerationEngine(EngineConfig(max_kv_slots=512, decode_graphs=settings), model=ReferenceDecoder(SMALL))
    assert engine.decode_runner is not None and tuple(engine.decode_runner.context_buckets) == usable
    [result] = engine.generate([[1, 2, 3]], 4)
    assert len(result.output) == 4


def test_from_checkpoint_refuses_two_runners_before_reading_weights(tmp_path: Path, monkeypatch) -> None:
    import torchhal.core.model.checkpoint as checkpoint

    def no_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("from_checkpoint read the checkpoint before refusing the config")

    monkeypatch.setattr(checkpoint, "load_checkpoint", no_read)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 48, "max_position_embeddings": 256,
    }))
    config = EngineConfig(max_kv_slots=512, prefill_graphs=PrefillGraphConfig())
    with pytest.raises(ValueError, match="prefill_graphs and runner_factory both choose"):
        GenerationEngine.from_checkpoint(tmp_path, config, runner_factory=lambda engine: None)  # type: ignore


def test_other_config_refusals_leave_the_model_untouched() -> None:
    class Plain(ReferenceDecoder):
        compile_layers = None  # type: ignore[assignment]

    model = Plain(SMALL)
    before = params_snapshot(model)
    with pytest.raises(TypeError, match="compile_layers = 'inductor', but model Plain has no compile_layers"):
        GenerationEngine(EngineConfig(max_kv_slots=512, dtype=torch.bfloat16, compile_layers="inductor"),
                         model=model)
    assert_untouched(model, before)
    with pytest.raises(ValueError, match="prefill_graphs and runner_factory both choose"):
        GenerationEngine(EngineConfig(max_kv_slots=512, dtype=torch.bfloat16, prefill_graphs=PrefillGraphConfig()),
                         model=model, runner_factory=lambda engine: None)  # type: ignore[arg-type,return-value]
    assert_untouched(model, before)


# -- 3. forward without a KV cache ---------------------------------------------------------------
def test_forward_without_a_kv_cache_names_the_fix() -> None:
    model = ReferenceDecoder(SMALL)
    meta = AttentionMetadata.build([[1]], [3], [3], 4, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"model\.kv is None: assign a KVCache \(.*\) before forward"):
        model(torch.tensor([1, 2, 3]), meta)
