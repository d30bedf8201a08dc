"""The one-way import rule (docs/design-notes.md, Architecture): engine code never names a vendor."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torchhal"
VENDOR_MODULES = ("torch_npu", "torch_musa", "intel_extension_for_pytorch", "pynvml", "torchhal.plugins")
VENDOR_ATTRS = ("cuda", "xpu", "npu", "musa", "hip")
DEVICE_STRINGS = ("cuda", "xpu", "npu", "musa", "hip", "rocm", "mps")


def violations(source: str, filename: str = "<src>") -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            names = []
        for name in names:
            if name.startswith(VENDOR_MODULES):
                found.append(f"{where}: imports {name}")
        if isinstance(node, ast.Attribute):
            if node.attr in VENDOR_ATTRS and isinstance(node.value, ast.Name) and node.value.id == "torch":
                found.append(f"{where}: torch.{node.attr}")
            elif node.attr == "cuda":  # tensor.cuda(), module.cuda()
                found.append(f"{where}: .cuda")
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.split(":")[0] in DEVICE_STRINGS:
                found.append(f"{where}: device-type literal {node.value!r}")
    return found


@pytest.mark.parametrize("folder", ["core", "attention", "conformance_tests"])
def test_engine_code_names_no_vendor(folder):
    files = sorted((PACKAGE / folder).rglob("*.py"))
    problems = [v for f in files for v in violations(f.read_text(), str(f.relative_to(PACKAGE)))]
    assert problems == []


def test_platforms_import_no_plugin_module():
    files = sorted((PACKAGE / "platforms").rglob("*.py"))
    problems = [
        v
        for f in files
        for v in violations(f.read_text(), str(f))
        if "imports" in v
    ]
    assert problems == []


def test_the_checker_catches_each_kind_of_violation():
    bad = (
        "import torch_npu\n"
        "from torchhal.plugins.cuda import CudaPlatform\n"
        "import torch\n"
        "torch.cuda.synchronize()\n"
        "x = y.cuda()\n"
        "d = torch.device('cuda:0')\n"
    )
    found = violations(bad)
    assert len(found) == 5, found
    assert violations("import torch\nx = platform.device(0)\n") == []


# -- the architecture rule (docs/design-notes.md, "Architecture") ---------------------

PLATFORMS_PACKAGE = "torchhal.platforms"
#: Submodules engine code may import from besides the package face: the IPC view helpers.
PUBLIC_SUBMODULES = ("torchhal.platforms.ipc",)
#: The documented testing seam: the conformance suite alone may import it.
TESTING_SEAM = "torchhal.platforms.testing"


def _imported_modules(node: ast.AST, package: str) -> list[tuple[str, list[str]]]:
    """(absolute module, names) for one import statement; relative imports resolved in `package`."""
    if isinstance(node, ast.Import):
        return [(alias.name, []) for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join(base + ([module] if module else []))
        return [(module, [alias.name for alias in node.names])]
    return []


def import_graph(sources: dict[str, str], package: str = PLATFORMS_PACKAGE) -> dict[str, set[str]]:
    """Module -> modules of `package` it imports (typing-only imports count: they are edges too).

    `from package import name` is an edge to the submodule `name` where there is one,
    else to the package face (`package`), which itself imports every submodule.
    """
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source, name)):
            for module, names in _imported_modules(node, package):
                if module == package:
                    for imported in names or [package]:
                        target = f"{package}.{imported}"
                        graph[name].add(target if target in sources else package)
                elif module.startswith(package + "."):
                    graph[name].add(module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph[node]:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def platforms_sources() -> dict[str, str]:
    out = {}
    for path in sorted((PACKAGE / "platforms").glob("*.py")):
        name = PLATFORMS_PACKAGE if path.stem == "__init__" else f"{PLATFORMS_PACKAGE}.{path.stem}"
        out[name] = path.read_text()
    return out


def test_no_import_circle_inside_platforms():
    assert circles(import_graph(platforms_sources())) == []


def test_the_circle_checker_catches_a_planted_circle():
    sources = platforms_sources()
    # The old circle: the hook specs name Platform, and Platform takes notify from the loader.
    sources["torchhal.platforms.platform"] += "\nfrom torchhal.platforms.manager import build_registry\n"
    assert ["torchhal.platforms.hookspecs", "torchhal.platforms.manager", "torchhal.platforms.platform"] in circles(
        import_graph(sources)
    )
    # A submodule that imports the package face closes a circle through __init__.
    sources = platforms_sources()
    sources["torchhal.platforms.records"] += "\nfrom torchhal.platforms import Platform\n"
    assert any("torchhal.platforms" in group and "torchhal.platforms.records" in group
               for group in circles(import_graph(sources)))


def public_face_violations(source: str, filename: str, package: str, seam_allowed: bool) -> list[str]:
    """Imports of torchhal.platforms that go past its public face, and reaches for `._plugin`."""
    import torchhal
    import torchhal.platforms

    face = set(torchhal.platforms.__all__)
    top = set(torchhal.__all__)
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and node.attr == "_plugin":
            found.append(f"{where}: reaches the plugin behind a Platform (use the Platform API)")
        for module, names in _imported_modules(node, package):
            if module == PLATFORMS_PACKAGE:
                found += [f"{where}: {module}.{n} is not in its __all__" for n in names if n not in face]
            elif module == "torchhal":
                found += [f"{where}: torchhal.{n} is not in its __all__" for n in names if n not in top]
            elif module.startswith(PLATFORMS_PACKAGE + "."):
                if module == TESTING_SEAM and not seam_allowed:
                    found.append(f"{where}: imports the testing seam {module} (conformance suite only)")
                elif module not in PUBLIC_SUBMODULES and module != TESTING_SEAM:
                    found.append(f"{where}: imports the private submodule {module}")
                found += [f"{where}: imports the private name {module}.{n}" for n in names if n.startswith("_")]
    return found


@pytest.mark.parametrize("folder", ["core", "attention", "conformance_tests"])
def test_engine_code_uses_only_the_public_platform_face(folder):
    problems = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        package = ".".join(relative.parts[:-1]) if relative.name != "__init__" else ".".join(relative.parts)
        problems += public_face_violations(path.read_text(), str(relative), package, folder == "conformance_tests")
    assert problems == []


def test_the_face_checker_catches_each_kind_of_violation():
    bad = (
        "from torchhal.platforms.manager import RegisteredPlatform\n"  # private submodule
        "from torchhal.platforms import manager\n"  # not in __all__
        "from torchhal.platforms.ipc import _check_int\n"  # private name of a public submodule
        "from torchhal.platforms.testing import plugin_under_test\n"  # the seam, outside the suite
        "import torchhal.platforms.selection\n"  # private submodule
        "plugin = platform._plugin\n"  # reaching around the API
    )
    found = public_face_violations(bad, "<core>", "torchhal.core", seam_allowed=False)
    assert len(found) == 6, found
    in_suite = public_face_violations(bad, "<suite>", "torchhal.conformance_tests", seam_allowed=True)
    assert len(in_suite) == 5, in_suite
    good = "from torchhal.platforms import Platform, ReleasePoint\nfrom torchhal.platforms.ipc import DTYPES\n"
    assert public_face_violations(good, "<core>", "torchhal.core", seam_allowed=False) == []
