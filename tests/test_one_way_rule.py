"""The one-way import rule (DESIGN.md): engine code never names a vendor."""

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


@pytest.mark.parametrize("folder", ["core", "conformance_tests"])
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
