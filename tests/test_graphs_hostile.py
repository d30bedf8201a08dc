"""The graph runners under hostile input, on the CPU (emulate=True runs their static path
eagerly): each bad value is refused before anything changes, naming it and the fix, and calls
in the wrong order are refused or repaired, never run on state left behind."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import numpy
import pytest
import torch

import torchhal
from torchhal.attention import SCRATCH_BLOCK, ReferenceBackend
from torchhal.core.graphs import GraphRunner
from torchhal.core.graphs.decode import BlockTable, DecodeGraphRunner
from torchhal.core.model import AttentionMetadata, KVCache, ModelConfig, ReferenceDecoder

BLOCK = 4
CPU = torch.device("cpu")


def placed_table(**bounds: int) -> BlockTable:
    rows = BlockTable(4, 16, BLOCK, CPU, max_steps=2, **bounds)
    rows.prepare([("x", 1, [1], 2, 1)], padded_rows=1)
    return rows


def snapshot(rows: BlockTable) -> tuple[object, ...]:
    return (rows.table.clone(), rows.inputs.clone(), dict(rows._row_of), list(rows._length), list(rows._written))


def same(before: tuple[object, ...], after: tuple[object, ...]) -> bool:
    return all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize(("batch", "padded", "steps", "message"), [
    # These changed the table (the request placed, x dropped) and then failed in a TypeError.
    ([("a", 1, [1, 2], 5.0, 1)], 2, 1, "request 'a' has 5.0 KV tokens; pass an int"),
    ([("a", 1, [1, 2], 5, 1)], 2.0, 1, "a decode batch of 1 padded to 2.0 rows does not fit 1..4 rows"),
    ([("a", 1, [1, 2], 5, 1)], 2, True, "a decode window of True steps does not fit 1..2 steps"),
    ([("a", 1, [1, 2], 5, True)], 2, 1, "request 'a' has True new tokens"),
    # These were written: a float block truncated to another block, a negative one read out of the cache.
    ([("a", 1, [1.5, 2], 5, 1)], 2, 1, "request 'a' holds 5 KV tokens in blocks [1.5, 2]; it needs exactly 2 "
                                       "blocks of 4, each an int in 1..15"),
    ([("a", 1, [-3, 2], 5, 1)], 2, 1, "in blocks [-3, 2]; it needs exactly 2 blocks of 4, each an int in 1..15"),
    ([("a", 1, [1, 16], 5, 1)], 2, 1, "in blocks [1, 16]; it needs exactly 2 blocks of 4, each an int in 1..15"),
    # A token outside the vocabulary: IndexError after the rows changed (a device assert on a GPU).
    ([("a", True, [1, 2], 5, 1)], 2, 1, "request 'a' has input token True; expected an int in 0..99"),
    ([("a", -1, [1, 2], 5, 1)], 2, 1, "request 'a' has input token -1; expected an int in 0..99"),
    ([("a", 100, [1, 2], 5, 1)], 2, 1, "request 'a' has input token 100; expected an int in 0..99"),
])
def test_a_bad_row_is_refused_before_the_table_changes(batch, padded, steps, message):
    rows = placed_table(num_blocks=16, vocab_size=100)
    before = snapshot(rows)
    with pytest.raises(ValueError, match=re.escape(message)):
        rows.prepare(batch, padded, steps)
    assert same(before, snapshot(rows))
    rows.prepare([("a", numpy.int64(7), [numpy.int64(1), 15], 5, 1)], 2)  # numpy ints are ints


def test_a_continuing_row_checks_only_the_blocks_it_starts():
    rows = placed_table(num_blocks=16)
    rows.prepare([("x", 2, [1], 3, 1)], 1)
    before = snapshot(rows)
    with pytest.raises(ValueError, match=re.escape("in blocks [1, 0]; it needs exactly 2 blocks of 4")):
        rows.prepare([("x", 3, [1, SCRATCH_BLOCK], 5, 2)], 1, steps=2)
    assert same(before, snapshot(rows))
    rows.prepare([("x", 3, [1, 9], 5, 2)], 1, steps=2)
    assert rows.table[0, :2].tolist() == [1, 9]


def cached_model(num_blocks: int = 16) -> ReferenceDecoder:
    model = ReferenceDecoder(ModelConfig(num_layers=1)).eval()
    model.kv = KVCache(model.config, num_blocks, BLOCK, CPU, torch.float32)
    return model


def decode_runner(model: ReferenceDecoder, **settings: object) -> DecodeGraphRunner:
    arguments = {"block_size": BLOCK, "backend": ReferenceBackend(), "batch_buckets": (1, 2),
                 "context_buckets": (16,), "emulate": True, **settings}
    return DecodeGraphRunner(model, torchhal.current_platform(), 0, **arguments)  # type: ignore[arg-type]


def test_the_decode_runner_bounds_tokens_by_the_vocabulary_and_blocks_by_the_cache():
    model = cached_model()
    runner = decode_runner(model)
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"request 'a' has input token {vocab}; expected an int in 0..{vocab - 1}"):
        runner.decode([("a", vocab, [1], 1, 1)])  # was IndexError in the embedding, the row already placed
    assert runner.rows.live == 0
    with pytest.raises(ValueError, match=r"each an int in 1..15 \(a block of the KV cache\)"):
        runner.decode([("a", 5, [16], 1, 1)])
    runner.release()
    model.kv = KVCache(model.config, 32, BLOCK, CPU, torch.float32)  # wake: a new, larger pool
    runner.resume()
    assert len(runner.decode([("a", 5, [31], 1, 1)])[0]) == 1


@pytest.mark.parametrize("chained", ["no", 1, None])
def test_a_window_with_a_non_bool_chained_is_refused_before_it_is_queued(chained):
    """'no' is truthy: the window ran as a continuation, then counting it failed in a TypeError,
    and the caller lost the queued window and its tokens."""
    runner = decode_runner(cached_model())
    first = runner.decode([("a", 5, [1], 1, 1)])
    before = snapshot(runner.rows), runner.steps, runner.windows
    with pytest.raises(ValueError, match=rf"chained must be True or False, got {chained!r}"):
        runner.launch([("a", first[0][0], [1], 2, 1)], chained=chained)
    assert same(before[0], snapshot(runner.rows)) and (runner.steps, runner.windows) == before[1:]
    reference = decode_runner(cached_model())
    reference.decode([("a", 5, [1], 1, 1)])
    second = [("a", first[0][0], [1], 2, 1)]
    assert runner.decode(second) == reference.decode(second)  # the refused call left nothing behind


def test_a_released_decode_runner_refuses_windows_until_resumed():
    """After release() (sleep) the decode runner took windows and ran them eagerly, step by
    step, on a GPU too: silently the slowest path, and on whatever cache the model then held."""
    runner = decode_runner(cached_model())
    expected = runner.decode([("a", 5, [1], 1, 1)])
    runner.release()
    assert runner.reason(1, 1) == "decode graphs are released (sleep); resume() captures them again"
    assert not runner.can_run(1, 1)
    with pytest.raises(RuntimeError, match=r"full-graph decode is unavailable: decode graphs are released \(sleep\); "
                                           r"resume\(\) captures them again"):
        runner.decode([("a", 5, [1], 1, 1)])
    runner.resume()
    assert runner.reason(1, 1) is None and runner.decode([("a", 5, [1], 1, 1)]) == expected


class SimGraph:
    """A graph that replays nothing: enough to see what a capture that fails leaves behind."""

    def replay(self) -> None:
        pass


@contextlib.contextmanager
def sim_capture(graph: SimGraph, pool: object, stream: object) -> Iterator[None]:
    yield


@pytest.fixture
def graphs_platform(make_registry):
    from torchhal.platforms import GraphSupport, hookimpl
    from torchhal.plugins.cpu import CpuPlatform

    class SimGraphsPlatform(CpuPlatform):
        name = "simgraphs"
        priority = -1

        def graph_support(self) -> GraphSupport:
            return GraphSupport(graph_class=SimGraph, new_pool=object, capture=sim_capture,
                                is_capturing=lambda: False)

    class Registration:
        @hookimpl
        def torchhal_register_platforms(self) -> list[CpuPlatform]:
            return [SimGraphsPlatform()]

    make_registry(Registration())
    return torchhal.get_platform("simgraphs")


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
    with pytest.raises(RuntimeError, match="capture did not finish"):  # not a silent eager step
        runner.launch([("a", 5, [1], 1, 1)])
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
