"""How attention over several queries runs: one masked call, one unmasked call per
query, or (a prefill chunk) only the keys each query sees.

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

A forward of more queries than a verify (a prefill chunk) takes neither: one masked
call scores every query against every key of the chunk, most of which it does not
see, so it attends per block of queries over only its window rows and its own
entries (``mlxserve.models.deepseek_v4.prefill_attention``).
"""

#: Verify forwards of up to this many queries may be split (a depth-7 round).
MAX_SPLIT_QUERIES = 8


def split_queries(length: int, split: bool) -> bool:
    """Whether a forward of `length` queries attends one query at a time, unmasked,
    where the tuning says to `split`."""
    return split and 2 <= length <= MAX_SPLIT_QUERIES


def blocked_queries(length: int) -> bool:
    """Whether a forward of `length` queries is a prefill chunk, attended by blocks
    (more queries than a verify forward has)."""
    return length > MAX_SPLIT_QUERIES
