"""Which drafted tokens to keep: greedy matching and speculative rejection sampling.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023): keep draft d_i
with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw the
replacement from normalize(max(p_i - q_i, 0)); if every draft is kept, draw a
bonus token from p_{k+1}. The emitted tokens then follow the target model's
distribution p exactly, whatever the drafter proposes.
"""

import mlx.core as mx

from mlxserve.engine.sampling import KeyStream, sample_from


def greedy_accept(drafts: list[int], targets: list[int]) -> list[int]:
    """`targets` has one more entry than `drafts`: the main model's argmax after each prefix."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return [*drafts[:accepted], targets[accepted]]


def rejection_accept(
    drafts: list[int], draft_probs: mx.array, target_probs: mx.array, keys: KeyStream
) -> list[int]:
    """Tokens to emit. `draft_probs` [k, V] (q), `target_probs` [k + 1, V] (p)."""
    k = len(drafts)
    index = mx.array(drafts)
    rows = mx.arange(k)
    p_draft = target_probs[rows, index] if k else mx.zeros((0,))
    q_draft = draft_probs[rows, index] if k else mx.zeros((0,))
    uniforms = mx.random.uniform(shape=(k,), key=keys.next()) if k else mx.zeros((0,))
    keep = (uniforms * q_draft < p_draft).tolist()
    assert isinstance(keep, list)
    accepted = 0
    while accepted < k and keep[accepted]:
        accepted += 1
    if accepted == k:
        final = sample_from(target_probs[k], keys.next())
    else:
        residual = mx.maximum(target_probs[accepted] - draft_probs[accepted], 0.0)
        total = residual.sum()
        # p == q on the support: any token of p is a valid replacement draw.
        residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), target_probs[accepted])
        final = sample_from(residual, keys.next())
    value = final.item()
    assert isinstance(value, int)
    return [*drafts[:accepted], value]
