"""The compile clause (contract 9) passes result-neutral inductor options and fails options that
change the numbers or that inductor does not know (the platforms live in tests/compile_broken.py);
the record refuses malformed options where it is made; the engine passes the options to inductor
and records them."""

from __future__ import annotations

import json

import pytest

from torchhal.core.engine import EngineConfig
from torchhal.core.engine.construction import compile_choice
from torchhal.platforms import CompileSupport

from .conftest import conformance_group_results, entry_point_distribution, run_cli, suite_summary

CASES = ("compile_options_are_result_neutral", "compile_options_replay_from_a_graph")


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """A distribution on PYTHONPATH whose entry point is tests.compile_broken."""
    return entry_point_distribution(tmp_path_factory.mktemp("compile_dist"), "compilebroken", "tests.compile_broken")


def test_result_neutral_options_pass(tmp_path, plugin_path):
    out, results = conformance_group_results(tmp_path, plugin_path, "compile_correct", "compile")
    assert results["compile_options_are_result_neutral"]["outcome"] == "passed", suite_summary(out)
    # The CPU platform has no graphs: the replay is reported as undeclared, never as passed.
    replay = results["compile_options_replay_from_a_graph"]
    assert replay["outcome"] == "skipped" and replay["skip_reason"].startswith("undeclared:")
    assert out.returncode == 0, suite_summary(out)


@pytest.mark.parametrize("platform, says", [
    ("compile_changes_numbers", "change the numbers"),
    ("compile_unknown_option", "triton.enable_pld"),
])
def test_options_that_change_numbers_or_do_not_exist_fail(tmp_path, plugin_path, platform, says):
    out, results = conformance_group_results(tmp_path, plugin_path, platform, "compile")
    result = results["compile_options_are_result_neutral"]
    assert result["outcome"] == "failed", suite_summary(out)
    assert says in result["message"], result["message"]
    assert out.returncode == 1, suite_summary(out)


def test_an_undeclared_platform_skips_the_group(tmp_path, plugin_path):
    out, results = conformance_group_results(tmp_path, plugin_path, "cpu", "compile")
    assert set(results) == set(CASES)
    assert all(t["outcome"] == "skipped" and t["skip_reason"].startswith("undeclared:") for t in results.values())


@pytest.mark.parametrize("options, says", [
    ({}, "non-empty dict"),
    ([("triton.enable_pdl", True)], "non-empty dict"),
    ({"": True}, "keys are inductor config names"),
    ({"triton.enable_pdl": 1.5}, "values are bool, int or str"),
])
def test_a_malformed_record_names_the_bad_option(options, says):
    with pytest.raises(TypeError, match=says):
        CompileSupport(inductor_options=options)


class Compiles:
    """A model whose `compile_layers` takes the platform's options."""

    def compile_layers(self, backend, options=None):
        pass


class TakesNoOptions:
    def compile_layers(self, backend):
        pass


def test_the_engine_passes_options_only_to_inductor_and_a_model_that_takes_them():
    support = CompileSupport({"triton.enable_pdl": True}, note="pdl")
    inductor, aot = EngineConfig(compile_layers="inductor"), EngineConfig(compile_layers="aot_eager")
    assert compile_choice(inductor, Compiles(), support) == ("inductor", {"triton.enable_pdl": True}, "pdl")
    assert compile_choice(inductor, Compiles(), None)[1] is None
    backend, options, why = compile_choice(aot, Compiles(), support)
    assert (backend, options) == ("aot_eager", None) and "'aot_eager'" in why
    backend, options, why = compile_choice(inductor, TakesNoOptions(), support)
    assert options is None and "takes no options" in why


def test_by_default_the_engine_compiles_with_inductor_where_the_platform_declares_compile_support():
    support = CompileSupport({"triton.enable_pdl": True}, note="pdl")
    assert compile_choice(EngineConfig(), Compiles(), support)[:2] == ("inductor", {"triton.enable_pdl": True})
    backend, _, why = compile_choice(EngineConfig(), Compiles(), None)  # the CPU platform: no compile
    assert backend is None and "declares no compile support" in why
    backend, _, why = compile_choice(EngineConfig(), object(), support)
    assert backend is None and "has no compile_layers" in why
    assert compile_choice(EngineConfig(compile_layers=None), Compiles(), support)[0] is None  # the way off


def test_info_shows_the_options_or_inductors_defaults(plugin_path):
    env = {"PYTHONPATH": plugin_path, "TORCHHAL_PLATFORM": "compile_correct"}
    out = run_cli("info", "--json", env=env)
    assert json.loads(out.stdout)["current"]["capabilities"]["compile"] == {
        "inductor_options": {"triton.enable_pdl": True}, "note": "compile correct"}
    assert "  compile: inductor options triton.enable_pdl=True (compile correct)" in run_cli("info", env=env).stdout
    assert "  compile: inductor's defaults (the platform asks for no options)" in run_cli("info").stdout


def test_only_the_cuda_plugin_asks_for_options_and_only_with_triton_on_a_gpu(monkeypatch):
    import importlib.util

    from torchhal.plugins import cuda
    from torchhal.plugins.cpu import CpuPlatform
    from torchhal.plugins.musa import MusaPlatform
    from torchhal.plugins.npu import NpuPlatform
    from torchhal.plugins.rocm import RocmPlatform
    from torchhal.plugins.xpu import XpuPlatform

    # ROCm inherits the CUDA plugin: it withholds PDL even where the CUDA plugin would ask for it.
    monkeypatch.setattr(cuda.CudaPlatform, "compile_support", lambda self: CompileSupport({"x": True}))
    for cls in (RocmPlatform, XpuPlatform, NpuPlatform, MusaPlatform, CpuPlatform):
        assert cls().compile_support() is None, cls.__name__
    monkeypatch.undo()
    real = importlib.util.find_spec
    monkeypatch.setattr(cuda.importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert cuda.CudaPlatform().compile_support() is None
