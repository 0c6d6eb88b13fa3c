"""The real server on the -0731-style demo (`demo-model --dspark`: a DSpark draft head in
place of the MTP block), speculating, through the real `openai` client.

Its main model is the demo's, so its greedy answers must be exactly those of the demo
server (`live`, MTP drafting: lossless too), while its own drafts are kept (metrics).
"""

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from mlxserve.models.demo.dspark import build_dspark_demo
from tests.server.live import MODEL, LiveServer

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
QUESTIONS = ["Python reference: for", "The assert statement"]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_dspark_demo(progress=False)


@pytest.fixture(scope="module")
def dspark(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LiveServer]:
    server = LiveServer(tmp_path_factory.mktemp("dspark"), CONFIG.format(model=model_dir))
    try:
        yield server.start()
    finally:
        assert server.stop() == 0, server.tail()


def _answer(server: LiveServer, question: str, **extra: object) -> str:
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        name = client.models.list().data[0].id
        params: dict[str, object] = {"max_tokens": 48, "temperature": 0, **extra}
        response = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": question}],
            **params,  # type: ignore[arg-type]
        )
    content = response.choices[0].message.content
    assert content is not None
    return content


def test_dspark_demo_speculates_and_answers_as_the_demo(
    dspark: LiveServer, live: LiveServer
) -> None:
    assert MODEL == "demo"
    for question in QUESTIONS:
        assert _answer(dspark, question) == _answer(live, question), question
    drafted = dspark.metric("mlxserve_speculative_drafted_tokens_total")
    accepted = dspark.metric("mlxserve_speculative_accepted_tokens_total")
    assert drafted > 0 and accepted > 0, (drafted, accepted, dspark.tail())


def test_seeded_sampling_is_served(dspark: LiveServer) -> None:
    first = _answer(dspark, QUESTIONS[0], temperature=0.8, seed=3)
    assert first == _answer(dspark, QUESTIONS[0], temperature=0.8, seed=3)
