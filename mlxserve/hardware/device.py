"""Which device the default stream runs on, for the kernel choices that differ by it."""

import mlx.core as mx


def on_cuda() -> bool:
    """Whether the default device is a CUDA GPU."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def on_cpu() -> bool:
    """Whether the default device is the CPU."""
    return mx.default_device() == mx.cpu
