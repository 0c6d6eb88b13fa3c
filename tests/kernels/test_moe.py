"""``full`` computes what ``skip`` computes, and never dispatches the sorted gather."""

import itertools

import mlx.core as mx
import pytest

from mlxserve.kernels.moe import (
    MOE_VARIANTS,
    QuantizedExperts,
    full_matmul,
    skip_matmul,
    takes_row_tiles,
)
from tests.kernels.conftest import GatherCall, make_experts, route, sort_rows

IN_DIMS, OUT_DIMS = 128, 64


def assert_same(full: mx.array, skip: mx.array) -> None:
    """Equal up to the kernels' float tolerance (bit-exact on the CPU)."""
    assert full.shape == skip.shape
    assert full.dtype == skip.dtype
    assert mx.allclose(full, skip, rtol=1e-5, atol=1e-5).item()


def both(
    experts: QuantizedExperts, x: mx.array, indices: mx.array, sorted_indices: bool
) -> tuple[mx.array, mx.array]:
    full = full_matmul(experts, x, indices, sorted_indices=sorted_indices)
    skip = skip_matmul(experts, x, indices, sorted_indices=sorted_indices)
    return full, skip


def test_variants() -> None:
    assert MOE_VARIANTS == ("skip", "full", "off")


# Every expert count x top-k x group size x bits; the sorted batch is what mlx-lm's
# SwitchGLU sends when it has >= 64 indices, the unsorted one what it sends below.
GRID = [
    (e, k, g, b)
    for e, k, g, b in itertools.product([4, 16, 64], [1, 2, 6, 8], [32, 64, 128], [4, 8])
    if k <= e
]


@pytest.mark.parametrize(("num_experts", "top_k", "group_size", "bits"), GRID)
def test_full_equals_skip(num_experts: int, top_k: int, group_size: int, bits: int) -> None:
    experts = make_experts(num_experts, IN_DIMS, OUT_DIMS, group_size=group_size, bits=bits)
    seed = num_experts * 100 + top_k * 10 + bits
    tokens = max(64 // top_k, 4 * num_experts // top_k + 1)
    x = mx.random.normal((tokens, IN_DIMS), key=mx.random.key(seed))
    indices = route(tokens, num_experts, top_k, seed=seed)
    sorted_x, sorted_indices = sort_rows(x, indices)
    assert indices.size >= 64
    assert takes_row_tiles(tuple(sorted_x.shape), tuple(sorted_indices.shape), num_experts)
    assert_same(*both(experts, sorted_x, sorted_indices, True))

    decode_tokens = 63 // top_k
    xd = mx.expand_dims(x[:decode_tokens], (-2, -3))
    assert_same(*both(experts, xd, indices[:decode_tokens], False))


@pytest.mark.parametrize(
    ("mode", "group_size", "bits"), [("mxfp4", 32, 4), ("nvfp4", 16, 4), ("mxfp8", 32, 8)]
)
def test_full_equals_skip_fp_modes(mode: str, group_size: int, bits: int) -> None:
    experts = make_experts(8, IN_DIMS, OUT_DIMS, group_size=group_size, bits=bits, mode=mode)
    x = mx.random.normal((48, IN_DIMS), key=mx.random.key(3))
    assert_same(*both(experts, *sort_rows(x, route(48, 8, 2, seed=3)), True))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_full_equals_skip_half_precision(dtype: mx.Dtype) -> None:
    experts = make_experts(8, IN_DIMS, OUT_DIMS, dtype=dtype)
    x = mx.random.normal((40, IN_DIMS), key=mx.random.key(4)).astype(dtype)
    full, skip = both(experts, *sort_rows(x, route(40, 8, 2, seed=4)), True)
    assert full.dtype == dtype
    assert mx.allclose(full, skip, rtol=1e-2, atol=1e-2).item()


@pytest.mark.parametrize(
    "routing",
    [
        [0] * 200,  # one expert takes everything
        [0] * 65 + [15] * 63,  # first and last expert, runs one row past / short of a tile
        list(range(16)) * 4 + [3] * 64,  # a single row for most experts, one long run
    ],
)
def test_full_equals_skip_skewed(routing: list[int]) -> None:
    experts = make_experts(16, IN_DIMS, OUT_DIMS)
    indices = mx.sort(mx.array(routing, dtype=mx.uint32))
    x = mx.random.normal((len(routing), 1, IN_DIMS), key=mx.random.key(5))
    assert_same(*both(experts, x, indices, True))


def test_sparse_sorted_batch_stays_on_the_unsorted_kernel(gather_calls: list[GatherCall]) -> None:
    """Under 4 rows per expert Metal runs even a sorted batch unsorted: so does ``full``."""
    experts = make_experts(64, IN_DIMS, OUT_DIMS)
    x, indices = sort_rows(mx.random.normal((32, IN_DIMS)), route(32, 64, 6))
    assert not takes_row_tiles(tuple(x.shape), tuple(indices.shape), 64)
    full, skip = both(experts, x, indices, True)
    assert_same(full, skip)
    assert gather_calls[0]["rhs_indices"] is indices
    assert gather_calls[0]["sorted_indices"] is False


def test_broadcast_x_batch() -> None:
    experts = make_experts(4, IN_DIMS, OUT_DIMS)
    indices = mx.sort(route(64, 4, 2).flatten()).reshape(2, 64)
    x = mx.random.normal((64, 1, IN_DIMS))
    assert takes_row_tiles(tuple(x.shape), tuple(indices.shape), 4)
    full, skip = both(experts, x, indices, True)
    assert full.shape == (2, 64, 1, OUT_DIMS)
    assert_same(full, skip)


def test_takes_row_tiles() -> None:
    assert takes_row_tiles((256, 1, 64), (256,), 64)
    assert not takes_row_tiles((255, 1, 64), (255,), 64)  # < 4 rows per expert
    assert not takes_row_tiles((15, 1, 64), (15,), 1)  # < 16 rows
    assert not takes_row_tiles((64, 2, 64), (64,), 4)  # M > 1
    assert not takes_row_tiles((3, 64, 1, 64), (64,), 4)  # x batch wider than indices
    assert not takes_row_tiles((3, 1, 64), (64,), 4)  # batch shapes do not broadcast
    assert not takes_row_tiles((64,), (64,), 4)


def test_full_never_dispatches_sorted(gather_calls: list[GatherCall]) -> None:
    experts = make_experts(16, IN_DIMS, OUT_DIMS)
    x = mx.random.normal((64, IN_DIMS))
    indices = route(64, 16, 4)
    sorted_x, sorted_indices = sort_rows(x, indices)

    mx.eval(skip_matmul(experts, sorted_x, sorted_indices, sorted_indices=True))
    assert [c["sorted_indices"] for c in gather_calls] == [True]  # the recorder sees it
    gather_calls.clear()

    mx.eval(full_matmul(experts, sorted_x, sorted_indices, sorted_indices=True))
    mx.eval(full_matmul(experts, mx.expand_dims(x, (-2, -3)), indices, sorted_indices=False))
    assert len(gather_calls) == 2
    assert all(c["sorted_indices"] is False for c in gather_calls)
    # The tiled call is a batch of 64-row matrices, one expert index per tile.
    tiled = gather_calls[0]["rhs_indices"]
    assert isinstance(tiled, mx.array)
    assert tiled.size < sorted_indices.size


def test_global_scale_reaches_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvfp4 experts with a global scale (GPU only in mlx) keep it on the tiled path."""
    base = make_experts(8, IN_DIMS, OUT_DIMS, group_size=16, mode="nvfp4")
    scale = mx.ones((8,), dtype=mx.float32)
    experts = QuantizedExperts(
        base.weight, base.scales, None, base.group_size, base.bits, base.mode, scale
    )

    recorded: list[object] = []

    def record(x: mx.array, *args: object, **kwargs: object) -> mx.array:
        recorded.append(kwargs["global_scale"])
        return mx.zeros((*x.shape[:-1], OUT_DIMS), dtype=x.dtype)

    monkeypatch.setattr(mx, "gather_qmm", record)
    x, indices = sort_rows(mx.random.normal((64, IN_DIMS)), route(64, 8, 2))
    y = full_matmul(experts, x, indices, sorted_indices=True)
    assert y.shape == (128, 1, OUT_DIMS)
    assert len(recorded) == 1
    assert recorded[0] is scale
