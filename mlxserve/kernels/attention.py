"""How attention over a few queries runs: one masked call, or one unmasked call per query.

A verify forward attends S = k + 1 queries, each over its own window and compressed
entries. One ``scaled_dot_product_attention`` with a boolean mask says that in one
call. MLX's CUDA backend has no fast path for a masked call (its vector kernel takes
no array mask and its cuDNN path no boolean one), so there the call falls back to
matmuls, a softmax and selects, plus the mask's own arange and compare ops: on the
43-layer Flash-shaped model a verify of 2 tokens built 4406 kernels against a decode
step's 3727, with no fused attention left. On CUDA each query therefore gets its own
unmasked call over exactly the keys it sees (a slice of the window and its entries),
which is the decode step's kernel S times: 3833 kernels, and verify(1) 0.94x the
masked call's time on an H200 (`benchmarks/setting_ab.py --setting split-attention`).
The CPU decomposes attention into ops either way, so it keeps the one masked call.
So does Metal, where nothing was measured: its vector kernel takes masks for up to 8
queries where the head size and the query heads per KV head fit it, and otherwise
both ways fall back.
"""

from mlxserve.hardware.device import on_cuda

#: Verify forwards of up to this many queries may be split (a depth-7 round).
MAX_SPLIT_QUERIES = 8
#: None: chosen by device; True or False: forced (tests and benchmarks compare both).
SPLIT_QUERIES: bool | None = None


def split_queries(length: int) -> bool:
    """Whether a forward of `length` queries attends one query at a time, unmasked."""
    if not 2 <= length <= MAX_SPLIT_QUERIES:
        return False
    if SPLIT_QUERIES is not None:
        return SPLIT_QUERIES
    return on_cuda()
