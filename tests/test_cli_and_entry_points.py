import json

import pytest

from .conftest import run_cli


def test_info_json_lists_platforms_and_current():
    out = run_cli("info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    names = {p["name"] for p in info["platforms"]}
    assert {"cpu", "cuda", "rocm", "xpu", "npu", "musa"} <= names
    assert info["current"]["name"] == "cpu"
    assert info["current"]["devices"][0]["memory"]["total"] > 0


def test_bad_platform_env_exits_nonzero_naming_known_platforms():
    out = run_cli("info", env={"TORCHHAL_PLATFORM": "nope"})
    assert out.returncode == 2
    assert "unknown platform 'nope'" in out.stderr
    # Every built-in is named; installed third-party plugins may add to the list.
    known = out.stderr.split("registered platforms: ")[1].split(".")[0].split(", ")
    assert {"cpu", "cuda", "musa", "npu", "rocm", "xpu"} <= set(known), out.stderr


def test_entry_point_plugin_is_loaded_with_its_distribution():
    out = run_cli("info", "--json", with_test_dist=True, env={"TORCHHAL_TESTPLUGIN_MODE": "ok"})
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    entry = {p["name"]: p for p in info["platforms"]}["testaccel"]
    assert entry["distribution"] == "torchhal-testplugin" and entry["version"] == "0.3"
    assert info["current"]["name"] == "testaccel"  # priority 5 beats cpu's 0


def test_raising_detection_shows_in_info_while_cpu_is_selected():
    out = run_cli("info", with_test_dist=True, env={"TORCHHAL_TESTPLUGIN_MODE": "raise"})
    assert out.returncode == 0, out.stderr
    assert "Current platform: cpu" in out.stdout
    assert "testaccel (torchhal-testplugin): failed to detect: RuntimeError: testaccel driver crashed" in out.stdout


def test_plugin_that_fails_to_import_is_reported():
    out = run_cli("info", "--json", with_test_dist=True, env={"TORCHHAL_TESTPLUGIN_MODE": "import"})
    assert out.returncode == 0, out.stderr
    errors = json.loads(out.stdout)["plugin_errors"]
    assert errors[0]["plugin"] == "testaccel" and errors[0]["stage"] == "import"
    assert "libtestaccel.so" in errors[0]["error"]
    assert "TorchhalPluginWarning" in out.stderr


def test_allow_list_empty_string_loads_no_third_party_plugins():
    out = run_cli("info", "--json", with_test_dist=True, env={"TORCHHAL_TESTPLUGIN_MODE": "ok", "TORCHHAL_PLUGINS": ""})
    info = json.loads(out.stdout)
    assert "testaccel" not in {p["name"] for p in info["platforms"]}
    assert info["current"]["name"] == "cpu"


def test_allow_list_names_the_plugin_and_reports_missing_ones():
    out = run_cli(
        "info", "--json", with_test_dist=True,
        env={"TORCHHAL_TESTPLUGIN_MODE": "ok", "TORCHHAL_PLUGINS": "testaccel,ghost"},
    )
    info = json.loads(out.stdout)
    assert "testaccel" in {p["name"] for p in info["platforms"]}
    assert any(e["plugin"] == "ghost" and "no installed distribution" in e["error"] for e in info["plugin_errors"])


def test_help_names_every_command():
    out = run_cli("--help")
    assert out.returncode == 0
    for command in ("info", "conformance", "generate", "plugin"):
        assert command in out.stdout.split("positional arguments")[0], out.stdout


def test_info_columns_line_up_for_long_platform_names():
    out = run_cli("info", with_test_dist=True, env={"TORCHHAL_TESTPLUGIN_MODE": "ok"})
    assert out.returncode == 0, out.stderr
    rows = out.stdout.split("Registered platforms:\n")[1].split("\n\n")[0].splitlines()
    assert any(row.split()[0] == "testaccel" for row in rows)  # longer than the built-in names
    assert len({row.index(" priority ") for row in rows}) == 1, rows


def test_output_that_cannot_be_written_is_one_line_not_a_traceback():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHHAL_")}
    with open("/dev/full", "w") as full:
        disk = subprocess.run([sys.executable, "-m", "torchhal.cli", "info", "--json"], stdout=full,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    assert disk.returncode == 2
    assert disk.stderr.strip() == "torchhal info: cannot write the output: No space left on device"

    pipe = subprocess.Popen([sys.executable, "-m", "torchhal.cli", "info", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert pipe.stdout is not None and pipe.stderr is not None
    pipe.stdout.close()  # the reader goes away before a byte is written, like `| head -0`
    stderr = pipe.stderr.read()
    assert pipe.wait(timeout=300) == 2
    assert stderr.strip() == "torchhal info: cannot write the output: Broken pipe", stderr


def test_the_conformance_verdict_does_not_depend_on_the_working_directory(tmp_path):
    """Started beside a folder named `torchhal` (a clone's root), the suite still tests the
    installed torchhal: a child `python -c` must not import that folder as a namespace package."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "torchhal").mkdir()
    (tmp_path / "torchhal" / "README.md").write_text("a clone's root has no __init__.py")
    script = Path(sys.executable).parent / "torchhal"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "torchhal.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHHAL_")}
    out = subprocess.run([*command, "conformance", "-k", "contract"], cwd=tmp_path, capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "VERDICT: CONFORMANT" in out.stdout
    assert "configfile: pytest.ini" in out.stdout and "devnull" not in out.stdout and "/dev/null" not in out.stdout


def test_info_shows_the_attention_backends_in_the_order_selection_tries_them():
    out = run_cli("info", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["current"]["capabilities"]["attention"]
    assert [row["name"] for row in rows][-1] == "reference"  # the portable fallback, always last
    text = run_cli("info").stdout
    assert "attention: 1. reference (portable reference, used when none above runs" in text


def test_conformance_output_that_cannot_be_written_is_one_line_and_the_report_is_still_written(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHHAL_")}
    command = [sys.executable, "-m", "torchhal.cli", "conformance", "-k", "contract"]
    report = tmp_path / "report.json"
    with open("/dev/full", "w") as full:
        disk = subprocess.run([*command, "--json", str(report)], stdout=full, stderr=subprocess.PIPE, text=True,
                              env=env, timeout=300)
    assert disk.returncode == 2, disk.stderr  # the documented code, not NOT CONFORMANT's 1
    assert disk.stderr.strip() == (f"torchhal conformance: cannot write the output: No space left on device; "
                                   f"verdict CONFORMANT, report written to {report}"), disk.stderr
    assert json.loads(report.read_text())["verdict_class"] == "CONFORMANT"  # only stdout broke

    pipe = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert pipe.stdout is not None and pipe.stderr is not None
    pipe.stdout.close()  # the reader goes away, as `| head -1` does
    stderr = pipe.stderr.read()
    assert pipe.wait(timeout=300) == 2
    assert stderr.strip() == "torchhal conformance: cannot write the output: Broken pipe", stderr


def test_pytest_marking_the_installed_package_for_rewriting_does_not_warn():
    """Installed from a wheel (how a vendor's CI installs torchhal), every `torchhal conformance`
    printed PytestAssertRewriteWarning: pytest marks the distribution's top-level package of its
    `pytest11` entry point for rewriting, after the command had imported it. pytest's own hook
    decides, in a fresh process (here pytest's loader has imported torchhal already)."""
    import subprocess
    import sys

    script = """
import torchhal  # first, as the CLI does
from _pytest.assertion.rewrite import AssertionRewritingHook

class Config:
    warned = []
    def getini(self, name):
        return ["test_*.py"]
    def issue_config_time_warning(self, warning, stacklevel):
        self.warned.append(str(warning))

config = Config()
AssertionRewritingHook(config).mark_rewrite("torchhal")
print(config.warned)
"""
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "[]", ran.stdout


@pytest.mark.parametrize("argv", [["--help"], [], ["bogus"], ["info", "--help"], ["info", "--bogus"],
                                  ["plugin", "new", "--help"], ["conformance", "--help"]])
def test_help_and_usage_errors_import_no_torch(argv):
    """Importing torch took seconds before `torchhal --help` printed its usage."""
    import subprocess
    import sys

    code = ("import sys\nfrom torchhal.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n"
            "    code = exc.code\nprint('torch imported' if 'torch' in sys.modules else f'no torch, exit {code}')\n")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    said = out.stdout.strip().splitlines()[-1]
    assert said == f"no torch, exit {0 if '--help' in argv else 2}", out.stdout + out.stderr


def test_the_help_lines_of_the_commands_are_their_own():
    """`torchhal --help` lists each command without importing it: the listed line is the command's own."""
    import argparse

    from torchhal.cli import COMMANDS, build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {choice.dest: choice.help for choice in sub._choices_actions} == {
        name: help_line for name, (_, help_line) in COMMANDS.items()}
