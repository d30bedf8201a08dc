"""Write the vendor API snapshots the surface test checks the plugins and fakes against.

    python -m tests.vendor_api.extract torch                  # live: torch.xpu, torch.cuda (HIP) of the installed torch
    python -m tests.vendor_api.extract npu WHEEL MODULE_CPP COMMIT  # static: a torch_npu wheel (never imported:
                                                                    # needs CANN); device-properties fields from
                                                                    # Ascend/pytorch torch_npu/csrc/npu/Module.cpp
    python -m tests.vendor_api.extract musa SRC_DIR COMMIT    # static: a checkout of MooreThreads/torch_musa
    python -m tests.vendor_api.extract npu-ops WHEEL          # add NPU_OPS and NPU_C_BINDINGS to the torch_npu
                                                              # snapshot of this wheel

Each snapshot maps an attribute path's last part to what the package defines there:
`{"kind": "function", "params": [[name, kind, has_default], ...]}`, a class with its
methods, a submodule, a value, or a name bound from a compiled extension (`external`:
present, signature unknown). Vendor packages are read with `ast` only, so nothing of
theirs runs here.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import re
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).parent
Entry = dict[str, Any]


# -- static reading -------------------------------------------------------------------


def params_of(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> list[list[Any]]:
    a = node.args
    out: list[list[Any]] = []
    positional = [*a.posonlyargs, *a.args]
    first_default = len(positional) - len(a.defaults)
    for i, arg in enumerate(positional):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append([arg.arg, kind, i >= first_default])
    if a.vararg:
        out.append([a.vararg.arg, "VAR_POSITIONAL", False])
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append([arg.arg, "KEYWORD_ONLY", default is not None])
    if a.kwarg:
        out.append([a.kwarg.arg, "VAR_KEYWORD", False])
    return out


def class_entry(node: ast.ClassDef) -> Entry:
    methods = {
        item.name: params_of(item) for item in node.body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    return {"kind": "class", "bases": [ast.unparse(b) for b in node.bases], "methods": methods}


class StaticPackage:
    """The namespaces of a package's modules, resolved from source without importing it."""

    def __init__(self, read: Callable[[str], str | None], root: str) -> None:
        self.read, self.root = read, root
        self._done: dict[str, dict[str, Entry]] = {}
        self._all: dict[str, list[str] | None] = {}

    def source(self, module: str) -> tuple[str, bool] | None:
        base = module.replace(".", "/")
        for path, is_package in ((f"{base}/__init__.py", True), (f"{base}.py", False)):
            text = self.read(path)
            if text is not None:
                return text, is_package
        return None

    def namespace(self, module: str) -> dict[str, Entry]:
        if module in self._done:
            return self._done[module]  # complete, or partial while an import cycle resolves
        names: dict[str, Entry] = {}
        self._done[module] = names
        found = self.source(module)
        if found is None:
            return names
        text, is_package = found
        package = module if is_package else module.rpartition(".")[0]
        self._all[module] = None
        self._walk(ast.parse(text).body, module, package, names)
        return names

    def public(self, module: str) -> dict[str, Entry]:
        """What `from module import *` binds."""
        names = self.namespace(module)
        exported = self._all.get(module)
        if exported is not None:
            return {n: names.get(n, {"kind": "unresolved", "from": module}) for n in exported}
        return {n: e for n, e in names.items() if not n.startswith("_")}

    def _walk(self, body: list[ast.stmt], module: str, package: str, names: dict[str, Entry]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names[node.name] = {"kind": "function", "params": params_of(node)}
                decorators = [ast.unparse(d) for d in node.decorator_list]
                if decorators:  # @classmethod changes how a call binds its first parameter
                    names[node.name]["decorators"] = decorators
            elif isinstance(node, ast.ClassDef):
                names[node.name] = class_entry(node)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        if target.id == "__all__" and node.value is not None:
                            try:
                                self._all[module] = [str(v) for v in ast.literal_eval(node.value)]
                            except ValueError:
                                pass
                        value = node.value
                        if isinstance(value, ast.Name) and value.id in names:
                            names[target.id] = names[value.id]  # an alias: same object
                        else:
                            names[target.id] = {"kind": "value", "expr": ast.unparse(value) if value else ""}
            elif isinstance(node, ast.ImportFrom):
                self._import_from(node, module, package, names)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        names[alias.asname] = {"kind": "module", "module": alias.name}
            elif isinstance(node, ast.If | ast.Try | ast.With):
                for part in ("body", "orelse", "finalbody"):
                    self._walk(getattr(node, part, []), module, package, names)
                for handler in getattr(node, "handlers", []):
                    self._walk(handler.body, module, package, names)

    def _import_from(self, node: ast.ImportFrom, module: str, package: str, names: dict[str, Entry]) -> None:
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1])
            source = f"{base}.{node.module}" if node.module else base
        else:
            source = node.module or ""
        internal = source == self.root or source.startswith(self.root + ".")
        for alias in node.names:
            if alias.name == "*":
                if internal:
                    names.update(self.public(source))
                continue
            bound = alias.asname or alias.name
            if not internal:
                names[bound] = {"kind": "external", "from": source}
            elif self.source(f"{source}.{alias.name}") is not None:
                names[bound] = {"kind": "module", "module": f"{source}.{alias.name}"}
            else:
                found = self.namespace(source).get(alias.name)
                if found is None and source.split(".")[-1].startswith("_") and self.source(source) is None:
                    found = {"kind": "external", "from": source}  # a compiled extension (_C, _MUSAC)
                names[bound] = found or {"kind": "unresolved", "from": source}

    def storage_methods(self, files: list[str]) -> dict[str, Entry]:
        """Methods the package adds to torch.UntypedStorage (setattr or assignment)."""
        found: dict[str, Entry] = {}
        for path in files:
            text = self.read(path)
            if text is None or "UntypedStorage" not in text:
                continue
            module = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            local = self.namespace(module)
            for node in ast.walk(ast.parse(text)):
                name = value = None
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and len(node.args) == 3:
                    target, key, value = node.args
                    if ast.unparse(target) in ("torch.UntypedStorage", "torch.storage.UntypedStorage") and isinstance(
                        key, ast.Constant
                    ):
                        name = str(key.value)
                elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                    target = node.targets[0]
                    if isinstance(target, ast.Attribute) and ast.unparse(target.value) in (
                        "torch.UntypedStorage",
                        "torch.storage.UntypedStorage",
                    ):
                        name, value = target.attr, node.value
                if name is not None and value is not None:
                    fn = local.get(ast.unparse(value), {"kind": "value", "expr": ast.unparse(value)})
                    found[name] = {**fn, "defined_in": path}
        return found


def reader_for(path: Path) -> tuple[Callable[[str], str | None], list[str]]:
    if path.is_file():
        archive = zipfile.ZipFile(path)
        members = set(archive.namelist())
        return (lambda p: archive.read(p).decode("utf-8-sig") if p in members else None), sorted(members)
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*.py"))
    return (lambda p: (path / p).read_text(encoding="utf-8-sig") if (path / p).is_file() else None), files


def require_binding(read: Callable[[str], str | None], path: str, pattern: str) -> str:
    """The source line that binds the device module (proof that torch.<dev> is this module)."""
    text = read(path) or ""
    match = re.search(pattern, text)
    if match is None:
        raise SystemExit(f"{path}: no line matching {pattern!r}; the device-module binding moved")
    return f"{path}: {match.group(0).strip()}"


def pybind_fields(cpp: str, class_name: str) -> dict[str, Entry]:
    """Fields a pybind11 `py::class_<...>(m, "class_name")` registration exposes."""
    start = cpp.find(f'"{class_name}"')
    if start < 0:
        raise SystemExit(f"no pybind registration of {class_name}")
    block = cpp[start : cpp.find(";", start)]
    return {name: {"kind": "value"} for name in re.findall(r'\.def_(?:readonly|property_readonly)\(\s*"(\w+)"', block)}


def stub_class_fields(stub: Path, class_name: str) -> dict[str, Entry]:
    for node in ast.parse(stub.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {
                item.target.id: {"kind": "value", "defined_in": f"torch/_C/{stub.name}: {class_name}"}
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            }
    raise SystemExit(f"{stub} has no class {class_name}")


#: torch_npu ops torchhal calls (torchhal.plugins.npu_attention). They are bound at import
#: (`torch_npu.<op> = torch.ops.npu.<op>` in utils/custom_ops.py), so the static reader
#: does not see them: their signatures come from the op schemas the wheel ships.
NPU_OPS = ("npu_fused_infer_attention_score",)
NPU_OP_SCHEMAS = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
NPU_OP_BINDINGS = "torch_npu/utils/custom_ops.py"
#: torch_npu._C functions a plugin calls, each (its name, the wheel's Python file that calls it there).
NPU_C_BINDINGS = (("_npu_customAllocator", "torch_npu/npu/memory.py"),)
NPU_LIBRARY = "torch_npu/lib/libtorch_npu.so"


def schema_params(schema: str) -> list[list[Any]]:
    """Parameters of an ATen schema `name(Tensor a, *, int b=1) -> ...`, as `params_of` writes them."""
    inside = schema[schema.index("(") + 1 : schema.rindex(") ->")]
    out: list[list[Any]] = []
    kind = "POSITIONAL_OR_KEYWORD"
    for item in (part.strip() for part in inside.split(",")):
        if item == "*":
            kind = "KEYWORD_ONLY"
            continue
        declaration, has_default, _ = item.partition("=")
        out.append([declaration.split()[-1], kind, bool(has_default)])
    return out


def npu_ops(read: Callable[[str], str | None], names: tuple[str, ...]) -> dict[str, Entry]:
    """Each op of `names` as torch_npu binds it: its schema's parameters and where both were read."""
    schemas, bindings = read(NPU_OP_SCHEMAS) or "", read(NPU_OP_BINDINGS) or ""
    found: dict[str, Entry] = {}
    for name in names:
        schema = re.search(rf"^\s*-?\s*func: ({re.escape(name)}\(.*\) -> .*)$", schemas, re.MULTILINE)
        binding = re.search(rf"^torch_npu\.{re.escape(name)} = torch\.ops\.npu\.{re.escape(name)}$", bindings,
                            re.MULTILINE)
        if schema is None or binding is None:
            raise SystemExit(f"{name}: no schema in {NPU_OP_SCHEMAS} or no binding in {NPU_OP_BINDINGS}")
        found[name] = {
            "kind": "function",
            "params": schema_params(schema.group(1)),
            "defined_in": f"{NPU_OP_SCHEMAS} (schema); {NPU_OP_BINDINGS}: {binding.group(0)}",
        }
    return found


def npu_c_bindings(wheel: Path) -> dict[str, Entry]:
    """Each of NPU_C_BINDINGS that the wheel's compiled library names and its own Python calls
    (the signature is the C++ binding's, not read: `external`)."""
    read, _ = reader_for(wheel)
    binary = zipfile.ZipFile(wheel).read(NPU_LIBRARY)
    found: dict[str, Entry] = {}
    for name, caller in NPU_C_BINDINGS:
        call = re.search(rf"torch_npu\._C\.{re.escape(name)}\([^)]*\)", read(caller) or "")
        if call is None or b"\0" + name.encode() + b"\0" not in binary:
            raise SystemExit(f"{name}: not in {NPU_LIBRARY} or not called in {caller}")
        found[name] = {"kind": "external", "defined_in": f"{NPU_LIBRARY}; {caller} calls {call.group(0)}"}
    return found


def add_npu_ops(wheel: Path) -> dict[str, Any]:
    """The torch_npu snapshot of this very wheel, with NPU_OPS added to its torch_npu surface and
    NPU_C_BINDINGS as its torch_npu._C surface."""
    snapshot = json.loads((HERE / "torch_npu-2.13.0.json").read_text())
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest not in snapshot["source"]:
        raise SystemExit(f"{wheel.name} (sha256 {digest}) is not the wheel the snapshot read: {snapshot['source']}")
    read, _ = reader_for(wheel)
    snapshot["surfaces"]["torch_npu"].update(npu_ops(read, NPU_OPS))
    snapshot["surfaces"]["torch_npu._C"] = npu_c_bindings(wheel)
    return dict(snapshot)


def extract_npu(wheel: Path, module_cpp: Path, cpp_commit: str) -> dict[str, Any]:
    read, files = reader_for(wheel)
    version = re.search(r"__version__ = '([^']+)'", read("torch_npu/version.py") or "")
    assert version, "torch_npu/version.py has no __version__"
    package = StaticPackage(read, "torch_npu")
    binary = zipfile.ZipFile(wheel).read("torch_npu/lib/libtorch_npu.so")
    npu_properties = {
        name: entry
        for name, entry in pybind_fields(module_cpp.read_text(), "_NPUDeviceProperties").items()
        if b"\0" + name.encode() + b"\0" in binary
    }
    return {
        "package": "torch_npu",
        "version": version.group(1),
        "source": f"PyPI wheel {wheel.name} (sha256 {hashlib.sha256(wheel.read_bytes()).hexdigest()})",
        "read": "statically with ast (torch_npu cannot be imported without CANN)",
        "bindings": {
            "torch.npu": require_binding(
                read,
                "torch_npu/_init/registry/backend.py",
                r"torch\._register_device_module\(\"npu\", torch_npu\.npu\)",
            ),
        },
        "device_properties": (
            f"torch_npu/csrc/npu/Module.cpp of github.com/Ascend/pytorch at {cpp_commit} (its version.txt "
            "lists 2.13.0; the wheel ships no C++ source), each field name also found in the wheel's "
            "torch_npu/lib/libtorch_npu.so"
        ),
        "surfaces": {
            "torch.npu.get_device_properties()": npu_properties,
            "torch.npu": package.namespace("torch_npu.npu"),
            "torch.UntypedStorage": package.storage_methods([f for f in files if f.endswith(".py")]),
            "torch_npu": {**package.namespace("torch_npu"), **npu_ops(read, NPU_OPS)},
            "torch_npu._C": npu_c_bindings(wheel),
        },
    }


def extract_musa(src: Path, commit: str) -> dict[str, Any]:
    read, files = reader_for(src)
    version = (read("version.txt") or "").strip()
    assert version, f"{src}/version.txt is missing"
    package = StaticPackage(read, "torch_musa")
    return {
        "package": "torch_musa",
        "version": version,
        "source": f"github.com/MooreThreads/torch_musa at commit {commit} (version.txt {version})",
        "read": "statically with ast (torch_musa needs a MUSA driver to import)",
        "bindings": {
            "torch.musa": require_binding(
                read, "torch_musa/__init__.py", r"torch\.__setattr__\(\"musa\", sys\.modules\[__name__\]\)"
            ),
        },
        "device_properties": "torch_musa/csrc/core/Module.cpp (_MusaDeviceProperties) at the same commit",
        "surfaces": {
            "torch.musa.get_device_properties()": pybind_fields(
                (src / "torch_musa/csrc/core/Module.cpp").read_text(), "_MusaDeviceProperties"
            ),
            "torch.musa": package.namespace("torch_musa"),
            "torch.UntypedStorage": package.storage_methods([f for f in files if f.startswith("torch_musa/")]),
            "torch_musa": package.namespace("torch_musa"),
        },
    }


# -- live reading (the installed torch) ---------------------------------------------------


def live_params(obj: Any) -> list[list[Any]] | None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None  # a C function without a text signature: name only
    return [[p.name, p.kind.name, p.default is not p.empty] for p in signature.parameters.values()]


def live_entry(obj: Any) -> Entry:
    if inspect.ismodule(obj):
        return {"kind": "module", "module": obj.__name__}
    if inspect.isclass(obj):
        if issubclass(obj, torch.Tensor | torch.storage.TypedStorage) or type(obj).__name__ == "tensortype":
            return {"kind": "class", "bases": [b.__qualname__ for b in obj.__bases__], "methods": None}
        methods = {}
        for name in sorted(dir(obj)):
            if name.startswith("__") and name not in ("__init__", "__new__", "__enter__", "__exit__"):
                continue
            member = getattr(obj, name, None)
            if callable(member):
                methods[name] = live_params(member)
        return {"kind": "class", "bases": [b.__qualname__ for b in obj.__bases__], "methods": methods}
    if callable(obj):
        return {"kind": "function", "params": live_params(obj)}
    return {"kind": "value", "expr": type(obj).__name__}


def live_namespace(obj: Any, keep: Callable[[str], bool] = lambda n: not n.startswith("__")) -> dict[str, Entry]:
    return {name: live_entry(getattr(obj, name)) for name in sorted(dir(obj)) if keep(name)}


def stub_functions(stub: Path, prefix: str) -> dict[str, Entry]:
    """C bindings declared in torch's own type stubs (compiled only into GPU builds)."""
    tree = ast.parse(stub.read_text())
    return {
        node.name: {"kind": "function", "params": params_of(node), "defined_in": f"torch/_C/{stub.name}"}
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith(prefix)
    }


def extract_torch() -> dict[str, Any]:
    stub = Path(torch.__file__).parent / "_C" / "__init__.pyi"
    return {
        "package": "torch",
        "version": torch.__version__.split("+")[0],
        "source": f"the installed torch {torch.__version__} (the build CI installs: .ci/run)",
        "read": "live with inspect; torch._C CUDA/HIP bindings from torch/_C/__init__.pyi",
        "bindings": {
            "torch.cuda": "a ROCm build ships the same torch/cuda/*.py as torch.cuda (HIP behind it)",
        },
        "surfaces": {
            "torch.xpu.get_device_properties()": stub_class_fields(stub, "_XpuDeviceProperties"),
            "torch.cuda.get_device_properties()": stub_class_fields(stub, "_CudaDeviceProperties"),
            "torch.xpu": live_namespace(torch.xpu),
            "torch.cuda": live_namespace(torch.cuda),
            "torch.version": live_namespace(torch.version, lambda n: not n.startswith("_")),
            "torch._C": stub_functions(stub, "_cuda_"),
            "torch.UntypedStorage": live_namespace(
                torch.UntypedStorage, lambda n: "share" in n and not n.startswith("__")
            ),
            # the core names plugins call beside their device module (a ROCm build has them too)
            "torch": {name: live_entry(getattr(torch, name))
                      for name in ("OutOfMemoryError", "__version__", "device", "empty", "uint8")},
        },
    }


def write(snapshot: dict[str, Any]) -> Path:
    path = HERE / f"{snapshot['package']}-{snapshot['version']}.json"
    path.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
    return path


def main(argv: list[str]) -> int:
    if argv[:1] == ["torch"]:
        print(write(extract_torch()))
    elif argv[:1] == ["npu"] and len(argv) == 4:
        print(write(extract_npu(Path(argv[1]), Path(argv[2]), argv[3])))
    elif argv[:1] == ["npu-ops"] and len(argv) == 2:
        print(write(add_npu_ops(Path(argv[1]))))
    elif argv[:1] == ["musa"] and len(argv) == 3:
        print(write(extract_musa(Path(argv[1]), argv[2])))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
