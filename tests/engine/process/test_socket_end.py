"""The engine's side of the socket sends what waits together: one `tokens` line for
the tokens of several steps, in order, and nothing after a finish."""

from mlxserve.channel.messages import Tokens, decode_engine, encode
from mlxserve.channel.request import TokenLogprob
from mlxserve.engine.core.request import FinishEvent, TokensEvent, Usage
from mlxserve.engine.core.stepper import RequestStream
from mlxserve.engine.process.socket_end import coalesce, to_tokens

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
