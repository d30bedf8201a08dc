"""Full-graph decode on CPU: buckets, the in-place block table, the scratch block, the reasons
it refuses a batch, the step's device-built metadata, and (graphs emulated: the same padded
static step run eagerly) tokens identical to the eager engine while requests finish and join.
Replay itself runs on a GPU in tests/test_gpu_decode_graphs.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import torchhal
from torchhal.attention import SCRATCH_BLOCK, ReferenceBackend, build_metadata
from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine, PauseMode
from torchhal.core.graphs.decode import (
    BlockTable,
    DecodeGraphRunner,
    attention_layer,
    pick_bucket,
    unsupported_reason,
)
from torchhal.core.graphs.program import BreakStep, GraphStep
from torchhal.core.model import AttentionMetadata, KVCache, ModelConfig, ReferenceDecoder

BLOCK = 4
CPU = torch.device("cpu")


def table(max_rows: int = 4, max_context: int = 16, max_steps: int = 1) -> BlockTable:
    return BlockTable(max_rows, max_context, BLOCK, CPU, max_steps)


def slot(block: int, offset: int) -> int:
    return block * BLOCK + offset


SCRATCH = slot(SCRATCH_BLOCK, 0)


# -- buckets and step names ------------------------------------------------------------------------
def test_pick_bucket_is_the_smallest_that_fits():
    buckets = [1, 2, 4, 8, 32]
    assert [pick_bucket(buckets, n) for n in (1, 2, 3, 4, 5, 8, 9, 32)] == [1, 2, 4, 4, 8, 8, 32, 32]
    assert pick_bucket(buckets, 33) is None


def test_attention_layer_from_field_or_name():
    run = lambda s, n, m: None  # noqa: E731
    assert attention_layer(BreakStep("anything", run, layer=5)) == 5
    assert attention_layer(BreakStep("layer12.attention", run)) == 12
    assert attention_layer(BreakStep("layer1.moe_dispatch", run)) is None


# -- the block table -------------------------------------------------------------------------------
def test_joining_rows_are_written_whole_and_padded_rows_write_the_scratch_block():
    rows = table()
    placed = rows.prepare([("a", 11, [3, 4], 6, 1), ("b", 12, [7], 2, 1)], padded_rows=4)
    assert placed == [0, 1] and rows.rows_written == 2
    assert rows.table[0].tolist() == [3, 4, SCRATCH_BLOCK, SCRATCH_BLOCK]
    assert rows.table[1].tolist() == [7, SCRATCH_BLOCK, SCRATCH_BLOCK, SCRATCH_BLOCK]
    # token, position, slot, live: a's 6th token sits at position 5 = block 4 offset 1.
    assert rows.step_inputs[:, :4].tolist() == [[11, 12, 0, 0], [5, 1, 0, 0], [slot(4, 1), slot(7, 1), SCRATCH,
                                                                             SCRATCH], [1, 1, 0, 0]]


def test_a_continuing_row_uploads_only_the_blocks_it_starts():
    rows = table()
    rows.prepare([("a", 11, [3], 4, 1), ("b", 12, [7], 2, 1)], padded_rows=2)
    rows.table[1, 1] = 99  # a sentinel past b's blocks: a continuing row is not rewritten
    placed = rows.prepare([("a", 21, [3, 5], 5, 1), ("b", 22, [7], 3, 1)], padded_rows=2)
    assert placed == [0, 1] and rows.rows_written == 2 and rows.block_uploads == 1
    assert rows.table[0, :2].tolist() == [3, 5] and rows.table[1, 1].item() == 99
    assert rows.step_inputs[:, :2].tolist() == [[21, 22], [4, 2], [slot(5, 0), slot(7, 2)], [1, 1]]
    rows.prepare([("a", 31, [3, 5], 6, 1), ("b", 32, [7], 4, 1)], padded_rows=2)  # inside their blocks
    assert rows.block_uploads == 1  # no upload at all: a step's host work does not grow with the context


def test_a_leaving_request_frees_its_row_and_the_highest_row_moves_into_it():
    rows = table()
    rows.prepare([("a", 1, [1], 1, 1), ("b", 2, [2], 2, 1), ("c", 3, [4, 5], 5, 1)], padded_rows=4)
    placed = rows.prepare([("c", 3, [4, 5], 6, 1), ("b", 2, [2], 3, 1)], padded_rows=2)
    assert placed == [0, 1] and rows.rows_moved == 1 and rows.rows_written == 3  # moved, not rewritten
    assert rows.table[0, :2].tolist() == [4, 5]
    assert rows.row_of("a") is None and rows.live == 2
    joined = rows.prepare([("c", 3, [4, 5], 7, 1), ("b", 2, [2], 4, 1), ("d", 4, [11], 2, 1)], 4)
    assert joined == [0, 1, 2] and rows.table[2, :1].tolist() == [11]


def test_a_request_whose_blocks_changed_gets_its_row_rewritten():
    rows = table()
    rows.prepare([("a", 1, [3], 3, 1)], padded_rows=1)
    rows.prepare([("a", 1, [20, 21], 5, 1)], padded_rows=1)  # retracted, admitted again elsewhere
    assert rows.rows_written == 2 and rows.table[0, :2].tolist() == [20, 21]


# -- the runner ------------------------------------------------------------------------------------
def small_model(num_blocks: int = 16) -> ReferenceDecoder:
    model = ReferenceDecoder(ModelConfig(num_layers=2)).eval()
    model.kv = KVCache(model.config, num_blocks, BLOCK, CPU, torch.float32)
    return model


def decode_runner(model: ReferenceDecoder, **settings: object) -> DecodeGraphRunner:
    return DecodeGraphRunner(model, torchhal.current_platform(), 0, block_size=BLOCK, backend=ReferenceBackend(),
                             **settings)  # type: ignore[arg-type]


def test_reasons_it_refuses(make_registry):
    make_registry()
    model = small_model()
    plain = decode_runner(model)
    assert plain.unsupported == "platform 'cpu' declares no graph support"
    assert plain.reason(1, 1) == plain.unsupported and not plain.can_run(1, 1)
    runner = decode_runner(model, batch_buckets=(2, 4), context_buckets=(16,), emulate=True)
    assert runner.reason(4, 16) is None and runner.can_run(3, 9)
    assert runner.reason(5, 3) == "decode batch 5 exceeds the largest batch bucket 4"
    assert runner.reason(1, 17) == "context of 17 tokens exceeds the largest context bucket 16"
    assert runner.buckets_for(3, 9) == (4, 16) and runner.buckets_for(1, 1) == (2, 16)


def test_models_it_cannot_graph_say_why():
    assert "lacks layer_program, embed_tokens, logits()" in str(unsupported_reason(torch.nn.Linear(2, 2)))
    model = small_model()
    model.kv = None
    assert "kv is not allocated" in str(unsupported_reason(model))
    model = small_model()
    program = model.layer_program()
    model.layer_program = lambda: [*program, BreakStep("router", lambda s, n, m: None)]  # type: ignore[method-assign]
    assert "break step 'router' is not attention" in str(unsupported_reason(model))
    model.layer_program = lambda: [GraphStep("g", lambda s: None)]  # type: ignore[method-assign]
    assert unsupported_reason(model) is None
    model.decode_graph_refusal = "soft-capped attention"  # type: ignore[assignment]
    assert unsupported_reason(model) == "soft-capped attention"


def test_the_steps_metadata_is_built_on_the_device_and_equals_a_build_from_host_lists(make_registry):
    """The emulated step reads the same metadata a replayed one does: for each step of a window
    it equals `build_metadata` of the rows' lengths, with padded rows at length 0 on the scratch block."""
    make_registry()
    runner = decode_runner(small_model(), batch_buckets=(4,), context_buckets=(16,), steps_per_sync=3,
                           emulate=True)
    batch = [("a", 5, [3, 4], 7, 3), ("b", 6, [7], 2, 1)]  # a: positions 4, 5, 6; b: position 1, then done
    runner.rows.prepare(batch, padded_rows=4, steps=3)
    for step in range(3):
        got = runner.step_metadata(4, 16)
        a_len, b_len = 5 + step, 2 + step
        want = build_metadata([[3, 4], [7], [], []], [a_len, b_len, 0, 0], [1, 1, 1, 1], BLOCK, CPU, max_blocks=4)
        assert got.seq_lens.tolist() == want.seq_lens.tolist()
        assert got.block_tables.tolist() == want.block_tables.tolist()
        # b wants one token: its later steps write the scratch block (their tokens are dropped).
        b_slot = want.slot_mapping[1].item() if step == 0 else SCRATCH
        assert got.slot_mapping.tolist() == [want.slot_mapping[0].item(), b_slot, SCRATCH, SCRATCH]
        assert got.query_start.tolist() == [0, 1, 2, 3, 4] and got.max_query_len == 1
        runner.advance_inputs(4, torch.zeros(4, dtype=torch.long))


def eager_prefill(model: ReferenceDecoder, prompts: list[list[int]], tables: list[list[int]]) -> list[int]:
    lengths = [len(p) for p in prompts]
    meta = AttentionMetadata.build(tables, lengths, lengths, BLOCK, CPU)
    hidden = model(torch.tensor([t for p in prompts for t in p]), meta)
    last = torch.tensor([sum(len(p) for p in prompts[: i + 1]) - 1 for i in range(len(prompts))])
    return model.logits(hidden, last).argmax(-1).tolist()


def test_padded_rows_write_only_the_scratch_block_and_tokens_match_eager(make_registry):
    make_registry()
    model = small_model()
    runner = decode_runner(model, batch_buckets=(4,), context_buckets=(16,), emulate=True)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    tables = [[1], [2], [3, 5]]  # the third request's decode token starts block 5
    tokens = eager_prefill(model, prompts, [t[:1] for t in tables])
    assert model.kv is not None
    before_k, before_v = model.kv.k.clone(), model.kv.v.clone()
    # The eager decode step on a copy of the cache is the reference.
    reference = small_model()
    reference.load_state_dict(model.state_dict())
    assert reference.kv is not None
    reference.kv.k.copy_(before_k)
    reference.kv.v.copy_(before_v)
    meta = AttentionMetadata.build(tables, [4, 3, 5], [1, 1, 1], BLOCK, CPU)
    expected = reference.logits(reference(torch.tensor(tokens), meta), torch.arange(3)).argmax(-1).tolist()
    got = runner.decode([(i, tokens[i], tables[i], len(prompts[i]) + 1, 1) for i in range(3)])  # padded to 4 rows
    assert got == [[token] for token in expected]
    changed = ((model.kv.k != before_k) | (model.kv.v != before_v)).any(-1).any(-1).any(0).flatten()
    assert set(changed.nonzero().flatten().tolist()) == {slot(1, 3), slot(2, 2), slot(5, 0), SCRATCH}


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 10, [300, 3], [7] * 20, [2], [11, 12, 13, 14]]
NEW_TOKENS = [6, 3, 9, 5, 7, 4, 8]


def run_engine(engine: GenerationEngine) -> list[tuple[int, ...]]:
    rids = [engine.add_request(p, n) for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
    while any(rid not in engine.results for rid in rids):
        engine.step()
    return [engine.results.pop(rid).output for rid in rids]


CONFIG = EngineConfig(max_kv_slots=512, max_running=3)  # 3 running: the rest join as others finish
# Blocks of 4: every request spans several blocks, so rows start new blocks mid-window.
EMULATED = DecodeGraphConfig(batch_buckets=(1, 2, 4), context_buckets=(8, 16, 32), emulate=True)
SINGLE_STEPS = replace(EMULATED, steps_per_sync=1)


def graph_engine(settings: DecodeGraphConfig = EMULATED, **overrides: object) -> GenerationEngine:
    return GenerationEngine(EngineConfig(**{"max_kv_slots": 512, "max_running": 3, "kv_block_size": BLOCK,
                                            **overrides},
                                         decode_graphs=settings))


@pytest.fixture(scope="module")
def reference() -> list[tuple[int, ...]]:
    return run_engine(GenerationEngine(CONFIG))


def test_emulated_full_graph_decode_matches_eager_while_requests_finish_and_join(reference):
    engine = graph_engine(SINGLE_STEPS)
    runner = engine.decode_runner
    assert runner is not None
    got = run_engine(engine)
    assert got == reference
    assert [len(o) for o in got] == NEW_TOKENS
    # The decode path really ran, rows moved as requests left, and joiners were written once each.
    assert runner.steps >= 10 and runner.rows.rows_moved >= 1
    assert len(PROMPTS) <= runner.rows.rows_written <= 2 * len(PROMPTS)
    assert runner.rows.live == 0  # every finished request gave its row back


def test_compiled_layers_run_in_eager_and_window_steps_with_the_same_tokens(reference):
    """`compile_layers` routes every layer's arithmetic through torch.compile (here a backend that
    counts what it compiles and runs it unfused: the numbers stay those of the uncompiled model)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    engine = graph_engine(replace(EMULATED, steps_per_sync=3), compile_layers=counter)
    runner = engine.decode_runner
    assert runner is not None
    assert run_engine(engine) == reference
    assert runner.windows < runner.steps
    # pre-attention, the MLP block up to SwiGLU and the final norm, each once for one token and
    # once for any other count (the token dimension is dynamic): prefills, padded batches and
    # windows share them. The output projections run outside: they add themselves to the
    # residual in place, and here (no platform kernel) always can, so no norm has one pending.
    assert counter.frame_count == 6, counter.frame_count
    torch._dynamo.reset()


def test_compile_layers_needs_a_model_that_offers_it():
    class Plain(ReferenceDecoder):
        compile_layers = None  # type: ignore[assignment]

    with pytest.raises(TypeError, match="has no compile_layers"):
        GenerationEngine(EngineConfig(max_kv_slots=64, compile_layers="inductor"), model=Plain(ModelConfig()))


# -- decode windows: several steps per token read-back ---------------------------------------------
def free_list(engine: GenerationEngine) -> list[int]:
    return list(engine.blocks._free)


@pytest.mark.parametrize("steps", [2, 3, 8])
def test_windows_give_the_tokens_of_single_steps_with_fewer_read_backs(reference, steps):
    engine = graph_engine(replace(EMULATED, steps_per_sync=steps))
    runner = engine.decode_runner
    assert runner is not None
    assert run_engine(engine) == reference
    assert runner.windows < runner.steps  # some windows ran several steps
    if steps < 8:  # windows of 8 cover these requests' tokens at once: nothing to chain
        assert runner.chained >= 1  # some were queued before the previous one's tokens landed
    assert engine.blocks.available == engine.blocks.num_blocks and runner.rows.live == 0


def test_a_window_runs_only_the_steps_its_requests_still_need_and_none_while_others_wait():
    engine = graph_engine(replace(EMULATED, steps_per_sync=4), max_running=1)
    runner = engine.decode_runner
    assert runner is not None
    first, second = engine.add_request([1, 2, 3], 10), engine.add_request([4, 5], 10)
    while first not in engine.results:
        engine.step()
    # The second request waited the whole time: 9 single steps, 9 read-backs.
    assert (runner.steps, runner.windows) == (9, 9)
    while second not in engine.results:
        engine.step()
    # Alone: 9 tokens after its prefill in windows of 4, 4 and 1.
    assert (runner.steps, runner.windows) == (18, 12)
    eager = GenerationEngine(EngineConfig(max_kv_slots=512, max_running=1))
    assert [r.output for r in eager.generate([[1, 2, 3], [4, 5]], 10)] == [
        engine.results.pop(first).output, engine.results.pop(second).output
    ]


def test_a_stop_token_inside_a_window_ends_the_request_there_and_frees_every_block(reference):
    # A token some request produces mid-way (not its first), so windows must cut after it.
    stop = next(out[3] for out in reference if len(out) > 5)
    eager = run_engine(GenerationEngine(replace(CONFIG, eos_token=stop)))
    engine = graph_engine(replace(EMULATED, steps_per_sync=8), eos_token=stop)
    got = run_engine(engine)
    assert got == eager
    assert any(len(out) < n for out, n in zip(got, NEW_TOKENS, strict=True))  # some request was cut
    assert all(out[-1] == stop or len(out) == n for out, n in zip(got, NEW_TOKENS, strict=True))
    assert engine.blocks.available == engine.blocks.num_blocks


def test_chained_windows_keep_tokens_and_slots_exact_through_a_stop_token():
    prompts, new_tokens = PROMPTS[:3], 20
    plain = [r.output for r in GenerationEngine(CONFIG).generate(prompts, new_tokens)]
    stop = plain[1][9]  # deep in a chained window of request 1
    eager = [r.output for r in GenerationEngine(replace(CONFIG, eos_token=stop)).generate(prompts, new_tokens)]
    engine = graph_engine(replace(EMULATED, steps_per_sync=4), eos_token=stop)
    runner = engine.decode_runner
    assert runner is not None
    assert [r.output for r in engine.generate(prompts, new_tokens)] == eager
    assert runner.chained >= 2 and engine.blocks.available == engine.blocks.num_blocks
    assert any(len(out) < new_tokens for out in eager)  # the stop cut a request short
    # A window still queued for requests that all stopped is landed by the lifecycle calls.
    assert engine.flush_cache(empty_cache=False).flushed and engine.executor.in_flight is None


def test_a_window_that_fails_to_land_gives_back_both_windows_and_is_recomputed():
    prompts, new_tokens = PROMPTS[:3], 20
    expected = [r.output for r in GenerationEngine(CONFIG).generate(prompts, new_tokens)]
    engine = graph_engine(replace(EMULATED, steps_per_sync=4))
    runner = engine.decode_runner
    assert runner is not None
    rids = [engine.add_request(p, new_tokens) for p in prompts]
    engine.step()  # prefill
    engine.step()  # a window launched; its tokens land at the next step
    assert engine.executor.in_flight is not None
    wait = engine.executor.wait
    engine.executor.wait = lambda event, what: (_ for _ in ()).throw(RuntimeError("device fault"))
    with pytest.raises(RuntimeError, match="device fault"):
        engine.step()  # chains the next window, then fails to read the first
    assert engine.executor.in_flight is None
    # Every running request holds exactly the KV of its landed tokens (none of either window).
    for request in engine.running:
        assert request.kv_tokens == len(request.prompt) + len(request.output) - 1
    engine.executor.wait = wait
    while any(rid not in engine.results for rid in rids):
        engine.step()
    assert [engine.results.pop(rid).output for rid in rids] == expected
    assert engine.blocks.available == engine.blocks.num_blocks


def test_a_window_that_fails_gives_back_every_block_it_reserved_and_is_recomputed(reference):
    engine = graph_engine(replace(EMULATED, steps_per_sync=4), max_running=4)
    runner = engine.decode_runner
    assert runner is not None
    rids = [engine.add_request(p, n) for p, n in zip(PROMPTS[:4], NEW_TOKENS[:4], strict=True)]
    engine.step()  # every prompt prefilled; the next step is a window
    kv_before = {r.rid: (list(r.blocks), r.kv_tokens) for r in engine.running}
    free_before, outputs_before = free_list(engine), {r.rid: list(r.output) for r in engine.running}
    step = runner._step
    calls = []

    def failing(batch: int, context: int) -> None:
        calls.append(1)
        if len(calls) == 2:  # the second step of the window
            raise RuntimeError("device fault")
        step(batch, context)

    runner._step = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="device fault"):
        engine.step()
    assert free_list(engine) == free_before
    assert {r.rid: (list(r.blocks), r.kv_tokens) for r in engine.running} == kv_before
    assert {r.rid: list(r.output) for r in engine.running} == outputs_before
    runner._step = step  # type: ignore[method-assign]
    while any(rid not in engine.results for rid in rids):
        engine.step()
    assert [engine.results.pop(rid).output for rid in rids] == reference[:4]
    assert runner.windows < runner.steps


def test_a_pool_too_short_for_the_window_runs_single_steps_with_the_same_tokens():
    # Two requests of 3 + 6 tokens in 3 blocks of 4: a first window of 5 each needs 4 blocks.
    config = EngineConfig(max_kv_slots=12, max_running=2, kv_block_size=BLOCK)
    prompts = [[1, 2, 3], [4, 5, 6]]
    eager = [r.output for r in GenerationEngine(config).generate(prompts, 6)]
    engine = GenerationEngine(replace(config, decode_graphs=replace(EMULATED, steps_per_sync=5)))
    runner = engine.decode_runner
    assert runner is not None
    free_before = engine.blocks.available
    rids = [engine.add_request(p, 6) for p in prompts]
    engine.step()  # prefill
    engine.step()  # the first decode: the pool is short for the window, so one step
    engine.drain()
    assert (runner.steps, runner.windows) == (1, 1)
    while any(rid not in engine.results for rid in rids):
        engine.step()
    assert [engine.results.pop(rid).output for rid in rids] == eager
    assert engine.blocks.available == free_before


def test_window_settings_are_checked():
    with pytest.raises(ValueError, match=r"steps_per_sync = 0 must be a positive int"):
        DecodeGraphConfig(steps_per_sync=0)


def test_a_window_fills_the_future_slots_across_a_block_edge_and_rows_needing_fewer_steps_get_scratch():
    rows = table(max_steps=3)
    rows.prepare([("a", 11, [3, 6], 6, 3), ("b", 12, [8], 2, 1)], padded_rows=2, steps=3)  # a: positions 3, 4, 5
    assert rows.step_inputs[:, :2].tolist() == [[11, 12], [3, 1], [slot(3, 3), slot(8, 1)], [1, 1]]
    assert rows.future[:, :2].tolist() == [[slot(6, 0), SCRATCH], [slot(6, 1), SCRATCH], [SCRATCH, SCRATCH]]
    # The next window: "a" continues with 3 more tokens (the last starts block 9), "b" with 1.
    rows.prepare([("a", 21, [3, 6, 9], 9, 3), ("b", 22, [8], 3, 1)], padded_rows=2, steps=3)
    assert rows.rows_written == 2 and rows.block_uploads == 1
    assert rows.step_inputs[:, :2].tolist() == [[21, 22], [6, 2], [slot(6, 2), slot(8, 2)], [1, 1]]
    assert rows.future[:2, 0].tolist() == [slot(6, 3), slot(9, 0)] and rows.table[0, :3].tolist() == [3, 6, 9]


def test_emulated_decode_beyond_the_largest_context_bucket_falls_back_and_stays_exact(reference):
    engine = graph_engine(DecodeGraphConfig(batch_buckets=(4,), context_buckets=(8,), emulate=True))
    assert run_engine(engine) == reference
    assert engine.decode_runner is not None and engine.decode_runner.steps >= 1  # short requests used graphs


def test_the_scratch_block_is_in_the_cache_but_never_handed_out():
    engine = graph_engine()
    assert engine.model.kv is not None and engine.model.kv.num_blocks == engine.blocks.num_blocks + 1
    every = engine.blocks.allocate(engine.blocks.available)
    assert every is not None and SCRATCH_BLOCK not in every and sorted(every) == list(range(1, len(every) + 1))


def test_without_graph_support_every_step_falls_back_to_the_runner(reference):
    engine = graph_engine(DecodeGraphConfig(batch_buckets=(1, 2, 4), context_buckets=(32,)))  # CPU: no graphs
    assert engine.decode_runner is not None and engine.decode_runner.unsupported is not None
    assert run_engine(engine) == reference
    assert engine.decode_runner.steps == 0


def test_decode_graph_settings_are_checked():
    with pytest.raises(ValueError, match=r"batch_buckets = \(\) must be a non-empty tuple"):
        DecodeGraphConfig(batch_buckets=())
    with pytest.raises(ValueError, match="context_buckets"):
        DecodeGraphConfig(context_buckets=(0, 8))
    with pytest.raises(TypeError, match="must be a DecodeGraphConfig or None"):
        EngineConfig(decode_graphs=True)  # type: ignore[arg-type]


def test_rows_are_forgotten_when_requests_leave_by_retract_abort_and_finish():
    engine = graph_engine()
    runner = engine.decode_runner
    assert runner is not None
    rids = [engine.add_request(p, 20) for p in PROMPTS[:3]]
    engine.step()  # prefill
    engine.step()  # a decode window: 3 rows
    assert runner.rows.live == 3 and all(runner.rows.row_of(rid) is not None for rid in rids)
    engine.pause_generation(PauseMode.RETRACT)
    assert runner.rows.live == 0
    engine.continue_generation()
    engine.step()
    engine.step()
    assert runner.rows.live == 3
    engine.pause_generation(PauseMode.ABORT)
    assert runner.rows.live == 0


def test_lifecycle_with_decode_graphs_gives_the_same_tokens_as_without(tmp_path):
    """Pause/continue in every mode, a weight update (in memory and from disk), and
    sleep/wake, each with requests in flight where allowed: tokens identical to eager."""
    other = ReferenceDecoder(ModelConfig(seed=5))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(tmp_path / "other.safetensors"))

    def scenario(engine: GenerationEngine) -> list[tuple[int, ...]]:
        outputs: list[tuple[int, ...]] = []
        for mode in PauseMode:
            rids = [engine.add_request(p, n) for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
            for _ in range(3):
                engine.step()
            engine.pause_generation(mode)
            engine.continue_generation()
            while any(rid not in engine.results for rid in rids):
                engine.step()
            outputs += [engine.results.pop(rid).output for rid in rids]
        outputs += [r.output for r in engine.generate(PROMPTS, 6)]
        engine.update_weights_from_tensors(other.named_parameters())
        outputs += [r.output for r in engine.generate(PROMPTS, 6)]
        engine.release_memory_occupation()
        engine.update_weights_from_disk(str(tmp_path / "other.safetensors"))
        engine.resume_memory_occupation()
        outputs += [r.output for r in engine.generate(PROMPTS, 6)]
        return outputs

    eager = scenario(GenerationEngine(CONFIG))
    engine = graph_engine()
    graphs = scenario(engine)
    assert graphs == eager
    assert engine.decode_runner is not None and engine.decode_runner.steps >= 20
    n = len(PROMPTS)
    before_update, after_update, after_wake = eager[-3 * n:-2 * n], eager[-2 * n:-n], eager[-n:]
    assert after_update != before_update and after_wake != before_update  # the updates changed the tokens
