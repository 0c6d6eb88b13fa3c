"""The fixed-size record encoding used for every exchange between ranks."""

import pytest

from mlxserve.cluster.exchange import PROFILE_BYTES, all_gather_bytes, decode_record, encode_record
from mlxserve.hardware.profile import RankProfile
from mlxserve.hardware.simulate import SimulatedRank, simulated_profile


def test_profile_round_trip_through_a_fixed_buffer() -> None:
    profile = simulated_profile(0, SimulatedRank(chip="Apple M5 Max"), "0.32.4", "0.32.2")
    buffer = encode_record(profile.model_dump_json().encode(), PROFILE_BYTES)
    assert len(buffer) == PROFILE_BYTES
    assert RankProfile.model_validate_json(decode_record(buffer)) == profile


def test_oversized_record_is_refused() -> None:
    with pytest.raises(ValueError, match="over the 8-byte exchange buffer"):
        encode_record(b"123456789", 8)


def test_single_process_gather() -> None:
    import mlx.core as mx

    group = mx.distributed.init()
    assert all_gather_bytes(group, b"hello", 16) == [b"hello"]
