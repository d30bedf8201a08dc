"""`torchhal plugin new NAME [--base plugin|accelerator|cpu]`: a plugin distribution to start from.

Three starting points, one per kind of device (`BASES`):

- `plugin`: every SPI member of `PlatformPlugin`, written from the class itself (real
  signatures, the guidance below). A member the SPI gains without guidance here is left
  out, and tests/test_plugin_template.py fails until it is added.
- `accelerator`: a declaration on `AcceleratorPlatform`, for a device module that
  mirrors `torch.cuda` (as `torch.xpu`, `torch.npu`, `torch.musa` do).
- `cpu`: a simulated or host-backed device on `CpuPlatform`: host tensors, streams,
  events and IPC come with it, so it is conformant before a line is changed.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import re
import textwrap
from pathlib import Path

from torchhal.platforms.manager import DEFAULT_PLUGINS, PlatformRegistry, new_plugin_manager
from torchhal.platforms.plugin import SPI_ATTRIBUTES, SPI_METHODS, SPI_VERSION, PlatformPlugin

_NAME = re.compile(r"[a-z][a-z0-9_]*")
BASES = ("plugin", "accelerator", "cpu")

#: Attribute -> (value expression, TODO). `{name}` is the platform name.
ATTRIBUTE_GUIDANCE: dict[str, tuple[str, str]] = {
    "name": ('"{name}"', "TORCHHAL_PLATFORM={name} selects this platform"),
    "device_type": ('"{name}"', "TODO: the torch device type string your tensors carry (torch.device(type, i))"),
    "priority": ("50", "TODO: higher wins when several are available; CPU is 0 (docs/spi-reference.md)"),
    "replaces": ("None", "name of a platform from another distribution this one replaces, if any"),
    "dist_backend": ('"gloo"', "TODO: your torch.distributed backend; a name torch lacks must be registered by "
                     "your extension (torch.distributed.Backend.register_backend)"),
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
    "attention_support": "return an AttentionSupport naming your attention backends over the paged KV "
    "cache (torchhal.attention.AttentionBackend; default None: torchhal's portable reference)",
    "linear_support": "return a LinearSupport naming your kernel for linears of few rows (decode): "
    "kernel(x [M, K], weight [N, K], bias or None) -> [M, N] with F.linear's numbers, max_rows, dtypes "
    "(default None: F.linear everywhere)",
    "compile_support": "return a CompileSupport with inductor options for the layers engines compile, e.g. "
    "{{'triton.enable_pdl': True}}; result-neutral only (default None: inductor's defaults)",
    "device_for_rank": "the default maps local rank r to visible device r (or 0 when each rank sees one "
    "device) and refuses more ranks than devices, naming visible_devices_env",
    "distributed_support": "return a DistributedSupport to supply your own communicator (a function given "
    "torchhal's default one, returning a wrapper that replaces e.g. all_reduce) or to declare collectives "
    "graph-capturable (only if they record into your device graphs and replay; docs/vendor-guide.md, Distributed)",
}


#: AcceleratorPlatform's declarations -> (value expression, TODO).
ACCELERATOR_GUIDANCE: dict[str, tuple[str, str]] = {
    "extension_module": ('"torch_{name}"', "TODO: the extension imported before torch.{name} exists "
                         "(None when torch itself has the device module)"),
    "runtime_hint": ('"needs torch_{name} and its runtime"', "TODO: what to install, said with a 'no'"),
    "graph_class_name": ("None", "TODO: the graph class on torch.{name} (like 'CUDAGraph'), or None: no graphs"),
    "ipc_share_method": ("None", "TODO: the UntypedStorage method exporting a device storage (like "
                         "'_share_cuda_'), or None: no IPC"),
    "ipc_open_method": ("None", "TODO: the UntypedStorage method opening one (like '_new_shared_cuda')"),
}


class TemplateError(ValueError):
    """A bad plugin name or target directory; nothing was written."""


def check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise TemplateError(f"plugin name {name!r} must be a lowercase identifier such as 'myaccel'")
    if len(name) > MAX_NAME:  # it names a directory and a package: file systems cap a name at 255 bytes
        raise TemplateError(f"plugin name {name[:20]!r}... is {len(name)} characters; use at most {MAX_NAME}")
    builtins = builtin_platform_names()
    if name.endswith("_"):  # the distribution name would end in '-', which pip refuses
        stripped = name.rstrip("_")
        raise TemplateError(
            f"plugin name {name!r} ends with '_', so its distribution name 'torchhal-{name.replace('_', '-')}' "
            "is not a valid package name (pip refuses it); end it with a letter or digit, e.g. "
            f"{stripped if stripped not in builtins else 'my' + stripped!r}"
        )
    if name in builtins:
        raise TemplateError(
            f"plugin name {name!r} is torchhal's built-in {name!r} platform, which the host keeps over a plugin "
            f"of the same name (dropped as a conflict): choose another name, such as 'my{name}'; to replace "
            f'the built-in, also set `replaces = "{name}"` in the generated class'
        )


def builtin_platform_names() -> list[str]:
    """The names torchhal's own plugins register, read from them (no detection, no entry points)."""
    registry = PlatformRegistry(new_plugin_manager())
    registry.load_builtins(DEFAULT_PLUGINS)
    registry.collect_platforms()
    return registry.names()


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


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_")) + "Platform"


def _attributes(name: str, guidance: dict[str, tuple[str, str]], overrides: dict[str, str] | None = None) -> list[str]:
    lines = []
    for attr, (value, todo) in guidance.items():
        value = (overrides or {}).get(attr, value).format(name=name, upper=f"{name.upper()}_VISIBLE_DEVICES")
        lines.append(f"{_comment(todo.format(name=name))}\n{attr} = {value}")
    return lines


def plugin_module_source(name: str, base: str = "plugin") -> str:
    """The plugin package's __init__.py for `base` (one of BASES)."""
    if base == "accelerator":
        return _accelerator_module_source(name)
    if base == "cpu":
        return _cpu_module_source(name)
    class_name = _class_name(name)
    attributes = _attributes(name, {a: ATTRIBUTE_GUIDANCE[a] for a in SPI_ATTRIBUTES if a in ATTRIBUTE_GUIDANCE})
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
    AttentionSupport,
    Availability,
    CompileSupport,
    DeviceInfo,
    DistributedSupport,
    GraphSupport,
    IpcSupport,
    LinearSupport,
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


def _accelerator_module_source(name: str) -> str:
    class_name = _class_name(name)
    spi = {a: ATTRIBUTE_GUIDANCE[a] for a in SPI_ATTRIBUTES if a in ATTRIBUTE_GUIDANCE}
    body = "\n\n".join(_attributes(name, spi, {"priority": "90"}) + _attributes(name, ACCELERATOR_GUIDANCE))
    return f'''"""torchhal platform plugin for {name}: a declaration on AcceleratorPlatform.

torch.{name} must mirror torch.cuda's names (device_count, mem_get_info, memory_reserved,
empty_cache, Stream, Event, ...): AcceleratorPlatform drives it through them, detection
included. Override a method only where your runtime differs: `runtime_missing()` (decide
from the torch build), `probe_device_count(module)` (counting needs more), `ipc_events()`
(interprocess events). Reference: docs/spi-reference.md of torchhal. Check it with:
    torchhal conformance --platform {name} --profile full
"""

from __future__ import annotations

from torchhal.platforms import PlatformPlugin, hookimpl
from torchhal.plugins.accelerator import AcceleratorPlatform


class {class_name}(AcceleratorPlatform):
{textwrap.indent(body, "    ")}


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [{class_name}()]
'''


def _cpu_module_source(name: str) -> str:
    class_name = _class_name(name)
    return f'''"""torchhal platform plugin for {name}: a simulated or host-backed device on CpuPlatform.

Tensors are host tensors (`device_type = "cpu"`); CpuPlatform supplies detection, host
streams and events, OOM recognition and IPC, so this plugin is conformant as written.
Make it yours where your device differs: most often `memory_info` and `empty_cache`
follow what your simulated device holds (a caching allocator's counters: allocated,
reserved, and what empty_cache releases). Reference: docs/spi-reference.md of torchhal,
"Building a CPU-backed or simulated platform". Check it with:
    torchhal conformance --platform {name} --profile full
"""

from __future__ import annotations

from torchhal.platforms import MemoryInfo, PlatformPlugin, hookimpl
from torchhal.plugins.cpu import CpuPlatform


class {class_name}(CpuPlatform):
    # TORCHHAL_PLATFORM={name} selects this platform
    name = "{name}"
    # host tensors: torch needs nothing new
    device_type = "cpu"
    # below the CPU's 0: never chosen over it, used when named (docs/spi-reference.md)
    priority = -1
    dist_backend = "gloo"
    visible_devices_env = ()
    spi_version = {tuple(SPI_VERSION)!r}

    def memory_info(self, index: int) -> MemoryInfo:
        # TODO: the counters of your simulated device (the default reports the host's memory)
        return super().memory_info(index)

    def empty_cache(self, index: int) -> int | None:
        # TODO: release your simulated cache; return reserved_before - reserved_after (or None)
        return super().empty_cache(index)


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [{class_name}()]
'''


def torchhal_requirement() -> str:
    """How this torchhal was installed, as a pip requirement a plugin can install it by
    (torchhal is not on the package index): its VCS URL and commit, or its local source;
    a placeholder naming what to fill in when pip recorded neither."""
    try:
        recorded = importlib.metadata.distribution("torchhal").read_text("direct_url.json")
        url = json.loads(recorded or "{}")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        url = {}
    vcs = url.get("vcs_info") if isinstance(url, dict) else None
    if isinstance(vcs, dict) and isinstance(url.get("url"), str):
        commit = f"@{vcs['commit_id']}" if isinstance(vcs.get("commit_id"), str) else ""
        return f"torchhal @ {vcs.get('vcs', 'git')}+{url['url']}{commit}"
    if isinstance(url, dict) and isinstance(url.get("url"), str):
        return f"torchhal @ {url['url']}"
    return PLACEHOLDER_REQUIREMENT


#: What to fill in when no installable source of torchhal is known.
PLACEHOLDER_REQUIREMENT = "torchhal @ git+https://YOUR-GIT-HOST/torchhal.git"


def runner_requirement(requirement: str) -> tuple[str, str]:
    """(requirement, TODO comment or "") for the CI job: a local directory is where torchhal
    lives on this machine only, so a runner gets the placeholder and a TODO saying why."""
    if not requirement.startswith("torchhal @ file:"):
        return requirement, ""
    where = requirement.removeprefix("torchhal @ ")
    return PLACEHOLDER_REQUIREMENT, (f"# TODO: this torchhal was installed from {where}, a directory a runner does "
                                     "not have: name the git URL (and commit) it comes from.")


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


def _readme(name: str, package: str, requirement: str, base: str) -> str:
    runner = "GitHub's hosted Ubuntu runner (the plugin is CPU-backed)" if base == "cpu" else "a runner with the device"
    return f"""# torchhal-{name.replace("_", "-")}

A torchhal platform plugin for {name}, started from `torchhal plugin new {name}`.

1. torchhal is not on the package index: install it first, from where this plugin was
   made from (`pip install "{requirement}"`), or from your own torchhal checkout
   (`pip install -e /path/to/torchhal`). Then `pip install -e .` here finds it installed.
2. Fill in every `TODO` in `{package}/__init__.py` (docs/spi-reference.md of torchhal
   documents each member, its types, units and defaults), and check that
   `torchhal info` lists `{name}` as available.
3. `torchhal conformance --platform {name} --profile full --json conformance.json`
   until the verdict is `CONFORMANT`; declare known failures in an expectation file
   (docs/conformance.md).

`.github/workflows/conformance.yml` runs the suite on every push, on {runner}.
"""


#: Where a CPU-backed plugin's CI job runs, and how it gets torch there: the CPU build (the
#: default index's is the multi-GB CUDA one).
HOSTED_RUNNER = """runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v4
      - uses: actions/setup-python@v5
        with:
          python-version: "3.12"
      - run: python -m pip install torch --index-url https://download.pytorch.org/whl/cpu"""


def _ci_workflow(name: str, requirement: str, base: str) -> str:
    requirement, todo = runner_requirement(requirement)
    todo = f"\n      {todo}" if todo else ""
    if base == "cpu":  # host tensors: any machine runs the suite
        runner = f"# {name} is CPU-backed: a hosted runner has all it needs.\n    {HOSTED_RUNNER}"
    else:
        runner = (f"# TODO: a runner with a {name} device and its runtime installed.\n"
                  f"    runs-on: [self-hosted, {name}]\n    steps:\n      - uses: actions/checkout@v4")
    return f"""name: torchhal conformance
on: [push, pull_request]
jobs:
  conformance:
    {runner}
      # torchhal is not on the package index: install it from its source first.{todo}
      - run: python -m pip install "{requirement}"
      - run: python -m pip install .
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


#: The longest plugin name: ample for a platform, and far below a file name's 255 bytes.
MAX_NAME = 64


def write_plugin(name: str, directory: Path | None = None, base: str = "plugin") -> Path:
    """Write the distribution for platform `name` on `base` (one of BASES) into `directory`
    (default ./torchhal-NAME); return it."""
    check_name(name)
    if base not in BASES:
        raise TemplateError(f"base {base!r} is not one of {', '.join(BASES)}")
    target = Path(directory) if directory is not None else Path(f"torchhal-{name.replace('_', '-')}")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise TemplateError(f"{target} already exists and is not an empty directory; choose another --dir")
    package = f"torchhal_{name}"
    requirement = torchhal_requirement()
    files = {
        Path("pyproject.toml"): _pyproject(name, package),
        Path(package) / "__init__.py": plugin_module_source(name, base),
        Path("README.md"): _readme(name, package, requirement, base),
        Path(".github") / "workflows" / "conformance.yml": _ci_workflow(name, requirement, base),
    }
    made: list[Path] = []  # what this call created, undone if anything stops it (a full disk, Ctrl-C)
    try:
        for relative, content in files.items():
            path = target / relative
            for folder in reversed([path.parent, *path.parent.parents]):
                if not folder.exists():
                    folder.mkdir()
                    made.append(folder)
            made.append(path)  # before the write: a write that fails part-way leaves a file too
            path.write_text(content)
    except BaseException as exc:
        for path in reversed(made):
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise TemplateError(f"could not write {target}: {exc}; nothing was left behind") from exc
        raise
    return target
