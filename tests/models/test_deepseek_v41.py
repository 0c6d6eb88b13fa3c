"""DeepSeek-V4.1: mlx-lm's text model plus mlxserve's Engram, from the published names.

The Engram (hashing and gated lookup) is compared with mlx-vlm's on the same random
weights and token map (a test-only reference); the fixtures in ``v41_fixtures.py``
load through mlxserve's loader, which names the parts it does not serve.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxserve.errors import UsageError
from mlxserve.models.deepseek_v41.engram import Engram, EngramHasher, EngramSpec, fp8_round_trip
from mlxserve.models.deepseek_v41.model import TOKEN_MAP_FILE
from mlxserve.models.loader import load_model
from tests.models.v41_fixtures import write_v41

SPEC = EngramSpec(
    layer_ids=(1, 3),
    table_rows=(3000, 3000),
    max_ngram=4,
    n_heads=4,
    head_dim=32,
    vocab_size=97,
    compressed_vocab_size=150,
    pad_token_id=2,
)


def test_engram_matches_mlx_vlm_within_1e_3() -> None:
    reference = pytest.importorskip("mlx_vlm.models.deepseek_v41.engram")
    from mlx_vlm.models.deepseek_v41.config import ModelConfig

    rng = np.random.default_rng(0)
    token_map = [int(t) for t in rng.permutation(np.arange(200) % 150)]
    config = ModelConfig(
        vocab_size=200,
        hidden_size=64,
        hc_mult=2,
        rms_norm_eps=1e-20,
        num_hidden_layers=4,
        engram_layer_ids=[1, 3],
        engram_num_embeddings=[3000, 3000],
        engram_max_ngram_size=4,
        engram_vocab_size=97,
        engram_n_heads=4,
        engram_head_dim=32,
        engram_pad_token_id=2,
        engram_compressed_vocab_size=150,
    )
    layout = reference.EngramLayout.from_config(config)
    assert np.array_equal(np.array(layout.primes), SPEC.primes())

    # Hashes: a prompt, then more tokens hashed against the kept history.
    tokens = mx.array(rng.integers(0, 200, (2, 30)))
    state = SimpleNamespace(engram=None)
    theirs_hash = reference.NgramHashState(config, layout, token_map=token_map)
    theirs = [theirs_hash(tokens[:, :20], 0, state), theirs_hash(tokens[:, 20:], 20, state)]
    hasher = EngramHasher(SPEC, token_map)
    first, history = hasher(tokens[:, :20], None)
    second, _ = hasher(tokens[:, 20:], history)
    assert mx.array_equal(first, theirs[0]).item() and mx.array_equal(second, theirs[1]).item()

    # The gated lookup, on the same random weights.
    ours, ref = Engram(SPEC, 3, 64, 2, 1e-20), reference.Engram(config, 3, layout)
    mx.random.seed(0)
    weights = []
    for name, value in tree_flatten(ours.parameters()):
        noise = mx.random.normal(value.shape)
        weights.append((name, 1 + 0.3 * noise if name.endswith("_weight") else 0.05 * noise))
    ours.load_weights(weights)
    ref.load_weights(weights)
    streams = mx.random.normal((2, 30, 2, 64))
    ids = mx.concatenate([first, second], axis=1)[:, :, 1]
    out, expected = ours(streams, ids), ref(streams, ids)
    assert mx.abs(out - expected).max().item() <= 1e-3
    assert mx.abs(out - streams).max().item() > 0.1  # the lookup does change the streams


def test_fp8_round_trip_keeps_representable_values_and_rounds_the_rest() -> None:
    x = mx.array([[1.0, 0.5, -2.0, 3.0] * 8])  # amax 3: scale 2**-7, all exact in e4m3
    assert mx.array_equal(fp8_round_trip(x), x).item()
    y = mx.array([[1.0 + 2**-6] + [1.0] * 31])  # below e4m3's step near 1 (2**-3)
    assert fp8_round_trip(y)[0, 0].item() == 1.0


@pytest.mark.parametrize("engram", [False, True])
def test_published_v41_loads_names_what_it_leaves_out_and_decodes_like_its_prefill(
    tmp_path: Path, engram: bool, caplog: pytest.LogCaptureFixture
) -> None:
    directory = write_v41(tmp_path, engram=engram)
    with caplog.at_level(logging.WARNING):
        model, _ = load_model(directory, memory_bytes=0)
    logged = caplog.text
    assert "vision tower (1 tensors) is not served" in logged
    assert "MTP draft head (1 tensors) is not served" in logged
    assert model.engram_layer_ids == ((1, 3) if engram else ())
    tokens = mx.array([[1, 50, 60, 70, 80, 90, 3, 4, 5, 100] * 3])
    cache = model.make_cache()
    model(tokens[:, :-1], cache=cache)
    step = model(tokens[:, -1:], cache=cache)[0, -1]
    full = model(tokens)[0, -1]
    assert mx.abs(step - full).max().item() <= 1e-4
    if engram:  # the Engram layers take part: without their values the logits move
        for layer_id in (1, 3):
            engram_module = model.model.layers[layer_id].engram
            engram_module.wkv.weight = mx.zeros_like(engram_module.wkv.weight)
        assert mx.abs(model(tokens)[0, -1] - full).max().item() > 1e-3


def test_engram_without_its_token_map_is_refused_by_name(tmp_path: Path) -> None:
    directory = write_v41(tmp_path, engram=True)
    (directory / TOKEN_MAP_FILE).unlink()
    with pytest.raises(UsageError) as info:
        load_model(directory, memory_bytes=0)
    text = str(info.value)
    assert "\n" not in text and TOKEN_MAP_FILE in text and "[1, 3]" in text


def test_a_v41_config_the_text_model_cannot_build_exits_2_from_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlxserve.cli import main

    directory = write_v41(tmp_path, engram=True)
    raw = json.loads((directory / "config.json").read_text())
    raw["text_config"]["engram_num_embeddings"] = [4000]  # one table for two layers
    (directory / "config.json").write_text(json.dumps(raw))
    code = main(["generate", "--model", str(directory), "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0 and "engram_num_embeddings" in err, err
