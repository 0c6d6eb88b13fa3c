"""DeepSeek-V4.1's DSpark head: loaded from V4.1-Flash's published names, driven by the
engine's DSpark adapter, lossless.

The fixture (``v41_fixtures.write_v41(dspark=True)``) holds the head as the release
names it (``mtp.0.main_proj``, ``mtp.{last}.markov_head.embed`` ...), with the draft's
own expert bank and its image-routing biases. Greedy speculation must give plain
decoding's tokens (the depth-0 path, ``PlainAdapter``), with drafts kept and rejected.

No numerical reference from outside exists for this head: mlx-vlm 0.7.10 drops V4.1's
``mtp.*`` (``models/deepseek_v41``) and its ``deepseek_v4_dspark`` drafter is built
on V4 blocks with a hyper-connection head that V4.1's stages do not have.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.adapter import PlainAdapter
from mlxserve.engine.spec.dspark import DSparkAdapter
from mlxserve.errors import UsageError
from mlxserve.models.deepseek_v4.dspark import head_of
from mlxserve.models.deepseek_v41.dspark import V41DSparkHead
from mlxserve.models.deepseek_v41.memory import weight_bytes
from mlxserve.models.loader import load_model
from mlxserve.models.safetensors_header import read_checkpoint
from tests.engine.drive import run
from tests.models.v41_fixtures import DSPARK_CONFIG, random_v41, write_v41

# Longer than the sliding window (16): the head's context keeps only its last rows.
PROMPT = tuple((7 * i + 3) % 1000 for i in range(40))
TOKENS = 20


@pytest.fixture(scope="module", params=[False, True], ids=["text", "engram"])
def model(request: pytest.FixtureRequest) -> Any:
    return random_v41(engram=request.param, dspark=True)


def test_the_head_loads_from_v41s_published_names(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = write_v41(tmp_path, engram=True, dspark=True)
    with caplog.at_level(logging.INFO):
        loaded, _ = load_model(directory, memory_bytes=0)
    assert "DSpark draft head (DeepSeek-V4.1, " in caplog.text
    assert "draft head" not in caplog.text.replace("DSpark draft head", "")
    head = head_of(loaded)
    assert isinstance(head, V41DSparkHead)
    assert head.spec.stages == 2 and head.spec.markov_rank == 8 and head.spec.block_size == 4
    assert head.spec.target_layers == (2, 3) and head.spec.noise_token == 1000
    assert head.spec.confidence_with_markov
    experts = head.v41_stages[0].mlp.experts.switch_mlp.gate_proj.weight
    assert experts.shape[0] == DSPARK_CONFIG["dspark_n_routed_experts"]
    # Every weight, the head's too, is the one written under its published name.
    source = dict(tree_flatten(random_v41(engram=True, dspark=True).parameters()))
    got = dict(tree_flatten(loaded.parameters()))
    assert sorted(got) == sorted(source)
    assert any(name.startswith("dspark.") for name in got)
    for name, value in source.items():
        assert mx.array_equal(got[name], value).item(), name


def test_the_memory_check_counts_the_head_when_it_is_served(tmp_path: Path) -> None:
    directory = write_v41(tmp_path, engram=False, dspark=True)
    tensors = read_checkpoint(directory)
    raw = json.loads((directory / "config.json").read_text())
    head = sum(info.nbytes for name, info in tensors.items() if name.startswith("mtp."))
    vision = sum(info.nbytes for name, info in tensors.items() if name.startswith("vision."))
    # The stages' image routing (``ffn.gate.bias_vl``) is dropped on load.
    image = sum(info.nbytes for name, info in tensors.items() if name.endswith(".bias_vl"))
    total = sum(info.nbytes for info in tensors.values())
    assert head > 0 and image > 0
    assert weight_bytes(tensors, 1, raw) == total - vision - image
    raw["text_config"].pop("dspark_block_size")  # no block: the head is not served
    assert weight_bytes(tensors, 1, raw) == total - vision - head


def test_a_head_without_a_part_is_refused_by_name(tmp_path: Path) -> None:
    directory = write_v41(tmp_path, engram=False, dspark=True)
    tensors = mx.load(str(directory / "model.safetensors"))
    assert isinstance(tensors, dict)
    del tensors["mtp.1.markov_head.embed.weight"]
    mx.save_safetensors(str(directory / "model.safetensors"), tensors)
    with pytest.raises(UsageError) as info:
        load_model(directory, memory_bytes=0)
    text = str(info.value)
    assert "\n" not in text and "markov_head" in text


def test_taps_are_the_streams_entering_their_layers(model: Any) -> None:
    tokens = mx.array([PROMPT[:12]])
    tapped: list[mx.array] = []
    hidden = model.forward_hidden(tokens, taps=(0, 2), tapped=tapped)
    # Entering layer 0, every stream is the token's embedding.
    assert mx.array_equal(tapped[0], model.model.embed_tokens(tokens)).item()
    assert tapped[1].shape == tapped[0].shape
    assert not mx.allclose(tapped[1], tapped[0]).item()
    assert mx.allclose(model.head_from_streams(hidden), model(tokens), atol=1e-5).item()


def test_the_block_reads_the_context(model: Any) -> None:
    """Two prompts ending in the same token: the drafts' logits differ with the context."""
    adapter = DSparkAdapter(model)
    logits = []
    for prompt in (PROMPT[:20], PROMPT[20:39] + PROMPT[19:20]):
        state = adapter.new_state(max_rollback=4)
        adapter.prefill(state, list(prompt))
        _, drafted, _ = adapter._draft(
            state, prompt[-1], 4, SamplingParams(), _draws(), adapter.propose
        )
        logits.append(mx.stack(drafted))
    assert mx.abs(logits[0] - logits[1]).max().item() > 1e-3


class Oracle(DSparkAdapter):
    """Drafts that are plain decoding's tokens at even draft positions and wrong at odd
    ones (the head still runs; only its token is replaced), all verified: rounds keep
    some drafts and trim the rest, across compressed groups and window edges."""

    def __init__(self, model: Any, reference: list[int]) -> None:
        super().__init__(model)
        self.reference = reference
        self.at: list[int] = []
        self.verify_all = True

    def speculate(self, state: Any, last_token: int, *args: Any) -> tuple[list[int], int, int]:
        self.at = self.reference[int(state.offset) + 1 :]
        return super().speculate(state, last_token, *args)

    def propose(self, level: int, logits: mx.array, params: SamplingParams, key: mx.array) -> Any:
        right = self.at[level] if level < len(self.at) else 0
        token = right if level % 2 == 0 else (right + 1) % 1000
        return mx.array(token, dtype=mx.int32) + mx.argmax(logits).astype(mx.int32) * 0


def _plain(model: Any, params: GenerationParams) -> list[int]:
    engine = Engine(PlainAdapter(model), EngineConfig(prefill_step=16, speculative_depth=0))
    return run(engine, GenerationRequest("a", params))["a"][0]


def test_greedy_speculation_is_plain_decoding(model: Any) -> None:
    params = GenerationParams(PROMPT, TOKENS)
    expected = _plain(model, params)
    oracle = Oracle(model, [*PROMPT, *expected])
    engine = Engine(oracle, EngineConfig(prefill_step=16, speculative_depth=4))
    tokens, finish = run(engine, GenerationRequest("a", params))["a"]
    assert tokens == expected
    assert finish.speculative is not None
    assert 0 < finish.speculative["accepted"] < finish.speculative["drafted"]
    # The head's own drafts (random weights: nearly all rejected), verified as it judges.
    engine = Engine(DSparkAdapter(model), EngineConfig(prefill_step=16, speculative_depth=3))
    tokens, finish = run(engine, GenerationRequest("b", params))["b"]
    assert tokens == expected
    assert finish.speculative is not None and finish.speculative["depth"] == 3


def test_a_seed_gives_one_answer_at_every_depth(model: Any) -> None:
    sampling = SamplingParams(temperature=0.8, seed=5)
    answers = []
    for depth in (0, 1, 3):
        adapter = DSparkAdapter(model)
        adapter.verify_all = True
        engine = Engine(adapter, EngineConfig(prefill_step=16, speculative_depth=depth))
        answers.append(run(engine, GenerationRequest("s", GenerationParams(PROMPT, 12, sampling))))
    tokens = [answer["s"][0] for answer in answers]
    assert tokens[0] == tokens[1] == tokens[2]


def test_the_first_draft_of_an_echo_model_is_its_next_token() -> None:
    """A model whose layers add nothing predicts from the last token alone; the head's
    first draft (its anchor through the stages, the draft norm and the shared head)
    is then exactly that prediction, so every verified draft is kept."""
    echo = random_v41(engram=False, dspark=True, echo=True)
    params = GenerationParams(PROMPT, TOKENS)
    expected = _plain(echo, params)
    engine = Engine(DSparkAdapter(echo), EngineConfig(prefill_step=16, speculative_depth=4))
    tokens, finish = run(engine, GenerationRequest("a", params))["a"]
    assert tokens == expected
    assert finish.speculative is not None
    drafted, accepted = finish.speculative["drafted"], finish.speculative["accepted"]
    assert drafted > 0 and accepted == drafted


def _draws() -> Any:
    from mlxserve.engine.sample.sampling import KeyStream

    return KeyStream(0).at(0)
