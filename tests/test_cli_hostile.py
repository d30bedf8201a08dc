"""A mistake on the command line (a name, a number, a setting, a broken file) is one line on
stderr and exit 2, said before anything runs: never a traceback, nor a verdict blaming a plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Ran
from tests.hf_models import save_hf_model
from torchhal.platforms import hookimpl

from .test_selection import fake_platform, plugin_module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    save_hf_model("llama3", directory)  # vocab 128, max_position 256
    return directory


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Ran]:
    """`torchhal ARGS...` run in this process, captured."""
    from torchhal.cli import main

    def run(*args: str) -> Ran:
        code = main(list(args))
        out = capsys.readouterr()
        return Ran(code, out.out, out.err)

    return run


def refused(ran: Ran, command: str, *expected: str) -> str:
    """The one line `ran` was refused with (exit 2, nothing on stdout), after checking it says `expected`."""
    assert ran.returncode == 2, ran
    assert ran.stdout == "" and "Traceback" not in ran.stderr, ran
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"torchhal {command}: "), ran.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0].removeprefix(f"torchhal {command}: ")


# -- conformance: what to test is checked before the suite runs ------------------------


@pytest.mark.parametrize("args, env, expected", [
    (("--platform", "nosuch"), {}, ["--platform 'nosuch' is not a registered platform", "registered: cpu"]),
    ((), {"TORCHHAL_PLATFORM": "nosuch"}, ["TORCHHAL_PLATFORM='nosuch' is not a registered platform"]),
    (("--device", "99"), {}, ["--device 99 is out of range", "platform 'cpu' has 1 device(s) here, 0..0"]),
    (("--device", "-1"), {}, ["--device -1 is out of range"]),
    (("--platform", "cpu"), {"TORCHHAL_DETECT_TIMEOUT": "abc"}, ["TORCHHAL_DETECT_TIMEOUT='abc'"]),
], ids=["platform", "platform-env", "device-high", "device-negative", "detect-timeout"])
def test_conformance_refuses_a_target_it_cannot_test(tmp_path, monkeypatch, cli, args, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    report = tmp_path / "report.json"
    refused(cli("conformance", *args, "--json", str(report)), "conformance", *expected)
    assert not report.exists()  # no NOT CONFORMANT report blaming a plugin for a typo


def test_plain_pytest_refuses_an_unknown_platform_before_any_test(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "torchhal.conformance_tests.plugin", "--pyargs",
         "torchhal.conformance_tests", "--torchhal-platform", "nosuch", "-p", "no:cacheprovider"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("TORCHHAL_")},
    )
    assert out.returncode == 4, out.stdout[-2000:]  # pytest's own usage-error code
    assert "--torchhal-platform 'nosuch' is not a registered platform" in out.stderr
    assert "VERDICT" not in out.stdout and "Traceback" not in out.stdout + out.stderr


def _alias_bomb(field: str) -> str:
    """About 600 bytes of YAML whose second entry's `field` is nine lists of nine ... nine deep (9**9 strings)."""
    anchors, previous = "a0: &a0 [" + ",".join(["lol"] * 9) + "]", "a0"
    for level in range(1, 9):
        anchors += f", a{level}: &a{level} [" + ",".join([f"*{previous}"] * 9) + "]"
        previous = f"a{level}"
    first = f'"memory::test_memory_info_cost": {{reason: slow, category: temporary, {anchors}}}\n'
    second = {"reason": f"reason: *{previous}, category: temporary", "category": f"reason: x, category: *{previous}"}
    return first + f'"memory::test_memory_info_fields": {{{second[field]}}}\n'


@pytest.mark.parametrize("name, content, says", [
    ("bomb-reason.yaml", _alias_bomb("reason"), "entry 'memory::test_memory_info_fields' needs a 'reason' (text)"),
    ("bomb-category.yaml", _alias_bomb("category"), "has category of type list; use one of temporary"),
    ("deep.yaml", "a: " + "[" * 3000 + "]" * 3000 + "\n", "not valid YAML: nested too deeply to read"),
    ("deep.toml", "a = " + "[" * 3000 + "]" * 3000 + "\n", "not valid TOML: nested too deeply to read"),
], ids=["alias-bomb-reason", "alias-bomb-category", "nested-yaml", "nested-toml"])
def test_conformance_refuses_a_hostile_expectation_file_at_once(tmp_path, name, content, says):
    """The alias bomb hung `conformance` (str() expanded the reason); the nesting was an uncaught
    RecursionError, exit 1. A subprocess, so a hang fails the test instead of stopping the run."""
    path = tmp_path / name
    path.write_text(content)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHHAL_")}
    out = subprocess.run([sys.executable, "-m", "torchhal.cli", "conformance", "--expect", str(path)],
                         capture_output=True, text=True, env=env, timeout=120)
    refused(Ran(out.returncode, out.stdout, out.stderr), "conformance", f"--expect {path}: ", says)


def test_conformance_without_pytest_says_what_to_install(monkeypatch, cli):
    monkeypatch.setitem(sys.modules, "pytest", None)  # `import pytest` raises ImportError, as where it is missing
    line = refused(cli("conformance", "--platform", "cpu"), "conformance")
    assert line == "the conformance suite runs on pytest, which is not installed: pip install 'torchhal[conformance]'"


def _failing_to_register() -> object:
    class Module:
        @hookimpl
        def torchhal_register_platforms(self):
            raise RuntimeError("libghost.so is missing")

    return Module()


def _counting(name: str, count: Callable[[], int]) -> object:
    """A plugin module registering platform `name` whose device_count() is `count()`."""
    cls = type(fake_platform(name, 5))
    return plugin_module(type(f"Counting{cls.__name__}", (cls,), {"device_count": lambda self: count()})())


def _no_count() -> int:
    raise RuntimeError("driver crashed")


def _exiting_count() -> int:
    sys.exit(11)


@pytest.mark.filterwarnings("ignore::torchhal.platforms.TorchhalPluginWarning")
@pytest.mark.parametrize("plugin, name, device", [
    (lambda: plugin_module(fake_platform("sleepy", 5, available=False)), "sleepy", 3),  # INCOMPLETE
    (lambda: _counting("zero", lambda: 0), "zero", 0),  # a device test fails on it
    (lambda: _counting("crashing", _no_count), "crashing", 0),  # so does this one
    (lambda: _counting("exiting", _exiting_count), "exiting", 0),  # sys.exit() must not end the run here
], ids=["unavailable", "no-devices", "count-raises", "count-exits"])
def test_a_plugins_own_trouble_is_left_to_the_suite(make_registry, plugin, name, device):
    from torchhal.conformance_tests.plugin import check_target

    make_registry(plugin())
    check_target(name, device, "--platform", "--device")  # no usage error: the suite reports it


@pytest.mark.filterwarnings("ignore::torchhal.platforms.TorchhalPluginWarning")
@pytest.mark.parametrize("args, env, named", [
    (("--platform", "cpux"), {}, "--platform 'cpux'"),
    ((), {"TORCHHAL_PLATFORM": "cpux"}, "TORCHHAL_PLATFORM='cpux'"),
], ids=["platform", "platform-env"])
def test_an_unregistered_platform_is_refused_while_a_plugin_failed_to_load(tmp_path, monkeypatch, make_registry,
                                                                            cli, args, env, named):
    from torchhal.conformance_tests.plugin import check_target

    make_registry(_failing_to_register())
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    report = tmp_path / "report.json"
    refused(cli("conformance", *args, "--json", str(report)), "conformance",
            f"{named} is not a registered platform (registered: cpu); name one of them",
            "failed to load, fix that plugin", "plugin 'test-plugin-0'",
            "failed to register: RuntimeError: libghost.so is missing")
    assert not report.exists()  # a typo runs no suite, and writes no report blaming a plugin
    check_target("cpu", 0, "--platform", "--device")  # a registered platform is still the suite's to test


def test_naming_a_replaced_platform_names_the_one_that_replaced_it(tmp_path, make_registry, cli):
    fastcpu = type("FastCpu", (type(fake_platform("fastcpu", 5)),), {"replaces": "cpu"})()
    make_registry(plugin_module(fastcpu))
    line = refused(cli("conformance", "--platform", "cpu", "--json", str(tmp_path / "r.json")), "conformance")
    assert line == ("--platform 'cpu': platform 'cpu' was replaced by platform 'fastcpu' (plugin 'test-plugin-0', "
                    "distribution <in-process>), which declares `replaces = 'cpu'`; name 'fastcpu' instead, or "
                    "uninstall <in-process> to get 'cpu' back")
    assert "install the plugin" not in line


# -- info: a plugin's bad DeviceInfo is its query error, not a traceback ------------------


@pytest.mark.filterwarnings("ignore::torchhal.platforms.TorchhalPluginWarning")
@pytest.mark.parametrize("name, says", [
    (None, "DeviceInfo.name is None; it must be a str"),
    (7, "DeviceInfo.name is 7; it must be a str"),
])
def test_info_reports_a_device_info_name_that_is_not_a_str(make_registry, cli, name, says):
    from torchhal.platforms import DeviceInfo

    cls = type(fake_platform("badname", 5))
    plugin = type("BadName", (cls,), {"device_info": lambda self, index: DeviceInfo(index, name, 1 << 30)})()
    make_registry(plugin_module(plugin))
    ran = cli("info")
    assert ran.returncode == 0 and "Traceback" not in ran.stderr, ran
    assert f"badname (<in-process>): failed to answer a query: device_info(0): TypeError: {says}" in ran.stdout
    assert "device 0: (device_info failed: see plugin errors)" in ran.stdout


# -- generate: the platform settings, the tokenizer, --max-new-tokens -------------------


@pytest.mark.parametrize("env, expected", [
    ({"TORCHHAL_PLATFORM": "nosuch"}, "unknown platform 'nosuch'"),
    ({"TORCHHAL_PLATFORM": "sleepy"}, "platform 'sleepy' is not available: fake: no device"),
    ({"TORCHHAL_DETECT_TIMEOUT": "abc"}, "TORCHHAL_DETECT_TIMEOUT='abc' is not a number of seconds"),
], ids=["unknown", "unavailable", "detect-timeout"])
def test_generate_refuses_a_bad_platform_setting_as_info_does(tiny, monkeypatch, make_registry, cli, env, expected):
    if "TORCHHAL_DETECT_TIMEOUT" not in env:  # that one must fail while the registry is built
        make_registry(plugin_module(fake_platform("sleepy", 5, available=False)))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    line = refused(cli("generate", "--model", str(tiny), "--prompt-ids", "1,2", "--max-new-tokens", "2"),
                   "generate", expected)
    info = cli("info")
    assert info.returncode == 2 and info.stderr.strip().splitlines()[-1] == f"torchhal info: {line}", info.stderr


@pytest.mark.parametrize("file, content, error", [
    ("tokenizer.json", "{not json", "JSONDecodeError"),
    ("tokenizer_config.json", "{}", "ValueError"),
], ids=["tokenizer-json", "bare-config"])
def test_a_broken_tokenizer_is_one_line_naming_the_file(tmp_path, tiny, cli, file, content, error):
    pytest.importorskip("transformers")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((tiny / "config.json").read_text())
    (model / file).write_text(content)
    refused(cli("generate", "--model", str(model), "--prompt", "hi"), "generate",
            f"cannot load the tokenizer from {model / file}: {error}", "give --prompt-ids instead of --prompt")


def test_max_new_tokens_refusal_names_the_flag(tiny, cli):
    line = refused(cli("generate", "--model", str(tiny), "--prompt-ids", "1,2", "--max-new-tokens", "0"), "generate",
                   "--max-new-tokens 0 must be a positive integer")
    assert "config.json" not in line  # the value came from the command line, not the checkpoint


# -- plugin new: a built-in's name would be dropped as a conflict -----------------------


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_plugin_new_refuses_a_built_in_name(tmp_path, cli, name):
    target = tmp_path / "plugin"
    refused(cli("plugin", "new", name, "--dir", str(target)), "plugin new",
            f"plugin name {name!r} is torchhal's built-in", "choose another name", f'replaces = "{name}"')
    assert not target.exists()


@pytest.mark.parametrize("name, suggestion", [("my_", "'my'"), ("accel__", "'accel'"), ("cuda_", "'mycuda'")])
def test_plugin_new_refuses_a_name_pip_cannot_take(tmp_path, cli, name, suggestion):
    target = tmp_path / "plugin"
    dist = "torchhal-" + name.replace("_", "-")
    refused(cli("plugin", "new", name, "--dir", str(target)), "plugin new",
            f"plugin name {name!r} ends with '_'", f"distribution name {dist!r} is not a valid package name",
            f"end it with a letter or digit, e.g. {suggestion}")
    assert not target.exists()


def test_every_built_in_name_is_refused(tmp_path):
    from torchhal.cli.plugin_template import TemplateError, builtin_platform_names, write_plugin

    names = builtin_platform_names()
    assert {"cpu", "cuda", "rocm", "xpu", "npu", "musa"} <= set(names), names
    for name in names:
        with pytest.raises(TemplateError, match="built-in"):
            write_plugin(name, tmp_path / name)
        assert not (tmp_path / name).exists()


# -- python -m torchhal ------------------------------------------------------------------


def test_python_dash_m_torchhal_is_the_torchhal_command():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHHAL_")}
    out = subprocess.run([sys.executable, "-m", "torchhal", "info", "--json"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["current"]["name"] == "cpu"


def test_generate_refuses_an_empty_model_path_instead_of_reading_the_working_directory(tiny, monkeypatch, cli):
    # `--model "$MODEL"` with MODEL unset ran whatever checkpoint the shell stood in.
    monkeypatch.chdir(tiny)
    refused(cli("generate", "--model", "", "--prompt-ids", "1,2", "--max-new-tokens", "1"), "generate",
            "checkpoint path '' is empty; pass the checkpoint directory")
    ran = cli("generate", "--model", ".", "--prompt-ids", "1,2", "--max-new-tokens", "1")
    assert ran.returncode == 0, ran.stderr


@pytest.mark.parametrize("report", ["--json", "--junit"])
def test_conformance_refuses_a_report_over_its_own_expectation_file(tmp_path, monkeypatch, cli, report):
    # The report overwrote the vendor's expectations: the next run had no file to read.
    monkeypatch.chdir(tmp_path)
    expectations = '["test_device::test_x"]\nreason = "known"\ncategory = "temporary"\n'
    (tmp_path / "exp.toml").write_text(expectations)
    refused(cli("conformance", "--expect", "exp.toml", report, str(tmp_path / "exp.toml"), "-k", "test_device_count"),
            "conformance", f"--expect and {report} both name exp.toml", "give the report its own file")
    assert (tmp_path / "exp.toml").read_text() == expectations


def test_a_refused_conformance_run_leaves_no_report_directory_behind(tmp_path, cli):
    # The report's missing parents were made before the platform was checked, and stayed.
    refused(cli("conformance", "--platform", "nosuch", "--json", str(tmp_path / "out" / "deep" / "r.json")),
            "conformance", "--platform 'nosuch' is not a registered platform")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("keywords, expected", [
    ({"tensor_parallel": True}, "tensor-parallel size True must be a positive int"),  # ran on one rank
    ({"tensor_parallel": "2"}, "tensor-parallel size '2' must be a positive int"),
    ({"tensor_parallel": 2.0}, "tensor-parallel size 2.0 must be a positive int"),
    ({"max_new_tokens": True}, "max_new_tokens True must be a positive int"),  # one token
    ({"graphs": "no"}, "--graphs 'no' must be True or False"),  # truthy: captured graphs
    ({"check_finite": "no"}, "check_finite 'no' must be True or False"),
    ({"prompt": "hi"}, "give a prompt or prompt ids, not both"),  # the text won, the ids were dropped
    ({"prompt_ids": "1,2"}, "prompt '1,2' is a str; pass a list of int token ids"),
    ({"prompt_ids": [1, True]}, "token True at position 1 is a bool"),
])
def test_generate_from_checkpoint_refuses_its_callers_arguments_as_theirs(tiny, keywords, expected):
    from torchhal.cli.generate import GenerateError, generate_from_checkpoint

    arguments: dict[str, object] = {"prompt_ids": [1, 2], "max_new_tokens": 1, **keywords}
    with pytest.raises(GenerateError) as info:
        generate_from_checkpoint(tiny, **arguments)  # type: ignore[arg-type]
    assert expected in str(info.value)
    assert "config.json" not in str(info.value)  # the caller's value, not the checkpoint's


def test_generate_from_checkpoint_takes_numpy_counts_as_the_engine_does(tiny):
    np = pytest.importorskip("numpy")
    from torchhal.cli.generate import generate_from_checkpoint

    out = generate_from_checkpoint(tiny, prompt_ids=[1, 2], max_new_tokens=np.int64(3), tensor_parallel=np.int32(1))
    assert out["max_new_tokens"] == 3 and type(out["max_new_tokens"]) is int
