"""`python -m m3serve` is the `m3serve` console script."""

import sys

from m3serve.cli import main

# Guarded: actor processes are spawned, and a spawned child re-imports the parent's __main__.
if __name__ == "__main__":
    sys.exit(main())
