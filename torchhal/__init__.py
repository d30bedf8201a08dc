"""torchhal: a pluggable hardware backend layer for PyTorch engines.

`import torchhal` resolves no platform and imports no vendor runtime; the
platform is chosen on the first `torchhal.current_platform()`.

PYTEST_DONT_REWRITE: `torchhal conformance` imports this package before it starts pytest,
which then marks the installed package for assertion rewriting and would warn that this
module (it has no asserts) came first; its submodules are still rewritten.
"""

from torchhal.platforms import *  # noqa: F403
from torchhal.platforms import __all__ as _platform_names

__version__ = "0.1.0"
__all__ = [*_platform_names, "__version__"]
