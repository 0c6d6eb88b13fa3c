"""Fixtures of the front's tests: the tokenizer, fake backends, an app around them."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from mlxserve.config import Settings
from mlxserve.models.demo.build import WEIGHTS_DIR
from mlxserve.models.demo.deepseek_format import _write_tokenizer
from mlxserve.server.app import create_app
from mlxserve.server.runtime import Runtime
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.fakes import FakeBackend
from tests.server.live import MODEL, LiveServer

DEMO_TOKENIZER = Path(__file__).resolve().parents[2] / "mlxserve" / "models" / "demo" / "weights"


@pytest.fixture(scope="session")
def tokenizer() -> FrontTokenizer:
    return FrontTokenizer.load(DEMO_TOKENIZER)


@pytest.fixture(scope="session")
def dsv4_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> FrontTokenizer:
    """The demo's tokenizer dressed as DeepSeek-V4's (no template: the encoder's prompts,
    ``</think>`` and DSML as text)."""
    directory: Path = tmp_path_factory.mktemp("dsv4-tokenizer")
    _write_tokenizer(WEIGHTS_DIR, directory)
    (directory / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    return FrontTokenizer.load(directory)


#: The Host name Starlette's TestClient sends, which the browser guard (no API key) must let in.
TEST_CLIENT_HOST = "testserver"


def make_runtime(
    tokenizer: FrontTokenizer, backends: list[FakeBackend], **server: object
) -> Runtime:
    server.setdefault("allowed_hosts", [TEST_CLIENT_HOST])
    settings = Settings(model="demo", server=server, engine={"max_running": 2})  # type: ignore[arg-type]
    return Runtime(settings, tokenizer, list(backends))


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend("primary", plan={"plan_hash": "abc123", "world_size": 1})


@pytest.fixture
def client(tokenizer: FrontTokenizer, fake: FakeBackend) -> Iterator[TestClient]:
    runtime = make_runtime(tokenizer, [fake], max_queue=1, max_body_bytes=4096)
    fake.up()
    with TestClient(create_app(runtime), raise_server_exceptions=False) as test_client:
        yield test_client


LIVE_CONFIG = """
model = "{model}"
[engine]
max_running = 2
prefill_step = 64
[server]
port = 0
max_queue = 1
max_body_bytes = 65536
ready_interval_s = 2.0
"""


@pytest.fixture(scope="session")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One real server (front + one engine) shared by the end-to-end API tests."""
    server = LiveServer(tmp_path_factory.mktemp("live"), LIVE_CONFIG.format(model=MODEL))
    try:
        yield server.start()
    finally:
        code = server.stop()
        assert code == 0, server.tail()
