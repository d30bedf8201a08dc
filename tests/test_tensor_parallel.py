"""Tensor-parallel decoder and engine (CPU, gloo, one spawned group per test): TP=2 and TP=4
give TP=1's tokens; a rank reads only its slices; lifecycle and failures under TP=2."""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from torchhal.core.engine import GenerationEngine
from torchhal.core.graphs.decode import unsupported_reason
from torchhal.core.graphs.program import BreakStep, GraphStep
from torchhal.core.model import LlamaDecoder, ModelConfig
from torchhal.core.model.checkpoint import CheckpointError, load_checkpoint
from torchhal.core.model.parallel import RankShard, TensorParallelPlan

from . import tensor_parallel_workers as workers
from .hf_models import PROMPTS, save_hf_model

# name -> (family, overrides); each model covers what its comment says.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # GQA, 8 query heads and 4 KV heads: KV heads split at TP=2 and TP=4; biases on q/k/v and o_proj
    "gqa": ("llama3", dict(num_attention_heads=8, num_key_value_heads=4, attention_bias=True)),
    # 8 query heads and 2 KV heads: each KV head replicated on two ranks at TP=4
    "replicated_kv": ("llama3", dict(num_attention_heads=8, num_key_value_heads=2)),
    # q/k/v biases (Qwen2), a vocabulary of 125: the last shard is padded at TP=2 and TP=4
    "qwen2_bias": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=4, vocab_size=125)),
    # q/k norms (Qwen3), tied embeddings sharing the vocabulary shard, a vocabulary of 127
    "qwen3_tied": ("qwen3", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=127)),
    # one KV head (replicated on every rank), head_dim 24 != hidden / heads, tied embeddings over a
    # padded vocabulary, a sliding window shorter than prompt + generation, and a checkpoint
    # sharded across files (each rank's slices come from several)
    "mistral_mqa": ("mistral", dict(num_key_value_heads=1, head_dim=24, tie_word_embeddings=True, vocab_size=127,
                                    max_shard_size="40KB")),
}
NEW_TOKENS = 6


def save(name: str, directory: Path, seed: int = 0) -> Path:
    family, overrides = MODELS[name]
    save_hf_model(family, directory, seed=seed, **overrides)
    return directory


def single_device_tokens(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    engine = GenerationEngine.from_checkpoint(path, workers.engine_config(False))
    return [list(r.output) for r in engine.generate(prompts, NEW_TOKENS)]


def run_group(world: int, jobs: list[dict[str, Any]], tmp_path: Path, timeout_s: float = 60.0) -> list[dict]:
    """Spawn one group of `world` ranks running `jobs`; every rank's results, in rank order."""
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    store = tmp_path / f"store-{world}"
    procs = [ctx.Process(target=workers.run_rank, args=(rank, world, str(store), jobs, results, timeout_s))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    by_rank: dict[int, dict] = {}
    try:
        for _ in procs:
            try:
                status, value = results.get(timeout=240)
            except queue_module.Empty:
                pytest.fail(f"a rank of {world} did not answer within 240 s")
            if status != "ok":
                pytest.fail(value)
            by_rank[value[0]] = value[1]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return [by_rank[rank] for rank in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_tokens_equal_single_device(world: int, tmp_path: Path) -> None:
    """Each model, loaded from an HF checkpoint per rank, on the eager path with chunked
    prefill and with emulated full-graph decode: every rank's tokens are TP=1's."""
    paths = {name: save(name, tmp_path / name) for name in MODELS}
    expected = {name: single_device_tokens(path, PROMPTS) for name, path in paths.items()}
    jobs = [dict(kind="generate", name=name, path=str(path), prompts=PROMPTS, new_tokens=NEW_TOKENS)
            for name, path in paths.items()]
    ranks = run_group(world, jobs, tmp_path)
    for name in MODELS:
        for rank, results in enumerate(ranks):
            got = results[name]
            assert got["eager"] == expected[name], f"{name}: rank {rank} of {world}, eager"
            assert got["graphs"] == expected[name], f"{name}: rank {rank} of {world}, emulated decode graphs"
            assert got["emulated_steps"] > 0, f"{name}: the emulated decode graph never ran"
            assert got["logits_width"] == MODELS[name][1].get("vocab_size", 128), f"{name}: padding in the logits"
        assert len({results[name]["num_blocks"] for results in ranks}) == 1, "ranks sized different KV pools"


def test_lifecycle_and_a_failed_step_under_tp2(tmp_path: Path) -> None:
    """TP=2: a shard-shaped update is refused (HF shapes only); pause(retract)/continue and
    sleep/wake give the same tokens; an update from whole HF tensors gives TP=1's tokens
    after the same update. Then a step failing on rank 1 only: both ranks refuse to go on."""
    path, update = save("qwen2_bias", tmp_path / "model"), save("qwen2_bias", tmp_path / "update", seed=1)
    prompts = PROMPTS[:3]
    before = single_device_tokens(path, prompts)
    after = single_device_tokens(update, prompts)
    assert before != after, "the update must change the tokens for this test to see it"
    reference_model = dict(vocab_size=131, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                           intermediate_size=48, seed=3)
    reference_tokens = [list(r.output) for r in GenerationEngine(
        replace(workers.engine_config(False), model=ModelConfig(**reference_model))).generate(prompts, NEW_TOKENS)]
    jobs = [
        dict(kind="reference", name="reference", model=reference_model, prompts=prompts, new_tokens=NEW_TOKENS),
        dict(kind="lifecycle", name="lifecycle", path=str(path), update_path=str(update), prompts=prompts,
             new_tokens=NEW_TOKENS),
        dict(kind="failure", name="failure", path=str(path), prompts=prompts, failing_rank=1),
    ]
    ranks = run_group(2, jobs, tmp_path, timeout_s=8.0)
    for rank, results in enumerate(ranks):
        life = results["lifecycle"]
        fraction = workers.engine_config(False).kv_fraction
        assert life["num_blocks"] == int((1 << 20) * fraction) // life["bytes_per_block"] - 1, \
            f"rank {rank}: the KV pool must be sized from the least free memory of any rank (rank 0's 1 MiB)"
        assert "expected (64, 64)" in life["shard_shaped_update"], life["shard_shaped_update"]
        assert life["version_after_refusal"] == 0
        assert life["paused"] == before, f"rank {rank}: pause(retract)/continue changed the tokens"
        assert life["woken"] == before, f"rank {rank}: sleep/wake changed the tokens"
        assert life["updated"] == after, f"rank {rank}: the weight update differs from TP=1's"
        assert results["reference"]["tokens"] == reference_tokens, f"rank {rank}: the engine's own sharding"
        assert_both_refuse(rank, results["failure"])


def test_updates_of_a_tied_padded_vocabulary_under_tp2_give_tp1s_tokens(tmp_path: Path) -> None:
    """qwen3_tied (vocabulary 127: rank 1's shard ends in a padding row, which lm_head shares):
    the whole embedding, then lm_head alone (the same weight), then a whole checkpoint; each rank
    writes its rows of each and generates what one device does after the same updates."""
    from torchhal.core.model.checkpoint import iter_checkpoint_tensors

    path, update = save("qwen3_tied", tmp_path / "model"), save("qwen3_tied", tmp_path / "update", seed=1)
    prompts = PROMPTS[:3]
    engine = GenerationEngine.from_checkpoint(path, workers.engine_config(False))
    embedding = dict(iter_checkpoint_tensors(update))["model.embed_tokens.weight"]
    expected: dict[str, list[list[int]]] = {}
    for name, batch in (("embedding", {"model.embed_tokens.weight": embedding}),
                        ("lm_head", {"lm_head.weight": embedding * 2}), ("whole", iter_checkpoint_tensors(update))):
        engine.update_weights_from_tensors(batch)
        expected[name] = [list(r.output) for r in engine.generate(prompts, NEW_TOKENS)]
    assert len({str(tokens) for tokens in expected.values()}) == 3, "each update must change the tokens"
    job = dict(kind="tied_update", name="tied", path=str(path), update_path=str(update), prompts=prompts,
               new_tokens=NEW_TOKENS)
    for rank, results in enumerate(run_group(2, [job], tmp_path, timeout_s=8.0)):
        assert results["tied"] == expected, f"rank {rank}"


def assert_both_refuse(rank: int, failed: dict[str, Any]) -> None:
    assert failed["step"] != "returned", f"rank {rank}: the failed step returned"
    assert "runs no more steps" in failed["after"], failed["after"]
    assert failed["pending"] is None, "the failed generate call must withdraw its requests"


def test_a_step_cut_short_in_its_bookkeeping_on_one_rank_breaks_every_rank(tmp_path: Path) -> None:
    """Rank 0's plan is cut short after an admission (as Ctrl-C could), so its book is
    recovered: the ranks' books now differ, so both refuse to go on, as after a failed step."""
    path = save("qwen2_bias", tmp_path / "model")
    job = dict(kind="failure", name="cut_short", path=str(path), prompts=PROMPTS[:3], failing_rank=0, cut="admission")
    for rank, results in enumerate(run_group(2, [job], tmp_path, timeout_s=4.0)):
        assert_both_refuse(rank, results["cut_short"])


def test_closing_the_group_releases_a_live_engines_graphs_first(tmp_path: Path) -> None:
    """NCCL cannot destroy a communicator that a captured graph still uses (close would wait
    for ever), so `close()` first has every engine of the group drop its graphs, while the
    group still works; the engine then refuses steps, naming the close. The group holds its
    engines weakly: one already gone costs nothing."""
    model = dict(vocab_size=131, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                 seed=3)
    ranks = run_group(2, [dict(kind="close", name="close", model=model, prompts=PROMPTS[:2])], tmp_path)
    for rank, results in enumerate(ranks):
        closed = results["close"]
        assert closed["collected"], f"rank {rank}: the group kept a dropped engine alive"
        assert closed["sum_while_releasing"] == 2.0, f"rank {rank}: the graphs were not released before the close"
        assert closed["after"].startswith("this engine's group was closed (DeviceGroup.close)"), closed["after"]
        assert closed["wake"] == closed["after"], "a closed engine must not wake (its graphs would be recaptured)"
    assert ranks[0]["close"]["tokens"] == ranks[1]["close"]["tokens"]


def test_a_device_wait_under_replayed_collectives_ends_within_the_group_timeout(tmp_path: Path) -> None:
    """No backend times out a collective replayed from a graph, so the engine bounds its own
    waits on device work by the group's timeout: a rank whose device never finishes raises
    CollectiveError naming the wait, and both ranks end broken, none hangs."""
    model = dict(vocab_size=131, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                 seed=3)
    ranks = run_group(2, [dict(kind="stalled_device", name="stall", model=model, prompts=PROMPTS[:2])], tmp_path,
                      timeout_s=2.0)
    stalled, peer = ranks[0]["stall"], ranks[1]["stall"]
    assert stalled["after"].startswith("CollectiveError: a step's sampled tokens: device work in group"), stalled
    assert "did not finish within the group's timeout (2 s)" in stalled["after"], stalled
    assert 2.0 <= stalled["seconds"] < 20, stalled
    assert peer["after"].startswith("CollectiveError"), peer  # its next collective lost its peer
    assert stalled["broken"] and peer["broken"]


def test_wait_for_returns_once_the_work_is_done_and_raises_past_the_timeout() -> None:
    import time
    from datetime import timedelta

    from torchhal.distributed import CollectiveError, init_group

    class DoneAfter:
        def __init__(self, polls: int) -> None:
            self.polls = polls

        def query(self) -> bool:
            self.polls -= 1
            return self.polls < 0

    group = init_group(rank=0, world_size=1, local_rank=0, timeout=timedelta(seconds=0.3))
    try:
        event = DoneAfter(1000)
        group.wait_for(event, "a window")
        assert event.polls == -1
        started = time.monotonic()
        with pytest.raises(CollectiveError, match=r"^a window: device work in group .* at rank 0 of 1 did not finish"):
            group.wait_for(DoneAfter(10**12), "a window")
        assert 0.3 <= time.monotonic() - started < 5
    finally:
        group.close()


def test_a_release_that_raises_leaves_the_group_open_and_close_again_finishes() -> None:
    from torchhal.distributed import init_group

    class Holder:
        calls = 0

        def release(self) -> None:
            self.calls += 1
            if self.calls == 1:
                raise ValueError("cannot drop its graphs yet")

    group = init_group(rank=0, world_size=1, local_rank=0)
    holder = Holder()
    group.release_on_close(holder.release)
    # A release that raises leaves the group open and registered: close() again finishes the job.
    with pytest.raises(ValueError, match="cannot drop its graphs yet"):
        group.close()
    assert float(group.comm.all_reduce(torch.ones(1))) == 1.0
    group.close()
    assert holder.calls == 2 and group.closed


def test_closing_a_group_of_one_rank_ends_its_engine_as_at_any_size() -> None:
    """SPMD code written for N ranks behaves the same at N = 1: after group.close() the engine
    refuses steps, and an engine is not built on a closed group."""
    from torchhal.core.engine import EngineConfig
    from torchhal.distributed import CollectiveError, init_group

    config = EngineConfig(model=ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
                                            intermediate_size=48, max_position=64), max_kv_slots=128)
    group = init_group(rank=0, world_size=1, local_rank=0)
    engine = GenerationEngine(config, group=group)
    assert engine.group is None  # one rank: the single-device engine
    assert len(engine.generate([[1, 2, 3]], 2)[0].output) == 2
    group.close()
    with pytest.raises(RuntimeError, match=r"group was closed \(DeviceGroup.close\)"):
        engine.generate([[1, 2, 3]], 2)
    with pytest.raises(CollectiveError, match=r"is closed \(DeviceGroup.close\); make a new group with init_group"):
        GenerationEngine(config, group=group)


def test_a_rank_reads_only_its_slices(tmp_path: Path) -> None:
    """Each rank's parameters are exactly its slices of the HF tensors (padding rows zero),
    and it reads only those bytes: about half the sharded weights, plus the replicated ones."""
    path = save("qwen2_bias", tmp_path / "model")
    full, whole = load_checkpoint(path)
    sharded = replicated = 0
    for name, param in full.named_parameters():
        nbytes = param.numel() * param.element_size()
        if RankShard(TensorParallelPlan(full.config, 2), 0).slice_of(name) is None:
            replicated += nbytes
        else:
            sharded += nbytes
    assert whole.bytes_read == sharded + replicated
    for rank in range(2):
        model, report = load_checkpoint(path, tensor_parallel=(2, rank))
        shard = model.shard
        assert shard is not None and shard.rank == rank
        full_params = dict(full.named_parameters())
        for name, param in model.named_parameters():
            assert torch.equal(param, shard.take(name, full_params[name])), f"rank {rank}: {name}"
        own = 0
        for name, param in full.named_parameters():
            part = shard.slice_of(name)
            nbytes = param.numel() * param.element_size()
            own += nbytes if part is None else nbytes // part.full * part.count
        assert report.bytes_read == own, f"rank {rank} read {report.bytes_read} bytes, its slices are {own}"
        assert report.bytes_read < replicated + 0.51 * sharded
    padded = load_checkpoint(path, tensor_parallel=(2, 1))[0]
    assert not padded.model.embed_tokens.weight[-1].any(), "the vocabulary shard's padding row must be zero"


def test_a_model_that_cannot_be_split_is_refused_before_any_weight_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchhal.core.model import checkpoint
    from torchhal.distributed import DeviceGroup, RankPlacement
    from torchhal.platforms import current_platform

    path = save("gqa", tmp_path / "model")
    touched: list[str] = []
    monkeypatch.setattr(LlamaDecoder, "materialize", lambda *a: touched.append("allocate"))
    monkeypatch.setattr(checkpoint, "_read_tensor", lambda *a: touched.append("read"))
    with pytest.raises(CheckpointError, match=r"num_attention_heads = 8 is not divisible by 3.*"
                                              r"choose a tensor-parallel size from \[1, 2, 4, 8\]"):
        load_checkpoint(path, tensor_parallel=(3, 0))
    platform = current_platform()
    group = DeviceGroup("three", RankPlacement(0, 3, 0, 1), platform, platform.device(0),  # type: ignore[arg-type]
                        comm=None, host=AgreeingHost(3), timeout=None)  # comm never reached
    with pytest.raises(ValueError, match="cannot split this model over 3 ranks"):
        GenerationEngine.from_checkpoint(path, workers.engine_config(False), group=group)
    assert touched == []


class AgreeingHost:
    """A host communicator of `world_size` ranks that all passed what this one passes."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return torch.cat([tensor] * self.world_size, dim)


class FakeCommunicator:
    """Enough of a Communicator to build a layer program (its collectives are never run)."""

    def __init__(self, rank: int, world_size: int, graph_capturable: bool) -> None:
        self.rank, self.world_size, self.graph_capturable = rank, world_size, graph_capturable
        self.device = torch.device("cpu")


def test_layer_program_collectives_and_the_single_rank_program() -> None:
    """One rank (no plan, or a plan of one): today's program, no collective. Two ranks: one
    all-reduce after o_proj and one after down_proj per layer, graph steps when the
    communicator can be captured, breaks (which refuse a real decode graph) when not."""
    config = ModelConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=48)
    plain = [(type(s).__name__, s.name) for s in LlamaDecoder(config).layer_program()]
    one = LlamaDecoder(config, (TensorParallelPlan(config, 1), 0))
    assert one.shard is None and [(type(s).__name__, s.name) for s in one.layer_program()] == plain
    assert all("all_reduce" not in name for _, name in plain)
    with torch.device("meta"):
        part = LlamaDecoder(config, (TensorParallelPlan(config, 2), 1))
    for capturable, kind in ((True, GraphStep), (False, BreakStep)):  # one decoder: a new group, a new program
        part.use_communicator(FakeCommunicator(1, 2, capturable))  # type: ignore[arg-type]
        reduces = [s for s in part.layer_program() if s.name.endswith("all_reduce")]
        assert [s.name for s in reduces] == [f"layer{i}.{p}.all_reduce" for i in range(2)
                                             for p in ("o_proj", "down_proj")]
        assert all(isinstance(s, kind) for s in reduces)
        part.kv = object()  # type: ignore[assignment]  # only checked for presence
        reason = unsupported_reason(part)
        assert (reason is None) == capturable, reason
        assert unsupported_reason(part, emulate=True) is None
    with pytest.raises(AssertionError, match="communicator is rank 0 of 2, this shard is rank 1 of 2"):
        part.use_communicator(FakeCommunicator(0, 2, False))  # type: ignore[arg-type]


class RecordingCommunicator(FakeCommunicator):
    """Runs nothing across ranks: records each collective's kind, shape and dtype."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size, graph_capturable=True)
        self.calls: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.calls.append(("all_reduce", tuple(tensor.shape), tensor.dtype))
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Any = None) -> torch.Tensor:
        self.calls.append(("all_gather", tuple(tensor.shape), tensor.dtype))
        return torch.cat([tensor] * self.world_size, dim)


def test_the_collective_benchmark_makes_a_decode_steps_collectives() -> None:
    """benchmarks/collective_latency.py times "a decode step's collectives": the decoder's own,
    in kind, number, order and the all-reduce's shape and dtype (embedding, two a layer, logits)."""
    from tests.benchmark_modules import load_benchmark

    config = ModelConfig(vocab_size=50, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                         intermediate_size=48)
    shard = LlamaDecoder(config, (TensorParallelPlan(config, 2), 0)).to(torch.bfloat16)
    decoder_comm = RecordingCommunicator(0, 2)
    shard.use_communicator(decoder_comm)  # type: ignore[arg-type]
    batch = 3
    hidden = shard.embed_tokens(torch.tensor([1, 7, 40]))
    reduces = [s for s in shard.layer_program() if s.name.endswith("all_reduce")]
    shard.logits(hidden, torch.arange(batch))
    decoder_calls = decoder_comm.calls[:1] + [decoder_comm.calls[0]] * len(reduces) + decoder_comm.calls[1:]

    benchmark = load_benchmark("collective_latency")
    bench_comm = RecordingCommunicator(0, 2)
    benchmark.step_collectives(bench_comm, torch.ones(batch, config.hidden_size, dtype=torch.bfloat16),
                               torch.ones(batch, config.vocab_size // 2), config.num_layers)
    assert [call[0] for call in bench_comm.calls] == [call[0] for call in decoder_calls]
    assert [call for call in bench_comm.calls if call[0] == "all_reduce"] == \
        [call for call in decoder_calls if call[0] == "all_reduce"]
    assert bench_comm.calls[-1][2] == decoder_calls[-1][2] == torch.float32  # the logits are gathered in fp32
