"""What the front does at start-up so that a first request pays no more than later
ones (`benchmarks/first_request.py` measures it: a first streamed chat took 85 ms on
the project's CPU, later ones 30, before these)."""

import subprocess
import sys
from typing import Any

from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.conftest import DEMO_TOKENIZER

REPO = DEMO_TOKENIZER.parents[3]


class _Recording:
    """The parts of mlx-lm's tokenizer wrapper that the warm-up uses, recorded."""

    has_chat_template = True

    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.rendered: list[Any] = []
        self.fed: list[int] = []

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
        self.rendered.append(messages)
        if self.refuse:
            raise ValueError("this template wants a system message first")
        return "<user>Hello.</user>"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    @property
    def detokenizer(self) -> Any:
        recording = self

        class _Detokenizer:
            def add_token(self, token: int) -> None:
                recording.fed.append(token)

            def finalize(self) -> None:
                recording.fed.append(-1)

        return _Detokenizer()


def test_the_warm_up_renders_the_template_and_runs_the_detokenizer() -> None:
    inner = _Recording(refuse=False)
    FrontTokenizer(inner).warm_up()
    assert inner.rendered == [[{"role": "user", "content": "Hello."}]]
    assert inner.fed[:3] == [ord("<"), ord("u"), ord("s")] and inner.fed[-1] == -1


def test_a_template_that_refuses_a_lone_user_message_does_not_stop_the_load() -> None:
    inner = _Recording(refuse=True)
    FrontTokenizer(inner).warm_up()  # no InvalidRequest escapes
    assert inner.rendered and inner.fed[-1] == -1


def test_loading_a_tokenizer_warms_it_up(monkeypatch: Any) -> None:
    calls = []
    monkeypatch.setattr(FrontTokenizer, "warm_up", lambda self: calls.append(self))
    tokenizer = FrontTokenizer.load(DEMO_TOKENIZER)
    assert calls == [tokenizer]


def test_the_start_up_task_group_imports_anyios_back_end() -> None:
    """In a fresh process: nothing imported it before, `open_a_task_group` does."""
    code = (
        "import asyncio, sys\n"
        "from mlxserve.server.runtime import open_a_task_group\n"
        "name = 'anyio._backends._asyncio'\n"
        "before = name in sys.modules\n"
        "asyncio.run(open_a_task_group())\n"
        "print(before, name in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
