"""The engine's side of the socket sends what waits together: one `tokens` line for
the tokens of several steps, in order, and nothing after a finish; the engine loop
sends each step's tokens itself and never waits on a front that does not read."""

import socket
import threading
import time

from mlxserve.channel.messages import Finish, Generate, Hello, Tokens, decode_engine, encode
from mlxserve.channel.request import GenerationParams, TokenLogprob
from mlxserve.engine.core.request import FinishEvent, TokensEvent, Usage
from mlxserve.engine.core.stepper import Engine, EngineConfig, RequestStream
from mlxserve.engine.process.front_link import FrontLink
from mlxserve.engine.process.loop import EngineLoop
from mlxserve.engine.process.socket_end import FrontDesk, coalesce, to_tokens
from mlxserve.engine.runner.adapter import PlainAdapter
from tests.engine.conftest import tiny_llama

USAGE = Usage(prompt_tokens=3, completion_tokens=4)


def test_waiting_tokens_go_out_as_one_line_in_order() -> None:
    events = [TokensEvent("r", (1,)), TokensEvent("r", (2, 3)), TokensEvent("r", (4,))]
    merged = coalesce([*events, FinishEvent("r", "length", USAGE)])
    assert merged == [TokensEvent("r", (1, 2, 3, 4)), FinishEvent("r", "length", USAGE)]
    line = decode_engine(encode(to_tokens(merged[0])))  # type: ignore[arg-type]
    assert isinstance(line, Tokens) and line.token_ids == [1, 2, 3, 4]


def test_logprobs_stay_with_their_tokens() -> None:
    first = TokensEvent("r", (1,), (TokenLogprob(1, -0.5),))
    second = TokensEvent("r", (2,), (TokenLogprob(2, -1.5),))
    (merged,) = coalesce([first, second])
    assert merged == TokensEvent("r", (1, 2), (TokenLogprob(1, -0.5), TokenLogprob(2, -1.5)))
    # A run with and without logprobs is not merged (never the case within one request).
    assert len(coalesce([first, TokensEvent("r", (2,))])) == 2


def test_nothing_is_sent_after_a_finish() -> None:
    finish = FinishEvent("r", "stop", USAGE)
    assert coalesce([finish, TokensEvent("r", (9,))]) == [finish]


def test_a_stream_hands_over_what_waits_without_blocking() -> None:
    stream = RequestStream("r")
    assert stream.ready() == []
    stream.put(TokensEvent("r", (1,)))
    stream.put(TokensEvent("r", (2,)))
    assert stream.ready() == [TokensEvent("r", (1,)), TokensEvent("r", (2,))]
    assert stream.ready() == []


def test_the_engine_goes_on_while_the_front_reads_nothing() -> None:
    """After each step the engine loop sends what it emitted itself, never waiting on
    the front: with the front reading nothing (small socket buffers, full at once),
    both requests still run to their end; then every token arrives, in order, each
    request's finish last."""
    engine = Engine(PlainAdapter(tiny_llama()), EngineConfig(max_running=4))
    loop = EngineLoop(engine)
    loop.start()
    hello = Hello(
        model="tiny",
        pid=1,
        context_length=4096,
        eos_token_ids=[],
        speculative_depth=0,
        speculative_auto=False,
        plan={},
    )
    desk = FrontDesk(engine, hello, vocab_size=97)
    ours, front = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    front.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    serving = threading.Thread(target=desk.serve, args=(FrontLink(ours),), daemon=True)
    serving.start()
    try:
        tokens = 300
        for rid in ("a", "b"):
            params = GenerationParams(tuple(range(3, 20)), tokens)
            front.sendall(encode(Generate(id=rid, params=params)))
        deadline = time.monotonic() + 60
        while engine.progress == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        while (engine.running or engine.queue_depth) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.running == 0 and engine.queue_depth == 0  # done, nothing read
        front.settimeout(30)
        reader = front.makefile("rb")
        assert isinstance(decode_engine(reader.readline()), Hello)
        got: dict[str, list[int]] = {"a": [], "b": []}
        finished: set[str] = set()
        while len(finished) < 2:
            message = decode_engine(reader.readline())
            if isinstance(message, Tokens):
                assert message.id not in finished
                got[message.id] += message.token_ids
            elif isinstance(message, Finish):
                assert message.completion_tokens == tokens
                finished.add(message.id)
        assert len(got["a"]) == len(got["b"]) == tokens
    finally:
        desk.stopping.set()
        front.close()
        loop.stop(5.0)
