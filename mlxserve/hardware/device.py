"""Which device the default stream runs on, for the kernel choices that differ by it."""

import mlx.core as mx

from mlxserve.hardware.profile import DeviceType


def on_cuda() -> bool:
    """Whether the default device is a CUDA GPU."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def on_cpu() -> bool:
    """Whether the default device is the CPU."""
    return mx.default_device() == mx.cpu


def default_device_type() -> DeviceType:
    """The kind of the default device: cuda, metal or cpu (as `on_cuda` and `on_cpu` tell)."""
    if on_cpu():
        return "cpu"
    return "cuda" if on_cuda() else "metal"
