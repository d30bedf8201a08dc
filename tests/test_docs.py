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


def doc_files() -> list[Path]:
    return [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]


def documented_commands() -> list[tuple[str, str, bool]]:
    """(file, command, whole) for each `torchhal ...` command the docs show: whole commands from
    bash blocks (continuations joined, comments and `[optional]` brackets dropped), and
    fragments from inline code (`torchhal conformance --platform NAME`), whose flags are checked."""
    import re

    found = []
    for path in doc_files():
        text = path.read_text()
        for block in re.findall(r"^```bash\n(.*?)\n```", text, flags=re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                for part in re.split(r"&&|;", line.split(" #")[0]):
                    if part.strip().startswith("torchhal "):
                        found.append((path.name, re.sub(r"\[([^\]]*)\]", r"\1", part.strip()), True))
        for span in re.findall(r"`(torchhal [^`]*)`", text):
            found.append((path.name, " ".join(span.split()), False))
    return found


def test_every_documented_torchhal_command_parses():
    """A renamed flag or subcommand breaks the docs' commands: each bash-block command parses as
    the CLI's own parser reads it, and each inline fragment names only flags its subcommand has."""
    import argparse
    import contextlib
    import io
    import shlex

    from torchhal.cli import build_parser

    parser = build_parser()
    commands = documented_commands()
    assert len([c for c in commands if c[2]]) >= 8
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    wrong = []
    for name, command, whole in commands:
        argv = shlex.split(command)[1:]
        if whole:
            try:
                with contextlib.redirect_stderr(io.StringIO()):
                    parser.parse_args(argv)
            except SystemExit:
                wrong.append(f"{name}: {command}")
            continue
        if not argv or argv == ["..."]:
            continue
        sub = subparsers.get(argv[0])
        if sub is not None and argv[0] == "plugin" and len(argv) > 1:
            sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices.get(argv[1])
        flags = [token.split("=")[0] for token in argv if token.startswith("-")]
        if sub is None or any(flag not in sub._option_string_actions for flag in flags):
            wrong.append(f"{name}: {command}")
    assert wrong == [], "these documented commands do not parse with `torchhal`'s parser"


def test_every_link_and_repository_path_in_the_docs_exists():
    """Relative links (and their #anchors, as GitHub makes them from headings) and backticked
    repository paths (`tests/...`, `torchhal/...`, `scripts/...`, ...) name what is there."""
    import re

    root = DOCS.parent

    def anchors(path: Path) -> set[str]:
        headings = re.findall(r"^#+ (.*)$", path.read_text(), flags=re.M)
        return {re.sub(r"[^\w\- ]", "", h.replace("`", "").strip().lower()).replace(" ", "-") for h in headings}

    wrong = []
    for path in doc_files():
        text = path.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file) if file else path
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
                wrong.append(f"{path.name}: ({target})")
        for named in re.findall(r"`((?:tests|torchhal|scripts|benchmarks|examples|docs|\.ci)/[\w./\-]*)`", text):
            if not (root / named).exists():
                wrong.append(f"{path.name}: `{named}`")
    assert wrong == [], "these links or paths name nothing in the repository"
