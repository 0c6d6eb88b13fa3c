"""A request's sampling fields and grammar survive the engine channel's wire form
(front -> engine process, rank 0 -> followers)."""

from mlxserve.channel.messages import Generate, decode_front, encode
from mlxserve.engine.lockstep import as_generate
from mlxserve.engine.process_front import to_request
from mlxserve.engine.request import GenerationRequest, SamplingParams


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
    request = GenerationRequest(
        "r", (1, 2, 3), 8, sampling, frozenset({5}), None, grammar='{"x": 1}', grammar_prefix=(4,)
    )
    message = decode_front(encode(as_generate(request)))
    assert isinstance(message, Generate)
    assert to_request(message, vocab_size=16) == request
    assert request.needs_chooser and not GenerationRequest("p", (1,), 2).needs_chooser
