"""The graph runners under hostile input, on the CPU (emulate=True runs their static path
eagerly): each bad value is refused before anything changes, naming it and the fix, and calls
in the wrong order are refused or repaired, never run on state left behind."""

from __future__ import annotations

import pytest
import torch

import torchhal
from torchhal.attention import ReferenceBackend
from torchhal.core.graphs import GraphRunner
from torchhal.core.graphs.decode import DecodeGraphRunner
from torchhal.core.model import AttentionMetadata, KVCache, ModelConfig, ReferenceDecoder

from .sim_graphs import sim_graphs_platform

BLOCK = 4
CPU = torch.device("cpu")


def cached_model(num_blocks: int = 16) -> ReferenceDecoder:
    model = ReferenceDecoder(ModelConfig(num_layers=1)).eval()
    model.kv = KVCache(model.config, num_blocks, BLOCK, CPU, torch.float32)
    return model


def decode_runner(model: ReferenceDecoder, **settings: object) -> DecodeGraphRunner:
    arguments = {"block_size": BLOCK, "backend": ReferenceBackend(), "batch_buckets": (1, 2),
                 "context_buckets": (16,), "emulate": True, **settings}
    return DecodeGraphRunner(model, torchhal.current_platform(), 0, **arguments)  # type: ignore[arg-type]


def test_a_released_decode_runner_refuses_windows_until_resumed():
    """After release() (sleep) the decode runner took windows and ran them eagerly, step by
    step, on a GPU too: silently the slowest path, and on whatever cache the model then held."""
    runner = decode_runner(cached_model())
    expected = runner.decode([("a", 5, [1], 1, 1)])
    runner.release()
    assert runner.reason(1, 1) == "decode graphs are released (sleep); resume() captures them again"
    assert not runner.can_run(1, 1)
    runner.resume()
    assert runner.reason(1, 1) is None and runner.decode([("a", 5, [1], 1, 1)]) == expected


@pytest.fixture
def graphs_platform(make_registry):
    return sim_graphs_platform(make_registry)


class FailingEmbedding(ReferenceDecoder):
    """A model whose embedding raises once `fail` is set: a capture fails part-way."""

    fail = False

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("out of memory (simulated)")
        return super().embed_tokens(input_ids)


def test_a_decode_capture_that_fails_part_way_leaves_the_runner_refusing_until_one_succeeds(graphs_platform):
    model = FailingEmbedding(ModelConfig(num_layers=1)).eval()
    model.kv = KVCache(model.config, 16, BLOCK, CPU, torch.float32)
    runner = DecodeGraphRunner(model, graphs_platform, 0, block_size=BLOCK, backend=ReferenceBackend(),
                               batch_buckets=(1, 2), context_buckets=(16,))
    assert runner.graphs_enabled and runner.report is not None and runner.report.graphs == 2
    runner.release()
    model.fail = True
    with pytest.raises(RuntimeError, match="out of memory"):
        runner.resume()
    assert not runner.graphs_enabled and runner.report is None  # no graph of the failed capture is kept
    assert runner.reason(1, 1) == "decode graph capture did not finish; resume() captures them again"
    assert not runner.can_run(1, 1)  # the engine asks before a window: not a silent eager step
    model.fail = False
    runner.resume()
    assert runner.graphs_enabled and runner.reason(1, 1) is None and runner.report is not None


# -- the breakable runner ----------------------------------------------------------------------------
def graph_runner(model: object, platform: object = None, **settings: object) -> GraphRunner:
    arguments = {"dtype": torch.float32, "buckets": (4, 16), **settings}
    return GraphRunner(model, platform or torchhal.current_platform(), 0, **arguments)  # type: ignore[arg-type]


def test_capture_on_a_runner_that_runs_eagerly_is_refused_naming_why():
    """It built emulated buckets on a platform without graphs (the runner then padded every step
    while eager_reason still said it ran eagerly), or failed an assert for a model without a
    layer stack."""
    runner = graph_runner(cached_model())
    with pytest.raises(RuntimeError, match=r"cannot capture: platform 'cpu' declares no graph support; pass "
                                           r"emulate=True to run the bucketed path without graphs"):
        runner.capture()
    assert not runner.graphs_enabled and runner.report is None
    stackless = graph_runner(torch.nn.Linear(2, 2), hidden_size=2, emulate=True)
    with pytest.raises(RuntimeError, match=r"cannot capture: cannot find the layer stack of Linear"):
        stackless.capture()


def test_bucket_for_past_the_largest_bucket_names_it():
    runner = graph_runner(cached_model(), emulate=True)
    assert runner.bucket_for(5) == 16
    with pytest.raises(ValueError, match=r"17 tokens exceed the largest bucket \(16\); can_run\(\) says when "
                                         r"a step fits"):
        runner.bucket_for(17)


def test_a_prefill_capture_that_fails_part_way_keeps_no_bucket_and_runs_eagerly(graphs_platform):
    model = cached_model()
    broken = FailingProgram(model)
    runner = graph_runner(broken, graphs_platform)
    assert runner.graphs_enabled and runner.report is not None
    runner.release()
    broken.fail_after = broken.builds + 1  # the second bucket's capture fails
    with pytest.raises(RuntimeError, match="out of memory"):
        runner.resume()
    assert not runner.graphs_enabled and runner.report is None and not runner.can_run(3)
    broken.fail_after = None
    meta = AttentionMetadata.build([[1]], [3], [3], BLOCK, CPU)
    eager = model.forward(torch.tensor([1, 2, 3]), meta).clone()
    torch.testing.assert_close(runner.forward(torch.tensor([1, 2, 3]), meta), eager)  # eager, and right


class FailingProgram(torch.nn.Module):
    """A model whose layer program raises from its `fail_after`-th build on (None: never)."""

    def __init__(self, inner: ReferenceDecoder) -> None:
        super().__init__()
        self.inner, self.config, self.fail_after, self.builds = inner, inner.config, None, 0

    def layer_program(self) -> list[object]:
        self.builds += 1
        if self.fail_after is not None and self.builds > self.fail_after:
            raise RuntimeError("out of memory (simulated)")
        return self.inner.layer_program()

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(input_ids)


@pytest.mark.parametrize("tokens", [3, 20], ids=["bucketed", "past_the_buckets"])
@pytest.mark.parametrize(("ids", "message"), [
    # [1, T] ids (a batch dimension): copy_'s broadcast error, or a reshape error inside a layer.
    (lambda n: torch.arange(1, n + 1)[None], r"input_ids is \(1, {n}\) torch.int64; pass a 1-D integer tensor"),
    (lambda n: torch.arange(1, n + 1).float(), r"input_ids is \({n},\) torch.float32; pass a 1-D integer tensor"),
    (lambda n: list(range(1, n + 1)), r"input_ids is \[1, 2, 3"),
    (lambda n: torch.arange(1, n), r"input_ids has {m} tokens but meta.positions {n}; build the metadata for "
                                   r"this step's tokens"),
])
def test_forward_refuses_token_ids_that_are_not_the_steps(tokens, ids, message):
    model = cached_model()
    runner = graph_runner(model, emulate=True)
    meta = AttentionMetadata.build([[1, 2, 3, 4, 5]], [tokens], [tokens], BLOCK, CPU)
    before = model.kv.k.clone()
    expected = message.format(n=tokens, m=tokens - 1)
    with pytest.raises(ValueError, match=rf"GraphRunner.forward: {expected}"):
        runner.forward(ids(tokens), meta)
    with pytest.raises(ValueError, match=rf"LlamaDecoder.forward: {expected}"):
        model.forward(ids(tokens), meta)
    assert torch.equal(model.kv.k, before)  # refused before any layer wrote the cache


class WideEmbedding(ReferenceDecoder):
    """A Model whose embed_tokens breaks the protocol: one row for every token."""

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids[:1])


def test_an_embedding_of_the_wrong_shape_is_named_not_broadcast_into_the_bucket():
    """Copied into the bucket's static buffer, one row was broadcast to every token: wrong hidden
    states, no error."""
    model = WideEmbedding(ModelConfig(num_layers=1)).eval()
    model.kv = KVCache(model.config, 16, BLOCK, CPU, torch.float32)
    runner = graph_runner(model, emulate=True)
    meta = AttentionMetadata.build([[1]], [3], [3], BLOCK, CPU)
    with pytest.raises(ValueError, match=r"WideEmbedding.embed_tokens returned \(1, 128\) torch.float32 for 3 "
                                         r"tokens; a Model embeds \[T\] ids as \[T, 128\] torch.float32"):
        runner.forward(torch.tensor([1, 2, 3]), meta)
