"""Probe the machine this rank runs on."""

import json
import os
import platform
import socket
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from mlxserve.hardware.profile import DeviceType, RankProfile


def probe_local() -> RankProfile:
    """This rank's profile, as MLX sees it. Imports MLX, so call it only when needed."""
    import mlx.core as mx

    info = {str(k): v for k, v in mx.device_info().items()}
    device_type = _device_type(mx)
    is_mac = platform.system() == "Darwin"
    arch = info.get("architecture")
    # On an NVIDIA rank the GPU is what kernels (and calibrations) depend on.
    gpu_name = str(info.get("device_name") or "") if device_type == "cuda" else ""
    return RankProfile(
        hostname=socket.gethostname(),
        chip=gpu_name or _chip_name(is_mac),
        gpu_architecture=str(arch) if arch and str(arch).startswith("applegpu") else None,
        device_type=device_type,
        os_name="macOS" if is_mac else platform.system(),
        os_version=platform.mac_ver()[0] if is_mac else platform.release(),
        mlx_version=package_version("mlx"),
        mlx_lm_version=package_version("mlx-lm"),
        memory_bytes=int(info.get("memory_size") or _physical_memory()),
        # Official macOS wheels are built with the NAX kernels; only Metal has them.
        mlx_nax_build=device_type == "metal",
    )


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


#: What any step is allowed at least, by device: MLX's CUDA backend compiles
#: kernels (NVRTC, cuDNN plans) on the first use of each shape, in any step, and
#: 1.25 s x the front's 20 stays under the engine's 30 s watchdog. Metal and the CPU:
#: 0, so hangs there are told within the front's floor (docs/engine.md#tuning has the
#: measurements).
STEP_FLOOR_S: dict[str, float] = {"cuda": 1.25}


def step_floor_s(device: str) -> float:
    """The least time any step is allowed on ``device`` (seconds), cold or not: where
    kernels compile on first use, any step or the gap before it may meet a new shape."""
    return STEP_FLOOR_S.get(device, 0.0)


def device_type() -> DeviceType:
    """The device MLX computes on here: cuda, metal or cpu."""
    import mlx.core as mx

    return _device_type(mx)


def _device_type(mx: object) -> DeviceType:
    core = mx  # mlx.core, passed in so this module imports MLX lazily
    if getattr(core, "cuda", None) is not None and core.cuda.is_available():  # type: ignore[attr-defined]
        return "cuda"
    if core.metal.is_available():  # type: ignore[attr-defined]
        return "metal"
    return "cpu"


def _chip_name(is_mac: bool) -> str:
    if is_mac:
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=5,
                check=True,
            )
            return out.stdout.strip() or "Apple (unknown)"
        except (OSError, subprocess.SubprocessError):
            return "Apple (unknown)"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def usable_memory_bytes() -> int:
    """Memory this process can fill with weights; 0 when unknown.

    On Metal that is the GPU's recommended working set (about three quarters of a Mac's
    unified memory unless raised with ``iogpu.wired_limit_mb``), elsewhere the device's
    or the machine's memory. Imports MLX, so call it only when needed.
    """
    import mlx.core as mx

    info = mx.device_info()
    limit = info.get("max_recommended_working_set_size") or info.get("memory_size")
    return int(limit or _physical_memory())


def benchmark_device() -> dict[str, Any]:
    """What a benchmark's JSON records about where it ran, so figures from a CPU, a Mac
    and an NVIDIA GPU are never mixed up (and whether a faster BLAS was preloaded).
    Imports MLX, so call it only when needed."""
    import mlx.core as mx

    info = {str(k): v for k, v in mx.device_info().items()}
    return {
        "device": str(mx.default_device()),
        "device_type": _device_type(mx),
        "device_name": str(info.get("device_name") or info.get("architecture") or ""),
        "device_info": {k: v for k, v in info.items() if isinstance(v, str | int | float)},
        "chip": _chip_name(platform.system() == "Darwin"),
        "mlx": package_version("mlx"),
        "mlx_lm": package_version("mlx-lm"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        # MLX's own settings (the CUDA graph cache among them): they move the figures
        "mlx_env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")},
    }


def benchmark_device_apart(timeout: float = 120.0) -> dict[str, Any]:
    """`benchmark_device` as a fresh process of this Python sees it: for a benchmark
    that drives servers (which run with the same Python) and should hold no MLX
    device of its own. A probe that fails is recorded as ``probe_error``."""
    root = str(Path(__file__).resolve().parents[2])  # the child imports this mlxserve
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    code = "import json; from mlxserve.hardware.probe import benchmark_device as d; "
    code += "print(json.dumps(d()))"
    try:
        found = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=dict(os.environ, PYTHONPATH=path),
        )
    except subprocess.TimeoutExpired:
        return {"probe_error": f"no answer in {timeout:.0f} s"}
    try:
        device: dict[str, Any] = json.loads(found.stdout)
    except json.JSONDecodeError:
        return {"probe_error": found.stderr[-500:]}
    return device
