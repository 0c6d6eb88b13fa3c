"""A step that raises in a tensor-parallel group ends the rank; alone it fails its requests.

On rank 0 (``lockstep``) and on a follower (``follows_group``) a whole step that
raised is the group's failure (a collective whose peer was lost): the engine must
not fail the step's requests and go on, because a follower that went on would wait
for rank 0's next step on a broken group, outside any step, where no watchdog sees
it (seen as a follower left behind in `tests/reliability/test_rank_watchdog.py`).
The step hook raises inside the step, as the broken collective did.
"""

import pytest
from mlx.nn.layers.base import Module

from mlxserve.channel.request import GenerationParams
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.step import Step
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.adapter import PlainAdapter
from tests.engine.drive import collect

LOST = "[ring] connection to a peer was lost"


def broken_engine(model: Module, follows_group: bool) -> Engine:
    engine = Engine(PlainAdapter(model), EngineConfig(prefix_cache_entries=0))
    engine.follows_group = follows_group

    def lose_the_peer(step: Step) -> None:
        raise RuntimeError(LOST)

    engine.before_step = lose_the_peer
    return engine


def test_a_follower_step_that_raises_ends_the_rank(llama_model: Module) -> None:
    engine = broken_engine(llama_model, follows_group=True)
    engine.submit(GenerationRequest("r", GenerationParams((1, 2, 3), 4)))
    with pytest.raises(RuntimeError, match="peer was lost"):
        engine.run_once()


def test_alone_a_step_that_raises_fails_its_requests(llama_model: Module) -> None:
    engine = broken_engine(llama_model, follows_group=False)
    stream = engine.submit(GenerationRequest("r", GenerationParams((1, 2, 3), 4)))
    for _ in range(3):  # bounded: the request ends in the first step
        if not engine.run_once():
            break
    tokens, finish = collect(stream)
    assert tokens == [] and finish.finish_reason == "error"
    assert finish.error is not None and LOST in finish.error
