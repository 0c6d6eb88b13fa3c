"""mlxserve: OpenAI-compatible serving for MLX, with a kernel-policy engine for mixed clusters."""

__version__ = "0.1.0"
