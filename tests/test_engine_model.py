"""The engine and the graph runner run any `Model`: a model class from outside plugs in
without editing either. The model here is a test's own: its next token is the scaled
sum of every token so far (through the KV pool), so each output is known exactly."""

import pytest
import torch
from torch import nn

from torchhal.core.engine import EngineConfig, GenerationEngine, RequestState
from torchhal.core.graphs import GraphRunner
from torchhal.core.graphs.program import BreakStep, GraphStep, run_eager
from torchhal.core.model import KVCache, Model, ModelConfig, ReferenceDecoder

SUM_CONFIG = ModelConfig(vocab_size=97, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=8, max_position=64)
PROMPTS = [[1, 2, 3], [40, 50], [96] * 7, [5], [11, 12, 13, 14, 15, 16]]


class ContextSumModel(nn.Module):
    """Next token = round(scale * sum of all tokens so far) mod vocab."""

    def __init__(self, config=SUM_CONFIG):
        super().__init__()
        self.config = config
        self.kv = None
        self.scale = nn.Parameter(torch.ones(1))
        self.register_buffer("derived_scale", torch.zeros(1), persistent=False)  # rebuilt by process_weights
        self.process_weights()

    def process_weights(self):
        with torch.no_grad():
            self.derived_scale.copy_(self.scale)

    def embed_tokens(self, input_ids):
        hidden = input_ids.to(self.scale.dtype)[:, None]
        return hidden.expand(-1, self.config.hidden_size).contiguous()

    def layer_program(self):
        def pre(state):
            state["attn_out"] = torch.empty_like(state["hidden"])

        def attend(state, num_tokens, meta):
            paged = meta.paged
            keys = self.kv.k[0].flatten(0, 1).flatten(1)  # [blocks * block_size, hidden]
            keys.index_copy_(0, paged.slot_mapping, state["hidden"][:num_tokens])
            block_size = self.kv.k.shape[2]
            # Each token's row, then the slots of that row's context up to the token's position.
            rows = torch.searchsorted(paged.query_start[1:], torch.arange(num_tokens, dtype=torch.int32), right=True)
            columns = torch.arange(paged.max_blocks * block_size)
            slots = paged.block_tables[rows][:, columns // block_size].long() * block_size + columns % block_size
            seen = (columns[None, :] <= meta.positions[:num_tokens, None]).to(keys.dtype)  # [T, context]
            state["attn_out"][:num_tokens].copy_(torch.einsum("tc,tch->th", seen, keys[slots]))

        def post(state):
            state["hidden"] = state["attn_out"] * self.derived_scale

        return [GraphStep("pre", pre), BreakStep("context_sum", attend), GraphStep("post", post)]

    def logits(self, hidden, last_token_index):
        token = hidden.index_select(0, last_token_index)[:, 0].round().long() % self.config.vocab_size
        return nn.functional.one_hot(token, self.config.vocab_size).float()

    def forward(self, input_ids, meta):
        state = {"hidden": self.embed_tokens(input_ids), "positions": meta.positions}
        run_eager(self.layer_program(), state, input_ids.numel(), meta)
        return state["hidden"]


def expected(prompt, new_tokens, scale=1):
    tokens = list(prompt)
    for _ in range(new_tokens):
        tokens.append(round(scale * sum(tokens)) % SUM_CONFIG.vocab_size)
    return tokens[len(prompt):]


def sum_engine(runner_factory=None, **overrides):
    return GenerationEngine(EngineConfig(**{"max_kv_slots": 256, **overrides}), model=ContextSumModel(),
                            runner_factory=runner_factory)


def test_both_models_satisfy_the_protocol():
    assert isinstance(ContextSumModel(), Model)
    assert isinstance(ReferenceDecoder(ModelConfig()), Model)
    assert not isinstance(nn.Linear(2, 2), Model)


@pytest.mark.parametrize("runner", ["eager", "graph_runner_emulated"])
def test_an_outside_model_generates_through_the_engine(runner):
    factory = None
    if runner == "graph_runner_emulated":
        def factory(e):
            return GraphRunner(e.model, e.platform, e.device_index, dtype=e.config.dtype, buckets=(4, 16), emulate=True)
    e = sum_engine(factory, max_running=2)  # mixed prefill/decode batches
    results = e.generate(PROMPTS, 5)
    assert [r.output for r in results] == [tuple(expected(p, 5)) for p in PROMPTS]
    if runner == "graph_runner_emulated":
        assert e.runner.hidden_size == SUM_CONFIG.hidden_size  # read from model.config


def test_the_engine_takes_model_facts_from_the_model_not_engine_config():
    e = sum_engine(max_kv_slots=1 << 20, kv_fraction=0.001)
    assert e.model_config is SUM_CONFIG
    assert e.kv_sizing.bytes_per_block == KVCache.bytes_per_block(SUM_CONFIG, torch.float32, 16)
    results = e.generate([[100], [1] * 60, [1, 2]], 5)  # EngineConfig.model would allow both bad ones
    assert "outside the vocabulary 0..96" in results[0].error
    assert "exceeds max_position 64" in results[1].error
    assert results[2].state is RequestState.FINISHED


def test_the_engine_moves_the_model_to_its_dtype_and_device():
    e = sum_engine(dtype=torch.float16)  # sums stay below 2048: exact in float16
    assert e.model.scale.dtype == torch.float16 and e.model.kv.k.dtype == torch.float16
    assert e.model.scale.device.type == e.device.type
    assert [r.output for r in e.generate(PROMPTS[:2], 3)] == [tuple(expected(p, 3)) for p in PROMPTS[:2]]


def test_weight_updates_and_sleep_reach_an_outside_model():
    e = sum_engine()
    e.update_weights_from_tensors({"scale": torch.tensor([2.0])})
    assert float(e.model.derived_scale) == 2.0  # process_weights ran
    assert [r.output for r in e.generate(PROMPTS, 4)] == [tuple(expected(p, 4, scale=2)) for p in PROMPTS]
    e.release_memory_occupation()
    e.update_weights_from_tensors({"scale": torch.tensor([3.0])})
    e.resume_memory_occupation()
    assert [r.output for r in e.generate(PROMPTS, 4)] == [tuple(expected(p, 4, scale=3)) for p in PROMPTS]


def test_an_object_that_is_not_a_model_is_refused_by_name():
    class Half(nn.Module):
        config = SUM_CONFIG

        def forward(self, ids, meta):
            return ids

    with pytest.raises(TypeError, match="model Half lacks layer_program, embed_tokens, logits, process_weights"):
        GenerationEngine(EngineConfig(), model=Half())


def test_a_runner_that_ignores_the_rows_fails_the_step_naming_it():
    """A runner that takes `rows` but returns every token's hidden states would have the
    engine sample the wrong rows: the step fails instead, and the engine rolls it back."""
    from torchhal.core.engine import EagerRunner

    class EveryRow(EagerRunner):
        def forward(self, input_ids, meta, rows=None):
            return super().forward(input_ids, meta)

    e = sum_engine(lambda engine: EveryRow(engine.model))
    e.add_request([1, 2, 3], 2)
    with pytest.raises(TypeError, match=r"EveryRow.forward returned hidden states \(3, 8\) torch.float32 for 1 rows; "
                                        r"a runner returns \[len\(rows\), hidden_size\] = \[1, 8\] torch.float32"):
        e.step()
    assert e.blocks.available == e.blocks.num_blocks and len(e.waiting) == 1


@pytest.mark.parametrize("returned, named", [
    (lambda h: None, "a NoneType"),
    (lambda h: h.tolist(), "a list"),
    (lambda h: torch.cat((h, h), 1), r"hidden states \(1, 16\) torch.float32"),
    (lambda h: h.double(), r"hidden states \(1, 8\) torch.float64"),
])
def test_a_runner_returning_something_else_than_hidden_states_fails_the_step_naming_it(returned, named):
    # Each raised from inside the engine before: AttributeError on .dim(), or the logits' matmul.
    from torchhal.core.engine import EagerRunner

    class Odd(EagerRunner):
        def forward(self, input_ids, meta, rows=None):
            return returned(super().forward(input_ids, meta, rows))

    e = sum_engine(lambda engine: Odd(engine.model))
    e.add_request([1, 2, 3], 2)
    with pytest.raises(TypeError, match=f"Odd.forward returned {named} for 1 rows; a runner returns "):
        e.step()
    assert e.blocks.available == e.blocks.num_blocks and len(e.waiting) == 1
