"""The `torchhal` command line: `info`, `conformance`, `generate` and `plugin new`.

One module a command; each registers its subcommand (`add_command`) and returns its
exit code. Bad input is one line on stderr and exit code 2; so is output that cannot
be written (a closed pipe, a full disk).
"""

from __future__ import annotations

import argparse
import sys

from torchhal.cli import conformance, generate, info, plugin
from torchhal.cli.info import collect_info
from torchhal.cli.output import OutputError, refuse

__all__ = ["build_parser", "collect_info", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchhal", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,conformance,generate,plugin}")
    for command in (info, conformance, generate, plugin):
        command.add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except OutputError as exc:
        return refuse(args.command, str(exc.strerror))


if __name__ == "__main__":
    sys.exit(main())
