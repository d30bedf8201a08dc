"""Hostile engine configuration and model use: refused at the boundary with a message naming
the bad value and the fix, before the user's model is moved, cast or read."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy
import pytest
import torch

import torchhal
from torchhal.core.engine import DecodeGraphConfig, EagerRunner, EngineConfig, GenerationEngine, PrefillGraphConfig
from torchhal.core.model import AttentionMetadata, LlamaDecoder, ModelConfig, ReferenceDecoder
from torchhal.core.model.config import ConfigValueError
from torchhal.values import short_repr

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
    (None, (256,)),  # the default: powers of 4 from 256, lowered to what the model holds
    ((64, 128), (64, 128)),
])
def test_context_buckets_past_max_position_are_lowered_to_it(buckets: tuple[int, ...],
                                                             usable: tuple[int, ...]) -> None:
    settings = DecodeGraphConfig(batch_buckets=(1, 2), context_buckets=buckets, emulate=True)
    engine = GenerationEngine(EngineConfig(max_kv_slots=512, decode_graphs=settings), model=ReferenceDecoder(SMALL))
    assert engine.decode_runner is not None and tuple(engine.decode_runner.context_buckets) == usable
    [result] = engine.generate([[1, 2, 3]], 4)
    assert len(result.output) == 4


def test_context_buckets_past_the_kv_pool_are_lowered_to_its_slots() -> None:
    """No request holds more tokens than the pool has slots: a bucket past them would size every
    decode step's buffers for a context no step reaches (here 2**30 tokens: out of memory)."""
    model = dataclasses.replace(SMALL, max_position=2**31 - 1)
    settings = DecodeGraphConfig(batch_buckets=(1,), context_buckets=(2**30,), emulate=True)
    engine = GenerationEngine(EngineConfig(max_kv_slots=64, decode_graphs=settings), model=ReferenceDecoder(model))
    slots = engine.kv_sizing.num_slots
    assert engine.decode_runner is not None and tuple(engine.decode_runner.context_buckets) == (slots,)
    [result] = engine.generate([[1, 2]], 3)
    assert result.error is None and len(result.output) == 3


def test_from_checkpoint_refuses_two_runners_before_reading_weights(tmp_path: Path, monkeypatch) -> None:
    import torchhal.core.model.checkpoint as checkpoint

    def no_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("from_checkpoint read the checkpoint before refusing the config")

    monkeypatch.setattr(checkpoint, "load_checkpoint", no_read)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 48, "max_position_embeddings": 256,
    }))
    config = EngineConfig(max_kv_slots=512, prefill_graphs=PrefillGraphConfig(token_buckets=(16, 64)))
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
        GenerationEngine(EngineConfig(max_kv_slots=512, dtype=torch.bfloat16,
                                      prefill_graphs=PrefillGraphConfig(token_buckets=(16, 64))),
                         model=model, runner_factory=lambda engine: None)  # type: ignore[arg-type,return-value]
    assert_untouched(model, before)


# -- 3. forward without a KV cache ---------------------------------------------------------------
def test_forward_without_a_kv_cache_names_the_fix() -> None:
    model = ReferenceDecoder(SMALL)
    meta = AttentionMetadata.build([[1]], [3], [3], 4, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"model\.kv is None: assign a KVCache \(.*\) before forward"):
        model(torch.tensor([1, 2, 3]), meta)


# -- 4. config fields: checked by the config itself, before any model is touched -----------------
@pytest.mark.parametrize("field, value, message", [
    ("kv_fraction", 0, r"EngineConfig\.kv_fraction = 0 must be a fraction of free memory in \(0, 1\]"),
    ("kv_fraction", 5, r"kv_fraction = 5 must be"),
    ("kv_fraction", float("nan"), r"kv_fraction = nan must be"),
    ("kv_fraction", "0.3", r"kv_fraction = '0.3' must be"),
    ("kv_fraction", None, r"kv_fraction = None must be"),
    ("kv_fraction", True, r"kv_fraction = True must be"),
    ("eos_token", "5", r"EngineConfig\.eos_token = '5' must be a token id \(an int >= 0\) or None"),
    ("eos_token", 5.5, r"eos_token = 5\.5 must be"),
    ("eos_token", -1, r"eos_token = -1 must be"),
    ("eos_token", True, r"eos_token = True must be"),
    ("eos_token", [5], r"eos_token = \[5\] must be"),
    ("idle_empty_after_s", "5", r"EngineConfig\.idle_empty_after_s = '5' must be a finite number of seconds >= 0"),
    ("idle_empty_after_s", float("nan"), r"idle_empty_after_s = nan must be"),
    ("idle_empty_after_s", True, r"idle_empty_after_s = True must be"),
    ("idle_empty_after_s", -1, r"idle_empty_after_s = -1 must be"),
])
def test_a_bad_config_value_is_refused_by_the_config(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("field, value, error, message", [
    ("check_finite_weights", "no", TypeError, r"EngineConfig\.check_finite_weights = 'no' must be True or False"),
    ("model", "x", TypeError, r"EngineConfig\.model = 'x' must be a ModelConfig"),
    ("model", None, TypeError, r"EngineConfig\.model = None must be a ModelConfig"),
])
def test_a_config_value_of_the_wrong_kind_is_refused(field: str, value: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("config", [EngineConfig(max_kv_slots=512, eos_token=64),
                                    EngineConfig(max_kv_slots=512, eos_tokens=(2, 10**6))])
def test_an_end_token_outside_the_vocabulary_is_refused_before_the_model_is_touched(config: EngineConfig) -> None:
    model = ReferenceDecoder(SMALL)
    before = params_snapshot(model)
    with pytest.raises(ValueError, match=r"end-of-sequence token\(s\) \[\d+\] are outside the model's vocabulary "
                                         r"0\.\.63"):
        GenerationEngine(config, model=model)
    assert_untouched(model, before)


def test_runner_factory_must_return_a_runner() -> None:
    with pytest.raises(TypeError, match=r"runner_factory returned NoneType, which lacks forward, release, resume"):
        GenerationEngine(EngineConfig(max_kv_slots=512, model=SMALL),
                         runner_factory=lambda engine: None)  # type: ignore[arg-type,return-value]


def test_a_runner_whose_forward_takes_no_rows_is_refused_at_construction() -> None:
    """The engine passes the rows it samples to every forward: a runner written for
    forward(input_ids, meta) is refused before any request, not at its first step."""

    class OldRunner:
        def __init__(self, engine: GenerationEngine) -> None:
            self.inner = EagerRunner(engine.model)

        def forward(self, input_ids: torch.Tensor, meta: object) -> torch.Tensor:
            return self.inner.forward(input_ids, meta)  # type: ignore[arg-type]

        def release(self) -> None: ...

        def resume(self) -> None: ...

    with pytest.raises(TypeError, match=r"OldRunner, whose forward\(input_ids: 'torch.Tensor', meta: 'object'\) "
                                        r"-> 'torch.Tensor' does not take the ModelRunner protocol's "
                                        r"\(input_ids, meta, rows\)"):
        GenerationEngine(EngineConfig(max_kv_slots=512, model=SMALL), runner_factory=OldRunner)


# -- 5. sizes no step can use are not allocated ----------------------------------------------------
def test_buckets_and_windows_no_step_can_use_are_left_out() -> None:
    """max_running above the pool's blocks, batch buckets above it, a window past the largest
    context bucket and token buckets above max_batch_tokens: each would only size buffers
    (30M-token ones here) that no step fills."""
    config = EngineConfig(
        model=SMALL, max_kv_slots=128, kv_block_size=16, max_batch_tokens=64, max_running=4_000_000,
        decode_graphs=DecodeGraphConfig(batch_buckets=(1, 2, 4, 30_000_000), context_buckets=(32, 64),
                                        steps_per_sync=50_000_000, emulate=True),
        prefill_graphs=PrefillGraphConfig(token_buckets=(16, 32, 128, 30_000_000), emulate=True),
    )
    engine = GenerationEngine(config)
    assert engine.kv_sizing.num_blocks == engine.max_running_requests == 8  # 128 slots of 16 tokens
    assert engine.executor.rows.max_rows == 8
    decode = engine.decode_runner
    assert decode is not None and decode.batch_buckets == [1, 2, 4, 8]
    assert decode.steps_per_sync == 64 and decode.history.shape == (64, 8)  # the largest context bucket
    assert engine.runner.bucket_sizes == [16, 32, 64]  # type: ignore[attr-defined]
    assert [list(r.output) for r in engine.generate([[1, 2, 3], [4, 5]], 3)] == [
        list(r.output) for r in GenerationEngine(EngineConfig(model=SMALL, max_kv_slots=128)).generate(
            [[1, 2, 3], [4, 5]], 3)]


# -- 6. requests: nothing of a refused call is left behind -----------------------------------------
def small_engine(**overrides: object) -> GenerationEngine:
    return GenerationEngine(EngineConfig(**{"model": SMALL, "max_kv_slots": 512, **overrides}))  # type: ignore[arg-type]


def test_prompts_that_fail_part_way_leave_nothing_queued() -> None:
    engine = small_engine()

    def prompts():
        yield [1, 2, 3]
        yield [4, 5]
        raise OSError("the prompt file went away")

    with pytest.raises(OSError, match="went away"):
        engine.generate(prompts(), 4)
    assert engine.pending() is None and not engine.waiting and not engine.results
    assert engine.flush_cache().flushed


@pytest.mark.parametrize("prompts, message", [
    (None, r"generate\(prompts=None\): pass a list of prompts, each a list of int token ids"),
    ("1 2 3", r"generate\(prompts='1 2 3'\): pass a list of prompts"),
    ([1, 2, 3], r"generate\(prompts=\[1, 2, 3\]\) is one prompt; pass a list of prompts: \[\[1, 2, 3\]\]"),
    # Iterating a dict gives its keys ([1, 2]: read as one prompt); a set has no order to answer in.
    ({1: [5, 6], 2: [7]}, r"generate\(prompts=\{1: \[5, 6\], 2: \[7\]\}\) is a dict; pass a list of prompts"),
    ({"a": [5, 6]}, r"is a dict; pass a list of prompts \(results come back in its order\), e\.g\. list\(prompts"),
    (frozenset({(1, 2)}), r"is a frozenset; pass a list of prompts"),
    # numpy's integers: one prompt too (each was taken as a prompt of its own and failed alone)
    (numpy.array([1, 2, 3]), r"is one prompt; pass a list of prompts of plain ints \(array\.tolist\(\)\): \[\["),
    ([numpy.int64(1), 2], r"is one prompt; pass a list of prompts of plain ints"),
])
def test_prompts_that_are_not_a_list_of_prompts_are_refused_at_the_call(prompts: object, message: str) -> None:
    engine = small_engine()
    with pytest.raises(TypeError, match=message):
        engine.generate(prompts, 4)  # type: ignore[arg-type]
    assert engine.pending() is None and not engine.results


def test_a_huge_bad_prompt_is_named_in_a_short_message() -> None:
    # The whole value was written into the error (and every failed result kept it): megabytes.
    engine = small_engine()
    for bad in ({i: i for i in range(200_000)}, [[0] * 200_000], [1, list(range(200_000))]):
        with pytest.raises(TypeError) as refused:
            engine.add_request(bad, 2)  # type: ignore[arg-type]
        assert len(str(refused.value)) < 300, str(refused.value)[:300]
    (result,) = engine.generate([[1, list(range(200_000))]], 2)  # type: ignore[list-item]
    assert result.error is not None and len(result.error) < 300


def test_bools_are_not_token_ids() -> None:
    engine = small_engine()
    message = r"token True at position 0 is a bool, not an int token id"
    with pytest.raises(TypeError, match=message):
        engine.add_request([True, False, 3], 2)
    assert not engine.waiting
    (result,) = engine.generate([[True, False, 3]], 2)
    assert result.state.value == "failed" and result.output == () and result.error is not None
    assert re.search(message, result.error)


@pytest.mark.parametrize("new_tokens, error", [
    (True, TypeError), (2.0, TypeError), ("4", TypeError), (None, TypeError), (0, ValueError), (-5, ValueError),
])
def test_a_bad_max_new_tokens_is_the_calls_error_not_every_prompts(new_tokens: object, error: type) -> None:
    # generate returned every prompt as a failed result naming it; it applies to the whole call.
    engine = small_engine()
    message = rf"max_new_tokens {re.escape(short_repr(new_tokens))} must be a positive int, e.g. 16"
    with pytest.raises(error, match=message):
        engine.add_request([1, 2], new_tokens)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        engine.generate([[1, 2], [3]], new_tokens)  # type: ignore[arg-type]
    assert not engine.waiting and not engine.results
    assert [len(r.output) for r in engine.generate([[1, 2], [3]], 2)] == [2, 2]


# -- 7. weight updates --------------------------------------------------------------------------
def test_an_empty_update_is_refused_and_is_no_new_version() -> None:
    engine = small_engine()
    for empty in ({}, iter([])):
        with pytest.raises(ValueError, match="the update names no weights"):
            engine.update_weights_from_tensors(empty)
    assert engine.weight_version == 0


def test_a_tied_model_takes_its_own_state_dict_back() -> None:
    tied = dataclasses.replace(SMALL, tie_word_embeddings=True)
    engine = small_engine(model=tied)
    tokens = [list(r.output) for r in engine.generate([[1, 2, 3]], 4)]
    state = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
    assert "lm_head.weight" in state
    result = engine.update_weights_from_tensors(state)
    assert result.weight_version == 1 and result.updated == len(state) - 1  # the tied pair is one weight
    assert [list(r.output) for r in engine.generate([[1, 2, 3]], 4)] == tokens
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    with pytest.raises(ValueError, match=r"'lm_head.weight' and 'model.embed_tokens.weight' are one tied weight, "
                                         r"given different values; send one"):
        engine.update_weights_from_tensors(state)
    assert engine.weight_version == 1


def test_an_update_whose_sources_are_the_models_own_weights_is_all_at_once() -> None:
    engine = small_engine()
    params = dict(engine.model.named_parameters())
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    with torch.no_grad():
        params[a].copy_(torch.arange(32.0))
        params[b].copy_(-torch.arange(32.0))
    engine.update_weights_from_tensors({a: params[b], b: params[a]})  # a swap, read before anything is written
    assert torch.equal(params[a], -torch.arange(32.0)) and torch.equal(params[b], torch.arange(32.0))


# -- 8. lifecycle arguments ----------------------------------------------------------------------
@pytest.mark.parametrize("call, label", [
    (lambda e: e.flush_cache(empty_cache="no"), r"flush_cache\(empty_cache\) = 'no' must be True or False"),
    (lambda e: e.update_weights_from_tensors({}, flush_cache="no"),
     r"update_weights_from_tensors\(flush_cache\) = 'no' must be True or False"),
    (lambda e: e.update_weights_from_disk("x", flush_cache="no"),
     r"update_weights_from_disk\(flush_cache\) = 'no' must be True or False"),
])
def test_flags_must_be_real_bools(call, label: str) -> None:
    with pytest.raises(TypeError, match=label):
        call(small_engine())


def test_continue_generation_flag_must_be_a_real_bool() -> None:
    engine = small_engine()
    engine.pause_generation("in_place")
    with pytest.raises(TypeError, match=r"continue_generation\(empty_cache\) = 'no' must be True or False"):
        engine.continue_generation(empty_cache="no")  # type: ignore[arg-type]
    assert engine.paused is not None  # still paused: nothing changed
    engine.continue_generation(empty_cache=False)


@pytest.mark.parametrize("path", [None, 42])
def test_update_from_disk_names_a_path_that_is_not_one(path: object) -> None:
    with pytest.raises(TypeError, match=rf"update_weights_from_disk\(path={path!r}\): pass the checkpoint's "
                                        "directory or safetensors file as a str or Path"):
        small_engine().update_weights_from_disk(path)  # type: ignore[arg-type]


def test_a_bad_pause_mode_lists_the_modes() -> None:
    engine = small_engine()
    with pytest.raises(ValueError, match=r"pause_generation\(mode='ABORT'\): choose one of 'abort', 'retract', "
                                         r"'in_place'"):
        engine.pause_generation("ABORT")
    assert engine.paused is None


def test_a_tied_pair_is_checked_after_each_value_and_nan_equals_nan() -> None:
    tied = dataclasses.replace(SMALL, tie_word_embeddings=True)
    engine = small_engine(model=tied)
    embedding = engine.model.state_dict()["model.embed_tokens.weight"]
    meta = torch.empty(embedding.shape, device="meta")
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' is a meta tensor and holds no values"):
        engine.update_weights_from_tensors({"model.embed_tokens.weight": meta, "lm_head.weight": meta})
    poisoned = embedding.clone()
    poisoned[0, 0] = float("nan")
    engine = small_engine(model=tied, check_finite_weights=False)
    result = engine.update_weights_from_tensors(  # check_finite_weights is off: NaN is a value like any
        {"model.embed_tokens.weight": poisoned, "lm_head.weight": poisoned.clone()})
    assert result.updated == 1 and engine.model.lm_head.weight[0, 0].isnan()


def test_a_swap_of_views_into_one_fused_weight_reads_both_first() -> None:
    engine = small_engine()
    params = dict(engine.model.named_parameters())
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    old_q, old_k = params[q].detach().clone(), params[k].detach().clone()
    engine.update_weights_from_tensors({q: params[k], k: params[q]})  # two views of the fused QKV
    assert torch.equal(params[q], old_k) and torch.equal(params[k], old_q)


def test_a_rank_whose_update_fails_in_any_way_tells_its_peers() -> None:
    from torchhal.core.engine.weights import WeightUpdater

    verdicts: list[bool] = []

    def batch():
        yield "lm_head.weight", torch.zeros(64, 32)
        raise OSError("the weight stream broke")

    updater = WeightUpdater(ReferenceDecoder(SMALL),
                            agree=lambda refused, replicated: verdicts.append(refused) or ([], []))
    with pytest.raises(OSError, match="stream broke"):
        updater.apply(batch())
    assert verdicts == [True], "the peers would wait in the agreement until the group's timeout"


@pytest.mark.parametrize("value", [numpy.float64(0.5), numpy.float32(0.5)])
def test_numpy_numbers_are_numbers(value: object) -> None:
    assert EngineConfig(kv_fraction=value, idle_empty_after_s=value).kv_fraction == value  # type: ignore[arg-type]


def test_from_checkpoint_refuses_an_end_token_outside_the_vocabulary_before_reading(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    from torchhal.core.model import checkpoint

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 48, "max_position_embeddings": 256,
    }))
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(ValueError, match=r"end-of-sequence token\(s\) \[64\] are outside the model's vocabulary"):
        GenerationEngine.from_checkpoint(tmp_path, EngineConfig(max_kv_slots=512, eos_token=64))


# -- the config and the model given to the engine ------------------------------------------------
@pytest.mark.parametrize("config", [torch.bfloat16, {"dtype": torch.bfloat16}, "bfloat16", SMALL, None])
def test_a_config_that_is_not_an_engine_config_is_refused_naming_it(config: object) -> None:
    model = ReferenceDecoder(SMALL)
    before = params_snapshot(model)
    with pytest.raises(TypeError, match=rf"config = .* is a {type(config).__name__}, not an EngineConfig; pass e\.g\. "
                                        r"EngineConfig\(dtype=torch.bfloat16\)"):
        GenerationEngine(config, model=model)  # type: ignore[arg-type]
    assert_untouched(model, before)


def test_from_checkpoint_refuses_a_config_that_is_not_an_engine_config_before_reading(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    import torchhal.core.model.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("a weight was read"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 48, "max_position_embeddings": 256,
    }))
    for config in (torch.bfloat16, "", {}):  # a falsy one too: not silently replaced by the defaults
        with pytest.raises(TypeError, match="not an EngineConfig"):
            GenerationEngine.from_checkpoint(tmp_path, config)  # type: ignore[arg-type]


def test_a_model_serves_one_engine_at_a_time() -> None:
    model = ReferenceDecoder(SMALL)
    first = GenerationEngine(EngineConfig(max_kv_slots=512), model=model)
    cache = model.kv
    with pytest.raises(ValueError, match="model ReferenceDecoder already serves another GenerationEngine, which set "
                                         r"its KV cache; give each engine its own model .*copy.deepcopy\(model\)"):
        GenerationEngine(EngineConfig(max_kv_slots=256), model=model)
    assert model.kv is cache  # the first engine's cache is still the model's
    expected = [r.output for r in GenerationEngine(EngineConfig(max_kv_slots=512), model=ReferenceDecoder(SMALL))
                .generate([[1, 2, 3]], 4)]
    assert [r.output for r in first.generate([[1, 2, 3]], 4)] == expected
    del first  # dropped: the model may serve a new engine
    assert [r.output for r in GenerationEngine(EngineConfig(max_kv_slots=512), model=model)
            .generate([[1, 2, 3]], 4)] == expected


def test_a_model_being_given_to_an_engine_on_another_thread_is_refused_until_that_engine_is_built() -> None:
    # Both threads passed the ownership check before either engine was registered: the second
    # overwrote the model's KV cache, the two engines wrote over each other's KV, tokens went wrong.
    import threading

    model = ReferenceDecoder(SMALL)
    building, finish = threading.Event(), threading.Event()
    built: list[GenerationEngine] = []

    def held_runner(engine: GenerationEngine) -> EagerRunner:
        building.set()
        assert finish.wait(30)
        return EagerRunner(engine.model)

    thread = threading.Thread(target=lambda: built.append(
        GenerationEngine(EngineConfig(max_kv_slots=512), model=model, runner_factory=held_runner)))
    thread.start()
    try:
        assert building.wait(30)
        with pytest.raises(ValueError, match="model ReferenceDecoder is being given to another GenerationEngine "
                                             "right now"):
            GenerationEngine(EngineConfig(max_kv_slots=256), model=model)
    finally:
        finish.set()
        thread.join(30)
    [first] = built
    assert model.kv is first.model.kv
    with pytest.raises(ValueError, match="already serves another GenerationEngine"):
        GenerationEngine(EngineConfig(max_kv_slots=256), model=model)

    def failing_runner(engine: GenerationEngine) -> EagerRunner:
        raise RuntimeError("runner failed")

    del first, built[:]  # dropped: a failed build after it leaves the model free for the next
    with pytest.raises(RuntimeError, match="runner failed"):
        GenerationEngine(EngineConfig(max_kv_slots=256), model=model, runner_factory=failing_runner)
    assert GenerationEngine(EngineConfig(max_kv_slots=256), model=model).generate([[1, 2, 3]], 2)[0].output


def test_a_request_longer_than_a_pool_capped_by_max_kv_slots_names_max_kv_slots() -> None:
    capped = GenerationEngine(EngineConfig(model=SMALL, max_kv_slots=16, kv_block_size=16))
    [result] = capped.generate([[1] * 11], 9)
    assert result.error is not None and result.error.endswith(
        "the pool holds 1 blocks of 16; raise EngineConfig.max_kv_slots (it caps the pool at 16 tokens), "
        "or shorten the prompt")


def test_decode_rows_are_sized_by_the_pool_not_by_max_position() -> None:
    huge = dataclasses.replace(SMALL, max_position=(1 << 31) - 1)
    engine = GenerationEngine(EngineConfig(model=huge, max_kv_slots=512, kv_block_size=16))
    assert engine.executor.rows.table.shape == (engine.max_running_requests, 512 // 16)
    assert len(engine.generate([[1, 2, 3]], 4)[0].output) == 4


class CaptureFailed(RuntimeError):
    pass


def failing_runner(engine: GenerationEngine) -> EagerRunner:
    raise CaptureFailed("graph capture ran out of memory")


def randomized(config: ModelConfig) -> LlamaDecoder:
    model = LlamaDecoder(config)  # uninitialised storage, as a checkpoint load would fill it
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(generator=torch.Generator().manual_seed(parameter.numel()))
    return model


@pytest.mark.parametrize("fails_at", ["runner", "decode_graphs"])
def test_a_construction_that_fails_after_the_move_puts_the_callers_model_back(fails_at: str, monkeypatch) -> None:
    """Construction casts the caller's model (float32 to bfloat16 is lossy, gradients too),
    gives it a cache, eval mode, compiled layers; when a later part fails (graph capture out
    of memory, say), the model is put back exactly as it was: the same parameters holding
    the same bits, their gradients, the fused weights' views, every module's attributes,
    uncompiled layers. The half-built engine drops what it built at once (no collector
    needed). A retry then gives a fresh model's tokens."""
    import gc
    import weakref

    from torch._dynamo.testing import CompileCounter

    tied = dataclasses.replace(SMALL, tie_word_embeddings=True)
    model = randomized(tied)
    model.model.norm.weight.grad = torch.randn_like(model.model.norm.weight)  # a caller mid-training
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    grad = model.model.norm.weight.grad.clone()
    parameters = dict(model.named_parameters())
    attributes = {name: dict(vars(module)) for name, module in model.named_modules()}
    layer_math = dict(vars(model.layer_math))
    halves: list[weakref.ref[GenerationEngine]] = []

    def fail(engine: GenerationEngine) -> EagerRunner:
        halves.append(weakref.ref(engine))
        engine.model.program_cache = {}  # type: ignore[attr-defined]  # state a part of construction adds
        return failing_runner(engine)

    overrides: dict[str, object] = {"runner_factory": fail}
    if fails_at == "decode_graphs":  # the last part of construction
        from torchhal.core.engine import construction

        monkeypatch.setattr(construction, "make_decode_runner", lambda engine, settings: fail(engine))
        overrides = {}
    graphs = {"decode_graphs": DecodeGraphConfig(emulate=True),  # built after the prefill graphs' program
              "prefill_graphs": PrefillGraphConfig(token_buckets=(4, 16), emulate=True)}
    config = EngineConfig(max_kv_slots=512, dtype=torch.bfloat16, compile_layers=CompileCounter(),
                          **(graphs if fails_at == "decode_graphs" else {}))  # type: ignore[arg-type]
    gc.disable()
    try:
        with pytest.raises(CaptureFailed):
            GenerationEngine(config, model=model, **overrides)  # type: ignore[arg-type]
        assert halves and halves[0]() is None  # freed by reference counting alone
    finally:
        gc.enable()
    after = model.state_dict()
    assert after.keys() == state.keys()
    for name, tensor in after.items():
        assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name
    assert dict(model.named_parameters()) == parameters  # the same Parameter objects
    norm = model.model.norm.weight
    assert norm.grad is not None and norm.grad.dtype == torch.float32 and torch.equal(norm.grad, grad)
    assert {name: dict(vars(module)) for name, module in model.named_modules()} == attributes
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.fused_weight.data_ptr()  # still views into the fused weight
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.training and model.kv is None and vars(model.layer_math) == layer_math
    monkeypatch.undo()
    fresh = randomized(tied)
    config = EngineConfig(max_kv_slots=512, dtype=torch.float32)
    tokens = [r.output for r in GenerationEngine(config, model=model).generate([[1, 2, 3]], 5)]
    assert tokens == [r.output for r in GenerationEngine(config, model=fresh).generate([[1, 2, 3]], 5)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_originals_kept_for_a_restore_count_as_free_host_memory_when_the_pool_is_sized(dtype: torch.dtype) -> None:
    """On the host (no caching allocator) a cast frees the float32 originals; holding them for
    a restore must not shrink the KV pool: the sizing adds back exactly the bytes only the
    record keeps. With no cast, the weights copied into the engine's regions unchanged are not
    held twice, and nothing but the recomputed rotary frequencies is added."""
    import torchhal
    from torchhal.platforms import MemoryInfo
    from torchhal.platforms.testing import patched_plugin

    def storages(model: torch.nn.Module) -> dict[int, int]:
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}

    model = randomized(SMALL)
    originals = storages(model)
    free = 10 * 2**20
    platform = torchhal.get_platform("cpu")
    with patched_plugin(platform, memory_info=lambda index: MemoryInfo(device=index, free=free, total=4 * free)):
        engine = GenerationEngine(EngineConfig(max_kv_slots=4096, dtype=dtype), model=model, platform=platform)
    if dtype == torch.float32:  # copied into the engine's regions unchanged: the originals are not held twice
        recomputed = model.model.rotary_emb.inv_freq.numel() * 4  # the rotary frequencies, made again by the move
        assert engine.kv_sizing.free_bytes == free + recomputed
    else:
        kept = storages(model)
        assert engine.kv_sizing.free_bytes == free + sum(size for pointer, size in originals.items()
                                                         if pointer not in kept)


def test_a_platform_or_runner_factory_of_the_wrong_type_is_refused_before_anything_moves(tmp_path: Path) -> None:
    from torchhal.core.residency import ResidencyManager

    model = ReferenceDecoder(SMALL)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    with pytest.raises(TypeError, match=r"GenerationEngine: platform = 'cpu' must be a torchhal Platform"):
        GenerationEngine(EngineConfig(max_kv_slots=512), model=model, platform="cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"runner_factory = 5 must be a function given the engine"):
        GenerationEngine(EngineConfig(max_kv_slots=512), model=model, runner_factory=5)  # type: ignore[arg-type]
    assert all(torch.equal(p, before[name]) for name, p in model.state_dict().items())
    with pytest.raises(TypeError, match=r"from_checkpoint: platform = 'cpu' must be a torchhal Platform"):
        GenerationEngine.from_checkpoint(tmp_path, platform="cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"from_checkpoint\(path=None\): pass the checkpoint's directory"):
        GenerationEngine.from_checkpoint(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ResidencyManager: platform = 'cpu' must be a torchhal Platform"):
        ResidencyManager({"a": torch.nn.Linear(2, 2)}, {}, platform="cpu")  # type: ignore[arg-type]


def test_integers_of_any_kind_but_bool_are_taken_as_plain_ints() -> None:
    """numpy's and IntEnum's integers: eos_tokens took an IntEnum and eos_token refused it;
    every count refused numpy's, which the attention layer and the communicator take."""
    import enum

    class Special(enum.IntEnum):
        EOS = 3

    config = EngineConfig(model=SMALL, max_kv_slots=numpy.int64(128), max_running=numpy.int32(4),
                          kv_block_size=numpy.int64(16), device=numpy.int64(0),
                          eos_tokens=(Special.EOS, numpy.int64(5)), eos_token=Special.EOS)
    assert (config.max_kv_slots, config.max_running, config.kv_block_size, config.device) == (128, 4, 16, 0)
    assert config.eos_tokens == (3, 5) and config.eos_token == 3
    plain = (config.max_kv_slots, config.max_running, config.kv_block_size, config.device, *config.eos_tokens,
             config.eos_token)
    assert all(type(value) is int for value in plain)
    with pytest.raises(ValueError, match=r"EngineConfig.eos_token = True must be a token id"):
        EngineConfig(model=SMALL, eos_token=True)
    with pytest.raises(ValueError, match=r"EngineConfig.eos_tokens = \(True,\) must be a tuple of token ids"):
        EngineConfig(model=SMALL, eos_tokens=(True,))
    with pytest.raises(ValueError, match=r"EngineConfig.max_running = True must be a positive int"):
        EngineConfig(model=SMALL, max_running=True)
    engine = GenerationEngine(EngineConfig(model=SMALL, max_kv_slots=128))
    [result] = engine.generate([[1, 2, 3]], numpy.int64(2))
    assert len(result.output) == 2
    with pytest.raises(TypeError, match=r"token np.int64\(2\) at position 1 is a int64, not an int token id; from a "
                                        r"numpy array or a tensor, pass .tolist\(\)"):
        engine.add_request([1, numpy.int64(2)], 2)


def test_a_compile_backend_torch_does_not_have_is_refused_when_configured() -> None:
    with pytest.raises(ValueError, match=r"EngineConfig.compile_layers = 'nonexistent_backend' is not a torch.compile "
                                         r"backend of this torch; use one of .*inductor"):
        EngineConfig(model=SMALL, compile_layers="nonexistent_backend")
    assert EngineConfig(model=SMALL, compile_layers="eager").compile_layers == "eager"


def test_model_and_graph_configs_take_numpy_integers_as_plain_ints() -> None:
    """The same rule as EngineConfig's: a shape computed with numpy is a shape."""
    from torchhal.core.devices import check_device_index
    from torchhal.values import check_buckets

    model = ModelConfig(vocab_size=numpy.int64(64), hidden_size=numpy.int32(32), num_layers=1, num_heads=2,
                        intermediate_size=48, max_position=256, seed=numpy.uint64(7))
    assert model == dataclasses.replace(SMALL, seed=7)
    assert type(model.vocab_size) is int and type(model.hidden_size) is int and type(model.seed) is int
    decode = DecodeGraphConfig(batch_buckets=(numpy.int64(1), 8), context_buckets=(numpy.int64(128),),
                               steps_per_sync=numpy.int32(4))
    assert (decode.batch_buckets, decode.context_buckets, decode.steps_per_sync) == ((1, 8), (128,), 4)
    assert all(type(b) is int for b in (*decode.batch_buckets, *decode.context_buckets, decode.steps_per_sync))
    prefill = PrefillGraphConfig(token_buckets=(numpy.int64(16), 64))
    assert prefill.token_buckets == (16, 64) and all(type(b) is int for b in prefill.token_buckets)
    assert check_buckets("buckets", [numpy.int64(8), 1, 8]) == (1, 8)
    assert type(check_device_index(torchhal.current_platform(), numpy.int64(0), "device")) is int
    for bad in ((True,), (numpy.float64(8.0),), (0,)):
        with pytest.raises(ValueError, match="must be a non-empty tuple of positive ints"):
            PrefillGraphConfig(token_buckets=bad)
    with pytest.raises(ConfigValueError, match=r"ModelConfig.num_layers = True must be an int"):
        dataclasses.replace(SMALL, num_layers=True)


def test_a_reference_model_larger_than_the_host_is_refused_naming_the_config() -> None:
    """2**31 - 1 tokens x 128: 2 TiB of float32, once a torch allocator error naming no field."""
    huge = ModelConfig(vocab_size=2**31 - 1, hidden_size=128)
    with pytest.raises(ValueError, match=r"ReferenceDecoder: this ModelConfig has [\d,]+ parameters, [\d,.]+ GiB of "
                                         r"torch.float32 weights, more than this host's .*\(vocab_size=2147483647, "
                                         r"hidden_size=128.*choose a smaller ModelConfig"):
        ReferenceDecoder(huge)
    with pytest.raises(ValueError, match="choose a smaller ModelConfig"):
        GenerationEngine(EngineConfig(model=huge, max_kv_slots=64))
    assert len(ReferenceDecoder(SMALL).state_dict()) > 0  # a config that fits is built as before
