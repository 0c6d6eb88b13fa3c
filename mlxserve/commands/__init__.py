"""One module per CLI command; `mlxserve.cli` only parses and dispatches."""
