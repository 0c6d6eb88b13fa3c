"""Rank 0's bytes on every rank, over MLX distributed.

Two collectives per message: every rank learns the length, then the bytes (an
`all_gather` in which only rank 0's part is kept). MLX collectives have no
timeout; a rank that stops calling them is what the progress watchdog is for.
"""

from typing import Any


def broadcast_bytes(group: Any, payload: bytes | None) -> bytes:
    """On rank 0 pass the payload; on the other ranks pass None. Returns rank 0's payload."""
    import mlx.core as mx
    import numpy as np

    is_root = group.rank() == 0
    if is_root != (payload is not None):
        raise ValueError("rank 0, and only rank 0, passes a payload")
    size = len(payload) if payload is not None else 0
    sizes = mx.distributed.all_gather(mx.array([size], dtype=mx.int64), group=group)
    size = int(np.array(sizes)[0])
    if size == 0:
        return b""
    local = (
        np.frombuffer(payload, dtype=np.uint8)
        if payload is not None
        else np.zeros(size, dtype=np.uint8)
    )
    gathered = mx.distributed.all_gather(mx.array(local), group=group)
    return bytes(np.array(gathered)[:size].tobytes())
