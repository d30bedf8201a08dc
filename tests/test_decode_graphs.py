"""Full-graph decode on CPU: buckets, the in-place slot table, the scratch slot, the reasons
it refuses a batch, and (graphs emulated: the same padded static step run eagerly) tokens
identical to the eager engine while requests finish and join. Replay itself is covered on
a GPU by benchmarks/decode_vs_transformers.py (tokens checked per row)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import torchhal
from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine, PauseMode
from torchhal.core.graphs.decode import (
    DecodeGraphRunner,
    SlotTable,
    attention_layer,
    paged_decode_attention,
    pick_bucket,
    unsupported_reason,
)
from torchhal.core.graphs.program import BreakStep, GraphStep
from torchhal.core.model import AttentionMetadata, KVCache, ModelConfig, ReferenceDecoder

SCRATCH = 63
CPU = torch.device("cpu")


def table(max_rows: int = 4, max_context: int = 8) -> SlotTable:
    return SlotTable(max_rows, max_context, SCRATCH, CPU)


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


# -- the slot table --------------------------------------------------------------------------------
def test_joining_rows_are_written_whole_and_padded_rows_point_at_the_scratch_slot():
    slots = table()
    rows = slots.prepare([("a", 11, [3, 4, 5], 1), ("b", 12, [7, 8], 1)], padded_rows=4)
    assert rows == [0, 1] and slots.rows_written == 2
    assert slots.table[0, :3].tolist() == [3, 4, 5] and slots.table[1, :2].tolist() == [7, 8]
    assert slots.step_inputs[:, :4].tolist() == [[11, 12, 0, 0], [2, 1, 0, 0], [5, 8, SCRATCH, SCRATCH]]


def test_a_continuing_row_only_gets_this_steps_inputs():
    slots = table()
    slots.prepare([("a", 11, [3, 4, 5], 1), ("b", 12, [7, 8], 1)], padded_rows=2)
    slots.table[0, 3] = -1  # the graph appends the slot itself; prepare must not rewrite the row
    rows = slots.prepare([("a", 21, [3, 4, 5, 9], 1), ("b", 22, [7, 8, 10], 1)], padded_rows=2)
    assert rows == [0, 1] and slots.rows_written == 2
    assert slots.table[0, 3].item() == -1
    assert slots.step_inputs[:, :2].tolist() == [[21, 22], [3, 2], [9, 10]]


def test_a_leaving_request_frees_its_row_and_the_highest_row_moves_into_it():
    slots = table()
    slots.prepare([("a", 1, [1], 1), ("b", 2, [2, 3], 1), ("c", 3, [4, 5, 6], 1)], padded_rows=4)
    rows = slots.prepare([("c", 3, [4, 5, 6, 7], 1), ("b", 2, [2, 3, 8], 1)], padded_rows=2)
    assert rows == [0, 1] and slots.rows_moved == 1 and slots.rows_written == 3  # moved, not rewritten
    assert slots.table[0, :3].tolist() == [4, 5, 6]
    assert slots.row_of("a") is None and slots.live == 2
    joined = slots.prepare([("c", 3, [4, 5, 6, 7, 9], 1), ("b", 2, [2, 3, 8, 10], 1), ("d", 4, [11, 12], 1)], 4)
    assert joined == [0, 1, 2] and slots.table[2, :2].tolist() == [11, 12]


def test_a_request_whose_slots_changed_gets_its_row_rewritten():
    slots = table()
    slots.prepare([("a", 1, [3, 4, 5], 1)], padded_rows=1)
    slots.prepare([("a", 1, [20, 21, 22, 23], 1)], padded_rows=1)  # retracted, admitted again elsewhere
    assert slots.rows_written == 2 and slots.table[0, :4].tolist() == [20, 21, 22, 23]


@pytest.mark.parametrize(
    "batch, padded, message",
    [
        ([("a", 1, [1], 1), ("a", 2, [2], 1)], 2, "request 'a' appears twice"),
        ([("a", 1, list(range(9)), 1)], 1, "request 'a' has 9 KV slots (1 new) and a window of 1 steps"),
        ([("a", 1, [], 1)], 1, "request 'a' has 1 new slots; a window of 1 steps takes 1..1"),
        ([("a", 1, [1], 1), ("b", 1, [2], 1)], 1, "a decode batch of 2 padded to 1 rows"),
        ([("a", 1, [1], 1)], 5, "padded to 5 rows does not fit 1..4"),
    ],
)
def test_bad_batches_are_refused_and_leave_the_table_intact(batch, padded, message):
    slots = table()
    slots.prepare([("x", 1, [1, 2], 1)], padded_rows=1)
    before = (slots.table.clone(), slots.step_inputs.clone(), slots.row_of("x"))
    with pytest.raises(ValueError, match=re.escape(message)):
        slots.prepare(batch, padded)
    assert torch.equal(slots.table, before[0]) and torch.equal(slots.step_inputs, before[1])
    assert slots.row_of("x") == before[2]


# -- decode attention ------------------------------------------------------------------------------
@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_paged_decode_attention_matches_sdpa_over_each_rows_slots(q_heads, kv_heads):
    torch.manual_seed(0)
    dim, num_slots = 8, 40
    k_cache, v_cache = torch.randn(num_slots, kv_heads, dim), torch.randn(num_slots, kv_heads, dim)
    seqs = [[3, 9, 1], [5], [30, 31, 32, 33, 34, 2]]
    context = 8
    slot_table = torch.full((3, context), 39)
    for row, seq in enumerate(seqs):
        slot_table[row, : len(seq)] = torch.tensor(seq)
    lengths = torch.tensor([len(s) for s in seqs])
    valid = torch.arange(context)[None, :] < lengths[:, None]
    q = torch.randn(3, q_heads, dim)
    got = paged_decode_attention(q, k_cache, v_cache, slot_table, valid, dim**-0.5)
    for row, seq in enumerate(seqs):
        keys = k_cache[seq].repeat_interleave(q_heads // kv_heads, dim=1).transpose(0, 1)  # [H, L, D]
        values = v_cache[seq].repeat_interleave(q_heads // kv_heads, dim=1).transpose(0, 1)
        expected = F.scaled_dot_product_attention(q[row][:, None], keys, values)[:, 0]
        torch.testing.assert_close(got[row], expected, atol=1e-5, rtol=1e-5)


# -- the runner ------------------------------------------------------------------------------------
def small_model(num_slots: int = 64) -> ReferenceDecoder:
    model = ReferenceDecoder(ModelConfig(num_layers=2)).eval()
    model.kv = KVCache(model.config, num_slots, CPU, torch.float32)
    return model


def test_reasons_it_refuses(make_registry):
    make_registry()
    platform = torchhal.current_platform()
    model = small_model()
    plain = DecodeGraphRunner(model, platform, 0, scratch_slot=SCRATCH)
    assert plain.unsupported == "platform 'cpu' declares no graph support"
    assert plain.reason(1, 1) == plain.unsupported and not plain.can_run(1, 1)
    with pytest.raises(RuntimeError, match="full-graph decode is unavailable: platform 'cpu'"):
        plain.decode([("a", 1, [1])])
    runner = DecodeGraphRunner(model, platform, 0, scratch_slot=SCRATCH, batch_buckets=(2, 4),
                               context_buckets=(16,), emulate=True)
    assert runner.reason(4, 16) is None and runner.can_run(3, 9)
    assert runner.reason(5, 3) == "decode batch 5 exceeds the largest batch bucket 4"
    assert runner.reason(1, 17) == "context of 17 tokens exceeds the largest context bucket 16"
    assert runner.buckets_for(3, 9) == (4, 16) and runner.buckets_for(1, 1) == (2, 16)
    with pytest.raises(ValueError, match="scratch_slot 64 is outside the KV pool of 64 slots"):
        DecodeGraphRunner(model, platform, 0, scratch_slot=64, emulate=True)
    with pytest.raises(ValueError, match=r"batch_buckets \(0, 4\) must be"):
        DecodeGraphRunner(model, platform, 0, scratch_slot=SCRATCH, batch_buckets=(0, 4))


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


def eager_prefill(model: ReferenceDecoder, prompts: list[list[int]], seqs: list[list[int]]) -> list[int]:
    meta = AttentionMetadata.build(seqs, [len(p) for p in prompts], CPU)
    hidden = model(torch.tensor([t for p in prompts for t in p]), meta)
    last = torch.tensor([sum(len(p) for p in prompts[: i + 1]) - 1 for i in range(len(prompts))])
    return model.logits(hidden, last).argmax(-1).tolist()


def test_padded_rows_write_only_the_scratch_slot_and_tokens_match_eager(make_registry):
    make_registry()
    model = small_model()
    runner = DecodeGraphRunner(model, torchhal.current_platform(), 0, scratch_slot=SCRATCH,
                               batch_buckets=(4,), context_buckets=(16,), emulate=True)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    seqs = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]  # slot 0 belongs to a request: padded rows must not touch it
    tokens = eager_prefill(model, prompts, seqs)
    seqs = [s + [10 + i] for i, s in enumerate(seqs)]
    assert model.kv is not None
    before_k, before_v = model.kv.k.clone(), model.kv.v.clone()
    # The eager decode step on a copy of the pool is the reference.
    reference = small_model()
    reference.load_state_dict(model.state_dict())
    assert reference.kv is not None
    reference.kv.k.copy_(before_k)
    reference.kv.v.copy_(before_v)
    meta = AttentionMetadata.build(seqs, [1, 1, 1], CPU)
    expected = reference.logits(reference(torch.tensor(tokens), meta), torch.arange(3)).argmax(-1).tolist()
    got = runner.decode([(i, tokens[i], seqs[i], 1) for i in range(3)])  # 3 requests padded to 4 rows
    assert got == [[token] for token in expected]
    changed = ((model.kv.k != before_k) | (model.kv.v != before_v)).flatten(2).any(-1).any(0)
    assert set(changed.nonzero().flatten().tolist()) == {10, 11, 12, SCRATCH}


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 10, [300, 3], [7] * 20, [2], [11, 12, 13, 14]]
NEW_TOKENS = [6, 3, 9, 5, 7, 4, 8]


def run_engine(engine: GenerationEngine) -> list[tuple[int, ...]]:
    rids = [engine.add_request(p, n) for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
    while any(rid not in engine.results for rid in rids):
        engine.step()
    return [engine.results.pop(rid).output for rid in rids]


CONFIG = EngineConfig(max_kv_slots=512, max_running=3)  # 3 running: the rest join as others finish
EMULATED = DecodeGraphConfig(batch_buckets=(1, 2, 4), context_buckets=(8, 16, 32), emulate=True)
SINGLE_STEPS = replace(EMULATED, steps_per_sync=1)


def graph_engine(settings: DecodeGraphConfig = EMULATED, **overrides: object) -> GenerationEngine:
    return GenerationEngine(EngineConfig(**{"max_kv_slots": 512, "max_running": 3, **overrides},
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
    assert runner.steps >= 10 and runner.slots.rows_moved >= 1
    assert len(PROMPTS) <= runner.slots.rows_written <= 2 * len(PROMPTS)
    assert runner.slots.live == 0  # every finished request gave its row back


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
    # pre-attention, post-attention and the final norm, each once for one token and once for any
    # other count (the token dimension is dynamic): prefills, padded batches and windows share them.
    assert counter.frame_count == 6, counter.frame_count
    torch._dynamo.reset()


def test_compile_layers_needs_a_model_that_offers_it():
    class Plain(ReferenceDecoder):
        compile_layers = None  # type: ignore[assignment]

    with pytest.raises(TypeError, match="has no compile_layers"):
        GenerationEngine(EngineConfig(max_kv_slots=64, compile_layers="inductor"), model=Plain(ModelConfig()))


# -- decode windows: several steps per token read-back ---------------------------------------------
def free_list(engine: GenerationEngine) -> list[int]:
    return list(engine.slots._free)


@pytest.mark.parametrize("steps", [2, 3, 8])
def test_windows_give_the_tokens_of_single_steps_with_fewer_read_backs(reference, steps):
    engine = graph_engine(replace(EMULATED, steps_per_sync=steps))
    runner = engine.decode_runner
    assert runner is not None
    assert run_engine(engine) == reference
    assert runner.windows < runner.steps  # some windows ran several steps
    if steps < 8:  # windows of 8 cover these requests' tokens at once: nothing to chain
        assert runner.chained >= 1  # some were queued before the previous one's tokens landed
    assert engine.slots.available == engine.slots.num_slots and runner.slots.live == 0


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


def test_a_stop_token_inside_a_window_ends_the_request_there_and_frees_every_slot(reference):
    # A token some request produces mid-way (not its first), so windows must cut after it.
    stop = next(out[3] for out in reference if len(out) > 5)
    eager = run_engine(GenerationEngine(replace(CONFIG, eos_token=stop)))
    engine = graph_engine(replace(EMULATED, steps_per_sync=8), eos_token=stop)
    got = run_engine(engine)
    assert got == eager
    assert any(len(out) < n for out, n in zip(got, NEW_TOKENS, strict=True))  # some request was cut
    assert all(out[-1] == stop or len(out) == n for out, n in zip(got, NEW_TOKENS, strict=True))
    assert engine.slots.available == engine.slots.num_slots


def test_chained_windows_keep_tokens_and_slots_exact_through_a_stop_token():
    prompts, new_tokens = PROMPTS[:3], 20
    plain = [r.output for r in GenerationEngine(CONFIG).generate(prompts, new_tokens)]
    stop = plain[1][9]  # deep in a chained window of request 1
    eager = [r.output for r in GenerationEngine(replace(CONFIG, eos_token=stop)).generate(prompts, new_tokens)]
    engine = graph_engine(replace(EMULATED, steps_per_sync=4), eos_token=stop)
    runner = engine.decode_runner
    assert runner is not None
    assert [r.output for r in engine.generate(prompts, new_tokens)] == eager
    assert runner.chained >= 2 and engine.slots.available == engine.slots.num_slots
    assert any(len(out) < new_tokens for out in eager)  # the stop cut a request short
    # A window still queued for requests that all stopped is landed by the lifecycle calls.
    assert engine.flush_cache(empty_cache=False).flushed and engine._in_flight is None


def test_a_window_that_fails_to_land_gives_back_both_windows_and_is_recomputed():
    prompts, new_tokens = PROMPTS[:3], 20
    expected = [r.output for r in GenerationEngine(CONFIG).generate(prompts, new_tokens)]
    engine = graph_engine(replace(EMULATED, steps_per_sync=4))
    runner = engine.decode_runner
    assert runner is not None
    rids = [engine.add_request(p, new_tokens) for p in prompts]
    engine.step()  # prefill
    engine.step()  # a window launched; its tokens land at the next step
    assert engine._in_flight is not None
    collect = runner.collect
    runner.collect = lambda window: (_ for _ in ()).throw(RuntimeError("device fault"))  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="device fault"):
        engine.step()  # chains the next window, then fails to read the first
    assert engine._in_flight is None
    # Every running request holds exactly the slots of its landed tokens (none of either window).
    for request in engine.running:
        assert len(request.slots) == len(request.prompt) + len(request.output) - 1
    runner.collect = collect  # type: ignore[method-assign]
    while any(rid not in engine.results for rid in rids):
        engine.step()
    assert [engine.results.pop(rid).output for rid in rids] == expected
    assert engine.slots.available == engine.slots.num_slots


def test_a_window_that_fails_gives_back_every_slot_it_reserved_and_is_recomputed(reference):
    engine = graph_engine(replace(EMULATED, steps_per_sync=4), max_running=4)
    runner = engine.decode_runner
    assert runner is not None
    rids = [engine.add_request(p, n) for p, n in zip(PROMPTS[:4], NEW_TOKENS[:4], strict=True)]
    engine.step()  # every prompt prefilled; the next step is a window
    slots_before = {r.rid: list(r.slots) for r in engine.running}
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
    assert {r.rid: list(r.slots) for r in engine.running} == slots_before
    assert {r.rid: list(r.output) for r in engine.running} == outputs_before
    runner._step = step  # type: ignore[method-assign]
    while any(rid not in engine.results for rid in rids):
        engine.step()
    assert [engine.results.pop(rid).output for rid in rids] == reference[:4]
    assert runner.windows < runner.steps


def test_a_pool_too_short_for_the_window_runs_single_steps_with_the_same_tokens():
    config = EngineConfig(max_kv_slots=12, max_running=2)  # two requests of 3 + 6: no room for 2 x 4 extra
    prompts = [[1, 2, 3], [4, 5, 6]]
    eager = [r.output for r in GenerationEngine(config).generate(prompts, 6)]
    engine = GenerationEngine(replace(config, decode_graphs=replace(EMULATED, steps_per_sync=5)))
    free_before = engine.slots.available
    assert [r.output for r in engine.generate(prompts, 6)] == eager
    assert engine.decode_runner is not None and engine.decode_runner.windows == engine.decode_runner.steps
    assert engine.slots.available == free_before


def test_window_settings_are_checked():
    with pytest.raises(ValueError, match=r"steps_per_sync = 0 must be a positive int"):
        DecodeGraphConfig(steps_per_sync=0)
    slots = SlotTable(2, 8, SCRATCH, CPU, max_steps=2)
    with pytest.raises(ValueError, match=re.escape("a decode window of 3 steps does not fit 1..2 steps")):
        slots.prepare([("a", 1, [1, 2], 1)], 1, steps=3)
    with pytest.raises(ValueError, match=re.escape("request 'a' has 3 new slots")):
        slots.prepare([("a", 1, [1, 2, 3], 3)], 1, steps=2)


def test_a_window_fills_the_future_slots_and_rows_needing_fewer_steps_get_scratch():
    slots = SlotTable(4, 16, SCRATCH, CPU, max_steps=3)
    slots.prepare([("a", 11, [3, 4, 5, 6, 7], 3), ("b", 12, [8, 9], 1)], padded_rows=2, steps=3)
    assert slots.step_inputs[:, :2].tolist() == [[11, 12], [2, 1], [5, 9]]
    assert slots.future[:, :2].tolist() == [[6, SCRATCH], [7, SCRATCH], [SCRATCH, SCRATCH]]
    # The next window: "a" continues with 3 more slots, "b" with 1.
    slots.prepare([("a", 21, [3, 4, 5, 6, 7, 10, 11, 12], 3), ("b", 22, [8, 9, 13], 1)], padded_rows=2, steps=3)
    assert slots.rows_written == 2 and slots.step_inputs[:, :2].tolist() == [[21, 22], [5, 2], [10, 13]]


def test_emulated_decode_beyond_the_largest_context_bucket_falls_back_and_stays_exact(reference):
    engine = graph_engine(DecodeGraphConfig(batch_buckets=(4,), context_buckets=(8,), emulate=True))
    assert run_engine(engine) == reference
    assert engine.decode_runner is not None and engine.decode_runner.steps >= 1  # short requests used graphs


def test_the_scratch_slot_is_in_the_pool_but_never_handed_out():
    engine = graph_engine()
    assert engine.model.kv is not None and engine.model.kv.num_slots == engine.slots.num_slots + 1
    assert engine.scratch_slot == engine.slots.num_slots
    every = engine.slots.allocate(engine.slots.available)
    assert every is not None and engine.scratch_slot not in every


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
    assert runner.slots.live == 3 and all(runner.slots.row_of(rid) is not None for rid in rids)
    engine.pause_generation(PauseMode.RETRACT)
    assert runner.slots.live == 0
    engine.continue_generation()
    engine.step()
    engine.step()
    assert runner.slots.live == 3
    engine.pause_generation(PauseMode.ABORT)
    assert runner.slots.live == 0


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
