"""`torchhal plugin new NAME`: a platform plugin distribution to start from; `torchhal plugin spi`: the SPI."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torchhal.cli.output import emit, refuse


def cmd_plugin_new(args: argparse.Namespace) -> int:
    from torchhal.cli.plugin_template import TemplateError, write_plugin

    try:
        target = write_plugin(args.name, args.dir, args.base)
    except (TemplateError, OSError) as exc:
        return refuse("plugin new", str(exc))
    todo = "fill in the TODOs, " if "TODO" in (target / f"torchhal_{args.name}" / "__init__.py").read_text() else ""
    emit(f"wrote the {args.name} plugin distribution to {target}\n"
         f"next: {todo}pip install -e {target}, torchhal conformance --platform {args.name}")
    return 0


def cmd_plugin_spi(args: argparse.Namespace) -> int:
    from torchhal.cli.plugin_template import spi_reference

    reference = spi_reference()
    emit(f"## Class attributes\n\n{reference['attributes']}\n\n## Methods\n\n{reference['methods']}")
    return 0


def add_command(sub: Any) -> None:
    plugin = sub.add_parser("plugin", help="tools for plugin authors")
    plugin_sub = plugin.add_subparsers(dest="plugin_command", required=True)
    new = plugin_sub.add_parser("new", help="write a platform plugin distribution to start from")
    new.add_argument("name", help="platform name, a lowercase identifier (e.g. myaccel)")
    new.add_argument("--dir", type=Path, help="where to write it (default: ./torchhal-NAME)")
    new.add_argument("--base", choices=("plugin", "accelerator", "cpu"), default="plugin",
                     help="plugin: every SPI member to fill in (default); accelerator: a declaration for a "
                     "device module mirroring torch.cuda; cpu: a simulated or host-backed device")
    new.set_defaults(func=cmd_plugin_new)
    spi = plugin_sub.add_parser("spi", help="print every PlatformPlugin member's contract (the SPI reference)")
    spi.set_defaults(func=cmd_plugin_spi)
