"""The prefix cache counts the bytes it holds: its copies', not their sources'.

A prompt's state lives in mlx-lm caches allocated ahead (in steps, or for the
whole prompt); the cache keeps a copy cut to the positions. Its ``nbytes`` (the
engine's ``prefix_cache_bytes``, which the serve benchmark takes out of the peak,
and what ``prefix_cache_mb`` bounds) must be the copy's size, as MLX's own
counters see it.
"""

import gc

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module

from mlxserve.engine.core.prefix_cache import MIN_SHARED_TOKENS, PrefixCache, shared_length
from mlxserve.engine.runner.adapter import PlainAdapter, PlainState
from tests.engine.conftest import tiny_sliding_gemma

#: tiny_llama: 2 layers, 2 KV heads of 16, float32 keys and values
BYTES_PER_POSITION = 2 * 2 * 2 * 16 * 4


def _prefilled(adapter: PlainAdapter, tokens: list[int], reserve: int) -> PlainState:
    state = adapter.new_state(max_rollback=0)
    adapter.reserve(state, reserve)
    adapter.prefill(state, tokens)
    return state


def test_a_stored_prompt_counts_its_positions_not_the_allocation(llama_model: Module) -> None:
    adapter = PlainAdapter(llama_model)
    tokens = list(range(3, 13))
    state = _prefilled(adapter, tokens, reserve=100)
    allocated = adapter.nbytes(state)
    assert allocated >= 100 * BYTES_PER_POSITION  # the whole prompt, allocated ahead
    gc.collect()
    mx.synchronize()
    before = mx.get_active_memory()
    cache = PrefixCache(adapter, max_entries=4, max_bytes=1 << 30)
    cache.store(tuple(tokens), state)
    mx.synchronize()
    held = mx.get_active_memory() - before
    assert cache.nbytes == len(tokens) * BYTES_PER_POSITION < allocated
    # MLX agrees: the copy, not the source (it may round small buffers up, or place
    # them in a larger freed one: 6.9 KB for these 5.1 KB once, under load).
    assert held <= 2 * cache.nbytes < allocated
    # The bound is on what is held: eviction frees the counted bytes exactly.
    cache.store(tuple(tokens[:5]), _prefilled(adapter, tokens[:5], reserve=100))
    assert cache.nbytes == 15 * BYTES_PER_POSITION
    cache.max_entries = 1
    cache.store((99,), _prefilled(adapter, [99], reserve=100))
    assert len(cache) == 1 and cache.nbytes == BYTES_PER_POSITION


def test_an_owned_state_is_kept_at_its_length(llama_model: Module) -> None:
    adapter = PlainAdapter(llama_model)
    state = _prefilled(adapter, list(range(3, 13)), reserve=40)
    assert adapter.nbytes(state) >= 40 * BYTES_PER_POSITION  # allocated for 40
    cache = PrefixCache(adapter, max_entries=4, max_bytes=1 << 30)
    cache.store(tuple(range(3, 13)), state, owned=True)  # compacted, not copied again
    assert cache.nbytes == adapter.nbytes(state) == 10 * BYTES_PER_POSITION


def test_a_state_over_the_bound_is_not_kept(llama_model: Module) -> None:
    adapter = PlainAdapter(llama_model)
    state = _prefilled(adapter, list(range(3, 13)), reserve=10)
    cache = PrefixCache(adapter, max_entries=4, max_bytes=adapter.nbytes(state) - 1)
    cache.store(tuple(range(3, 13)), state)
    assert len(cache) == 0 and cache.nbytes == 0


def test_a_shared_start_is_served_trimmed_and_decodes_as_from_scratch(
    llama_model: Module,
) -> None:
    """Two prompts with one long start (a system prompt) and different ends: the
    second prefills only its own end, and its logits are those of a fresh prefill."""
    adapter = PlainAdapter(llama_model)
    cache = PrefixCache(adapter, max_entries=4, max_bytes=1 << 30)
    start = [(7 * i) % 50 + 3 for i in range(40)]
    first = (*start, 11, 12, 13, 14)
    cache.store(first[:-1], _prefilled(adapter, list(first[:-1]), reserve=0))
    second = (*start, 21, 22, 23)
    hit = cache.lookup(second)
    assert hit is not None
    state, cached = hit
    assert cached == len(start) == state.offset
    adapter.prefill(state, list(second[cached:-1]))
    reused = adapter.step(state, mx.array(second[-1:]))
    fresh_state = _prefilled(adapter, list(second[:-1]), reserve=0)
    fresh = adapter.step(fresh_state, mx.array(second[-1:]))
    assert mx.allclose(reused, fresh, atol=1e-5).item()
    # The entry itself is untouched: its own prompt still extends it whole.
    again = cache.lookup((*first, 15))
    assert again is not None and again[1] == len(first) - 1


def test_a_short_shared_start_or_an_exact_prefix_is_not_trimmed(llama_model: Module) -> None:
    adapter = PlainAdapter(llama_model)
    cache = PrefixCache(adapter, max_entries=4, max_bytes=1 << 30)
    entry = tuple(range(3, 3 + 40))
    cache.store(entry, _prefilled(adapter, list(entry), reserve=0))
    # Fewer shared tokens than MIN_SHARED_TOKENS: a miss.
    assert cache.lookup((*entry[: MIN_SHARED_TOKENS - 1], 99, 98, 97)) is None
    # An exact prefix is served whole, as before.
    hit = cache.lookup((*entry, 5, 6))
    assert hit is not None and hit[1] == len(entry)
    assert shared_length(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert shared_length(np.array([1, 2]), np.array([1, 2, 4])) == 2


def test_a_short_start_of_a_long_entry_holds_only_itself(llama_model: Module) -> None:
    """The trimmed copy is the shared start's size, not the entry's: a system prompt
    reused from a long conversation does not carry the conversation along."""
    adapter = PlainAdapter(llama_model)
    cache = PrefixCache(adapter, max_entries=4, max_bytes=1 << 30)
    long_entry = tuple((3 * i) % 50 + 3 for i in range(400))
    cache.store(long_entry, _prefilled(adapter, list(long_entry), reserve=0))
    hit = cache.lookup((*long_entry[:40], 99, 98, 97))
    assert hit is not None
    state, cached = hit
    assert cached == 40 == state.offset
    assert adapter.nbytes(state) == 40 * BYTES_PER_POSITION


def test_a_sliding_window_trims_only_before_it_wraps() -> None:
    """Its rotating cache keeps no positions from before the window: an entry past the
    window cannot be cut back to a shared start (a miss, never a wrong state); one
    within it can, and decodes as a fresh prefill."""
    prompt = tuple((11 * i) % 90 + 3 for i in range(44))
    other = (*prompt[:36], 50, 51, 52)
    for window, reusable in ((16, False), (128, True)):
        adapter = PlainAdapter(tiny_sliding_gemma(window))
        cache = PrefixCache(adapter, max_entries=4, max_bytes=1 << 30)
        cache.store(prompt, _prefilled(adapter, list(prompt), reserve=0))
        hit = cache.lookup(other)
        if not reusable:
            assert hit is None
            continue
        assert hit is not None and hit[1] == 36
        state = hit[0]
        adapter.prefill(state, list(other[36:-1]))
        reused = adapter.step(state, mx.array(other[-1:]))
        fresh = adapter.step(_prefilled(adapter, list(other[:-1]), 0), mx.array(other[-1:]))
        assert mx.allclose(reused, fresh, atol=1e-5).item()
