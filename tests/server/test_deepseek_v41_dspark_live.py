"""The real server on a tiny DeepSeek-V4.1 with Engram and its DSpark draft head, in the
published names, speculating, through the real `openai` client.

The checkpoint is ``v41_fixtures.write_v41(dspark=True, echo=True)``: its layers add
nothing to the streams, so the model predicts from the last token alone and the
head's first draft is that very prediction (its confidence is one half: one draft
verified a round). So the server drafts, verifies and keeps drafts, and its greedy
answer must be plain decoding's, computed here in process on the same checkpoint at
depth 0.
"""

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from mlxserve.channel.request import GenerationParams
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.adapter import PlainAdapter
from mlxserve.models.demo.build import WEIGHTS_DIR
from mlxserve.models.demo.deepseek_format import _write_tokenizer
from mlxserve.models.loader import load_model
from mlxserve.server.tokenizer import FrontTokenizer
from tests.engine.drive import run
from tests.models.v41_fixtures import write_v41
from tests.server.live import LiveServer

pytestmark = pytest.mark.slow

CONFIG = """
model = "{model}"
[speculative]
depth = 4
[engine]
max_running = 2
prefill_step = 64
[server]
port = 0
ready_interval_s = 2.0
"""
QUESTION = [{"role": "user", "content": "Python reference: for"}]
CHAT_OFF = {"thinking": {"type": "disabled"}}
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("v41-dspark") / "DeepSeek-V4.1-tiny"
    write_v41(directory, engram=True, dspark=True, echo=True)
    _write_tokenizer(WEIGHTS_DIR, directory)  # DeepSeek's special tokens, no template
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(tmp_path_factory.mktemp("v41-dspark-serve"), CONFIG.format(model=model_dir))
    try:
        yield live.start()
    finally:
        assert live.stop() == 0, live.tail()


def _plain_answer(model_dir: Path, prompt: list[int]) -> str:
    model, _ = load_model(model_dir, memory_bytes=0)
    engine = Engine(PlainAdapter(model), EngineConfig(prefill_step=64, speculative_depth=0))
    request = GenerationRequest("plain", GenerationParams(tuple(prompt), MAX_TOKENS))
    tokens, _ = run(engine, request)["plain"]
    return FrontTokenizer.load(model_dir).decode(tokens)


def _ask(server: LiveServer, model_dir: Path) -> str | None:
    """The greedy answer to QUESTION through the real `openai` client."""
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        reply = client.chat.completions.create(
            model=str(model_dir),
            messages=QUESTION,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=CHAT_OFF,
        )
    return reply.choices[0].message.content


def _prompt(server: LiveServer, model_dir: Path) -> list[int]:
    """QUESTION's prompt tokens, as the server renders them (`/tokenize`)."""
    with server.client() as http:
        response = http.post(
            "/tokenize", json={"model": str(model_dir), "messages": QUESTION, **CHAT_OFF}
        )
    assert response.status_code == 200, response.text
    tokens: list[int] = response.json()["tokens"]
    return tokens


def test_v41_speculates_with_its_dspark_head_and_answers_as_plain_decoding(
    server: LiveServer, model_dir: Path
) -> None:
    assert "DSpark draft head (DeepSeek-V4.1, " in server.logged("DSpark draft head")
    content = _ask(server, model_dir)
    assert content
    drafted = server.metric("mlxserve_speculative_drafted_tokens_total")
    accepted = server.metric("mlxserve_speculative_accepted_tokens_total")
    assert drafted > 0 and accepted > 0, (drafted, accepted, server.tail())
    assert content == _plain_answer(model_dir, _prompt(server, model_dir))


def test_two_ranks_speculate_with_the_head_and_answer_as_one_process(
    tmp_path: Path, model_dir: Path
) -> None:
    """The same checkpoint sharded over two real ring ranks (rank 0 serves, rank 1
    follows in lockstep): the DSpark head, held whole on each rank, drafts and the
    answer is still plain decoding's on one process."""
    from tests.ring import served_by_two_ranks

    with served_by_two_ranks(tmp_path, CONFIG.format(model=model_dir)) as (front, _):
        content = _ask(front, model_dir)
        with front.client() as http:
            status = http.get("/status", params={"format": "json"}).json()
        assert status["plan"]["world_size"] == 2
        assert front.metric("mlxserve_speculative_accepted_tokens_total") > 0, front.tail()
        assert content == _plain_answer(model_dir, _prompt(front, model_dir))
