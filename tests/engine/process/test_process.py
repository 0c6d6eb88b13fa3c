"""The engine process over its unix socket: hello, generation, cancel, bad input, lifecycle."""

import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxserve.engine.process.front_link import MAX_LINE_BYTES
from mlxserve.engine.process.loop import (
    EXIT_ENGINE_CRASHED,
    MAX_SOCKET_PATH_BYTES,
    EngineLoop,
    prepare_socket_path,
)
from mlxserve.errors import UsageError
from tests.engine.conftest_process import CONTEXT_LENGTH, EngineProcess, build_tiny_model

PROMPT = [5, 17, 42, 99, 7, 150, 3, 12]
LONG = 400  # tokens: long enough to cancel or disconnect in the middle


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[EngineProcess]:
    """One engine process shared by the tests that leave it serving."""
    process = EngineProcess(tmp_path_factory.mktemp("engine"), model_dir)
    try:
        process.wait_ready()
        yield process
    finally:
        process.close()


@pytest.fixture
def front(engine: EngineProcess) -> Iterator[EngineProcess]:
    """A fresh connection to the shared engine, closed after the test."""
    engine.connect()
    try:
        yield engine
    finally:
        engine.disconnect()


def in_process_greedy(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    from mlxserve.channel.request import GenerationParams
    from mlxserve.config import load_settings
    from mlxserve.engine.core.build import build_engine
    from mlxserve.engine.core.request import FinishEvent, GenerationRequest, TokensEvent
    from mlxserve.startup.plan import build_plan

    settings = load_settings(None, {"model": str(model_dir)})
    plan, membership = build_plan(settings)
    engine, _ = build_engine(settings, plan, membership.rank)
    stream = engine.submit(GenerationRequest("ref", GenerationParams(tuple(prompt), max_tokens)))
    tokens: list[int] = []
    for _ in range(10_000):
        if not engine.run_once():
            break
    for _ in range(max_tokens + 1):
        event = stream.get(timeout=5)
        if isinstance(event, TokensEvent):
            tokens.extend(event.token_ids)
        else:
            assert isinstance(event, FinishEvent)
            return tokens
    raise AssertionError("no finish")


def wait_for_idle(front: EngineProcess, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        front.send(type="status")
        status = front.recv()
        if status["running"] == 0 and status["queued"] == 0:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"still busy after {timeout} s: {status}")
        time.sleep(0.02)


def reported_progress(front: EngineProcess, timeout: float = 10.0) -> dict[str, Any]:
    """The idle engine's status, once its progress reports have caught up with it: the
    reporting thread sends a move within REPORT_S, later on a loaded machine."""
    deadline = time.monotonic() + timeout
    while True:
        status = wait_for_idle(front, timeout)
        caught_up = front.progress and front.progress[-1]["steps"] == status["progress"]
        if caught_up or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


@pytest.mark.slow
def test_hello_describes_model_and_plan(engine: EngineProcess, model_dir: Path) -> None:
    hello = engine.connect()
    engine.disconnect()
    assert hello["model"] == str(model_dir)
    assert hello["pid"] == engine.proc.pid
    assert hello["context_length"] == CONTEXT_LENGTH
    assert hello["eos_token_ids"] == [0]
    assert hello["speculative_depth"] == 0
    assert len(hello["plan"]["plan_hash"]) == 64
    assert "progress_timeout_s" in hello["plan"]["world"]


@pytest.mark.slow
def test_socket_is_private(engine: EngineProcess) -> None:
    engine.wait_ready()
    assert stat.S_IMODE(engine.socket_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(engine.socket_path.parent.stat().st_mode) == 0o700


@pytest.mark.slow
def test_greedy_matches_in_process_engine(front: EngineProcess, model_dir: Path) -> None:
    expected = in_process_greedy(model_dir, PROMPT, 24)
    front.generate("g1", PROMPT, max_tokens=24)
    tokens, finish, others = front.collect("g1")
    assert tokens == expected
    assert finish["finish_reason"] == "length"
    assert finish["prompt_tokens"] == len(PROMPT) and finish["completion_tokens"] == 24
    assert others == []
    # The engine reports its step counter (within REPORT_S of a move), never going back.
    status = reported_progress(front)
    steps = [report["steps"] for report in front.progress]
    assert steps and steps == sorted(steps) and steps[-1] == status["progress"], front.progress


@pytest.mark.slow
def test_concurrent_requests_and_stop_tokens(front: EngineProcess, model_dir: Path) -> None:
    expected = in_process_greedy(model_dir, PROMPT, 12)
    stop = expected[4]
    front.generate("c1", PROMPT, max_tokens=12)
    front.generate("c2", PROMPT, max_tokens=12, stop_token_ids=[stop])
    results: dict[str, tuple[list[int], str]] = {"c1": ([], ""), "c2": ([], "")}
    while not all(reason for _, reason in results.values()):
        message = front.recv()
        tokens, _ = results[message["id"]]
        if message["type"] == "tokens":
            tokens.extend(message["token_ids"])
        else:
            results[message["id"]] = (tokens, message["finish_reason"])
    assert results["c1"] == (expected, "length")
    assert results["c2"] == (expected[: expected.index(stop)], "stop")


@pytest.mark.slow
def test_cancel_mid_generation(front: EngineProcess) -> None:
    front.generate("x1", PROMPT, max_tokens=LONG)
    first = front.recv()
    assert first["type"] == "tokens" and first["id"] == "x1"
    front.send(type="cancel", id="x1")
    _, finish, others = front.collect("x1")
    assert finish["finish_reason"] == "cancelled"
    assert finish["completion_tokens"] < LONG
    assert others == []
    # A cancel that races the finish is not an error; a cancel of an unknown id is.
    front.send(type="cancel", id="x1")
    front.send(type="cancel", id="never-sent")
    assert front.recv() == {"type": "error", "id": "never-sent", "message": "unknown request id"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("line", "error_id", "says"),
    [
        (b"not json", None, "not valid JSON"),
        (b"\xff\xfe\x00garbage", None, "not valid JSON"),
        (b"[1, 2, 3]", None, "JSON object"),
        (b'{"type": "shutdown"}', None, "unknown message type 'shutdown'"),
        (b'{"id": "n1"}', "n1", "missing 'type'"),
        (b'{"id": "n1b", "prompt_ids": [1], "max_tokens": 2}', "n1b", "missing 'type'"),
        (b"{}", None, "missing 'type'"),
        (b'{"type": 7}', None, "unknown message type 7"),
        (
            b'{"type": "generate", "id": "n2", "params": {"prompt_ids": [], "max_tokens": 2}}',
            "n2",
            "at least one token",
        ),
        (
            b'{"type": "generate", "id": "n3", "params": {"prompt_ids": [1], "max_tokens": 0}}',
            "n3",
            "max_tokens",
        ),
        (
            b'{"type": "generate", "id": "n4", '
            b'"params": {"prompt_ids": [1], "max_tokens": 4, "sampling": {"top_p": 0}}}',
            "n4",
            "top_p",
        ),
        (
            b'{"type": "generate", "id": "n5", '
            b'"params": {"prompt_ids": [1, 100000], "max_tokens": 4}}',
            "n5",
            "outside the vocabulary",
        ),
        (b'{"type": "cancel"}', None, "id"),
        (b'{"type": "status", "extra": 1}', None, "extra"),
    ],
)
def test_malformed_line_gets_error_and_serving_continues(
    front: EngineProcess, line: bytes, error_id: str | None, says: str
) -> None:
    front.send_raw(b"\n" + line + b"\n")  # the empty line is ignored
    error = front.recv()
    assert error["type"] == "error", error
    assert error["id"] == error_id
    assert says in error["message"]
    front.generate("after", PROMPT, max_tokens=3)
    tokens, finish, others = front.collect("after")
    assert len(tokens) == 3 and finish["finish_reason"] == "length" and others == []


@pytest.mark.slow
def test_oversized_line_gets_error(front: EngineProcess) -> None:
    just_over = b'{"type": "status", "pad": "' + b"x" * MAX_LINE_BYTES + b'"}\n'
    far_over = b'{"type": "generate", "prompt_ids": [' + b"1, " * (MAX_LINE_BYTES // 2) + b"1]}\n"
    for line in (just_over, far_over):
        front.send_raw(line)
        error = front.recv()
        assert error["type"] == "error" and "longer than" in error["message"]
        front.send(type="status")  # the next line is read as usual
        assert front.recv()["type"] == "status"


@pytest.mark.slow
def test_duplicate_request_id_is_rejected(front: EngineProcess) -> None:
    front.generate("dup", PROMPT, max_tokens=LONG)
    front.generate("dup", PROMPT, max_tokens=2)
    error = next(m for m in front.messages_until("error") if m["type"] == "error")
    assert error["id"] == "dup" and "duplicate" in error["message"]
    front.send(type="cancel", id="dup")
    _, finish, _ = front.collect("dup")
    assert finish["finish_reason"] == "cancelled"
    # Once finished, the id may be used again.
    front.generate("dup", PROMPT, max_tokens=2)
    assert front.collect("dup")[1]["finish_reason"] == "length"


@pytest.mark.slow
def test_status_reports_engine_counters(front: EngineProcess) -> None:
    before = wait_for_idle(front)
    front.generate("counted", PROMPT, max_tokens=5)
    front.collect("counted")
    after = wait_for_idle(front)
    assert after["type"] == "status"
    assert after["progress"] - before["progress"] == 5  # one prefill step, then 4 decodes


@pytest.mark.slow
def test_disconnect_cancels_in_flight_requests(engine: EngineProcess) -> None:
    said = "front disconnected; cancelled 1 in-flight request"
    before = engine.stderr().count(said)
    engine.connect()
    engine.send(type="status")
    progress_before = engine.recv()["progress"]
    engine.generate("orphan", PROMPT, max_tokens=LONG)
    assert engine.recv()["type"] == "tokens"
    engine.disconnect()
    # The engine's desk thread cancels and logs once it reads the EOF; a connection
    # made before that is refused ("already serves") if it takes over a second.
    deadline = time.monotonic() + 30
    while engine.stderr().count(said) == before:
        assert time.monotonic() < deadline, engine.stderr()[-3000:]
        time.sleep(0.05)
    engine.connect()
    try:
        status = wait_for_idle(engine)
        assert status["progress"] - progress_before < LONG  # cancelled, not run to the end
        assert engine.stderr().count(said) == before + 1
        engine.generate("orphan", PROMPT, max_tokens=2)  # the old id is free again
        assert engine.collect("orphan")[1]["finish_reason"] == "length"
    finally:
        engine.disconnect()


@pytest.mark.slow
def test_second_connection_is_refused(front: EngineProcess) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as second:
        second.settimeout(10)
        second.connect(str(front.socket_path))
        data = second.recv(4096)
    assert b'"type":"error"' in data and b"already serves" in data
    front.send(type="status")
    assert front.recv()["type"] == "status"


@pytest.mark.slow
def test_sigterm_stops_cleanly(tmp_path: Path, model_dir: Path) -> None:
    process = EngineProcess(tmp_path, model_dir)
    try:
        process.connect()
        process.generate("busy", PROMPT, max_tokens=LONG)
        assert process.recv()["type"] == "tokens"
        assert process.terminate() == 0
        assert not process.socket_path.exists()
        assert "stopped" in process.stderr()
    finally:
        process.close()


@pytest.mark.slow
def test_refuses_to_start_with_one_line(tmp_path: Path, model_dir: Path) -> None:
    process = EngineProcess(tmp_path, model_dir, policy=("startup=refuse",))
    try:
        assert process.wait(60) == 2
        lines = process.stderr().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("mlxserve-engine: error: refusing to start")
        assert not process.socket_path.exists()
    finally:
        process.close()


# -- the socket path, in-process ---------------------------------------------------


def test_socket_directory_is_created_private(tmp_path: Path) -> None:
    path = prepare_socket_path(tmp_path / "new" / "engine.sock")
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not path.exists()


def test_stale_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(path))
    assert path.exists()
    assert prepare_socket_path(path) == path and not path.exists()


def test_live_socket_is_not_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(path))
        live.listen(1)
        with pytest.raises(UsageError, match="another process is listening"):
            prepare_socket_path(path)
    assert path.exists()


def test_other_files_are_not_removed(tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"
    path.write_text("data")
    with pytest.raises(UsageError, match="not a socket"):
        prepare_socket_path(path)
    assert path.read_text() == "data"


def test_too_long_socket_path_is_refused(tmp_path: Path) -> None:
    path = tmp_path / ("d" * MAX_SOCKET_PATH_BYTES) / "engine.sock"
    with pytest.raises(UsageError, match="socket path longer"):
        prepare_socket_path(path)
    assert not path.parent.exists()


def test_parent_must_be_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="not a directory"):
        prepare_socket_path(tmp_path / "file" / "engine.sock")
    assert os.path.isfile(tmp_path / "file")


@pytest.mark.slow
def test_sigterm_while_loading_exits_zero(tmp_path: Path, model_dir: Path) -> None:
    process = EngineProcess(tmp_path, model_dir)
    try:
        deadline = time.monotonic() + 60
        while "progress timeout" not in process.stderr():  # logged just before the load
            assert time.monotonic() < deadline and process.proc.poll() is None, process.stderr()
            time.sleep(0.01)
        assert process.terminate() == 0
        assert not process.socket_path.exists()
    finally:
        process.close()


def test_engine_loop_crash_exits_70() -> None:
    class Broken:
        def run_once(self, block: bool = False) -> bool:
            raise RuntimeError("scheduler bug")

        def wake(self) -> None:
            pass

    exited = threading.Event()
    codes: list[int] = []

    def record(code: int) -> None:
        codes.append(code)
        exited.set()

    loop = EngineLoop(Broken(), exit=record)  # type: ignore[arg-type]
    loop.start()
    assert exited.wait(5)
    assert codes == [EXIT_ENGINE_CRASHED]
    assert loop.stop(5)
