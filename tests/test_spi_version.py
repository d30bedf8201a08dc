"""The versioned SPI: the host refuses another major and accepts every minor of its own."""

import warnings

import pytest

import torchhal
from torchhal.platforms import (
    SPI_VERSION,
    PlatformPlugin,
    PluginContractError,
    TorchhalPluginWarning,
    UnknownPlatformError,
    manager,
)
from torchhal.plugins.cpu import CpuPlatform

from .test_plugin_host import run_info
from .test_selection import plugin_module

# What a plugin written for SPI 1.0 implements; a 1.x release may not require more.
SPI_1_REQUIRED_METHODS = {
    "is_available", "device_module", "device_info", "memory_info", "empty_cache", "oom_error_types",
}
SPI_1_REQUIRED_ATTRIBUTES = {"name", "device_type", "dist_backend"}


def versioned(name, spi_version, **members):
    return type(f"V{name.title()}", (CpuPlatform,), {"name": name, "priority": 10, "spi_version": spi_version,
                                                     **members})()


def test_torchhal_declares_its_spi_version_and_plugins_default_to_its_major():
    assert isinstance(SPI_VERSION, tuple) and len(SPI_VERSION) == 2
    assert torchhal.SPI_VERSION == SPI_VERSION
    assert PlatformPlugin.spi_version == (SPI_VERSION[0], 0)
    assert "spi_version" in torchhal.SPI_ATTRIBUTES


def test_new_members_of_a_major_always_have_defaults():
    # A member added in a minor release must not be abstract, or 1.0 plugins break.
    assert set(PlatformPlugin.__abstractmethods__) == SPI_1_REQUIRED_METHODS
    without_default = {a for a in torchhal.SPI_ATTRIBUTES if not hasattr(PlatformPlugin, a)}
    assert without_default == SPI_1_REQUIRED_ATTRIBUTES


def test_a_plugin_for_an_older_minor_works_silently(make_registry, monkeypatch):
    monkeypatch.setattr(manager, "SPI_VERSION", (SPI_VERSION[0], SPI_VERSION[1] + 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg = make_registry(plugin_module(versioned("oldminor", (SPI_VERSION[0], 0))))
    assert "oldminor" in reg.names() and reg.notices == []
    assert torchhal.current_platform().name == "oldminor"


def test_a_plugin_for_a_newer_minor_works_with_a_notice(make_registry):
    newer = (SPI_VERSION[0], SPI_VERSION[1] + 1)
    with pytest.warns(TorchhalPluginWarning, match=f"targets SPI {newer[0]}.{newer[1]}, newer than"):
        reg = make_registry(plugin_module(versioned("newminor", newer)))
    assert "newminor" in reg.names() and len(reg.notices) == 1


@pytest.mark.parametrize("major", [SPI_VERSION[0] + 1, SPI_VERSION[0] - 1])
def test_a_plugin_for_another_major_is_refused_naming_both_versions(make_registry, monkeypatch, major):
    ours = ".".join(map(str, SPI_VERSION))
    refused = f"VFuture \\(platform 'future'\\) targets torchhal SPI {major}.0, but this torchhal implements SPI {ours}"
    with pytest.warns(TorchhalPluginWarning, match=refused):
        reg = make_registry(plugin_module(versioned("future", (major, 0))))
    [failure] = [f for f in reg.failures if f.stage == "version"]
    assert failure.plugin == "test-plugin-0" and failure.failed_to == "match the SPI version"
    assert "future" not in reg.names()
    monkeypatch.setenv("TORCHHAL_PLATFORM", "future")
    with pytest.raises(UnknownPlatformError, match="failed to match the SPI version"):
        torchhal.current_platform()


@pytest.mark.parametrize("bad", [(1,), "1.0", (1, "0"), (True, 0), (1, -1), [1, 0]])
def test_a_malformed_spi_version_is_refused_where_the_class_is_defined(bad):
    with pytest.raises(PluginContractError, match=r"VMalformed \(platform 'malformed'\): spi_version is .*; it must "
                                                  r"be \(major, minor\)"):
        versioned("malformed", bad)


def test_info_names_a_future_major_plugin():
    out = run_info("future-spi")
    assert out.returncode == 0, out.stderr
    ours = ".".join(map(str, SPI_VERSION))
    assert ("hostile (torchhal-hostile): failed to match the SPI version: FutureSpi (platform 'hostile') "
            f"targets torchhal SPI 2.0, but this torchhal implements SPI {ours}") in out.stdout
    assert "Current platform: cpu" in out.stdout


def test_a_plugin_written_before_spi_1_4_runs_f_linear(make_registry):
    """SPI 1.4 added linear_support(): a 1.3 plugin inherits the None default, with no notice."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg = make_registry(plugin_module(versioned("before14", (1, 3))))
    assert reg.notices == [] and SPI_VERSION >= (1, 4)
    platform = torchhal.get_platform("before14")
    assert platform.linear_support is None


def test_a_plugin_written_before_spi_1_5_compiles_with_inductors_defaults(make_registry):
    """SPI 1.5 added compile_support(): a 1.4 plugin inherits the None default, with no notice."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg = make_registry(plugin_module(versioned("before15", (1, 4))))
    assert reg.notices == [] and SPI_VERSION >= (1, 5)
    platform = torchhal.get_platform("before15")
    assert platform.compile_support is None
