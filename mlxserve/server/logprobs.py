"""Token log-probabilities in the shapes of the chat and the completions APIs.

The engine sends token ids and numbers (`TokenLogprob`); the text of each token
is the tokenizer's decoding of that one id, and ``bytes`` its UTF-8, as OpenAI
gives it (a token that is part of a multi-byte character decodes to U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlxserve.channel.request import TokenLogprob
from mlxserve.server.tokenizer import FrontTokenizer


def _item(tokenizer: FrontTokenizer, token: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(tokenizer: FrontTokenizer, records: Sequence[TokenLogprob]) -> dict[str, Any]:
    content = []
    for record in records:
        entry = _item(tokenizer, record.token, record.logprob)
        entry["top_logprobs"] = [_item(tokenizer, token, value) for token, value in record.top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    tokenizer: FrontTokenizer, records: Sequence[TokenLogprob], offset: int = 0
) -> dict[str, Any]:
    """The legacy shape: parallel lists, top alternatives as {text: logprob}."""
    tokens, values, tops, offsets = [], [], [], []
    for record in records:
        text = tokenizer.decode([record.token])
        tokens.append(text)
        values.append(record.logprob)
        tops.append({tokenizer.decode([token]): value for token, value in record.top})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
