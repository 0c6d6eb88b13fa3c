"""The built-in demo model: deterministic build, loading, chat template, generation, MTP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")

from mlx_lm.models.switch_layers import QuantizedSwitchLinear  # noqa: E402

from mlxserve.models import load  # noqa: E402
from mlxserve.models.demo import build  # noqa: E402
from mlxserve.models.demo.spec import ASSISTANT, END, USER  # noqa: E402
from training.demo.corpus import Sample, split  # noqa: E402
from training.demo.evaluate import (  # noqa: E402
    encode,
    eval_samples,
    greedy_continue,
    heldout_acceptance,
    heldout_distinct_ngrams,
    prompt_text,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build.build_demo_model(tmp_path_factory.mktemp("demo") / "ckpt", progress=False)


@pytest.fixture(scope="module")
def loaded(built: Path) -> tuple[Any, Any]:
    return load(built)


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_build_is_deterministic_and_reused(built: Path, tmp_path: Path) -> None:
    again = build.build_demo_model(tmp_path / "other", progress=False)
    assert _files(again) == _files(built)
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert build.build_demo_model(again, progress=False) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_default_location_uses_cache_dir_and_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLXSERVE_CACHE_DIR", str(tmp_path))
    path = build.build_demo_model(progress=False)
    assert path == tmp_path / f"demo-{build.content_hash()[:12]}"
    assert (path / build.MARKER).is_file()
    # load("demo") resolves the built-in source lazily and reuses that build.
    model, tokenizer = load("demo")
    assert model.num_mtp_blocks == 1 and tokenizer.eos_token == END
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_loads_quantized_with_mtp(loaded: tuple[Any, Any], built: Path) -> None:
    model, _ = loaded
    config = json.loads((built / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert model.num_mtp_blocks == 1
    for block in [*model.layers, *model.mtp]:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            layer = getattr(block.ffn.switch_mlp, proj)
            assert isinstance(layer, QuantizedSwitchLinear)
            assert (layer.group_size, layer.bits) == (32, 4)
    # Only the experts are quantised.
    assert type(model.layers[0].attn.wq_a).__name__ == "Linear"


def test_chat_template_and_eos(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    messages = [{"role": "user", "content": "Python reference: assert"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == f"{USER}Python reference: assert{END}{ASSISTANT}"
    sample = Sample("assert", "x")
    rendered = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": sample.prompt},
            {"role": "assistant", "content": sample.text},
        ],
        tokenize=False,
    )
    assert rendered == sample.render()
    assert tokenizer.eos_token == END
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids(END)}
    ids = encode(tokenizer, text)
    assert ids[0] == tokenizer.convert_tokens_to_ids(USER) and len(set(ids)) > 3


def test_greedy_generation_is_text_and_stops_at_eos(loaded: tuple[Any, Any]) -> None:
    from mlx_lm import generate

    model, tokenizer = loaded
    sample = eval_samples(split()[1], 4)[1]
    prompt = encode(tokenizer, prompt_text(sample))
    new = greedy_continue(model, prompt, 20, tokenizer.eos_token_id)
    text = tokenizer.decode(new)
    assert text.strip() and all(c.isprintable() or c in "\n\t" for c in text), text
    assert sum(c.isalpha() for c in text) >= len(text) // 3, text
    # mlx_lm's generate stops at the EOS: a short exchange ends well before the limit.
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Python reference: pass"}], add_generation_prompt=True
    )
    out = generate(model, tokenizer, chat, max_tokens=400)
    assert END not in out


def test_mtp_acceptance_on_heldout(loaded: tuple[Any, Any]) -> None:
    """The issue's target: depth-1 greedy acceptance >= 0.6 on held-out prompts.

    The shipped weights measure 0.727 on 48 held-out prompts (weights/training.json);
    this checks 12 of them (0.77 over 328 drafts), and that the main model has not
    bought its acceptance by collapsing into loops (distinct 4-grams 0.96 before the
    agreement phase, 0.88 after).
    """
    model, tokenizer = loaded
    samples = eval_samples(split()[1], 12)
    result = heldout_acceptance(model, tokenizer, samples, max_new=32)
    assert result.trials[0] >= 300
    assert result.rates[0] >= 0.6, result
    assert heldout_distinct_ngrams(model, tokenizer, samples[::2]) >= 0.8
