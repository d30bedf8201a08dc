"""`torchhal plugin new NAME [--base plugin|accelerator|cpu]`: a plugin distribution to start from.

Three starting points, one per kind of device (`BASES`):

- `plugin`: every SPI member of `PlatformPlugin`, written from the class itself: its real
  signatures, and as each member's guidance the first paragraph of its docstring (the SPI is
  written once, in `torchhal.platforms.plugin`).
- `accelerator`: a declaration on `AcceleratorPlatform`, for a device module that mirrors
  `torch.cuda` (as `torch.xpu`, `torch.npu`, `torch.musa` do); its declarations are
  guided by their docstrings too.
- `cpu`: a simulated or host-backed device on `CpuPlatform`: host tensors, streams,
  events and IPC come with it, so it is conformant before a line is changed.

The files point at the reference every installation has: the docstrings, through `REFERENCE`.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import json
import textwrap
from functools import cache
from pathlib import Path

from torchhal.platforms.manager import DEFAULT_PLUGINS, PlatformRegistry, PluginManager
from torchhal.platforms.plugin import NAME_PATTERN, SPI_ATTRIBUTES, SPI_METHODS, SPI_VERSION, PlatformPlugin

BASES = ("plugin", "accelerator", "cpu")
#: Where the generated files send a vendor for every member's contract: the SPI's docstrings, as every install has them.
REFERENCE = "torchhal plugin spi"
#: The longest plugin name: ample for a platform, and far below a file name's 255 bytes.
MAX_NAME = 64
#: What to fill in when no installable source of torchhal is known.
PLACEHOLDER_REQUIREMENT = "torchhal @ git+https://YOUR-GIT-HOST/torchhal.git"
#: Class attributes the template starts from a value other than their default (`{name}`: the platform name).
STARTING_VALUES = {
    "name": '"{name}"', "device_type": '"{name}"', "dist_backend": '"gloo"', "spi_version": repr(SPI_VERSION),
    "visible_devices_env": '("{upper}_VISIBLE_DEVICES",)', "extension_module": '"torch_{name}"',
    "runtime_hint": '"needs torch_{name} and its runtime"',
}
#: Class attributes whose starting value is a guess the vendor replaces (a TODO).
TO_FILL = frozenset({"device_type", "priority", "dist_backend", "visible_devices_env", "extension_module",
                     "runtime_hint", "graph_class_name", "ipc_share_method", "ipc_open_method"})


class TemplateError(ValueError):
    """A bad plugin name or target directory; nothing was written."""


@cache
def spi_doc(cls: type, member: str) -> str:
    """The SPI's text for `member` of `cls`: a method's docstring, or the string under a class attribute."""
    value = vars(cls).get(member)
    if callable(value):
        return inspect.getdoc(value) or ""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    for node, after in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == member:
            text = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
            return inspect.cleandoc(text) if isinstance(text, str) else ""
    return ""


def spi_reference() -> dict[str, str]:
    """The SPI reference rendered from `PlatformPlugin`'s docstrings, as Markdown: "attributes" (a table)
    and "methods" (a section each). docs/spi-reference.md holds them (tests/test_spi_reference.py)."""
    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    rows = ["| attribute | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name in SPI_ATTRIBUTES:
        annotation = PlatformPlugin.__annotations__[name].removeprefix("ClassVar[")[:-1]
        default = f"`{getattr(PlatformPlugin, name)!r}`" if hasattr(PlatformPlugin, name) else "required"
        rows.append(f"| `{name}` | `{cell(annotation)}` | {default} | {cell(spi_doc(PlatformPlugin, name))} |")
    sections = []
    for name in SPI_METHODS:
        method = getattr(PlatformPlugin, name)
        signature = inspect.signature(method)
        shown = str(signature.replace(parameters=list(signature.parameters.values())[1:])).replace("'", "")
        required = "**Required.** " if getattr(method, "__isabstractmethod__", False) else ""
        sections.append(f"### `{name}{shown}`\n\n{required}{spi_doc(PlatformPlugin, name)}")
    return {"attributes": "\n".join(rows), "methods": "\n\n".join(sections)}


def guidance(cls: type, member: str) -> str:
    """The first paragraph of `member`'s SPI text, on one line."""
    return " ".join(spi_doc(cls, member).split("\n\n")[0].split())


def _name_problem(name: str) -> str | None:
    if not NAME_PATTERN.fullmatch(name):
        return f"plugin name {name!r} must be a lowercase identifier such as 'myaccel'"
    if len(name) > MAX_NAME:  # it names a directory and a package: file systems cap a name at 255 bytes
        return f"plugin name {name[:20]!r}... is {len(name)} characters; use at most {MAX_NAME}"
    builtins = builtin_platform_names()
    if name.endswith("_"):  # the distribution name would end in '-', which pip refuses
        stripped = name.rstrip("_")
        return (f"plugin name {name!r} ends with '_', so its distribution name 'torchhal-{name.replace('_', '-')}' "
                "is not a valid package name (pip refuses it); end it with a letter or digit, e.g. "
                f"{stripped if stripped not in builtins else 'my' + stripped!r}")
    if name in builtins:
        return (f"plugin name {name!r} is torchhal's built-in {name!r} platform, which the host keeps over a plugin "
                f"of the same name (dropped as a conflict): choose another name, such as 'my{name}'; to replace "
                f'the built-in, also set `replaces = "{name}"` in the generated class')
    return None


def builtin_platform_names() -> list[str]:
    """The names torchhal's own plugins register, read from them (no detection, no entry points)."""
    registry = PlatformRegistry(PluginManager())
    registry.load_builtins(DEFAULT_PLUGINS)
    registry.collect_platforms()
    return registry.names()


def _comment(text: str) -> str:
    return "\n".join("# " + line for line in textwrap.wrap(text, 80, break_on_hyphens=False))


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_")) + "Platform"


def _attributes(cls: type, names: list[str], name: str, **overrides: str) -> list[str]:
    """Each class attribute with its guidance as a comment, set to where the template starts it."""
    lines = []
    for attribute in names:
        value = {**STARTING_VALUES, **overrides}.get(attribute) or repr(getattr(cls, attribute))
        todo = "TODO: " if attribute in TO_FILL else ""
        lines.append(f"{_comment(todo + guidance(cls, attribute))}\n"
                     f"{attribute} = {value.format(name=name, upper=name.upper())}")
    return lines


def _method_source(method: str, name: str) -> str:
    signature = inspect.signature(getattr(PlatformPlugin, method))
    header = f"def {method}{str(signature).replace(chr(39), '')}:"
    call = f"super().{method}({', '.join(list(signature.parameters)[1:])})"
    if method == "is_available":  # answers "no" until written, so the stub never breaks the host
        body = f'return Availability.no("TODO: {name} detection is not written yet")'
    elif getattr(getattr(PlatformPlugin, method), "__isabstractmethod__", False):
        body = f'raise NotImplementedError("TODO: {name} {method} is not written yet")'
    elif method == "use_stream":
        header, body = "@contextlib.contextmanager\n" + header, f"with {call}:\n    yield"
    else:
        body = f"return {call}"
    required = "TODO: " if getattr(getattr(PlatformPlugin, method), "__isabstractmethod__", False) else ""
    return header + "\n" + textwrap.indent(_comment(required + guidance(PlatformPlugin, method)) + "\n" + body, "    ")


def plugin_module_source(name: str, base: str = "plugin") -> str:
    """The plugin package's __init__.py for `base` (one of BASES)."""
    class_name = _class_name(name)
    if base == "cpu":
        source = _CPU_MODULE.format(name=name, class_name=class_name, spi_version=SPI_VERSION, reference=REFERENCE)
    elif base == "accelerator":
        from torchhal.plugins.accelerator import AcceleratorPlatform

        declarations = [n for n in vars(AcceleratorPlatform)["__annotations__"] if not n.startswith("_")]
        body = (_attributes(PlatformPlugin, list(SPI_ATTRIBUTES), name, priority="90")
                + _attributes(AcceleratorPlatform, declarations, name))
        source = _ACCELERATOR_HEAD.format(name=name, reference=REFERENCE) + _class(class_name, "AcceleratorPlatform",
                                                                                   body)
    else:
        body = _attributes(PlatformPlugin, list(SPI_ATTRIBUTES), name) + [_method_source(m, name) for m in SPI_METHODS]
        source = _PLUGIN_HEAD.format(name=name, reference=REFERENCE) + _class(class_name, "PlatformPlugin", body)
    register = f"@hookimpl\ndef torchhal_register_platforms() -> list[PlatformPlugin]:\n    return [{class_name}()]\n"
    return f"{source}\n\n{register}"


def _class(class_name: str, base: str, members: list[str]) -> str:
    return f"\n\n\nclass {class_name}({base}):\n" + textwrap.indent("\n\n".join(members), "    ") + "\n"


_PLUGIN_HEAD = '''"""torchhal platform plugin for {name}: every SPI member, to fill in.

Each member's contract: `{reference}`. Check it with:
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
    VirtualMemorySupport,
    hookimpl,
)'''

_ACCELERATOR_HEAD = '''"""torchhal platform plugin for {name}: a declaration on AcceleratorPlatform.

torch.{name} must mirror torch.cuda's names (device_count, mem_get_info, memory_reserved,
empty_cache, Stream, Event, ...): AcceleratorPlatform drives it through them, detection
included. Override a method only where your runtime differs: `runtime_missing()` (decide
from the torch build), `probe_device_count(module)` (counting needs more), `ipc_events()`
(interprocess events). Each member's contract: `{reference}` (the declarations below:
`python -m pydoc torchhal.plugins.accelerator.AcceleratorPlatform`). Check it with:
    torchhal conformance --platform {name} --profile full
"""

from __future__ import annotations

from torchhal.platforms import PlatformPlugin, hookimpl
from torchhal.plugins.accelerator import AcceleratorPlatform'''

_CPU_MODULE = '''"""torchhal platform plugin for {name}: a simulated or host-backed device on CpuPlatform.

Tensors are host tensors (`device_type = "cpu"`); CpuPlatform supplies detection, host
streams and events, OOM recognition and IPC, so this plugin is conformant as written.
Make it yours where your device differs: most often `memory_info` and `empty_cache`
follow what your simulated device holds (a caching allocator's counters: allocated,
reserved, and what empty_cache releases). Each member's contract: `{reference}`.
Check it with:
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
    # below the CPU's 0: never chosen over it, used when named
    priority = -1
    dist_backend = "gloo"
    visible_devices_env = ()
    spi_version = {spi_version!r}

    def memory_info(self, index: int) -> MemoryInfo:
        # The host's memory; make it the counters of your simulated device.
        return super().memory_info(index)

    def empty_cache(self, index: int) -> int | None:
        # Release your simulated cache; return reserved_before - reserved_after (or None).
        return super().empty_cache(index)
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


def with_suite(requirement: str) -> str:
    """`requirement` with the `conformance` extra: the suite runs on pytest, which torchhal
    itself does not need."""
    assert requirement.startswith("torchhal @ "), requirement
    return requirement.replace("torchhal @ ", "torchhal[conformance] @ ", 1)


def runner_requirement(requirement: str) -> tuple[str, str]:
    """(requirement, TODO comment or "") for the CI job: a local path (a source directory, a wheel)
    is on this machine only, so a runner gets the placeholder and a TODO saying why."""
    if not requirement.startswith("torchhal @ file:"):
        return requirement, ""
    where = requirement.removeprefix("torchhal @ ")
    return PLACEHOLDER_REQUIREMENT, (f"# TODO: this torchhal was installed from {where}, a path on this machine "
                                     "that a runner does not have: name the git URL (and commit) it comes from.")


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
    step = (f"Make `memory_info` and `empty_cache` in `{package}/__init__.py` follow your device (it is conformant "
            "as written)" if base == "cpu" else f"Fill in every `TODO` in `{package}/__init__.py`")
    return f"""# torchhal-{name.replace("_", "-")}

A torchhal platform plugin for {name}, started from `torchhal plugin new {name}`.

1. torchhal is not on the package index: install it first, from where this plugin was
   made from (`pip install "{with_suite(requirement)}"`), or from your own torchhal checkout
   (`pip install -e '/path/to/torchhal[conformance]'`). Then `pip install -e .` here finds it installed.
2. {step}: `{REFERENCE}` documents each member, its types, units and
   defaults. Check that `torchhal info` lists `{name}` as available.
3. `torchhal conformance --platform {name} --profile full --json conformance.json`
   until the verdict is `CONFORMANT`; declare known failures in an expectation file
   (torchhal's conformance guide).

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
      - run: python -m pip install "{with_suite(requirement)}"
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


def write_plugin(name: str, directory: Path | None = None, base: str = "plugin") -> Path:
    """Write the distribution for platform `name` on `base` (one of BASES) into `directory`
    (default ./torchhal-NAME); return it."""
    problem = _name_problem(name) or (None if base in BASES else f"base {base!r} is not one of {', '.join(BASES)}")
    target = Path(directory) if directory is not None else Path(f"torchhal-{name.replace('_', '-')}")
    if problem is None and target.exists() and (not target.is_dir() or any(target.iterdir())):
        problem = f"{target} already exists and is not an empty directory; choose another --dir"
    if problem is not None:
        raise TemplateError(problem)
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
