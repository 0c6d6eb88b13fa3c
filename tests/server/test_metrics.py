"""Prometheus metrics of speculative decoding: tokens, acceptance, depths chosen."""

from mlxserve.server.metrics import Metrics


def test_depths_chosen_are_counted_per_depth() -> None:
    metrics = Metrics()
    metrics.record_speculative(12, 9, {"0": 5, "3": 4})
    metrics.record_speculative(2, 1, {"1": 2})
    metrics.record_speculative(0, 0, {"0": 7})  # plain steps only: still counted
    text = metrics.render().decode()
    assert 'mlxserve_speculative_depth_steps_total{depth="0"} 12.0' in text
    assert 'mlxserve_speculative_depth_steps_total{depth="3"} 4.0' in text
    assert 'mlxserve_speculative_depth_steps_total{depth="1"} 2.0' in text
    assert "mlxserve_speculative_drafted_tokens_total 14.0" in text
    assert "mlxserve_speculative_acceptance_rate 0.7142857142857143" in text
