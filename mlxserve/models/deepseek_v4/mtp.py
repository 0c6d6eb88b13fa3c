"""Multi-token prediction (MTP) forward of DeepSeek-V4.

An MTP block drafts token ``t + 2`` from what the main model knows at position ``t``:

* the main model's residual streams at ``t`` *before* its ``hc_head``
  (``Model.forward_hidden``), normalised per stream (``hnorm``) and projected
  (``h_proj``);
* the embedding of token ``t + 1`` (shared with the main model), normalised (``enorm``),
  projected (``e_proj``) and added to every stream. The embedding is zeroed where the
  absolute position is 0, as the reference implementations do;
* one full V4 decoder layer (its own attention with its own cache, MoE and
  hyper-connections), then the block's own ``hc_head`` and ``norm`` and the main
  model's output head.

The decoder layer's output streams are returned next to the logits: drafting deeper
than the number of blocks feeds them, with the drafted token, back into the last block
(positions keep advancing in that block's cache, so the engine trims the drafted rows
after verification, like the main model's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from .cache import LayerCache, RowCaches
from .config import SLIDING
from .stacked import StackedRows

if TYPE_CHECKING:
    from .model import Model

#: The deepest chained draft this implementation is meant for (as in the references).
MAX_DRAFT_DEPTH = 5


def block_for_depth(num_blocks: int, depth: int) -> int:
    """The block drafting at ``depth`` (1-based): block ``depth - 1``, else the last one."""
    if num_blocks <= 0:
        raise ValueError("The model has no MTP blocks.")
    if not 1 <= depth <= MAX_DRAFT_DEPTH:
        raise ValueError(f"MTP depth must be in 1..{MAX_DRAFT_DEPTH}; got {depth}.")
    return min(depth, num_blocks) - 1


def mtp_forward(
    model: Model,
    streams: mx.array,
    next_tokens: mx.array,
    cache: LayerCache | RowCaches | StackedRows,
    block: int = 0,
) -> tuple[mx.array, mx.array]:
    """Run MTP block ``block`` on streams [B, S, hc, D] and the tokens that follow them.

    ``next_tokens`` [B, S] holds token ``t + 1`` for each stream position ``t``; the
    positions are ``cache.offset ..``. Returns ``(logits [B, S, V], out_streams)``,
    the logits predicting token ``t + 2``.
    """
    if not 0 <= block < len(model.mtp):
        raise IndexError(f"MTP block {block} requested; the model has {len(model.mtp)}.")
    if streams.shape[:2] != next_tokens.shape:
        raise ValueError(
            f"streams {streams.shape} and next_tokens {next_tokens.shape} disagree on [B, S]."
        )
    mtp = model.mtp[block]
    x = _block_input(model, block, streams, next_tokens, cache)
    out_streams = mtp.decode(x, next_tokens, cache)
    logits = model.output_head(mtp.norm(mtp.hc_head(out_streams)))
    return logits, out_streams


def mtp_fill(
    model: Model,
    streams: mx.array,
    next_tokens: mx.array,
    cache: LayerCache | RowCaches,
    block: int = 0,
) -> None:
    """The cache entries ``mtp_forward`` would add, without the rest of the block.

    The engine makes the MTP entries of positions the main model has already decoded
    (a plain step's carry, a batch's backlog, a verified round's accepted drafts) and
    reads nothing else of that forward. A sliding-window block's entry at a position
    is the K=V row of that position's own input, so only the block's input, its
    attention hyper-connection and norm, and the K=V projection run: not the
    attention core (row by row for a batch), the MoE, the second hyper-connection or
    the vocabulary head. MLX never computes those unread parts, so what this saves
    is building their graph on the host (for a batch, the attention core once per
    row), not the device's work (docs/engine.md#batching-measured: ``--ab-fill``).
    Other blocks run ``mtp_forward``.
    """
    mtp = model.mtp[block]
    if mtp.attn.layer_type != SLIDING:
        mtp_forward(model, streams, next_tokens, cache, block)
        return
    x = _block_input(model, block, streams, next_tokens, cache)
    attention_input, _, _ = mtp.hc_attn.enter(x)
    mtp.attn.fill_window(mtp.attn_norm(attention_input), cache)


def _block_input(
    model: Model,
    block: int,
    streams: mx.array,
    next_tokens: mx.array,
    cache: LayerCache | RowCaches | StackedRows,
) -> mx.array:
    """Block ``block``'s input streams: the main streams and the next token's embedding."""
    mtp = model.mtp[block]
    length = next_tokens.shape[1]
    embedded = model.model.embed_tokens(next_tokens)
    offsets = cache.offsets if isinstance(cache, RowCaches | StackedRows) else [cache.offset]
    if 0 in offsets:
        # Only the first call of a sequence can contain absolute position 0.
        at_zero = mx.array([offset == 0 for offset in offsets])[:, None, None]
        first = (mx.arange(length) == 0)[None, :, None] & at_zero
        embedded = mx.where(first, mx.zeros_like(embedded), embedded)
    e = mtp.e_proj(mtp.enorm(embedded))
    x: mx.array = mtp.h_proj(mtp.hnorm(streams)) + e[:, :, None, :].astype(streams.dtype)
    return x


def greedy_draft(
    model: Model,
    streams: mx.array,
    next_tokens: mx.array,
    caches: list[LayerCache],
    depth: int,
) -> list[mx.array]:
    """Chained greedy drafts for one position: ``depth`` arrays [B] (tokens t+2 .. t+1+depth).

    ``streams`` [B, 1, hc, D] and ``next_tokens`` [B, 1] are the main model's streams at
    ``t`` and token ``t + 1``; each deeper step feeds the block its own output streams
    and greedy token. Every step appends one row to the cache of the block it uses.
    """
    drafts: list[mx.array] = []
    for step in range(1, depth + 1):
        block = block_for_depth(len(model.mtp), step)
        logits, streams = mtp_forward(model, streams, next_tokens, caches[block], block)
        next_tokens = mx.argmax(logits[:, -1:], axis=-1)
        drafts.append(next_tokens[:, 0])
    return drafts
