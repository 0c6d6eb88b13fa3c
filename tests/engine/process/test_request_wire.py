"""A request's record survives the engine channel's wire form (front -> engine process,
rank 0 -> followers), and the wire refuses what the record would."""

import pytest
from pydantic import ValidationError

from mlxserve.channel.messages import Generate, decode_front, encode
from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.process.socket_end import to_request


def test_every_field_round_trips() -> None:
    sampling = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        seed=3,
        top_k=5,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias=((7, -100.0), (9, 2.5)),
        logprobs=4,
    )
    params = GenerationParams((1, 2, 3), 8, sampling, (5,), '{"x": 1}', grammar_prefix=(4,))
    request = GenerationRequest("r", params, speculative_depth=2)
    message = decode_front(encode(request.as_generate()))
    assert isinstance(message, Generate)
    assert to_request(message, vocab_size=16) == request
    assert request.needs_chooser
    assert not GenerationRequest("p", GenerationParams((1,), 2)).needs_chooser


@pytest.mark.parametrize(
    ("sampling", "says"),
    [
        ('{"top_p": 0}', "top_p must be in (0, 1]"),
        ('{"logprobs": 21}', "logprobs must be in [0, 20]"),
        ('{"top_q": 1}', "Unexpected keyword argument"),
    ],
)
def test_the_wire_refuses_what_the_record_would(sampling: str, says: str) -> None:
    line = '{"type": "generate", "id": "r", "params": {"prompt_ids": [1], "max_tokens": 2, '
    with pytest.raises(ValidationError, match=r"params\.sampling") as refused:
        decode_front(f'{line}"sampling": {sampling}}}}}'.encode())
    assert says in str(refused.value)
