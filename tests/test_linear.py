"""The platform's linear kernel (contract 8) on CPU: the record's checks, the one routing rule,
every projection of the decoder going through it (eager, compiled and in emulated decode graphs,
with F.linear's tokens), `use_linear(None)` restoring F.linear, the engine's choice and its
event, and which built-in plugins declare one."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import torchhal
from torchhal.core.engine import DecodeGraphConfig, EngineConfig, GenerationEngine
from torchhal.core.model import ModelConfig, ReferenceDecoder
from torchhal.core.model.decoder import LayerMath
from torchhal.core.model.linear import routed_linear
from torchhal.platforms import LinearSupport
from torchhal.platforms.testing import patched_plugin

#: (rows, weight data pointer) of every call the counting kernel received, in order.
CALLS: list[tuple[int, int]] = []


@torch.library.custom_op("torchhal_test::counting_linear", mutates_args=())
def counting_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear's numbers, recording each call: a custom op, as a platform's kernel is, so
    torch.compile keeps it as one opaque call that runs (and counts) every time."""
    CALLS.append((x.shape[0], weight.data_ptr()))
    return F.linear(x, weight, bias)


@counting_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def counting(max_rows: int = 1, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> LinearSupport:
    return LinearSupport(name="counting", kernel=torch.ops.torchhal_test.counting_linear, max_rows=max_rows,
                         dtypes=dtypes)


@pytest.fixture(autouse=True)
def fresh_calls():
    CALLS.clear()
    yield
    CALLS.clear()


# -- the record --------------------------------------------------------------------------------------
GOOD = {"name": "k", "kernel": F.linear, "max_rows": 1, "dtypes": (torch.bfloat16,)}


@pytest.mark.parametrize("field, value, error, says", [
    ("name", "", TypeError, "LinearSupport.name is ''; it must be a non-empty str"),
    ("name", None, TypeError, "LinearSupport.name is None"),
    ("kernel", "F.linear", TypeError, "LinearSupport.kernel is 'F.linear'; it must be a callable"),
    ("max_rows", 0, ValueError, "LinearSupport.max_rows is 0; it must be >= 1"),
    ("max_rows", 1.0, TypeError, "LinearSupport.max_rows is 1.0; it must be an int"),
    ("max_rows", True, TypeError, "LinearSupport.max_rows is True; it must be an int"),
    ("dtypes", [torch.bfloat16], TypeError, r"LinearSupport.dtypes is \[torch.bfloat16\]; it must be a tuple"),
    ("dtypes", ("bfloat16",), TypeError, r"LinearSupport.dtypes is \('bfloat16',\); it must be a tuple of torch"),
    ("dtypes", (), ValueError, r"LinearSupport.dtypes is \(\); it must be non-empty"),
    ("graph_capture", 1, TypeError, "LinearSupport.graph_capture is 1; it must be True or False"),
    ("note", None, TypeError, "LinearSupport.note is None; it must be a str"),
])
def test_a_bad_linear_support_names_its_field_and_the_fix(field, value, error, says):
    with pytest.raises(error, match=says):
        LinearSupport(**{**GOOD, field: value})
    assert LinearSupport(**GOOD).max_rows == 1  # the good record is made


# -- the routing rule ------------------------------------------------------------------------------
def test_routed_linear_sends_inputs_of_at_most_max_rows_to_the_kernel_and_the_rest_to_f_linear():
    linear = routed_linear(counting(max_rows=2, dtypes=(torch.float32,)))
    weight, bias = torch.randn(6, 5), torch.randn(6)
    for rows in (1, 2, 3, 5, 1, 4, 2):
        x = torch.randn(rows, 5)
        assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))
    assert [rows for rows, _ in CALLS] == [1, 2, 1, 2]


def test_routed_linear_leaves_undeclared_dtypes_other_shapes_and_strided_weights_to_f_linear():
    linear = routed_linear(counting(max_rows=4, dtypes=(torch.bfloat16,)))
    weight = torch.randn(6, 5)
    linear(torch.randn(1, 5), weight, None)  # float32: not declared
    linear(torch.randn(1, 1, 5, dtype=torch.bfloat16), weight.bfloat16(), None)  # 3-D
    linear(torch.randn(1, 5, dtype=torch.bfloat16), torch.randn(5, 6, dtype=torch.bfloat16).T, None)  # strided
    assert CALLS == []
    linear(torch.randn(1, 5, dtype=torch.bfloat16), weight.bfloat16(), None)
    assert len(CALLS) == 1


def test_no_support_is_f_linear_itself():
    assert routed_linear(None) is F.linear


def test_layer_math_routes_the_output_projection_and_the_mlp():
    config = ModelConfig()
    math = LayerMath(config)
    math.use_linear(counting())
    h, i = config.hidden_size, config.intermediate_size
    o_weight, gate_up, down = torch.randn(h, h), torch.randn(2 * i, h), torch.randn(h, i)
    residual = torch.randn(1, h)
    pending = math.into_residual(residual, torch.randn(1, h), o_weight, None)
    _, act = math.mlp(residual, pending, None, torch.ones(h), gate_up)
    math.into_residual(residual, act, down, None)
    assert [ptr for _, ptr in CALLS] == [o_weight.data_ptr(), gate_up.data_ptr(), down.data_ptr()]


@pytest.mark.parametrize("support, rows, bias, added_in_place", [
    (None, 5, False, True),  # F.linear's route: the product adds itself
    (None, 5, True, False),  # a bias: the GEMM can't add it and the residual at once
    (counting(), 1, False, False),  # the platform's kernel: it has no accumulate
    (counting(), 2, False, True),  # more rows than the kernel takes: F.linear's route
])
def test_into_residual_adds_in_the_product_only_on_the_general_route(support, rows, bias, added_in_place):
    math = LayerMath(ModelConfig())
    math.use_linear(support)
    x, weight = torch.randn(rows, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    b = torch.randn(4, dtype=torch.float64) if bias else None
    residual = torch.randn(rows, 4, dtype=torch.float64)
    before = residual.clone()
    # The counting kernel declares float32 only: give it float32 where it should run.
    if support is not None:
        x, weight, residual, before = x.float(), weight.float(), residual.float(), before.float()
    pending = math.into_residual(residual, x, weight, b)
    expected = before + F.linear(x, weight, b)
    if added_in_place:
        assert pending is None
        torch.testing.assert_close(residual, expected)
    else:
        assert pending is not None and torch.equal(residual, before)  # left for the next norm
        torch.testing.assert_close(before + pending, expected)
    assert len(CALLS) == (0 if added_in_place or support is None else 1)


# -- the decoder and the engine ----------------------------------------------------------------------
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 10]
NEW_TOKENS = [6, 3, 9]


def run(engine: GenerationEngine) -> list[tuple[int, ...]]:
    rids = [engine.add_request(p, n) for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
    while any(rid not in engine.results for rid in rids):
        engine.step()
    return [engine.results.pop(rid).output for rid in rids]


def projection_weights(model: ReferenceDecoder) -> set[int]:
    """The data pointer of every projection's weight: each layer's QKV, o_proj, gate-up, down, and lm_head."""
    ptrs = {model.lm_head.weight.data_ptr()}
    for layer in model.decoder_layers:
        ptrs |= {layer.self_attn.fused_weight.data_ptr(), layer.self_attn.o_proj.weight.data_ptr(),
                 layer.mlp.fused_weight.data_ptr(), layer.mlp.down_proj.weight.data_ptr()}
    return ptrs


# One request at a time: decode steps have one row (prefills have several, and take F.linear).
CONFIG = EngineConfig(max_kv_slots=512, max_running=1, kv_block_size=4)
EMULATED = DecodeGraphConfig(batch_buckets=(1, 2, 4), context_buckets=(8, 16, 32), emulate=True)


@pytest.fixture(scope="module")
def plain_tokens() -> list[tuple[int, ...]]:
    return run(GenerationEngine(CONFIG))


@pytest.mark.parametrize("settings", [
    {},
    {"decode_graphs": EMULATED},
    {"decode_graphs": EMULATED, "compile_layers": "eager"},
], ids=["eager", "emulated_graphs", "compiled_emulated_graphs"])
def test_one_row_projections_run_the_platform_kernel_with_f_linears_tokens(plain_tokens, settings):
    platform = torchhal.current_platform()
    torch._dynamo.reset()
    try:
        with patched_plugin(platform, linear_support=counting):
            engine = GenerationEngine(replace(CONFIG, **settings))
            tokens = run(engine)
    finally:
        torch._dynamo.reset()
    assert tokens == plain_tokens
    assert CALLS and all(rows == 1 for rows, _ in CALLS)
    # Every projection of every layer, and lm_head, went through the kernel.
    assert {ptr for _, ptr in CALLS} == projection_weights(engine.model)  # type: ignore[arg-type]
    [event] = [e for e in engine.trace if e["kind"] == "linear_kernel"]
    assert event["kernel"] == "counting" and event["why"] == "counting for inputs of at most 1 row(s), F.linear above"


def test_use_linear_none_restores_f_linear():
    model = ReferenceDecoder(ModelConfig())
    model.use_linear(counting())
    assert model.layer_math.linear is not F.linear
    model.use_linear(None)
    assert model.layer_math.linear is F.linear
    engine = GenerationEngine(CONFIG, model=model)  # the CPU platform supplies no kernel
    run(engine)
    assert CALLS == []


def test_the_engine_records_why_it_runs_f_linear():
    platform = torchhal.current_platform()
    engine = GenerationEngine(CONFIG)
    [event] = [e for e in engine.trace if e["kind"] == "linear_kernel"]
    assert event["kernel"] is None and event["why"] == "the platform supplies no linear kernel: F.linear everywhere"
    # A kernel that does not take the engine's dtype is not given to the model.
    with patched_plugin(platform, linear_support=lambda: counting(dtypes=(torch.bfloat16, torch.float16))):
        engine = GenerationEngine(CONFIG)
        run(engine)
    [event] = [e for e in engine.trace if e["kind"] == "linear_kernel"]
    assert event["kernel"] is None
    assert event["why"] == "counting takes bfloat16, float16, not float32: F.linear everywhere"
    assert engine.model.layer_math.linear is F.linear and CALLS == []  # type: ignore[attr-defined]


def test_a_model_without_use_linear_keeps_its_own_linears():
    class Plain(ReferenceDecoder):
        @property
        def use_linear(self):  # type: ignore[override]  # a model written without the member
            raise AttributeError("use_linear")

    with patched_plugin(torchhal.current_platform(), linear_support=counting):
        engine = GenerationEngine(CONFIG, model=Plain(ModelConfig()))
    [event] = [e for e in engine.trace if e["kind"] == "linear_kernel"]
    assert event["kernel"] is None and event["why"] == "model Plain has no use_linear(support): F.linear everywhere"


# -- the platforms ---------------------------------------------------------------------------------
def test_the_platform_asks_its_plugin_once():
    platform = torchhal.get_platform("cpu")
    assert platform.linear_support is None
    calls = []

    def linear_support() -> LinearSupport:
        calls.append(1)
        return counting()

    with patched_plugin(platform, linear_support=linear_support):
        assert platform.linear_support is platform.linear_support
        assert platform.linear_support.name == "counting" and calls == [1]


def test_only_the_cuda_plugin_supplies_a_kernel_and_only_with_triton(monkeypatch):
    from torchhal.plugins import cuda
    from torchhal.plugins.musa import MusaPlatform
    from torchhal.plugins.npu import NpuPlatform
    from torchhal.plugins.rocm import RocmPlatform
    from torchhal.plugins.xpu import XpuPlatform

    # ROCm inherits the CUDA plugin: it withholds the GEMV even where the CUDA plugin would supply it.
    monkeypatch.setattr(cuda.CudaPlatform, "linear_support", lambda self: counting())
    for cls in (RocmPlatform, XpuPlatform, NpuPlatform, MusaPlatform):
        assert cls().linear_support() is None, cls.__name__
    monkeypatch.undo()
    real = importlib.util.find_spec
    monkeypatch.setattr(cuda.importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert cuda.CudaPlatform().linear_support() is None
