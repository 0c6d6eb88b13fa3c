"""`python -m mlxserve`, the same as the `mlxserve` command."""

from mlxserve.cli import entry

if __name__ == "__main__":
    entry()
