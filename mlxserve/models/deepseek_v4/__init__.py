"""MLX implementation of DeepSeek-V4 (``model_type == "deepseek_v4"``)."""

from .cache import LayerCache
from .config import ModelArgs
from .model import Model

__all__ = ["LayerCache", "Model", "ModelArgs"]
