"""DeepSeek-V4's published chat format: its prompt encoder and its DSML tool calls."""
