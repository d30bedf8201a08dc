"""docs/spi-reference.md documents every SPI member and record field, as the code has them."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from torchhal.platforms import records
from torchhal.platforms.plugin import SPI_ATTRIBUTES, SPI_METHODS, PlatformPlugin

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "spi-reference.md"
RECORDS = [obj for obj in vars(records).values() if dataclasses.is_dataclass(obj) and isinstance(obj, type)]


def text() -> str:
    return REFERENCE.read_text()


def cell(value: str) -> str:
    return value.replace("|", "\\|")  # a literal | inside a Markdown table cell


def attribute_type(name: str) -> str:
    annotation = str(PlatformPlugin.__annotations__[name])
    match = re.fullmatch(r"ClassVar\[(.*)\]", annotation)
    return match.group(1) if match else annotation


def method_heading(name: str) -> str:
    signature = inspect.signature(getattr(PlatformPlugin, name))
    params = list(signature.parameters.values())[1:]  # without self
    rendered = str(signature.replace(parameters=params)).replace("'", "")
    return f"### `{name}{rendered}`"


def section(doc: str, heading: str) -> str:
    start = doc.index(heading) + len(heading)
    following = re.search(r"^#{1,3} ", doc[start:], re.MULTILINE)
    return doc[start : start + following.start()] if following else doc[start:]


def default_text(value: object) -> str:
    return "required" if value is dataclasses.MISSING else f"`{value!r}`"


def test_the_reference_covers_a_nonempty_spi():
    assert len(SPI_METHODS) >= 20 and len(SPI_ATTRIBUTES) >= 6 and len(RECORDS) >= 7


@pytest.mark.parametrize("name", SPI_ATTRIBUTES)
def test_every_spi_attribute_is_documented_with_its_type_and_default(name):
    default = getattr(PlatformPlugin, name, dataclasses.MISSING)
    row = f"| `{name}` | `{cell(attribute_type(name))}` | {default_text(default)} |"
    assert row in text(), f"add this row to the class attributes table of docs/spi-reference.md: {row}"


@pytest.mark.parametrize("name", SPI_METHODS)
def test_every_spi_method_is_documented_with_its_signature_and_whether_it_is_required(name):
    heading = method_heading(name)
    doc = text()
    assert heading in doc, f"add a section to docs/spi-reference.md headed: {heading}"
    body = section(doc, heading)
    if getattr(getattr(PlatformPlugin, name), "__isabstractmethod__", False):
        assert "**Required.**" in body, f"{name} is abstract: say **Required.** in its section"
    else:
        assert "Default:" in body, f"{name} has a default: say what it is (Default: ...)"


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.__name__)
def test_every_record_field_is_documented_with_its_type_and_default(record):
    doc = text()
    heading = f"### `{record.__name__}`"
    assert heading in doc, f"add a section {heading} to docs/spi-reference.md"
    body = section(doc, heading)
    missing = []
    for field in dataclasses.fields(record):
        if field.default_factory is not dataclasses.MISSING:
            default = default_text(field.default_factory())
        else:
            default = default_text(field.default)
        row = f"| `{field.name}` | `{cell(str(field.type))}` | {default} |"
        if row not in body:
            missing.append(row)
    assert missing == [], f"document in the {record.__name__} table: " + "; ".join(missing)


def test_every_release_point_is_documented():
    doc = text()
    missing = [
        f"| `ReleasePoint.{p.name}` | `{p.value}` |" for p in records.ReleasePoint
        if f"| `ReleasePoint.{p.name}` | `{p.value}` |" not in doc
    ]
    assert missing == []


def test_the_reference_states_the_conventions_the_suite_relies_on():
    doc = text()
    assert "device_module().is_initialized()" in doc
    assert "| `priority` | `int` | `50` |" in doc
    assert "### Priority ranges" in doc and "## Building a CPU-backed or simulated platform" in doc
    assert "tests/plugin_dist/torchhal_simaccel" in doc
    assert (REFERENCE.parents[1] / "tests" / "plugin_dist" / "torchhal_simaccel").is_dir()



def test_the_public_base_classes_and_their_declarations_are_documented():
    """AcceleratorPlatform's declarations and hooks are SPI: each is named in the reference."""
    from torchhal.plugins.accelerator import AcceleratorPlatform
    from torchhal.plugins.cpu import CpuPlatform

    text = (Path(__file__).resolve().parents[1] / "docs" / "spi-reference.md").read_text()
    section = text.split("## Base classes", 1)[1].split("\n## ", 1)[0]
    assert "torchhal.plugins.accelerator.AcceleratorPlatform" in section
    assert f"torchhal.plugins.cpu.{CpuPlatform.__name__}" in section
    own = [name for name in vars(AcceleratorPlatform) if not name.startswith("_")
           and name not in vars(PlatformPlugin)]
    assert own, "AcceleratorPlatform declares nothing of its own?"
    missing = [name for name in own if f"`{name}" not in section]
    assert missing == [], f"document these AcceleratorPlatform members in spi-reference.md 'Base classes': {missing}"


def rendered(doc: str) -> dict[str, str]:
    """The sections of `doc` between its `<!-- rendered: NAME -->` markers."""
    return dict(re.findall(r"<!-- rendered: (\w+) -->\n(.*?)\n<!-- end rendered: \1 -->", doc, flags=re.S))


def render(doc: str) -> str:
    """`doc` with every rendered section as the docstrings render it now."""
    from torchhal.cli.plugin_template import spi_reference

    sections = spi_reference()
    return re.sub(r"(<!-- rendered: (\w+) -->\n).*?(\n<!-- end rendered: \2 -->)",
                  lambda m: m.group(1) + sections[m.group(2)] + m.group(3), doc, flags=re.S)


def test_the_attributes_and_methods_are_what_the_spi_docstrings_render():
    """The SPI is written once, in PlatformPlugin's docstrings: this file holds what they render."""
    from torchhal.cli.plugin_template import spi_reference

    assert set(rendered(text())) == set(spi_reference()) == {"attributes", "methods"}
    assert text() == render(text()), "the SPI docstrings changed: run `python -m tests.test_spi_reference`"


def test_every_method_with_a_default_says_what_it_is_in_its_docstring():
    required = set(PlatformPlugin.__abstractmethods__)
    assert [name for name in SPI_METHODS if name not in required and "Default:" not in inspect.getdoc(
        getattr(PlatformPlugin, name))] == []


if __name__ == "__main__":  # rewrite the rendered sections from the docstrings
    REFERENCE.write_text(render(text()))
