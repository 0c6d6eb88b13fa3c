"""Which drafted tokens to keep: greedy matching and speculative rejection sampling.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023): keep draft d_i
with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw the
replacement from normalize(max(p_i - q_i, 0)); if every draft is kept, draw a
bonus token from p_{k+1}. The emitted tokens then follow the target model's
distribution p exactly, whatever the drafter proposes.

A request with a seed is verified by coupled draws instead: the token at each
verified position is drawn from p with that position's own key, as a plain step
draws it (`Draws.pick`), and drafts, drawn from q with the same keys, are kept while
they equal those tokens (`greedy_accept` on the draws). Each token still follows p
(its key's noise is independent of the tokens before it), fewer drafts are kept than
by rejection sampling, and the answer is the one depth 0 gives, draw for draw.
"""

import mlx.core as mx

from mlxserve.engine.sample.sampling import Draws, sample_from, token_id

#: The uses of a round's keys besides its positions' draws (`KeyStream.key`).
UNIFORMS, RESIDUAL = 1, 2


def greedy_accept(drafts: list[int], targets: list[int]) -> list[int]:
    """`targets` has one more entry than `drafts`: the main model's argmax after each prefix."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return [*drafts[:accepted], targets[accepted]]


def rejection_accept(
    drafts: list[int], draft_probs: mx.array, target_probs: mx.array, keys: Draws
) -> list[int]:
    """Tokens to emit. `draft_probs` [k, V] (q), `target_probs` [k + 1, V] (p)."""
    accepted, final = rejection_decision(
        mx.array(drafts, dtype=mx.int32), draft_probs, target_probs, keys
    )
    mx.eval(accepted, final)
    count = token_id(accepted)
    return [*drafts[:count], token_id(final)]


def rejection_decision(
    drafts: mx.array, draft_probs: mx.array, target_probs: mx.array, keys: Draws
) -> tuple[mx.array, mx.array]:
    """(number of drafts kept, the token drawn after them), both lazy.

    Lazy so a speculative round reads drafts, decision and token back with one host
    sync. The replacement after a rejection at i comes from normalize(max(p_i - q_i, 0));
    q gets a zero row at k, so "all kept" draws the bonus token from p_k by the same
    expression.
    """
    k = int(drafts.shape[0])
    vocab = int(target_probs.shape[-1])
    if k:
        rows = mx.arange(k)
        p_draft = target_probs[rows, drafts]
        q_draft = draft_probs[rows, drafts]
        uniforms = mx.random.uniform(shape=(k,), key=keys.key(0, UNIFORMS))
        keep = (uniforms * q_draft < p_draft).astype(mx.int32)
        accepted = mx.cumprod(keep).sum()
        padded = mx.concatenate([draft_probs.astype(target_probs.dtype), mx.zeros((1, vocab))])
    else:
        accepted = mx.array(0, dtype=mx.int32)
        padded = mx.zeros((1, vocab), dtype=target_probs.dtype)
    p_row = mx.take(target_probs, accepted, axis=0)
    q_row = mx.take(padded, accepted, axis=0)
    residual = mx.maximum(p_row - q_row, 0.0)
    total = residual.sum()
    # p == q on the support: any token of p is a valid replacement draw.
    residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p_row)
    return accepted, sample_from(residual, keys.key(0, RESIDUAL))
