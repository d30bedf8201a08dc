"""`python -m torchhal.core.transport reclaim`: unlink shared-memory files of dead producers."""

from __future__ import annotations

import argparse
import os

from torchhal.core.transport._shm import SHM_DIR, reclaim_orphans


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchhal.core.transport")
    parser.add_argument("command", choices=["reclaim"], help="reclaim: remove files of producers that exited")
    parser.add_argument("--dir", default=SHM_DIR, help=f"shared-memory directory (default {SHM_DIR})")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):  # reclaim_orphans reads a missing one as empty: "0 removed" would mislead
        what = "is a file" if os.path.exists(args.dir) else "does not exist"
        parser.error(f"--dir {args.dir} {what}; pass the shared-memory directory the producers write to "
                     f"(default {SHM_DIR})")
    removed = reclaim_orphans(args.dir)
    for name in removed:
        print(f"removed {name}")
    print(f"{len(removed)} file(s) of exited producers removed from {args.dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
