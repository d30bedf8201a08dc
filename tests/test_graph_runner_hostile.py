"""Hostile arguments to GraphRunner, on the CPU (emulate=True builds the static buffers).

Each is refused at construction with a ValueError naming the value, not at the first
bucketed forward or capture deep inside torch (or, for a non-bool emulate, not at all).
"""

import pytest
import torch

import torchhal
from torchhal.core.engine import EngineConfig, GenerationEngine
from torchhal.core.graphs import GraphRunner
from torchhal.core.model import ModelConfig, ReferenceDecoder

HIDDEN = ModelConfig().hidden_size


@pytest.fixture(scope="module")
def model():
    return ReferenceDecoder(ModelConfig(num_layers=1))


def build(model, **kwargs):
    arguments = {"device_index": 0, "dtype": torch.float32, "emulate": True, "buckets": (4, 16), **kwargs}
    return GraphRunner(model, torchhal.current_platform(), **arguments)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"hidden_size": 0}, r"hidden_size = 0 must be a positive int"),
    ({"hidden_size": -1}, r"hidden_size = -1 must be a positive int"),
    ({"hidden_size": True}, r"hidden_size = True must be a positive int"),
    ({"hidden_size": str(HIDDEN)}, rf"hidden_size = '{HIDDEN}' must be a positive int"),
    ({"dtype": torch.int64}, r"dtype = torch.int64 must be the floating torch.dtype of the model's weights"),
    ({"dtype": "float32"}, r"dtype = 'float32' must be the floating torch.dtype"),
    ({"dtype": None}, r"dtype = None must be the floating torch.dtype"),
    ({"dtype": torch.float16}, r"dtype = torch.float16 but ReferenceDecoder's weights are torch.float32; pass the "
                               r"weights' dtype \(an engine's runner_factory: dtype=e.config.dtype\)"),
    ({"buckets": 8}, r"buckets = 8 must be a non-empty sequence of positive ints, e.g. \(1, 8, 32\)"),
    ({"buckets": (True, 8)}, r"buckets = \(True, 8\) must be a non-empty sequence of positive ints"),
    ({"emulate": "no"}, r"emulate must be True or False, got 'no'$"),
    ({"emulate": 1}, r"emulate must be True or False, got 1$"),
    ({"device_index": 1}, r"device_index = 1, but platform 'cpu' has 1 device\(s\); pass 0..0, or None for the "
                          r"current device$"),
    ({"device_index": -1}, r"device_index = -1 must be a device index \(an int >= 0, e.g. 0\) or None"),
    ({"device_index": "0"}, r"device_index = '0' must be a device index"),
])
def test_bad_arguments_are_refused_at_construction_naming_the_value(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build(model, **kwargs)


def test_no_device_index_is_the_platforms_current_device(model):
    assert build(model, device_index=None).device_index == torchhal.current_platform().current_device()


def test_a_hidden_size_given_must_be_the_models(model):
    with pytest.raises(ValueError, match=rf"hidden_size = {HIDDEN // 2} but ReferenceDecoder.config.hidden_size is "
                                         rf"{HIDDEN}; leave hidden_size out to use the model's"):
        build(model, hidden_size=HIDDEN // 2)
    runner = build(model, hidden_size=HIDDEN, buckets=[16, 4, 16])  # the model's own: accepted
    assert runner.hidden_size == HIDDEN and runner.bucket_sizes == [4, 16] and runner.graphs_enabled


def test_an_engine_refuses_a_runner_in_another_dtype_before_any_step():
    def factory(engine):
        return GraphRunner(engine.model, engine.platform, engine.device_index, dtype=torch.float16, emulate=True)

    with pytest.raises(ValueError, match="dtype = torch.float16 but ReferenceDecoder's weights are torch.float32"):
        GenerationEngine(EngineConfig(model=ModelConfig(num_layers=1), max_kv_slots=256), runner_factory=factory)


@pytest.mark.parametrize("tokens", [3, 20], ids=["bucketed", "past_the_buckets"])
def test_forward_refuses_rows_outside_the_step_before_running_it(tokens):
    """Both paths (a bucket's padded replay, the eager run past the buckets) refuse rows the
    step does not have, naming them, before any layer writes the KV cache."""
    engine = GenerationEngine(EngineConfig(model=ModelConfig(num_layers=1), max_kv_slots=256),
                              runner_factory=lambda e: build(e.model))
    runner = engine.runner
    from torchhal.core.model import AttentionMetadata

    meta = AttentionMetadata.build([[1, 2]], [tokens], [tokens], 16, engine.device)
    ids = torch.arange(tokens) + 1
    before = engine.model.kv.k.clone()
    with pytest.raises(ValueError, match=rf"GraphRunner.forward: row {tokens} is outside the step's {tokens} tokens"):
        runner.forward(ids, meta, torch.tensor([0, tokens]))
    assert torch.equal(engine.model.kv.k, before)
    every = runner.forward(ids, meta).clone()
    torch.testing.assert_close(runner.forward(ids, meta, torch.tensor([tokens - 1, 0])), every[[tokens - 1, 0]])
