"""Session-wide test isolation: the state a test run learns is its own.

Plans read the calibration records and the incidents remembered in `[server]
state_dir` (rules moe-calibrated-fastest and incident-pinned); a developer's real
~/.cache/mlxserve must not change what the tests' plans decide, and the tests'
records must not reach it.
"""

"""Session-wide test isolation: the state a test run learns is its own.

Plans read the calibration records and the incidents remembered in `[server]
state_dir` (rules moe-calibrated-fastest and incident-pinned); a developer's real
~/.cache/mlxserve must not change what the tests' plans decide, and the tests'
records must not reach it.
"""
