"""The agent pattern on the live server: turn 2 of a chat reuses turn 1's cache.

Turn 2 sends turn 1's messages, the answer and a new question. The engine kept
turn 1's final state (prompt and answer) in its prefix cache, so turn 2 prefills
only what is new: the usage report and the /metrics counters of reused and
prefilled prompt tokens say so. The same holds while other requests decode in
the batch.
"""

import threading

import pytest

from tests.server.live import MODEL, LiveServer

pytestmark = pytest.mark.slow


def chat(live: LiveServer, messages: list[dict[str, str]], max_tokens: int) -> dict[str, object]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    with live.client() as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    out: dict[str, object] = response.json()
    return out


def cached(reply: dict[str, object]) -> int:
    usage = reply["usage"]
    assert isinstance(usage, dict)
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens", 0))


def prompt_tokens(reply: dict[str, object]) -> int:
    usage = reply["usage"]
    assert isinstance(usage, dict)
    return int(usage["prompt_tokens"])


def answer(reply: dict[str, object]) -> str:
    choices = reply["choices"]
    assert isinstance(choices, list)
    return str(choices[0]["message"]["content"])


def test_turn_two_reuses_turn_one(live: LiveServer) -> None:
    # Another conversation decodes meanwhile, so turn 1 and 2 share the batch with it.
    stop = threading.Event()

    def background() -> None:
        while not stop.is_set():
            chat(live, [{"role": "user", "content": "Tell me about dictionaries."}], 24)

    other = threading.Thread(target=background, daemon=True)
    other.start()
    try:
        turn1 = [{"role": "user", "content": "How does the for statement iterate over a list?"}]
        before_cached = live.metric("mlxserve_prompt_cached_tokens_total")
        before_prefilled = live.metric("mlxserve_prompt_prefilled_tokens_total")
        first = chat(live, turn1, 24)
        turn2 = [
            *turn1,
            {"role": "assistant", "content": answer(first)},
            {"role": "user", "content": "And over a dictionary?"},
        ]
        second = chat(live, turn2, 16)
    finally:
        stop.set()
        other.join(120)
    # Turn 2 reused at least turn 1's whole prompt: nothing of it was prefilled again.
    reused = cached(second)
    assert reused >= prompt_tokens(first), (reused, prompt_tokens(first))
    assert reused < prompt_tokens(second)
    # The counters (the background requests add theirs; ours are included).
    added_cached = live.metric("mlxserve_prompt_cached_tokens_total") - before_cached
    added_prefilled = live.metric("mlxserve_prompt_prefilled_tokens_total") - before_prefilled
    assert added_cached >= reused
    assert added_prefilled >= prompt_tokens(second) - reused
