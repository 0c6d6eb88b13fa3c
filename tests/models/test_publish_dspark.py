"""A DSpark draft head written in -0731's published stage names (``publish.py``).

One directory, written once by ``deepseek_v4.publish.write_published``, is read by
mlxserve's loader (every tensor back, bit for bit) and by mlx-vlm's
``deepseek_v4_dspark`` drafter (the test-only reference, strict: every tensor must land
on a parameter), whose draft logits must match mlxserve's head within 1e-3 on the same
taps. Two heads: a random two-stage head on a tiny model whose compression ratios
mlx-vlm's main model accepts too (so its own taps are compared as well), and the
demo's trained one-stage head (``demo-model --dspark``), whose main model mlx-vlm
cannot build (its HCA ratio 16), so only the drafter is read there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx.utils import tree_flatten  # noqa: E402

from mlxserve.models.deepseek_v4 import Model, ModelArgs  # noqa: E402
from mlxserve.models.deepseek_v4.dspark import DSparkHead, DSparkSpec, head_of  # noqa: E402
from mlxserve.models.deepseek_v4.publish import (  # noqa: E402
    dspark_stage_name,
    published_weights,
    write_published,
)
from mlxserve.models.loader import load_model  # noqa: E402

VOCAB = 96
#: A tiny -0731: sliding, CSA and HCA at DeepSeek's ratios, a hash layer, a DSpark head
#: of two stages (so its first and last stage differ) drafting blocks of 4.
CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 32,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "num_hash_layers": 1,
    "sliding_window": 16,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 4,
    "hc_mult": 2,
    "qk_rope_head_dim": 8,
    "compress_ratios": [0, 4, 128],
    "num_nextn_predict_layers": 0,
    "dspark_block_size": 4,
    "dspark_target_layer_ids": [0, 1, 2],
    "dspark_markov_rank": 8,
    "dspark_noise_token_id": 95,
}
STAGES = 2


def random_dspark_model(seed: int = 0) -> Model:
    """The tiny model of ``CONFIG`` with a random DSpark head (confidence reads Markov)."""
    args = ModelArgs.from_dict(CONFIG)
    model = Model(args)
    spec = DSparkSpec(4, (0, 1, 2), 95, STAGES, 8, confidence_with_markov=True)
    model["dspark"] = DSparkHead(args, spec)
    mx.random.seed(seed)
    weights = []
    for name, value in tree_flatten(model.parameters()):
        if value.dtype == mx.int32:  # tid2eid
            weights.append((name, mx.random.randint(0, args.n_routed_experts, value.shape)))
        elif name.endswith("norm.weight"):
            weights.append((name, 1 + 0.1 * mx.random.normal(value.shape)))
        else:
            weights.append((name, 0.2 * mx.random.normal(value.shape)))
    model.load_weights(weights)
    return model


def parameters(model: Any) -> dict[str, mx.array]:
    return dict(tree_flatten(model.parameters()))


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Model, Model]:
    """(directory, the model written, mlxserve's model loaded back from it)."""
    model = random_dspark_model()
    directory = write_published(
        model, tmp_path_factory.mktemp("dspark") / "tiny", {"bos_token_id": 0, "eos_token_id": 1}
    )
    loaded, _ = load_model(directory, memory_bytes=0)
    return directory, model, loaded


def test_stage_names_are_the_published_ones(written: tuple[Path, Model, Model]) -> None:
    directory, _, _ = written
    names = set(mx.load(str(directory / "model.safetensors")))
    for name in (
        "mtp.0.main_proj.weight",
        "mtp.0.main_norm.weight",
        "mtp.0.attn.kv_norm.weight",
        "mtp.0.hc_attn_fn",
        "mtp.0.ffn.experts.3.w2.weight",
        "mtp.0.ffn.shared_experts.w1.weight",
        "mtp.1.attn.wq_a.weight",
        "mtp.1.hc_head_fn",
        "mtp.1.norm.weight",
        "mtp.1.markov_head.markov_w1.weight",
        "mtp.1.confidence_head.proj.bias",
    ):
        assert name in names, name
    assert not any(n.startswith(("dspark.", "model.")) or ".switch_mlp." in n for n in names)
    # Parts held once are on one stage only: main_* on the first, the outputs on the last.
    assert "mtp.1.main_proj.weight" not in names and "mtp.0.hc_head_fn" not in names
    config = json.loads((directory / "config.json").read_text())
    assert config["dspark_block_size"] == 4 and config["dspark_target_layer_ids"] == [0, 1, 2]
    assert config["compress_ratios"] == [0, 4, 128]


def test_dspark_stage_name_places_each_part() -> None:
    assert dspark_stage_name("dspark.stages.2.attn.wkv.weight", 3) == "mtp.2.attn.wkv.weight"
    assert dspark_stage_name("dspark.main_norm.weight", 3) == "mtp.0.main_norm.weight"
    assert dspark_stage_name("dspark.hc_head.hc_fn", 3) == "mtp.2.hc_head.hc_fn"
    assert dspark_stage_name("model.norm.weight", 3) == "model.norm.weight"
    with pytest.raises(ValueError, match=r"dspark\.extra"):
        dspark_stage_name("dspark.extra.weight", 3)


def test_mlxserve_reads_back_every_tensor_unchanged(written: tuple[Path, Model, Model]) -> None:
    _, model, loaded = written
    head = head_of(loaded)
    assert head is not None and loaded.num_mtp_blocks == 0
    original = head_of(model)
    assert original is not None and head.spec == original.spec
    before, after = parameters(model), parameters(loaded)
    assert set(before) == set(after)
    for name, value in before.items():
        assert after[name].dtype == value.dtype, name
        np.testing.assert_array_equal(np.array(after[name]), np.array(value), err_msg=name)
    # Written again from what was loaded: the same published tensors.
    again = published_weights(loaded)
    first = published_weights(model)
    assert set(again) == set(first)
    assert all(mx.array_equal(again[n], first[n]).item() for n in first)


def _mlx_vlm_drafter(directory: Path) -> Any:
    drafters = pytest.importorskip("mlx_vlm.speculative.drafters", reason="mlx-vlm reference")
    drafter, kind = drafters.load_drafter(str(directory))
    assert kind == "dflash"
    assert type(drafter).__name__ == "DeepseekV4DsparkDraftModel"
    return drafter


def _compare_drafts(model: Any, drafter: Any, taps_rounds: list[tuple[mx.array, int]]) -> None:
    """Rounds of (taps of the new positions [1, n, targets * D], anchor): the context
    grows between rounds on both sides; hidden states, base logits and the
    Markov-biased logits of the block agree within 1e-3."""
    head = head_of(model)
    assert head is not None
    block = head.spec.block_size
    noise = head.spec.noise_token
    vlm_cache = drafter.make_cache()
    keys: list[Any] = []
    start = 0
    for taps, anchor in taps_rounds:
        new_keys = head.stage_keys(head.context(taps), start)
        if keys:
            new_keys = [mx.concatenate(p, axis=1) for p in zip(keys, new_keys, strict=True)]
        keys = new_keys
        start += taps.shape[1]
        anchor_ids = mx.array([anchor])
        ours = head.hidden(model, anchor_ids, keys, start)
        inputs = mx.concatenate([anchor_ids[:, None], mx.full((1, block - 1), noise)], axis=1)
        theirs = drafter._hidden(inputs, taps, vlm_cache)
        ours_logits, theirs_logits = model.output_head(ours), drafter._logits(theirs)
        assert ours_logits.shape == theirs_logits.shape == (1, block, model.args.vocab_size)
        assert mx.abs(theirs_logits).max().item() > 0.1  # not a vacuous match
        np.testing.assert_allclose(np.array(ours_logits), np.array(theirs_logits), atol=1e-3)
        previous = mx.concatenate([anchor_ids, mx.argmax(ours_logits[0, :-1], axis=-1)])
        ours_steps = head.step_logits(ours_logits[0], previous)
        theirs_steps = drafter.markov_head.apply_step_logits(theirs_logits[0], previous)
        np.testing.assert_allclose(np.array(ours_steps), np.array(theirs_steps), atol=1e-3)


def _taps(model: Any, tokens: list[int], cache: list[Any]) -> mx.array:
    tapped: list[mx.array] = []
    head = head_of(model)
    assert head is not None
    model.forward_hidden(mx.array([tokens]), cache, taps=head.spec.target_layers, tapped=tapped)
    return mx.concatenate(tapped, axis=-1)


def test_mlx_vlm_drafts_what_mlxserve_drafts(written: tuple[Path, Model, Model]) -> None:
    """mlx-vlm loads the written directory twice (its main model and its drafter); its
    prompt's taps equal mlxserve's, and its drafter's logits mlxserve's head's.

    Only the prompt's taps are compared: mlx-vlm's CSA drops a window's overlap when it
    closes in a later call (docs/deepseek-v4-flash.md), so later taps part by design.
    """
    mlx_vlm_utils = pytest.importorskip("mlx_vlm.utils", reason="mlx-vlm reference")
    directory, _, loaded = written
    drafter = _mlx_vlm_drafter(directory)
    target = mlx_vlm_utils.load_model(directory)
    drafter.bind(target)
    prompt, follow = [5, 17, 42, 8, 60, 3, 33, 25, 9, 51, 2, 70], [25, 9, 51]
    cache = loaded.make_cache()
    rounds = [(_taps(loaded, prompt, cache), 12), (_taps(loaded, follow, cache), 40)]
    from mlx_vlm.models.cache import make_prompt_cache

    lm = target.language_model
    out = lm(mx.array([prompt]), cache=make_prompt_cache(lm), capture_layer_ids=[0, 1, 2])
    theirs = mx.concatenate(out.hidden_states, axis=-1)
    np.testing.assert_allclose(np.array(rounds[0][0]), np.array(theirs), atol=1e-4)
    _compare_drafts(loaded, drafter, rounds)


def test_the_demo_head_written_once_is_read_by_both(tmp_path: Path) -> None:
    """The demo's trained head (``demo-model --dspark``) in the published layout: mlxserve
    reads it back unchanged and mlx-vlm's drafter drafts the same logits from it."""
    from mlxserve.models.demo.dspark import build_dspark_demo

    source, _ = load_model(build_dspark_demo(progress=False), memory_bytes=0)
    directory = write_published(source, tmp_path / "demo-dspark")
    loaded, _ = load_model(directory, memory_bytes=0)
    ours, theirs = head_of(source), head_of(loaded)
    assert ours is not None and theirs is not None and ours.spec == theirs.spec
    before, after = parameters(ours), parameters(theirs)
    assert set(before) == set(after)
    for name, value in before.items():
        np.testing.assert_array_equal(np.array(after[name]), np.array(value), err_msg=name)
    drafter = _mlx_vlm_drafter(directory)
    drafter.bind(loaded)  # its embedding and output head: mlx-vlm cannot build the demo
    cache = loaded.make_cache()
    prompt, follow = [1, 2, 300, 41, 77, 512, 9, 10, 11], [400, 5]
    rounds = [(_taps(loaded, prompt, cache), 600), (_taps(loaded, follow, cache), 33)]
    _compare_drafts(loaded, drafter, rounds)
