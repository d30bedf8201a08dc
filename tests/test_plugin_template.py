"""`torchhal plugin new`: a distribution a vendor can start from, with every SPI member."""

from __future__ import annotations

import importlib
import sys

import pytest
import tomllib

from torchhal.cli.plugin_template import (
    BASES,
    PLACEHOLDER_REQUIREMENT,
    TemplateError,
    runner_requirement,
    torchhal_requirement,
    with_suite,
    write_plugin,
)
from torchhal.platforms import ENTRY_POINT_GROUP, SPI_ATTRIBUTES, SPI_METHODS, Availability, PlatformPlugin
from torchhal.plugins.accelerator import AcceleratorPlatform

from .conftest import run_cli


@pytest.fixture
def generated(tmp_path, monkeypatch):
    """Generate `myaccel` with the CLI and import its package from the generated tree."""
    target = tmp_path / "torchhal-myaccel"
    out = run_cli("plugin", "new", "myaccel", "--dir", str(target))
    assert out.returncode == 0, out.stderr
    monkeypatch.syspath_prepend(str(target))
    module = importlib.import_module("torchhal_myaccel")
    yield target, module
    sys.modules.pop("torchhal_myaccel", None)


def test_the_distribution_has_its_entry_point_readme_and_ci_job(generated):
    target, module = generated
    project = tomllib.loads((target / "pyproject.toml").read_text())
    assert project["project"]["entry-points"][ENTRY_POINT_GROUP] == {"myaccel": "torchhal_myaccel"}
    assert "torchhal" in project["project"]["dependencies"]
    assert "torchhal conformance --platform myaccel" in (target / "README.md").read_text()
    ci = (target / ".github" / "workflows" / "conformance.yml").read_text()
    assert "torchhal conformance --platform myaccel" in ci
    # torchhal is not on the package index: README and CI install it from its source before the
    # plugin, with the suite's extra (pytest), which the conformance run needs.
    requirement = with_suite(torchhal_requirement())
    assert requirement.startswith("torchhal[conformance] @ ")
    readme = (target / "README.md").read_text()
    assert f'pip install "{requirement}"' in readme
    assert readme.index(requirement) < readme.index("pip install -e .")
    install = ci.index(f'python -m pip install "{with_suite(runner_requirement(torchhal_requirement())[0])}"')
    assert install < ci.index("python -m pip install .\n") < ci.index("torchhal conformance --platform")


def test_a_ci_runner_is_not_sent_to_a_directory_of_this_machine(monkeypatch, tmp_path):
    """Installed from a local directory, the README may name it (it is on this machine); the CI
    job gets the placeholder and a TODO naming the directory. A VCS source goes to both."""
    from torchhal.cli import plugin_template

    for installed, runner in (("torchhal @ file:///src/torchhal", PLACEHOLDER_REQUIREMENT),
                              ("torchhal @ git+https://example.org/t.git@abc", "torchhal @ git+https://example.org/t.git@abc")):
        monkeypatch.setattr(plugin_template, "torchhal_requirement", lambda installed=installed: installed)
        target = write_plugin("myaccel", tmp_path / installed.split(":")[1].strip("/").replace("/", "_"))
        ci = (target / ".github" / "workflows" / "conformance.yml").read_text()
        assert f'python -m pip install "{with_suite(runner)}"' in ci
        assert ("TODO: this torchhal was installed from file:///src/torchhal" in ci) == (runner != installed)
        assert f'pip install "{with_suite(installed)}"' in (target / "README.md").read_text()


@pytest.mark.parametrize("base", BASES)
def test_a_cpu_backed_plugins_ci_job_runs_on_a_hosted_runner_the_others_on_their_device(tmp_path, base):
    """Host tensors need no device: that job runs on a hosted runner with torch's CPU build
    installed first; a device's plugin needs a runner with that device."""
    target = write_plugin("myaccel", tmp_path / base, base=base)
    ci = (target / ".github" / "workflows" / "conformance.yml").read_text()
    readme = (target / "README.md").read_text()
    runs_on = [line.strip() for line in ci.splitlines() if line.strip().startswith("runs-on:")]
    if base == "cpu":
        assert runs_on == ["runs-on: ubuntu-latest"]
        torch_install = ci.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
        assert torch_install < ci.index("python -m pip install .\n")
        assert "hosted Ubuntu runner" in readme
    else:
        assert runs_on == ["runs-on: [self-hosted, myaccel]"]
        assert "pip install torch" not in ci  # the device's own torch build is the runner's
        assert "a runner with the device" in readme
    steps = ci.index("    steps:\n")
    assert ci.index("actions/checkout@v4") > steps and ci.count("    steps:") == 1


def test_the_requirement_names_where_this_torchhal_was_installed_from(monkeypatch):
    import importlib.metadata
    import json

    class Dist:
        def __init__(self, record: dict) -> None:
            self.record = record

        def read_text(self, name: str) -> str:
            assert name == "direct_url.json"
            return json.dumps(self.record)

    def pretend(record: dict) -> None:
        monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Dist(record))

    pretend({"url": "https://example.org/torchhal.git", "vcs_info": {"vcs": "git", "commit_id": "abc123"}})
    assert torchhal_requirement() == "torchhal @ git+https://example.org/torchhal.git@abc123"
    pretend({"url": "file:///src/torchhal", "dir_info": {"editable": True}})
    assert torchhal_requirement() == "torchhal @ file:///src/torchhal"
    pretend({})
    assert "YOUR-GIT-HOST" in torchhal_requirement()  # a placeholder that says what to fill in


def test_the_plugin_class_defines_every_spi_member(generated):
    _, module = generated
    cls = type(module.torchhal_register_platforms()[0])
    assert issubclass(cls, PlatformPlugin)
    # Read from PlatformPlugin: when the SPI grows and the template does not, this fails.
    missing = [name for name in (*SPI_ATTRIBUTES, *SPI_METHODS) if name not in vars(cls)]
    assert missing == [], f"add guidance for these SPI members to torchhal/cli/plugin_template.py: {missing}"
    assert cls.name == "myaccel" and cls.priority == PlatformPlugin.priority == 50


def test_the_generated_plugin_registers_and_is_unavailable_until_written(generated, make_registry):
    _, module = generated
    reg = make_registry(module)
    assert reg.failures == []
    assert "myaccel" in reg.platforms
    availability = reg.availability("myaccel")
    assert isinstance(availability, Availability) and not availability
    assert "TODO" in availability.reason
    plugin = reg.platforms["myaccel"].plugin
    # Required members raise until filled in, naming what is missing; optional ones keep the defaults.
    with pytest.raises(NotImplementedError, match="myaccel memory_info is not written yet"):
        plugin.memory_info(0)
    assert plugin.runtime_version() is None and plugin.graph_support() is None


@pytest.mark.parametrize("base", BASES)
def test_the_generated_module_is_lint_clean(tmp_path, base):
    """Linted where the vendor lints it: in its own repository, where torchhal is third-party."""
    import subprocess

    target = write_plugin("myaccel", tmp_path / "torchhal-myaccel", base)
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "."],
                         capture_output=True, text=True, cwd=target)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_accelerator_base_is_a_declaration_that_detects_its_runtime(tmp_path, monkeypatch, make_registry):
    target = write_plugin("myaccel", tmp_path / "out", "accelerator")
    monkeypatch.syspath_prepend(str(target))
    try:
        module = importlib.import_module("torchhal_myaccel")
        plugin = module.torchhal_register_platforms()[0]
        assert isinstance(plugin, AcceleratorPlatform)
        reg = make_registry(module)
        assert reg.failures == []
        assert reg.availability("myaccel").reason.startswith("torch_myaccel is not installed")
    finally:
        sys.modules.pop("torchhal_myaccel", None)


def test_the_cpu_base_is_conformant_as_written(tmp_path):
    """A simulated device on the CPU base passes the core suite before a line is changed,
    registered the way a vendor ships it: an installed distribution's entry point."""
    import os
    import subprocess

    target = write_plugin("mysim", tmp_path / "dist", "cpu")
    info = tmp_path / "dist" / "torchhal_mysim-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchhal-mysim\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[torchhal]\nmysim = torchhal_mysim\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHHAL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(target), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-m", "torchhal.cli", "conformance", "--platform", "mysim"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "platform: mysim from torchhal-mysim 0.1.0" in out.stdout and "VERDICT: CONFORMANT (core)" in out.stdout


def test_an_unknown_base_is_refused_and_writes_nothing(tmp_path):
    with pytest.raises(TemplateError, match="base 'gpu' is not one of plugin, accelerator, cpu"):
        write_plugin("myaccel", tmp_path / "out", "gpu")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, expected", [("My-Accel", "lowercase identifier"), ("evil\n", "lowercase identifier")])
def test_bad_names_are_refused_and_write_nothing(tmp_path, name, expected):
    with pytest.raises(TemplateError, match=expected):
        write_plugin(name, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_existing_nonempty_directory_is_refused(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    out = run_cli("plugin", "new", "myaccel", "--dir", str(tmp_path))
    assert out.returncode == 2
    assert "already exists and is not an empty directory" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_a_name_too_long_for_a_file_name_is_refused_before_writing(tmp_path):
    with pytest.raises(TemplateError, match=r"is 250 characters; use at most 64"):
        write_plugin("a" * 250, tmp_path / "plug")
    assert not (tmp_path / "plug").exists()


def test_a_write_that_fails_part_way_leaves_nothing_behind(tmp_path, monkeypatch):
    from pathlib import Path

    real, writes = Path.write_text, []

    def failing_third(self, *args, **kwargs):
        writes.append(self)
        if len(writes) == 3:
            raise OSError(28, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", failing_third)
    with pytest.raises(TemplateError, match=r"could not write .*No space left on device; nothing was left behind"):
        write_plugin("myaccel", tmp_path / "plug")
    assert not (tmp_path / "plug").exists()
    monkeypatch.setattr(Path, "write_text", real)
    assert (write_plugin("myaccel", tmp_path / "plug") / "pyproject.toml").is_file()  # a rerun is not refused


def test_a_write_interrupted_part_way_leaves_nothing_behind(tmp_path, monkeypatch):
    # Ctrl-C between two files leaves no half distribution for the rerun to refuse as a non-empty directory.
    from pathlib import Path

    real, writes = Path.write_text, []

    def interrupted_third(self, *args, **kwargs):
        writes.append(self)
        if len(writes) == 3:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", interrupted_third)
    with pytest.raises(KeyboardInterrupt):
        write_plugin("myaccel", tmp_path / "plug")
    assert not (tmp_path / "plug").exists()
    monkeypatch.setattr(Path, "write_text", real)
    assert (write_plugin("myaccel", tmp_path / "plug") / "pyproject.toml").is_file()


def test_a_file_cut_short_by_a_full_disk_is_removed_with_the_rest(tmp_path, monkeypatch):
    # The half-written file counts as made: its folder is removed too, and the refusal names the full disk.
    from pathlib import Path

    real = Path.write_text

    def disk_full_in_init(self, content, *args, **kwargs):
        if self.name == "__init__.py":
            real(self, content[:10], *args, **kwargs)
            raise OSError(28, "No space left on device")
        return real(self, content, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", disk_full_in_init)
    with pytest.raises(TemplateError, match=r"could not write .*No space left on device; nothing was left behind"):
        write_plugin("myaccel", tmp_path / "plug")
    assert not (tmp_path / "plug").exists()


def comments_above(source: str, line: str) -> str:
    """The comment lines right above `line` in `source`, joined into one line of text."""
    lines = source.splitlines()
    index = next(i for i, text in enumerate(lines) if text.strip() == line)
    comments = []
    while lines[index - 1].strip().startswith("#"):
        index -= 1
        comments.insert(0, lines[index].strip().removeprefix("# "))
    return " ".join(comments)


@pytest.mark.parametrize("base", ["plugin", "accelerator"])
def test_each_members_guidance_is_the_first_paragraph_of_its_docstring(base):
    """The SPI is written once: the template's guidance is read from PlatformPlugin (and
    AcceleratorPlatform), not restated."""
    import inspect

    from torchhal.cli.plugin_template import TO_FILL, guidance, plugin_module_source, spi_doc

    source = plugin_module_source("myaccel", base)
    owner = {name: PlatformPlugin for name in SPI_ATTRIBUTES}
    owner.update({name: AcceleratorPlatform for name in vars(AcceleratorPlatform)["__annotations__"]}
                 if base == "accelerator" else {})
    for name, cls in owner.items():
        line = next(text.strip() for text in source.splitlines() if text.strip().startswith(f"{name} = "))
        first = " ".join(spi_doc(cls, name).split("\n\n")[0].split())
        assert first and comments_above(source, line) == ("TODO: " if name in TO_FILL else "") + first, name
    if base == "plugin":
        for name in SPI_METHODS:
            doc = " ".join(inspect.getdoc(getattr(PlatformPlugin, name)).split("\n\n")[0].split())
            assert doc == guidance(PlatformPlugin, name) and " ".join(doc.split()) in " ".join(
                line.strip().removeprefix("# ") for line in source.splitlines()), name


def test_the_next_step_of_a_template_conformant_as_written_is_no_todo(tmp_path):
    out = run_cli("plugin", "new", "mysim", "--base", "cpu", "--dir", str(tmp_path / "cpu"))
    assert out.returncode == 0, out.stderr
    assert "TODO" not in (tmp_path / "cpu" / "torchhal_mysim" / "__init__.py").read_text()
    assert "fill in the TODOs" not in out.stdout and "next: pip install -e" in out.stdout
    out = run_cli("plugin", "new", "myaccel", "--dir", str(tmp_path / "plugin"))
    assert "next: fill in the TODOs, pip install -e" in out.stdout


def test_a_ci_runner_sent_to_a_wheel_of_this_machine_is_not_told_it_is_a_directory(monkeypatch, tmp_path):
    from torchhal.cli import plugin_template

    wheel = "torchhal @ file:///build/torchhal-0.1.0-py3-none-any.whl"
    monkeypatch.setattr(plugin_template, "torchhal_requirement", lambda: wheel)
    ci = (write_plugin("myaccel", tmp_path / "out") / ".github" / "workflows" / "conformance.yml").read_text()
    assert "directory" not in ci
    assert ("TODO: this torchhal was installed from file:///build/torchhal-0.1.0-py3-none-any.whl, a path on this "
            "machine that a runner does not have") in ci


@pytest.mark.parametrize("base", BASES)
def test_the_files_point_at_a_reference_the_installation_has(tmp_path, base):
    """The wheel has no docs/ folder: the generated files send a vendor to `torchhal plugin spi`."""
    target = write_plugin("myaccel", tmp_path / base, base)
    written = "".join(path.read_text() for path in target.rglob("*") if path.is_file())
    assert "docs/" not in written and "torchhal plugin spi" in (target / "README.md").read_text()


def test_plugin_spi_prints_the_reference_the_docstrings_render():
    from torchhal.cli.plugin_template import spi_reference

    out = run_cli("plugin", "spi")
    assert out.returncode == 0, out.stderr
    reference = spi_reference()
    assert out.stdout == (f"## Class attributes\n\n{reference['attributes']}\n\n## Methods\n\n{reference['methods']}\n")
