"""A request's sampling fields and grammar survive the engine channel's wire form
(front -> engine process, rank 0 -> followers)."""

from mlxserve.channel.messages import Generate, decode_front, encode, sampling_wire
from mlxserve.engine.core.request import GenerationRequest, SamplingParams
from mlxserve.engine.process.lockstep import as_generate
from mlxserve.engine.process.socket_end import to_request
from mlxserve.server.backends.base import GenerationParams


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


def test_the_front_and_rank_0_send_the_same_sampling_fields() -> None:
    """A backend's params and an engine request map to `Generate` the same way."""
    values = {
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 3,
        "top_k": 5,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "logit_bias": [(7, -100.0)],
        "logprobs": 4,
    }
    engine_side = sampling_wire(
        SamplingParams(0.7, 0.9, 3, 5, 0.1, 0.5, -0.5, 1.2, ((7, -100.0),), 4)
    )
    front_side = sampling_wire(
        GenerationParams((1,), 2, 0.7, 0.9, 3, (), 5, 0.1, 0.5, -0.5, 1.2, ((7, -100.0),), 4)
    )
    assert engine_side == front_side == values
    message = Generate(id="r", prompt_ids=[1], max_tokens=2, speculative_depth=None, **front_side)
    assert message.model_dump(include=set(values)) == values
