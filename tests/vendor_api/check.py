"""Check the built-in plugins and the test fakes against the vendor API snapshots.

    python -m tests.vendor_api.check      # prints every use and fake name with its verdict

A *use* is a vendor attribute a plugin reads, found by reading the plugin's source (every
method of its class and of the torchhal bases it inherits): `module.mem_get_info(index)`
where `module = self.device_module()`, `getattr(module, self.graph_class_name, None)`,
`graph.capture_begin(pool=pool)`, `torch.version.hip`, ... A use is checked for its name
and, where it is called, for its call binding to the real parameters. A *fake name* is
what `tests.fakes.make_device_module` defines for a vendor: each must exist in the real
package, or the mapping tests prove a mapping onto an API that does not exist.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
import textwrap
import types
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
REPO = HERE.parent.parent

#: Which snapshot holds each built-in plugin's vendor API (torch's is the fallback for all).
SNAPSHOTS: dict[str, str] = {
    "npu": "torch_npu-2.13.0.json",
    "musa": "torch_musa-2.7.1.json",
    "xpu": "torch-2.13.0.json",
    "rocm": "torch-2.13.0.json",
}
TORCH_SNAPSHOT = "torch-2.13.0.json"


@dataclass(frozen=True)
class Use:
    path: str  # e.g. "torch.npu.NPUGraph.capture_begin"
    args: int | None  # positional arguments at the call; None where not called (or *args)
    keywords: tuple[str, ...]
    on_instance: bool  # called on an instance (a graph, a storage): the first parameter is bound
    optional: bool  # read through hasattr / getattr with a default: absence is handled
    where: str


@cache
def load(name: str) -> dict[str, Any]:
    return dict(json.loads((HERE / name).read_text()))


# -- what a plugin uses ------------------------------------------------------------------


class _UseFinder(ast.NodeVisitor):
    def __init__(self, plugin: type, where: str) -> None:
        self.plugin, self.where = plugin, where
        self.device = f"torch.{plugin.device_type}"
        self.module_names: set[str] = set()
        self.storage_names: set[str] = set()
        self.props_names: set[str] = set()  # results of get_device_properties()
        self.graph_names = {"graph"}  # the capture() parameter: an instance of the graph class
        self.uses: list[Use] = []
        self.parents: dict[ast.AST, ast.AST] = {}

    def run(self, tree: ast.AST) -> list[Use]:
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
            if isinstance(parent, ast.Assign) and len(parent.targets) == 1:
                target, value = parent.targets[0], parent.value
                if isinstance(target, ast.Name) and isinstance(value, ast.Call):
                    if ast.unparse(value.func) == "self.device_module":
                        self.module_names.add(target.id)
                    elif ast.unparse(value.func).endswith(".untyped_storage"):
                        self.storage_names.add(target.id)
                    elif ast.unparse(value.func).endswith(".get_device_properties"):
                        self.props_names.add(target.id)
        self.visit(tree)
        return self.uses

    def class_attr(self, node: ast.expr) -> str | None:
        """`"name"`, `self.attr` or `self.attr or ""` -> the string it names."""
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            node = node.values[0]
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self":
            value = getattr(self.plugin, node.attr, None)
            return value if isinstance(value, str) else None
        return None

    def base(self, node: ast.expr) -> tuple[str, bool] | None:
        """The vendor path an expression stands for, and whether it is an instance."""
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.device_module":
            return self.device, False
        if isinstance(node, ast.Name):
            if node.id in self.module_names:
                return self.device, False
            if node.id in self.graph_names and self.plugin.graph_class_name:
                return f"{self.device}.{self.plugin.graph_class_name}", True
            if node.id in self.storage_names:
                return "torch.UntypedStorage", True
            if node.id in self.props_names:
                return f"{self.device}.get_device_properties()", True
            if node.id == "torch" or node.id == getattr(self.plugin, "extension_module", None):
                return node.id, False
        if isinstance(node, ast.Attribute):
            inner = self.base(node.value)
            if inner is not None and inner[0].split(".")[0] in ("torch", "torch_npu", "torch_musa"):
                return f"{inner[0]}.{node.attr}", inner[1]
        return None

    def record(self, node: ast.expr, path: str, on_instance: bool, optional: bool) -> None:
        call = self.parents.get(node)
        args: int | None = None
        keywords: tuple[str, ...] = ()
        if isinstance(call, ast.Call) and call.func is node:
            starred = any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)
            args = None if starred else len(call.args)
            keywords = tuple(str(k.arg) for k in call.keywords if k.arg)
        self.uses.append(Use(path, args, keywords, on_instance, optional, f"{self.where}:{node.lineno}"))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        parent = self.parents.get(node)
        if not (isinstance(parent, ast.Attribute) and parent.value is node):  # outermost of a chain
            found = self.base(node.value)
            if found is not None:
                self.record(node, f"{found[0]}.{node.attr}", found[1], optional=False)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = ast.unparse(node.func)
        if name in ("getattr", "hasattr") and len(node.args) >= 2:
            found = self.base(node.args[0])
            attr = self.class_attr(node.args[1])
            if found is not None and attr:
                optional = name == "hasattr" or len(node.args) == 3
                self.record(node, f"{found[0]}.{attr}", found[1], optional)
        self.generic_visit(node)


def _drop_annotations(tree: ast.AST) -> None:
    """Type hints (`tensor: torch.Tensor`) are not vendor calls."""
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            node.annotation = None
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            node.returns = None


def plugin_uses(plugin: type, backends: tuple[type, ...] = ()) -> list[Use]:
    """Every vendor attribute `plugin` reads, from the source of the methods it runs, and
    what its attention `backends` (classes) read, named as the plugin names the vendor."""
    uses = _class_uses(plugin, plugin)
    # A backend computes with plain torch too (torch.where, ...): only its vendor calls are checked.
    vendor = tuple(f"{name}." for name in (getattr(plugin, "extension_module", None), f"torch.{plugin.device_type}")
                   if name)
    for backend in backends:
        uses += [use for use in _class_uses(backend, plugin) if use.path.startswith(vendor)]
    return uses


def _class_uses(scanned: type, plugin: type) -> list[Use]:
    uses: list[Use] = []
    seen: set[str] = set()
    for klass in scanned.__mro__:
        if klass is object:
            continue
        for name, member in vars(klass).items():
            if name in seen or not inspect.isfunction(member):
                continue
            seen.add(name)
            function = inspect.unwrap(member)  # @contextmanager wraps use_stream
            lines, first = inspect.getsourcelines(function)
            tree = ast.parse(textwrap.dedent("".join(lines)))
            ast.increment_lineno(tree, first - 1)
            _drop_annotations(tree)
            where = str(inspect.getsourcefile(function)).replace(str(REPO) + "/", "")
            uses += _UseFinder(plugin, f"{where} ({name})").run(tree)
    return uses


# -- what a fake defines -------------------------------------------------------------------


def fake_names(fake: types.ModuleType, device_path: str) -> list[str]:
    """The vendor names a fake device module defines (its call log and state are test plumbing)."""
    paths = []
    properties = getattr(fake, "get_device_properties", None)
    if properties is not None:
        calls = list(getattr(fake, "calls", []))
        fields = vars(properties(0))
        fake.calls[:] = calls  # type: ignore[attr-defined]  # reading the fields is not a call under test
        paths += [f"{device_path}.get_device_properties().{field}" for field in sorted(fields)]
    for name, value in sorted(vars(fake).items()):
        if name.startswith("__") or name in ("calls", "state"):
            continue
        paths.append(f"{device_path}.{name}")
        if inspect.isclass(value) and not issubclass(value, BaseException):
            for method in sorted(m for m in dir(value) if not m.startswith("_")):
                paths.append(f"{device_path}.{name}.{method}")
    return paths


# -- checking against a snapshot -----------------------------------------------------------


def _params(entry: dict[str, Any], on_instance: bool) -> list[list[Any]] | None:
    """Parameter list a call binds to, or None where the real signature is unknown."""
    if entry.get("kind") == "class":
        methods = entry.get("methods") or {}
        for ctor in ("__init__", "__new__"):
            params = methods.get(ctor)
            if not params:
                continue
            named = params if params[0][1] == "VAR_POSITIONAL" else params[1:]  # drop self / cls where there is one
            if {kind for _, kind, _ in named} <= {"VAR_POSITIONAL", "VAR_KEYWORD"}:
                continue  # (*args, **kwargs): a C constructor's signature says nothing of its parameters
            return named
        return None
    params = entry.get("params")
    if params is None or entry.get("kind") != "function":
        return None
    decorators = entry.get("decorators", [])
    if "staticmethod" in decorators:
        return list(params)
    if on_instance or "classmethod" in decorators:
        return list(params[1:])
    return list(params)


def _binds(params: list[list[Any]], args: int, keywords: tuple[str, ...]) -> str | None:
    signature = inspect.Signature(
        [
            inspect.Parameter(
                name, getattr(inspect.Parameter, kind), default=0 if has_default else inspect.Parameter.empty
            )
            for name, kind, has_default in params
        ]
    )
    try:
        signature.bind(*range(args), **dict.fromkeys(keywords, 0))
    except TypeError as exc:
        return str(exc)
    return None


def lookup(path: str, snapshots: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    """The entry a path names, and the snapshot surface it was looked up in."""
    for snapshot in snapshots:
        surfaces = snapshot["surfaces"]
        if path in surfaces:
            return {"kind": "module"}, f"{snapshot['package']} {snapshot['version']}"
        prefix = max((s for s in surfaces if path.startswith(s + ".")), key=len, default=None)
        if prefix is None:
            continue
        where = f"{prefix} in {snapshot['package']} {snapshot['version']}"
        name, _, member = path[len(prefix) + 1 :].partition(".")
        entry = surfaces[prefix].get(name)
        if entry is None or not member:
            return entry, where
        methods = entry.get("methods")
        if entry.get("kind") != "class" or methods is None:
            return None, where
        return ({"kind": "function", "params": methods[member]} if member in methods else None), where
    return None, "no snapshot covers it"


def check_use(use: Use, snapshots: list[dict[str, Any]]) -> str | None:
    """A problem with one use, or None if the real package has it (and the call binds)."""
    entry, where = lookup(use.path, snapshots)
    if entry is None:
        if use.optional:
            return None  # the plugin reads it through hasattr/getattr with a fallback
        return f"{use.path} ({use.where}) does not exist in {where}"
    if use.args is None:
        return None
    params = _params(entry, use.on_instance)
    if params is None:
        return None
    error = _binds(params, use.args, use.keywords)
    if error is None:
        return None
    shown = ", ".join(p[0] for p in params)
    return f"{use.path}({use.args} positional, keywords {list(use.keywords)}) at {use.where}: {error}; real: ({shown})"


def check_fake(paths: list[str], snapshots: list[dict[str, Any]]) -> list[str]:
    problems = []
    for path in paths:
        entry, where = lookup(path, snapshots)
        if entry is None:
            problems.append(f"the fake defines {path}, which does not exist in {where}")
    return problems


def snapshots_for(platform: str) -> list[dict[str, Any]]:
    names = [SNAPSHOTS[platform]]
    if TORCH_SNAPSHOT not in names:
        names.append(TORCH_SNAPSHOT)
    return [load(n) for n in names]


def builtin_plugins() -> dict[str, type]:
    from torchhal.plugins.musa import MusaPlatform
    from torchhal.plugins.npu import NpuPlatform
    from torchhal.plugins.rocm import RocmPlatform
    from torchhal.plugins.xpu import XpuPlatform

    return {"npu": NpuPlatform, "musa": MusaPlatform, "xpu": XpuPlatform, "rocm": RocmPlatform}


def attention_backends(platform: str) -> tuple[type, ...]:
    """The attention backend classes a built-in plugin may declare (scanned with the plugin)."""
    from torchhal.plugins.npu_attention import NpuFusedAttention

    return {"npu": (NpuFusedAttention,)}.get(platform, ())


def uses_of(platform: str) -> list[Use]:
    return plugin_uses(builtin_plugins()[platform], attention_backends(platform))


def fake_ops_for(platform: str) -> dict[str, Any]:
    """The fake vendor ops the mapping tests install, by the path the plugin calls them at."""
    from tests.fakes import FakeFusedInferAttention

    return {"torch_npu.npu_fused_infer_attention_score": FakeFusedInferAttention()} if platform == "npu" else {}


def check_fake_op(path: str, fake: Any, snapshots: list[dict[str, Any]]) -> str | None:
    """A fake op must exist in the real package and take exactly its parameters."""
    entry, where = lookup(path, snapshots)
    if entry is None:
        return f"the fake defines {path}, which does not exist in {where}"
    real = _params(entry, on_instance=False)
    mine = live_params(fake)
    if real is not None and mine != real:
        return f"the fake {path} takes {mine}; the real one ({where}) takes {real}"
    return None


def live_params(obj: Any) -> list[list[Any]]:
    return [[p.name, p.kind.name, p.default is not p.empty] for p in inspect.signature(obj).parameters.values()]


def fake_for(platform: str) -> types.ModuleType | None:
    """The fake the mapping tests use for this platform (ROCm patches the real torch.cuda)."""
    from tests.fakes import make_device_module

    plugin = builtin_plugins()[platform]
    if platform == "rocm":
        return None
    return make_device_module(plugin.device_type, graph_class=plugin.graph_class_name)


def report(platform: str) -> list[str]:
    plugin = builtin_plugins()[platform]
    snapshots = snapshots_for(platform)
    problems = [p for use in uses_of(platform) if (p := check_use(use, snapshots))]
    fake = fake_for(platform)
    if fake is not None:
        problems += check_fake(fake_names(fake, f"torch.{plugin.device_type}"), snapshots)
    problems += [p for path, op in fake_ops_for(platform).items() if (p := check_fake_op(path, op, snapshots))]
    return problems


def main() -> int:
    failed = False
    for platform in sorted(SNAPSHOTS):
        snapshot = load(SNAPSHOTS[platform])
        print(f"== {platform}: {snapshot['package']} {snapshot['version']} ({snapshot['source']})")
        for use in sorted(set(uses_of(platform)), key=lambda u: (u.path, u.where)):
            problem = check_use(use, snapshots_for(platform))
            print(
                f"  {'FAIL' if problem else 'ok  '} {use.path}  [{use.where}]"
                + (f"\n       {problem}" if problem else "")
            )
            failed |= problem is not None
        fake = fake_for(platform)
        for path in fake_names(fake, f"torch.{builtin_plugins()[platform].device_type}") if fake else []:
            problems = check_fake([path], snapshots_for(platform))
            print(f"  {'FAIL' if problems else 'ok  '} fake {path}" + (f"\n       {problems[0]}" if problems else ""))
            failed |= bool(problems)
        for path, op in fake_ops_for(platform).items():
            problem = check_fake_op(path, op, snapshots_for(platform))
            print(f"  {'FAIL' if problem else 'ok  '} fake {path}" + (f"\n       {problem}" if problem else ""))
            failed |= problem is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
