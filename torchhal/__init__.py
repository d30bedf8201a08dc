"""torchhal: a pluggable hardware backend layer for PyTorch engines.

`import torchhal` resolves no platform and imports no vendor runtime; the
platform is chosen on the first `torchhal.current_platform()`.
"""

from torchhal.platforms import *  # noqa: F403
from torchhal.platforms import __all__ as _platform_names

__version__ = "0.1.0"
__all__ = [*_platform_names, "__version__"]
