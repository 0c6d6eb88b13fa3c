"""`python -m mlxserve`, the same as the `mlxserve` command."""

import sys

from mlxserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
