"""How attention over a few queries runs: one masked call, or one unmasked call per query.

A verify forward attends S = k + 1 queries, each over its own window and compressed
entries. One ``scaled_dot_product_attention`` with a boolean mask says that in one
call. MLX's CUDA backend has no fast path for a masked call (its vector kernel takes
no array mask and its cuDNN path no boolean one), so there the call falls back to
matmuls, a softmax and selects, plus the mask's own arange and compare ops, with no
fused attention left. Split, each query gets its own unmasked call over exactly the
keys it sees (a slice of the window and its entries), which is the decode step's
kernel S times. The CPU decomposes attention into ops either way, and Metal's vector
kernel takes masks for up to 8 queries where the head size and the query heads per
KV head fit it. The tuning's ``split_attention_queries`` chooses (on by default on
CUDA only; docs/engine.md#tuning has the measurements).
"""

#: Verify forwards of up to this many queries may be split (a depth-7 round).
MAX_SPLIT_QUERIES = 8


def split_queries(length: int, split: bool) -> bool:
    """Whether a forward of `length` queries attends one query at a time, unmasked,
    where the tuning says to `split`."""
    return split and 2 <= length <= MAX_SPLIT_QUERIES
