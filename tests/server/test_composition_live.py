"""Features that compose: thinking, constrained output and tools, under speculation,
through every API, on both demo formats.

The matrix of issue 29 over the real server: {thinking off, on with a budget} x
{json_object, json_schema strict, forced tool, required, auto} x {chat, Responses,
Messages}, all sent at once (a mixed batch) and a few alone, on the demo (its chat
template) and on the demo in DeepSeek-V4's published format, at the automatic
depth (which drafts at 1-5). Every answer must be valid: 200, and JSON that parses
(and follows the schema) or the forced call with arguments that validate. The
template demo has no reasoning markers, so there a thinking cell must be refused
by name (400), never a 5xx. Depths 1 and 3, greedy and seeded, alone and batched,
are also held token for token against depth 0 in-process
(tests/engine/spec/test_thinking_rounds.py).
"""

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from composition import all_cells, body, check

from mlxserve.models.demo.deepseek_format import build_deepseek_format_demo
from tests.server.live import LiveServer

pytestmark = pytest.mark.slow

CONFIG = """
model = "{model}"
[speculative]
depth = {depth}
[engine]
max_running = 8
[server]
port = 0
max_queue = 64
ready_interval_s = 5.0
"""


@pytest.fixture(scope="module", params=[("template", '"auto"'), ("dsv4", '"auto"')])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, LiveServer]]:
    fmt, depth = request.param
    model = str(build_deepseek_format_demo(progress=False)) if fmt == "dsv4" else "demo"
    workdir = tmp_path_factory.mktemp(f"compose-{fmt}")
    live = LiveServer(workdir, CONFIG.format(model=model, depth=depth))
    try:
        yield fmt, live.start()
    finally:
        assert live.stop() == 0, live.tail()


def test_every_cell_is_valid_alone_and_in_a_mixed_batch(served: tuple[str, LiveServer]) -> None:
    fmt, live = served
    model = "demo"
    if fmt == "dsv4":
        model = str(build_deepseek_format_demo(progress=False))
    cells = all_cells()

    def send(cell: tuple[str, str, bool]) -> tuple[tuple[str, str, bool], httpx.Response]:
        api, kind, thinking = cell
        path, payload = body(api, kind, thinking, model)
        return cell, httpx.post(f"{live.url}{path}", json=payload, timeout=300)

    with ThreadPoolExecutor(len(cells)) as pool:
        batched = list(pool.map(send, cells))
    alone = [send(cell) for cell in cells if cell[0] == "chat" and cell[2]]
    problems = []
    for (api, kind, thinking), response in [*batched, *alone]:
        if thinking and fmt == "template":
            named = "thinking" in response.text or "reasoning" in response.text
            if response.status_code != 400 or not named:
                problems.append(f"{api} {kind} thinking: {response.status_code} {response.text}")
            continue
        problem = check(api, kind, response)
        if problem is not None:
            problems.append(f"{api} {kind} thinking={thinking}: {problem}")
    assert not problems, "\n".join(problems)
    assert not any(" 500 " in line or "Traceback" in line for line in live.lines), live.tail()
