"""The `torchhal` command line: `info`, `conformance`, `generate` and `plugin new`.

One module a command; each registers its subcommand (`add_command`) and returns its
exit code. Only the command named is imported: `torchhal --help` and a usage error
import no torch. Bad input is one line on stderr and exit code 2; so is output that
cannot be written (a closed pipe, a full disk).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable

from torchhal.cli.output import OutputError, refuse

__all__ = ["COMMANDS", "build_parser", "main"]

#: Command -> (its module, the line `torchhal --help` shows for it).
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("torchhal.cli.info", "registered platforms, the current one, its devices"),
    "conformance": ("torchhal.cli.conformance", "run the conformance suite on a platform"),
    "generate": ("torchhal.cli.generate", "greedy generation from a Hugging Face checkpoint directory"),
    "plugin": ("torchhal.cli.plugin", "tools for plugin authors"),
}


def build_parser(load: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser, with the arguments of the commands in `load` (default: every command); the
    others are only listed, so their modules are not imported."""
    load = set(COMMANDS if load is None else load)
    parser = argparse.ArgumentParser(prog="torchhal", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (module, help_line) in COMMANDS.items():
        if name in load:
            importlib.import_module(module).add_command(sub)
        else:
            sub.add_parser(name, help=help_line, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = next((arg for arg in argv if not arg.startswith("-")), None)  # the command: the first positional
    args = build_parser(load=[named] if named in COMMANDS else []).parse_args(argv)
    try:
        return int(args.func(args))
    except OutputError as exc:
        return refuse(args.command, str(exc.strerror))


if __name__ == "__main__":
    sys.exit(main())
