"""Every hookspec is documented in docs/hooks.md with its exact signature."""

import inspect
from pathlib import Path

import pytest

from torchhal.platforms import hookspecs

DOCS = Path(__file__).resolve().parents[1] / "docs"


def signature_text(func) -> str:
    sig = inspect.signature(func)
    params = ", ".join(f"{p.name}: {p.annotation}" for p in sig.parameters.values())
    return f"{func.__name__}({params}) -> {sig.return_annotation}"


def hookspec_functions():
    return [
        obj
        for name, obj in vars(hookspecs).items()
        if name.startswith("torchhal_") and callable(obj)
    ]


def test_every_hookspec_is_documented_with_its_signature():
    text = (DOCS / "hooks.md").read_text()
    specs = hookspec_functions()
    assert len(specs) >= 6
    missing = [signature_text(f) for f in specs if signature_text(f) not in text]
    assert missing == [], "document these in docs/hooks.md exactly as written"


def test_every_hookspec_has_a_docstring_with_an_example():
    for func in hookspec_functions():
        assert func.__doc__ and "Example::" in func.__doc__, func.__name__


def runnable_blocks(path: Path) -> dict[str, str]:
    """Python blocks a doc marks `<!-- runnable: NAME -->`: examples a newcomer copies as they are."""
    import re

    return dict(re.findall(r"<!-- runnable: (\w+) -->\n```python\n(.*?)\n```", path.read_text(), flags=re.S))


def test_the_engine_guide_examples_run_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    blocks = runnable_blocks(DOCS / "engine-guide.md")
    assert set(blocks) >= {"engine", "residency"}
    monkeypatch.chdir(tmp_path)  # the engine example writes ./tiny-llama
    for name, code in blocks.items():
        exec(compile(code, f"engine-guide.md[{name}]", "exec"), {"__name__": f"docs_{name}"})
    printed = capsys.readouterr().out
    assert "LlamaForCausalLM on cpu" in printed
    assert "failed () token id 999 is outside the vocabulary 0..127" in printed
    assert "torch.Size([1, 64])" in printed
