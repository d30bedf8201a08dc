"""`python -m torchhal`: the same as the `torchhal` command."""

import sys

from torchhal.cli import main

sys.exit(main())
