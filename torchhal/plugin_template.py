"""`torchhal plugin new NAME`: write a platform plugin distribution a vendor starts from.

The plugin class is written from `PlatformPlugin` itself: each SPI member gets its
real signature and the guidance below (what to do, what the contract demands).
A member the SPI gains without guidance here is left out of the template, and
tests/test_plugin_template.py fails until it is added.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from pathlib import Path

from torchhal.platforms.plugin import SPI_ATTRIBUTES, SPI_METHODS, SPI_VERSION, PlatformPlugin

_NAME = re.compile(r"[a-z][a-z0-9_]*")

#: Attribute -> (value expression, TODO). `{name}` is the platform name.
ATTRIBUTE_GUIDANCE: dict[str, tuple[str, str]] = {
    "name": ('"{name}"', "TORCHHAL_PLATFORM={name} selects this platform"),
    "device_type": ('"{name}"', "TODO: the torch device type string your tensors carry (torch.device(type, i))"),
    "priority": ("50", "TODO: higher wins when several are available; CPU is 0 (docs/spi-reference.md)"),
    "replaces": ("None", "name of a platform from another distribution this one replaces, if any"),
    "dist_backend": ('"gloo"', "TODO: your torch.distributed backend (e.g. your collective library)"),
    "visible_devices_env": ('("{upper}",)', "TODO: variables that restrict which devices the runtime sees"),
    "ipc_peer_redirect": ("False", "True if your IPC open maps handles through the consumer's own device"),
    "spi_version": (repr(tuple(SPI_VERSION)), "the torchhal SPI this plugin was written for (docs/vendor-guide.md)"),
}

#: Method -> TODO text. Required (abstract) members raise NotImplementedError with it until
#: filled in, except is_available, which answers "no" so the stub never breaks the host;
#: the others call the default and say when to override it.
METHOD_GUIDANCE: dict[str, str] = {
    "is_available": "cheap, idempotent, never raises, initialises no device: find_spec your extension, "
    "count devices, and return Availability.no('why, and what to install') on any problem",
    "device_module": "return your torch device module (e.g. torch.{name}), imported here, lazily; "
    "it should offer is_initialized() (the suite checks detection leaves it False)",
    "device_count": "the default calls device_module().device_count()",
    "current_device": "the default calls device_module().current_device()",
    "set_device": "the default calls device_module().set_device(index)",
    "synchronize": "the default calls device_module().synchronize(index)",
    "device_info": "return DeviceInfo(index, name, total_memory bytes > 0, capability or None)",
    "runtime_version": "return your driver/runtime version string for reports (default: None)",
    "memory_info": "return MemoryInfo(index, free, total, reserved, allocated) as int bytes; only observe: "
    "no empty_cache, no synchronize, no other device; well under a millisecond",
    "empty_cache": "return cached blocks to the device; return reserved_before - reserved_after (or None)",
    "oom_error_types": "return the exception classes an out-of-memory allocation raises",
    "is_out_of_memory": "the default is isinstance(error, oom_error_types()); override if OOM is a generic error",
    "pin_memory": "the default is tensor.pin_memory()",
    "peak_memory": "the default reads max_memory_reserved/max_memory_allocated of the device module",
    "reset_peak_memory": "the default calls device_module().reset_peak_memory_stats(index)",
    "can_access_peer": "the default calls device_module().can_device_access_peer(index, peer)",
    "new_stream": "the default is device_module().Stream(device=index)",
    "current_stream": "the default is device_module().current_stream(index)",
    "use_stream": "the default enters device_module().stream(stream)",
    "new_event": "the default is device_module().Event()",
    "graph_support": "return a GraphSupport to declare device graphs (default None: undeclared)",
    "ipc_support": "return an IpcSupport to declare cross-process sharing (default None: undeclared)",
}


class TemplateError(ValueError):
    """A bad plugin name or target directory; nothing was written."""


def check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise TemplateError(f"plugin name {name!r} must be a lowercase identifier such as 'myaccel'")


def _signature(method: str) -> str:
    signature = inspect.signature(getattr(PlatformPlugin, method))
    return str(signature).replace("'", "")


def _call_args(method: str) -> str:
    params = list(inspect.signature(getattr(PlatformPlugin, method)).parameters)[1:]
    return ", ".join(params)


def _method_source(method: str, name: str) -> str:
    todo = _comment("TODO: " + METHOD_GUIDANCE[method].format(name=name))
    func = getattr(PlatformPlugin, method)
    header = f"def {method}{_signature(method)}:"
    if method == "is_available":
        body = f'{todo}\nreturn Availability.no("TODO: {name} detection is not written yet")'
    elif getattr(func, "__isabstractmethod__", False):
        body = f'{todo}\nraise NotImplementedError("TODO: {name} {method} is not written yet")'
    elif method == "use_stream":
        header = "@contextlib.contextmanager\n" + header
        body = f"{todo}\nwith super().use_stream({_call_args(method)}):\n    yield"
    else:
        body = f"{todo}\nreturn super().{method}({_call_args(method)})"
    return header + "\n" + textwrap.indent(body, "    ")


def _comment(text: str) -> str:
    return "\n".join("# " + line for line in textwrap.wrap(text, 80, break_on_hyphens=False))


def plugin_module_source(name: str) -> str:
    """The plugin package's __init__.py: every SPI member the guidance covers, stubbed."""
    class_name = "".join(part.capitalize() for part in name.split("_")) + "Platform"
    attributes = []
    for attr in SPI_ATTRIBUTES:
        if attr in ATTRIBUTE_GUIDANCE:
            value, todo = ATTRIBUTE_GUIDANCE[attr]
            value = value.format(name=name, upper=f"{name.upper()}_VISIBLE_DEVICES")
            attributes.append(f"{_comment(todo.format(name=name))}\n{attr} = {value}")
    methods = [_method_source(m, name) for m in SPI_METHODS if m in METHOD_GUIDANCE]
    body = "\n\n".join(attributes) + "\n\n" + "\n\n".join(methods)
    return f'''"""torchhal platform plugin for {name}: every SPI member, to fill in.

Reference: docs/spi-reference.md of torchhal. Check it with:
    torchhal conformance --platform {name}
Import your runtime only inside methods: `import torchhal` must never import it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from torchhal.platforms import (
    Availability,
    DeviceInfo,
    GraphSupport,
    IpcSupport,
    MemoryInfo,
    PeakMemory,
    PlatformPlugin,
    hookimpl,
)


class {class_name}(PlatformPlugin):
{textwrap.indent(body, "    ")}


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [{class_name}()]
'''


def _pyproject(name: str, package: str) -> str:
    return f'''[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "torchhal-{name.replace("_", "-")}"
version = "0.1.0"
description = "torchhal platform plugin for {name}"
requires-python = ">=3.10"
dependencies = ["torchhal"]

# torchhal finds the plugin through this entry point (group "torchhal").
[project.entry-points.torchhal]
{name} = "{package}"

[tool.setuptools]
packages = ["{package}"]
'''


def _readme(name: str, package: str) -> str:
    return f"""# torchhal-{name.replace("_", "-")}

A torchhal platform plugin for {name}, started from `torchhal plugin new {name}`.

1. Fill in every `TODO` in `{package}/__init__.py` (docs/spi-reference.md of torchhal
   documents each member, its types, units and defaults).
2. `pip install -e .` and check that `torchhal info` lists `{name}` as available.
3. `torchhal conformance --platform {name} --profile full --json conformance.json`
   until the verdict is `CONFORMANT`; declare known failures in an expectation file
   (docs/conformance.md).

`.github/workflows/conformance.yml` runs the suite on every push, on a runner with the device.
"""


def _ci_workflow(name: str) -> str:
    return f"""name: torchhal conformance
on: [push, pull_request]
jobs:
  conformance:
    # TODO: a runner with a {name} device and its runtime installed.
    runs-on: [self-hosted, {name}]
    steps:
      - uses: actions/checkout@v4
      - run: python -m pip install torchhal .
      - run: torchhal info
      - run: torchhal conformance --platform {name} --profile full --json conformance.json --junit junit.xml
      - uses: actions/upload-artifact@v4
        if: always()
        with:
          name: conformance-report
          path: |
            conformance.json
            junit.xml
"""


def write_plugin(name: str, directory: Path | None = None) -> Path:
    """Write the distribution for platform `name` into `directory` (default ./torchhal-NAME); return it."""
    check_name(name)
    target = Path(directory) if directory is not None else Path(f"torchhal-{name.replace('_', '-')}")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise TemplateError(f"{target} already exists and is not an empty directory; choose another --dir")
    package = f"torchhal_{name}"
    files = {
        Path("pyproject.toml"): _pyproject(name, package),
        Path(package) / "__init__.py": plugin_module_source(name),
        Path("README.md"): _readme(name, package),
        Path(".github") / "workflows" / "conformance.yml": _ci_workflow(name),
    }
    for relative, content in files.items():
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return target
