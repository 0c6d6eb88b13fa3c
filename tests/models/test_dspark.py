"""DeepSeek-V4-Flash-0731's DSpark head: loaded from the published names, and its
drafts' logits against mlx-vlm's drafter (the test-only reference) on the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlxserve.models.deepseek_v4.dspark import DSparkHead, head_of  # noqa: E402
from mlxserve.models.loader import load_model  # noqa: E402
from tests.models.published_layouts import (  # noqa: E402
    CONFIG,
    DSPARK_CONFIG,
    build,
    config_for,
    float_tensors,
    write_checkpoint,
)

_CACHE: dict[str, Any] = {}


def _published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """The -0731 fixture in float32 (published names), and its tensors."""
    if "float" not in _CACHE:
        ck = build("0731", seed=3)
        plain = {k: v for k, v in config_for("0731").items() if k != "quantization_config"}
        root = tmp_path_factory.mktemp("dspark")
        path = write_checkpoint(root / "float", plain, float_tensors(ck.reference), shards=2)
        _CACHE["float"] = (path, ck.reference)
    out: tuple[Path, dict[str, np.ndarray]] = _CACHE["float"]
    return out


def _load(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path, _ = _published(tmp_path_factory)
    model, _ = load_model(path)
    return model


def test_0731_loads_its_dspark_head_from_the_published_names(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    _, reference = _published(tmp_path_factory)
    model = _load(tmp_path_factory)
    head = head_of(model)
    assert isinstance(head, DSparkHead)
    assert model.num_mtp_blocks == 0
    spec = head.spec
    assert spec.stages == 3 and spec.block_size == DSPARK_CONFIG["dspark_block_size"]
    assert spec.target_layers == (0, 1, 2) and spec.noise_token == 63
    assert spec.markov_rank == 8 and not spec.confidence_with_markov
    # Published stage parts land on the head; stage tensors keep their values.
    pairs = {
        "mtp.0.main_proj.weight": head.main_proj.weight,
        "mtp.2.markov_head.markov_w2.weight": head.markov_head.markov_w2.weight,
        "mtp.2.confidence_head.proj.bias": head.confidence_head.proj.bias,
        "mtp.2.hc_head_fn": head.hc_head.hc_fn,
        "mtp.1.attn.wq_a.weight": head.stages[1].attn.wq_a.weight,
    }
    # The K=V norm: ``attn.kv_norm`` as published (``attn.norm`` in mlxserve's names).
    kv = "mtp.2.attn.kv_norm.weight"
    pairs[kv if kv in reference else "mtp.2.attn.norm.weight"] = head.stages[2].attn.norm.weight
    for name, value in pairs.items():
        np.testing.assert_array_equal(np.array(value), reference[name])


def _mlx_vlm_drafter(model: Any, reference: dict[str, np.ndarray]) -> Any:
    """mlx-vlm's DeepSeek-V4 DSpark drafter on the same published tensors."""
    drafter_module = pytest.importorskip("mlx_vlm.speculative.drafters.deepseek_v4_dspark")
    text = {**CONFIG, "compress_ratios": [0, 4, 128], "qk_rope_head_dim": 16}
    text.update(DSPARK_CONFIG)
    # mlx-vlm reads the dspark_* fields at the top level (its splitter copies them there).
    top = {
        "text_config": text,
        "n_mtp_layers": 3,
        "target_layer_ids": DSPARK_CONFIG["dspark_target_layer_ids"],
        "mask_token_id": DSPARK_CONFIG["dspark_noise_token_id"],
        "markov_rank": DSPARK_CONFIG["dspark_markov_rank"],
        "block_size": DSPARK_CONFIG["dspark_block_size"] + 1,
    }
    config = drafter_module.ModelConfig.from_dict(top)
    drafter = drafter_module.Model(config)
    published = {
        name.replace(".attn.norm.", ".attn.kv_norm."): mx.array(value)
        for name, value in reference.items()
        if name.startswith("mtp.")
    }
    weights = drafter.sanitize(published)
    drafter.load_weights(list(weights.items()), strict=True)
    drafter.bind(model)
    return drafter


def test_dspark_logits_match_mlx_vlm(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two rounds (the context grows between them): the block's hidden states, base
    logits and Markov-biased logits agree within 1e-3."""
    _, reference = _published(tmp_path_factory)
    model = _load(tmp_path_factory)
    head = head_of(model)
    assert head is not None
    drafter = _mlx_vlm_drafter(model, reference)
    vlm_cache = drafter.make_cache()
    block = DSPARK_CONFIG["dspark_block_size"]
    mx.random.seed(7)
    keys: list[Any] = []
    start = 0
    for round_length, anchor in ((5, 17), (3, 42)):
        taps = mx.random.normal((1, round_length, 3 * CONFIG["hidden_size"]))
        new_keys = head.stage_keys(head.context(taps), start)
        keys = (
            new_keys
            if not keys
            else [mx.concatenate(p, axis=1) for p in zip(keys, new_keys, strict=True)]
        )
        start += round_length
        anchor_ids = mx.array([anchor])
        ours = head.hidden(model, anchor_ids, keys, start)
        inputs = mx.concatenate([anchor_ids[:, None], mx.full((1, block - 1), 63)], axis=1)
        theirs = drafter._hidden(inputs, taps, vlm_cache)
        assert ours.shape == theirs.shape == (1, block, CONFIG["hidden_size"])
        ours_logits, theirs_logits = model.output_head(ours), drafter._logits(theirs)
        assert mx.abs(theirs_logits).max().item() > 0.1
        np.testing.assert_allclose(np.array(ours_logits), np.array(theirs_logits), atol=1e-3)
        previous = mx.array([anchor, 5, 9, 60, 2])
        ours_steps = head.step_logits(ours_logits[0], previous)
        theirs_steps = drafter.markov_head.apply_step_logits(theirs_logits[0], previous)
        np.testing.assert_allclose(np.array(ours_steps), np.array(theirs_steps), atol=1e-3)
