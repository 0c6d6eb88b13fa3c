"""Exchange small records between ranks over MLX distributed.

Every exchange is one all_gather of a fixed-size byte buffer. Records are
UTF-8 JSON (structured and inert: no pickle across machines), zero-padded.
What a record means is its sender's business: the calibration verdicts travel
through `all_gather_bytes` from `mlxserve.startup.plan`.
"""

from typing import Any

from mlxserve.errors import UsageError
from mlxserve.hardware.profile import RankProfile

PROFILE_BYTES = 4096


def encode_record(payload: bytes, size: int) -> bytes:
    if len(payload) > size:
        raise ValueError(f"record is {len(payload)} bytes, over the {size}-byte exchange buffer")
    return payload.ljust(size, b"\0")


def decode_record(buffer: bytes) -> bytes:
    return buffer.rstrip(b"\0")


def all_gather_bytes(group: Any, payload: bytes, size: int) -> list[bytes]:
    """Every rank's payload, in rank order, on every rank."""
    import mlx.core as mx
    import numpy as np

    local = mx.array(np.frombuffer(encode_record(payload, size), dtype=np.uint8))
    raw = np.array(mx.distributed.all_gather(local, group=group)).tobytes()
    return [decode_record(raw[i * size : (i + 1) * size]) for i in range(group.size())]


def gather_profiles(group: Any, profile: RankProfile) -> list[RankProfile]:
    records = all_gather_bytes(group, profile.model_dump_json().encode(), PROFILE_BYTES)
    return [RankProfile.model_validate_json(record) for record in records]


def check_same_plan(group: Any, plan_hash: str) -> None:
    """Fail on every rank when ranks computed different plans (e.g. different rule files)."""
    hashes = [r.decode() for r in all_gather_bytes(group, plan_hash.encode(), 64)]
    if len(set(hashes)) > 1:
        listing = ", ".join(f"rank {i}: {h[:12]}" for i, h in enumerate(hashes))
        raise UsageError(
            f"ranks computed different plans ({listing}); run the same mlxserve and policies "
            "on every rank"
        )
