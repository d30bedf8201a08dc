"""torchhal: a pluggable hardware backend layer for PyTorch engines.

`import torchhal` imports neither torch nor a vendor runtime and resolves no platform: the
names of `torchhal.platforms` (the public face, `__all__`) are imported on first use, and
the platform is chosen on the first `torchhal.current_platform()`. So `torchhal --help`
and a mistyped command answer at once.

PYTEST_DONT_REWRITE: `torchhal conformance` imports this package before it starts pytest,
which then marks the installed package for assertion rewriting and would warn that this
module (it has no asserts) came first; its submodules are still rewritten.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchhal.platforms import *  # noqa: F403

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """The public face of `torchhal.platforms`, imported on first use (PEP 562)."""
    platforms = importlib.import_module("torchhal.platforms")
    if name == "__all__":
        return [*platforms.__all__, "__version__"]
    if name in platforms.__all__:
        return getattr(platforms, name)
    raise AttributeError(f"module 'torchhal' has no attribute {name!r}")
