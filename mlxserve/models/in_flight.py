"""At most two pieces of a long forward queued on the device at once.

MLX allocates an operation's output when the host encodes it and frees its inputs
when the device has finished the batch of work that read them. On a GPU the host
runs far ahead: it encodes a whole prefill chunk (every layer, every query group of
the indexer and the attention) before the device has finished the first layer, so
the device holds every encoded group's scores at once. On an H100, eight real-width
layers at 100K held a 12.9 GB working set against 1.5 GB for one group's, and it grew
with the context (4.7 GB at 4K, 8.7 GB at 32K), though the layers were already queued
one at a time: nothing held the host back. (The CPU backend runs the host at most a
few operations ahead, so it never showed.) With `InFlight`: 3.4 GB at 100K, the peak
1.05x the docs' prediction at 4K, 32K and 100K (docs/engine.md, "On the GPU (H100,
stop 31)").

`InFlight` bounds it: each piece is queued (``mx.async_eval``) and the host then waits
for the piece before it, so the device runs one piece while the host builds the
next, and at most two pieces' working sets are alive. The pieces are the layers of a
prefill chunk (``TextModel.streams``) and the query groups of one layer's indexer
and attention (``indexer.py``, ``prefill_attention.py``). Queuing a piece also keeps
the next one's ops from being scheduled ahead of it, which ``mx.depends`` did before.

Never inside a compiled function or a gradient (``mx.compile`` and ``mx.grad`` cannot
evaluate; a forward that fits one group, as every training forward here does, queues
nothing), and only between the pieces of one forward: the last piece stays lazy, part
of the caller's graph. A verify forward queued every few layers (the tuning's
``verify_queue_every_layers``) waits too, so the host runs at most two groups ahead of
the device there as well.
"""

from __future__ import annotations

import mlx.core as mx


class InFlight:
    """Queues pieces of work, waiting for the one before the last (module docstring)."""

    def __init__(self) -> None:
        self._queued: list[mx.array] = []

    def queue(self, *pieces: mx.array) -> None:
        """Queue ``pieces`` for the device, then wait for what was queued before them."""
        mx.async_eval(*pieces)  # type: ignore[no-untyped-call]
        if self._queued:
            mx.eval(self._queued)
        self._queued = list(pieces)
