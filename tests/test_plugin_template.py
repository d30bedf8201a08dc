"""`torchhal plugin new`: a distribution a vendor can start from, with every SPI member."""

from __future__ import annotations

import importlib
import sys

import pytest
import tomllib

from torchhal.platforms import ENTRY_POINT_GROUP, SPI_ATTRIBUTES, SPI_METHODS, Availability, PlatformPlugin
from torchhal.plugin_template import TemplateError, write_plugin

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
    assert "pip install torchhal ." in ci and "torchhal conformance --platform myaccel" in ci


def test_the_plugin_class_defines_every_spi_member(generated):
    _, module = generated
    cls = type(module.torchhal_register_platforms()[0])
    assert issubclass(cls, PlatformPlugin)
    # Read from PlatformPlugin: when the SPI grows and the template does not, this fails.
    missing = [name for name in (*SPI_ATTRIBUTES, *SPI_METHODS) if name not in vars(cls)]
    assert missing == [], f"add guidance for these SPI members to torchhal/plugin_template.py: {missing}"
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


def test_the_generated_module_is_lint_clean(generated):
    import subprocess

    target, _ = generated
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", str(target)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


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
