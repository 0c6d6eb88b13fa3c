"""HTTP routes, one small module per API feature."""
