"""`python -m m3serve` is the `m3serve` console script."""

import sys

from m3serve.cli import main

sys.exit(main())
