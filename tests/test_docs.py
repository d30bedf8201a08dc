"""Every hookspec is documented in docs/hooks.md with its exact signature."""

import inspect
from pathlib import Path

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
