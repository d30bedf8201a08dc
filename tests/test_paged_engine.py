"""The engine on the paged KV cache: the backend it chose and why, chunked prefill sharing
steps with decode, block accounting, and long-ish mixed-length prompts (several blocks,
GQA, a Mistral window shorter than the prompt) token-exact against transformers' greedy
output on every engine path (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.hf_models import hf_greedy, make_hf_model
from torchhal.attention import SCRATCH_BLOCK
from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine, PrefillGraphConfig, RequestState
from torchhal.core.graphs import GraphRunner
from torchhal.core.model import AttentionMetadata, LlamaDecoder, ModelConfig
from torchhal.core.model.checkpoint import load_checkpoint

LONG = [(7 * i) % 500 + 1 for i in range(200)]


def engine(**overrides: object) -> GenerationEngine:
    return GenerationEngine(EngineConfig(**{"max_kv_slots": 2048, **overrides}))


# -- the backend, chosen once --------------------------------------------------------------------
def test_the_engine_records_the_chosen_backend_and_why():
    e = engine()
    assert e.attention.name == "reference"
    assert e.attention.why == "reference: the platform declares no attention backend"
    events = [ev for ev in e.trace if ev["kind"] == "attention_backend"]
    assert len(events) == 1 and events[0]["backend"] == "reference" and events[0]["why"] == e.attention.why


def test_the_spec_comes_from_the_model_config_dtype_block_size_window_and_graphs(monkeypatch):
    seen = []
    from torchhal.platforms.platform import Platform

    real = Platform.choose_attention
    monkeypatch.setattr(Platform, "choose_attention", lambda self, spec: seen.append(spec) or real(self, spec))
    model = ModelConfig(num_heads=4, num_kv_heads=2, sliding_window=7)
    engine(model=model, kv_block_size=8, dtype=torch.bfloat16, decode_graphs=DecodeGraphConfig(emulate=True))
    (spec,) = seen
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 32)
    # Emulated decode graphs run eagerly, and the host captures none: the backend need not be capturable.
    assert (spec.dtype, spec.block_size, spec.sliding_window, spec.needs_graph) == (torch.bfloat16, 8, 7, False)


@pytest.mark.parametrize("value", [0, -16, 1.5, True])
def test_a_bad_block_size_is_refused_with_the_fix(value):
    with pytest.raises(ValueError, match=f"EngineConfig.kv_block_size = {value!r} must be a positive int"):
        EngineConfig(kv_block_size=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_kv_slots = 8 holds no block of kv_block_size = 16 tokens"):
        EngineConfig(max_kv_slots=8)


# -- blocks ----------------------------------------------------------------------------------------
def test_requests_own_whole_blocks_and_give_back_each_when_no_token_of_theirs_remains():
    e = engine(kv_block_size=4, max_kv_slots=64)
    total = e.blocks.available
    rid = e.add_request(list(range(1, 10)), 8)  # 9 prompt tokens: 3 blocks of 4
    e.step()
    (request,) = e.running
    assert request.kv_tokens == 9 and len(request.blocks) == 3 and SCRATCH_BLOCK not in request.blocks
    assert e.blocks.available == total - 3
    e.step()  # a 10th token fits the third block
    e.step()  # ... the 11th and 12th too
    e.step()
    assert request.kv_tokens == 12 and len(request.blocks) == 3
    e.step()  # the 13th starts a fourth block
    assert request.kv_tokens == 13 and len(request.blocks) == 4 and e.blocks.available == total - 4
    e.blocks.shrink(request, 1)  # giving back the 13th empties the fourth block: it is freed
    assert len(request.blocks) == 3 and e.blocks.available == total - 3
    e.blocks.shrink(request, 1)  # the 12th leaves the third block partly used: kept
    assert len(request.blocks) == 3
    e.blocks.grow([request], [2])
    while rid not in e.results:
        e.step()
    assert e.blocks.available == total and request.blocks == [] and request.kv_tokens == 0


# -- chunked prefill -------------------------------------------------------------------------------
def test_decode_steps_on_the_runner_read_device_rows_and_upload_only_the_blocks_they_start(monkeypatch):
    e = engine()  # blocks of 16
    built = []
    real_build = AttentionMetadata.build.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(AttentionMetadata, "build",
                        classmethod(lambda cls, *args, **kwargs: built.append(1) or real_build(cls, *args, **kwargs)))
    rid = e.add_request(LONG, 40)  # 200 tokens: 13 blocks
    e.step()
    assert len(built) == 1  # the prefill's metadata comes from host lists
    while rid not in e.results:
        e.step()
    assert len(built) == 1  # no decode step built metadata from host lists
    # The request's table was written once; its 39 decode tokens (KV 201..239) started blocks at
    # 209 and 225: one upload each, none at the other 37 steps.
    assert (e.executor.rows.rows_written, e.executor.rows.block_uploads) == (1, 2)
    assert e.executor.rows.live == 0  # the finished request gave its row back


def test_a_long_prompt_prefills_in_chunks_while_running_requests_gain_a_token_each_step():
    e = engine(max_batch_tokens=32, max_running=4)
    short = [e.add_request([3, 1, 4], 40), e.add_request([1, 5, 9, 2], 40)]
    e.step()  # both prefill
    e.step()  # both decode
    long_rid = e.add_request(LONG, 5)
    chunks = []
    while True:
        before = {r.rid: len(r.output) for r in e.running}
        e.step()
        long_request = next(r for r in e.running if r.rid == long_rid)
        for rid in short:  # each running request got exactly one token this step
            assert len(next(r for r in e.running if r.rid == rid).output) == before[rid] + 1
        chunks.append(long_request.kv_tokens - sum(chunks))
        if long_request.output:
            break
    # Budget 32 = 2 decode tokens + a 30-token chunk: 200 tokens in 7 steps, the last one 20.
    assert chunks == [30] * 6 + [20]
    while any(rid not in e.results for rid in [*short, long_rid]):
        e.step()
    whole = engine()  # the same requests, every prompt prefilled in one step
    expected = [r.output for r in whole.generate([[3, 1, 4], [1, 5, 9, 2]], 40)] + \
        [whole.generate([LONG], 5)[0].output]
    assert [e.results[rid].output for rid in [*short, long_rid]] == expected
    assert e.blocks.available == e.blocks.num_blocks


def test_a_prompt_that_would_be_cut_waits_for_a_step_it_fits_whole():
    e = engine(max_batch_tokens=32, max_running=4)
    prompts = [[(3 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate((20, 20, 10, 40))]
    rids = [e.add_request(p, 6) for p in prompts]
    steps = []
    for _ in range(3):
        before = {r.rid: r.kv_tokens for r in e.running}
        e.step()
        steps.append(sorted(r.kv_tokens - before.get(r.rid, 0) for r in e.running))
    # Step 1: the first 20 whole; the second (20 > 12 left) waits rather than being cut to 12.
    # Step 2: a decode, the second 20 whole and the 10 (31 of 32); the 40 waits.
    # Step 3: three decodes, then the 40 is the step's first prefill: cut to the 29 left.
    assert steps == [[20], [1, 10, 20], [1, 1, 1, 29]]
    while any(rid not in e.results for rid in rids):
        e.step()
    whole = engine()
    assert [e.results[rid].output for rid in rids] == [r.output for r in whole.generate(prompts, 6)]
    assert e.blocks.available == e.blocks.num_blocks


def test_chunked_prefill_steps_roll_back_exactly():
    e = engine(max_batch_tokens=32, kv_block_size=4)
    e.add_request([3, 1, 4], 20)
    e.step()
    e.add_request(LONG, 3)
    e.step()  # the first chunk of the long prompt
    free_before = list(e.blocks._free)
    held = {r.rid: (list(r.blocks), r.kv_tokens) for r in e.running}
    real_forward = e.runner.forward

    def failing(ids, meta, rows):  # noqa: ANN001, ANN202
        raise RuntimeError("device fault")

    e.runner.forward = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="device fault"):
        e.step()
    assert list(e.blocks._free) == free_before
    assert {r.rid: (list(r.blocks), r.kv_tokens) for r in e.running} == held
    e.runner.forward = real_forward  # type: ignore[method-assign]


def test_decodes_retract_a_prefill_short_of_blocks_and_it_resumes_with_the_same_tokens():
    # 12 blocks of 4 = 48 tokens: two 30-token prompts cannot both hold their KV at once.
    e = engine(max_batch_tokens=8, kv_block_size=4, max_kv_slots=48)
    prompts = [[(5 * i + j) % 400 + 1 for j in range(30)] for i in range(2)]
    results = e.generate(prompts, 4)
    assert all(r.state is RequestState.FINISHED for r in results)
    assert [r.output for r in results] == [r.output for r in engine().generate(prompts, 4)]
    assert e.blocks.available == e.blocks.num_blocks


def test_a_prefill_that_outgrows_the_pool_fails_alone_and_frees_its_blocks():
    # 2 blocks of 4: a 10-token prompt is admitted in chunks of 4, then no block is left for it.
    e = engine(max_batch_tokens=4, kv_block_size=4, max_kv_slots=8)
    results = e.generate([[1] * 10, [2, 3]], 2)
    assert results[0].state is RequestState.FAILED
    assert "needs KV for 10 tokens but the pool holds 2 blocks of 4" in str(results[0].error)
    assert results[1].state is RequestState.FINISHED and e.blocks.available == e.blocks.num_blocks


# -- long-ish prompts, token-exact against transformers, on every engine path -----------------------
FAMILY_PROMPT_LENGTHS = (300, 170, 45)
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=["llama3", "mistral"])
def family_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """llama3: GQA; mistral: GQA and a sliding window of 12, far shorter than every prompt."""
    family = request.param
    directory = tmp_path_factory.mktemp(family)
    hf = make_hf_model(family, max_position_embeddings=512)
    hf.save_pretrained(directory)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=generator).tolist() for n in FAMILY_PROMPT_LENGTHS]
    return directory, prompts, hf_greedy(hf, prompts, NEW_TOKENS)


def serve(directory, **overrides: object) -> GenerationEngine:  # noqa: ANN001
    model: LlamaDecoder = load_checkpoint(directory)[0]
    return GenerationEngine(EngineConfig(**{"max_kv_slots": 4096, **overrides}), model=model)  # type: ignore[arg-type]


BREAKABLE_GRAPHS = PrefillGraphConfig(token_buckets=(4, 64, 512), emulate=True)
DECODE_GRAPHS = DecodeGraphConfig(batch_buckets=(1, 2, 4), context_buckets=(64, 512), steps_per_sync=3, emulate=True)
PATHS = {
    "eager": {},
    "breakable_graphs": {"prefill_graphs": BREAKABLE_GRAPHS},
    "decode_graphs": {"decode_graphs": DECODE_GRAPHS},
    "chunked_prefill_decode_graphs": {"max_batch_tokens": 64, "decode_graphs": DECODE_GRAPHS},
    "chunked_prefill": {"max_batch_tokens": 64},
    "chunked_prefill_breakable_graphs": {"max_batch_tokens": 64, "prefill_graphs": BREAKABLE_GRAPHS},
    "chunked_prefill_breakable_and_decode_graphs": {"max_batch_tokens": 64, "prefill_graphs": BREAKABLE_GRAPHS,
                                                    "decode_graphs": DECODE_GRAPHS},
    "blocks_of_5": {"kv_block_size": 5},
}


@pytest.mark.parametrize("path", list(PATHS))
def test_long_mixed_prompts_equal_transformers_on_every_path(family_case, path):
    directory, prompts, expected = family_case
    e = serve(directory, **PATHS[path])
    assert [list(r.output) for r in e.generate(prompts, NEW_TOKENS)] == expected
    if "decode_graphs" in path:
        assert e.decode_runner is not None and e.decode_runner.steps >= NEW_TOKENS - 1
    if "breakable" in path:
        assert isinstance(e.runner, GraphRunner) and e.runner.bucketed_steps > 0
    assert e.blocks.available == e.blocks.num_blocks


@pytest.mark.parametrize("max_batch_tokens", [4096, 8])
@pytest.mark.parametrize("prompt_length", [17, 16])
def test_a_request_longer_than_the_pool_fails_and_the_queue_behind_it_runs(max_batch_tokens: int,
                                                                           prompt_length: int) -> None:
    """A 16-slot pool. 17 prompt tokens never fit; 16 fit, and the first new token's KV does not.
    Prefilled chunk by chunk, such a request reached the pool's last slot, retracted itself for
    its next token and started again, for ever; the small request behind it never ran."""
    model = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=48,
                        max_position=128)
    e = GenerationEngine(EngineConfig(model=model, max_kv_slots=16, kv_block_size=4,
                                      max_batch_tokens=max_batch_tokens))
    assert e.kv_sizing.num_slots == 16
    big = e.add_request(list(range(1, prompt_length + 1)), 4)
    small = e.add_request([1, 2, 3], 2)
    for _ in range(50):
        if big in e.results and small in e.results:
            break
        e.step()
    assert big in e.results and small in e.results, "the scheduler went round without ending either request"
    failed = e.results[big]
    assert failed.state is RequestState.FAILED and "needs KV for 17 tokens but the pool holds 4 blocks of 4" in (
        failed.error or "")
    assert e.results[small].state is RequestState.FINISHED and len(e.results[small].output) == 2
    assert e.blocks.available == e.blocks.num_blocks  # every block back
