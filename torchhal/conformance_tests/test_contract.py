"""contract: the plugin is well-formed. No device work."""

from __future__ import annotations

import inspect
import subprocess
import warnings
from typing import Any

import pytest

import torchhal
from torchhal.platforms import (
    PLATFORM_FACTS,
    SPI_ATTRIBUTES,
    SPI_METHODS,
    Availability,
    PlatformPlugin,
    PluginContractError,
    PluginFailure,
    RegisteredPlatform,
)
from torchhal.platforms.testing import describe_error

from ._helpers import python_code_command
from .plugin import SuiteState

pytestmark = pytest.mark.conformance("contract")


def test_plugin_registers(registered):
    failures = [
        f
        for f in torchhal.registry().failures
        if f.plugin in (registered.plugin.name, registered.source) and f.stage != "detect"  # detection has its own test
    ]
    assert failures == [], "; ".join(map(str, failures))


def test_spi_methods_present_with_signatures(registered):
    problems = []
    for name in SPI_METHODS:
        method = getattr(registered.plugin, name, None)
        if not callable(method):
            problems.append(f"{name} is missing or not callable ({method!r})")
            continue
        expected = list(inspect.signature(getattr(PlatformPlugin, name)).parameters)[1:]
        actual = list(inspect.signature(method).parameters)
        if actual != expected:
            problems.append(f"{name}{tuple(actual)} should take {tuple(expected)}")
    assert problems == [], "; ".join(problems)


def test_spi_attributes_have_the_right_types(registered):
    plugin = registered.plugin
    missing = [name for name in SPI_ATTRIBUTES if not hasattr(plugin, name)]
    assert missing == [], f"missing SPI attribute(s): {', '.join(missing)}"
    checks = {
        "name": isinstance(plugin.name, str),
        "device_type": isinstance(plugin.device_type, str),
        "priority": isinstance(plugin.priority, int) and not isinstance(plugin.priority, bool),
        "dist_backend": isinstance(plugin.dist_backend, str),
        "replaces": plugin.replaces is None or isinstance(plugin.replaces, str),
        "visible_devices_env": isinstance(plugin.visible_devices_env, tuple)
        and all(isinstance(v, str) for v in plugin.visible_devices_env),
        "ipc_peer_redirect": isinstance(plugin.ipc_peer_redirect, bool),
    }
    wrong = [f"{name}={getattr(plugin, name)!r}" for name, ok in checks.items() if not ok]
    assert wrong == [], f"SPI attribute(s) of the wrong type (see docs/spi-reference.md): {', '.join(wrong)}"


def test_is_available_never_raises_and_is_idempotent(registered, measure):
    # Probed as the host probes: isolated, and abandoned after TORCHHAL_DETECT_TIMEOUT seconds.
    results = []
    for _ in range(3):
        result, error = torchhal.registry().detect(registered.plugin)
        assert not isinstance(error, TimeoutError), str(error)
        assert error is None, f"is_available() raised {describe_error(error)}"
        results.append(result)
    assert all(isinstance(r, Availability) for r in results), [type(r).__name__ for r in results]
    assert len(set(results)) == 1, results
    if not results[0]:
        assert results[0].reason, "a 'no' must say why"
    measure["available"] = results[0].available
    measure["reason"] = results[0].reason


def test_is_available_creates_no_device_context(registered, measure):
    """In a fresh process, detection leaves the device runtime uninitialised."""
    code = (
        "import torchhal\n"
        f"plugin = torchhal.registry().platforms[{registered.plugin.name!r}].plugin\n"
        "try:\n"
        "    init = plugin.device_module().is_initialized\n"
        "except Exception:\n"
        "    init = lambda: False  # runtime absent: nothing to initialise\n"
        "before = init()\n"
        "torchhal.registry().detect(plugin)  # isolated and time-limited: raising or hanging is the other test's\n"
        "print('initialised' if init() and not before else 'clean')\n"
    )
    out = subprocess.run(python_code_command(code), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "clean", (
        "is_available() initialised the device runtime (device_module().is_initialized() turned True)"
    )


def conflict_involves(failure: PluginFailure, registered: RegisteredPlatform) -> bool:
    """Whether a name conflict concerns the platform under test: over its name, or with its plugin a party."""
    return registered.plugin.name in failure.involves or registered.source in failure.involves


def test_platform_names_are_unique(suite: SuiteState, request: pytest.FixtureRequest, measure: dict[str, Any]) -> None:
    conflicts = [f for f in torchhal.registry().failures if f.stage == "conflict"]
    whose = ""
    if not suite.platform_chosen_automatically:
        # Named with --platform: judged on its own conflicts; the others are reported, not held against it.
        registered = request.getfixturevalue("registered")
        others = [f for f in conflicts if not conflict_involves(f, registered)]
        conflicts = [f for f in conflicts if conflict_involves(f, registered)]
        whose = f" involving platform {registered.plugin.name!r}"
        if others:
            measure["other_conflicts"] = [str(f) for f in others]
            warnings.warn(f"platform-name conflict(s) between other plugins, not judged for platform "
                          f"{registered.plugin.name!r}: " + "; ".join(map(str, others)), stacklevel=1)
    assert not conflicts, f"{len(conflicts)} platform-name conflict(s){whose}: " + "; ".join(map(str, conflicts))


def test_capability_records_have_the_right_types(platform):
    # Every fact the SPI types (graph, IPC, attention, linear, compile, distributed support, OOM
    # types), read as engines read it: the platform refuses an answer of the wrong type, which
    # would otherwise pass core and fail the first engine that reads it.
    refused = []
    for fact in PLATFORM_FACTS:
        try:
            getattr(platform, fact)
        except PluginContractError as exc:
            refused.append(str(exc))
    assert not refused, "; ".join(refused)
    assert platform.oom_error_types, "oom_error_types() returned (); name the exception types an OOM raises"
