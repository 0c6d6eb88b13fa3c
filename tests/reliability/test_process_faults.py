"""Faults in a real engine process: a hang ends in exit 75 with a diagnostic, a crash
ends the process, a raised step fails only its request."""

import time
from pathlib import Path

import pytest

from tests.engine.conftest_process import EngineProcess, build_tiny_model

PROMPT = [5, 17, 42, 99, 7, 150, 3, 12]
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"))


def start(tmp_path: Path, model_dir: Path, **faults: int) -> EngineProcess:
    env = {f"MLXSERVE_FAULT_{name.upper()}": str(step) for name, step in faults.items()}
    return EngineProcess(
        tmp_path, model_dir, policy=(f"progress_timeout_s={TIMEOUT_S:g}",), env=env
    )


@pytest.mark.slow
def test_hang_exits_75_with_a_diagnostic(tmp_path: Path, model_dir: Path) -> None:
    process = start(tmp_path, model_dir, hang_at_step=2)  # step 1 prefills, step 2 decodes
    try:
        process.connect()
        process.generate("stuck-request", PROMPT, max_tokens=8)
        sent = time.monotonic()
        code = process.wait(TIMEOUT_S + 10)
        elapsed = time.monotonic() - sent
        log = process.stderr()
        assert code == 75, log
        assert elapsed < TIMEOUT_S + 2, log
        assert "FAULT INJECTION ARMED" in log
        assert "has made no progress" in log  # the soft warning came first
        assert "stuck step: index=2 kind=decode" in log
        assert "requests: stuck-request" in log
        assert "thread mlxserve-engine" in log and "faults.py" in log  # where it hangs
        assert "thread mlxserve-watchdog" in log
    finally:
        process.close()


@pytest.mark.slow
def test_crash_exits_non_zero(tmp_path: Path, model_dir: Path) -> None:
    process = start(tmp_path, model_dir, crash_at_step=1)
    try:
        process.connect()
        process.generate("doomed", PROMPT, max_tokens=8)
        assert process.wait(20) == 3
        assert "injected crash at step 1 (prefill)" in process.stderr()
    finally:
        process.close()


@pytest.mark.slow
def test_raised_step_fails_its_request_only(tmp_path: Path, model_dir: Path) -> None:
    process = start(tmp_path, model_dir, raise_at_step=2)
    try:
        process.connect()
        process.generate("unlucky", PROMPT, max_tokens=8)
        tokens, finish, _ = process.collect("unlucky")
        assert finish["finish_reason"] == "error"
        assert "InjectedFault" in finish["error"]
        process.generate("next", PROMPT, max_tokens=8)
        tokens, finish, _ = process.collect("next")
        assert finish["finish_reason"] == "length" and len(tokens) == 8
        assert process.proc.poll() is None
        assert process.terminate() == 0
    finally:
        process.close()


@pytest.mark.slow
def test_bad_fault_variable_is_a_usage_error(tmp_path: Path, model_dir: Path) -> None:
    process = EngineProcess(tmp_path, model_dir, env={"MLXSERVE_FAULT_HANG_AT_STEP": "soon"})
    try:
        assert process.wait(60) == 2
        assert process.stderr().strip() == (
            "mlxserve-engine: error: MLXSERVE_FAULT_HANG_AT_STEP must be a step index >= 1, "
            "got 'soon'"
        )
    finally:
        process.close()
