"""Speculative acceptance: greedy matching, and rejection sampling preserves p."""

import mlx.core as mx
import numpy as np
from scipy.stats import chisquare

from mlxserve.engine.sample.acceptance import greedy_accept, rejection_accept
from mlxserve.engine.sample.sampling import KeyStream


def test_greedy_accept() -> None:
    assert greedy_accept([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert greedy_accept([1, 2, 3], [1, 5, 3, 4]) == [1, 5]
    assert greedy_accept([9], [1, 2]) == [1]
    assert greedy_accept([], [7]) == [7]


def test_rejection_sampling_matches_target_distribution() -> None:
    """Draft from a skewed q; the first emitted token must still follow p (chi-square)."""
    rng = np.random.default_rng(0)
    vocab = 5
    p = np.array([[0.05, 0.4, 0.1, 0.25, 0.2], [0.3, 0.1, 0.2, 0.2, 0.2]])
    q = np.array([[0.5, 0.05, 0.3, 0.1, 0.05]])
    keys = KeyStream(1234)
    counts = np.zeros(vocab)
    second = np.zeros(vocab)
    runs = 4000
    for run in range(runs):
        draft = int(rng.choice(vocab, p=q[0]))
        out = rejection_accept(
            [draft], mx.array(q, dtype=mx.float32), mx.array(p, dtype=mx.float32), keys.at(run)
        )
        counts[out[0]] += 1
        if len(out) == 2:
            second[out[1]] += 1
    assert chisquare(counts, p[0] * runs).pvalue > 0.001
    # After an accepted draft, the bonus token follows p's next row.
    assert chisquare(second, p[1] * second.sum()).pvalue > 0.001
    # And the test can fail: the drafter's own distribution is far from p.
    assert chisquare(counts, q[0] * runs).pvalue < 1e-6


def test_identical_distributions_accept_everything() -> None:
    p = mx.array([[0.2, 0.8], [0.5, 0.5], [0.1, 0.9]])
    keys = KeyStream(0)
    for run in range(20):
        out = rejection_accept([1, 0], p[:2], p, keys.at(run))
        assert out[:2] == [1, 0] and len(out) == 3
