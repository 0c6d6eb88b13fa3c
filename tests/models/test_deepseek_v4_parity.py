"""Numerical parity of the MLX DeepSeek-V4 with transformers' PyTorch reference.

Each case builds a tiny random ``DeepseekV4ForCausalLM`` in float32, saves it with
``save_pretrained``, loads it through ``mlxserve.models.loader`` and compares logits for
a full prefill and for a prefill followed by single-token decode steps (against the
reference's full forward on the whole sequence). The cases together cover sliding,
CSA (ratio 4, with the indexer picking a strict subset) and HCA (ratio 128 and a small
ratio) layers, hash and routed MoE layers, ``hc_mult`` 1 and 4, and prompts longer than
the sliding window and the compression ratios.

16 indexer heads keep the indexer scores free of ties (with few heads many ReLU scores
are exactly 0 and the two frameworks break the top-k ties differently).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (CPU) is the numerical reference")
transformers = pytest.importorskip("transformers", reason="transformers holds the reference")
mx = pytest.importorskip("mlx.core")

from mlxserve.models.loader import load, load_model  # noqa: E402

pytestmark = pytest.mark.torch

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"


@dataclass(frozen=True)
class Case:
    name: str
    seed: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    hc_mult: int
    hca_ratio: int
    prompt: int
    decode: int
    extra: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case(
        "hc4_yarn_hca128",
        seed=0,
        layer_types=(SLIDING, CSA, HCA, CSA),
        mlp_layer_types=("hash_moe", "moe", "moe", "moe"),
        hc_mult=4,
        hca_ratio=128,
        prompt=190,
        decode=8,
        extra={
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 16.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
            }
        },
    ),
    Case(
        "hc1_hca16",
        seed=1,
        layer_types=(HCA, CSA, SLIDING),
        mlp_layer_types=("hash_moe", "hash_moe", "moe"),
        hc_mult=1,
        hca_ratio=16,
        prompt=150,
        decode=6,
        extra={"sliding_window": 24, "index_topk": 12},
    ),
    Case(
        "hc4_groups4_hca128",
        seed=2,
        layer_types=(CSA, HCA, SLIDING, HCA),
        mlp_layer_types=("moe", "hash_moe", "moe", "moe"),
        hc_mult=4,
        hca_ratio=128,
        prompt=262,
        decode=6,
        extra={
            "num_attention_heads": 8,
            "o_groups": 4,
            "n_routed_experts": 8,
            "num_experts_per_tok": 3,
            "index_topk": 20,
        },
    ),
]


def _config(case: Case) -> Any:
    kwargs: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": len(case.layer_types),
        "num_attention_heads": 4,
        "head_dim": 32,
        "q_lora_rank": 32,
        "num_experts_per_tok": 2,
        "n_routed_experts": 4,
        "layer_types": list(case.layer_types),
        "mlp_layer_types": list(case.mlp_layer_types),
        "sliding_window": 16,
        "o_groups": 2,
        "o_lora_rank": 16,
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_topk": 8,
        "hc_mult": case.hc_mult,
        "partial_rotary_factor": 0.25,
        "compress_rates": {CSA: 4, HCA: case.hca_ratio},
    }
    kwargs.update(case.extra)
    return transformers.DeepseekV4Config(**kwargs)


def _randomize(model: Any, seed: int) -> None:
    """Give the zero-initialised parts (biases, sinks, ape, tid2eid) real values.

    The default init leaves them at 0 (all hash tokens on expert 0, no sink, flat
    compressor bias), which would hide mistakes in their handling; weights are also
    scaled up so every path moves the logits.
    """
    gen = torch.Generator().manual_seed(seed + 1000)
    cfg = model.config
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in ("position_bias", "sinks", "base")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            elif param.dim() >= 2:
                param.mul_(5.0)
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                rows = [
                    torch.randperm(cfg.n_routed_experts, generator=gen)[: cfg.num_experts_per_tok]
                    for _ in range(cfg.vocab_size)
                ]
                buf.copy_(torch.stack(rows))
            elif name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)


def _save_reference(case: Case, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Save a random reference model to ``path``; return its ids and full logits."""
    torch.manual_seed(case.seed)
    model = transformers.DeepseekV4ForCausalLM(_config(case)).float().eval()
    _randomize(model, case.seed)
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(case.seed + 7)
    ids = torch.randint(0, 256, (1, case.prompt + case.decode), generator=gen)
    with torch.no_grad():
        logits = model(ids).logits[0].numpy()
    return ids.numpy(), logits


@pytest.fixture(scope="module", params=CASES, ids=lambda case: case.name)
def reference(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Case, Path, np.ndarray, np.ndarray]:
    case: Case = request.param
    path = tmp_path_factory.mktemp(case.name)
    ids, logits = _save_reference(case, path)
    return case, path, ids, logits


def _tolerance(ref: np.ndarray) -> float:
    return 1e-4 * max(1.0, float(np.abs(ref).max()))


def test_prefill_matches_reference(reference: tuple[Case, Path, np.ndarray, np.ndarray]) -> None:
    case, path, ids, ref = reference
    model, _ = load_model(path)
    out = np.array(model(mx.array(ids[:, : case.prompt]))[0])
    diff = float(np.abs(out - ref[: case.prompt]).max())
    assert diff <= _tolerance(ref), f"{case.name}: prefill max abs diff {diff}"


def test_cached_decode_matches_reference(
    reference: tuple[Case, Path, np.ndarray, np.ndarray],
) -> None:
    case, path, ids, ref = reference
    model, _ = load_model(path)
    cache = model.make_cache()
    steps = [np.array(model(mx.array(ids[:, : case.prompt]), cache)[0])]
    for t in range(case.prompt, case.prompt + case.decode):
        steps.append(np.array(model(mx.array(ids[:, t : t + 1]), cache)[0]))
    out = np.concatenate(steps, axis=0)
    diff = float(np.abs(out - ref).max())
    assert diff <= _tolerance(ref), f"{case.name}: prefill + decode max abs diff {diff}"


def test_chunked_prefill_and_rollback(
    reference: tuple[Case, Path, np.ndarray, np.ndarray],
) -> None:
    """Uneven prefill chunks, then a rollback of 3 decode steps, still match."""
    case, path, ids, ref = reference
    model, _ = load_model(path)
    cache = model.make_cache(max_rollback=3)
    total = case.prompt + case.decode
    steps, pos = [], 0
    for size in (5, 1, 37, 2, case.prompt - 45):
        steps.append(np.array(model(mx.array(ids[:, pos : pos + size]), cache)[0]))
        pos += size
    for t in range(pos, pos + 3):
        model(mx.array(ids[:, t : t + 1]), cache)
    assert all(layer.trim(3) == 3 for layer in cache)
    for t in range(pos, total):
        steps.append(np.array(model(mx.array(ids[:, t : t + 1]), cache)[0]))
    diff = float(np.abs(np.concatenate(steps, axis=0) - ref).max())
    assert diff <= _tolerance(ref), f"{case.name}: chunked + rollback max abs diff {diff}"


def test_load_with_tokenizer(tmp_path: Path) -> None:
    """``load`` returns mlx_lm's tokenizer wrapper next to the DeepSeek-V4 model."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    case = Case(
        "tokenizer",
        seed=3,
        layer_types=(SLIDING, CSA),
        mlp_layer_types=("hash_moe", "moe"),
        hc_mult=2,
        hca_ratio=128,
        prompt=40,
        decode=0,
    )
    ids, ref = _save_reference(case, tmp_path)
    vocab = {f"t{i}": i for i in range(256)}
    raw = Tokenizer(WordLevel(vocab, unk_token="t2"))
    raw.pre_tokenizer = Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="t0", eos_token="t1", unk_token="t2"
    )
    fast.save_pretrained(tmp_path)
    model, tokenizer = load(tmp_path)
    assert tokenizer.encode("t5 t7", add_special_tokens=False) == [5, 7]
    assert tokenizer.eos_token_id == 1
    out = np.array(model(mx.array(ids))[0])
    assert float(np.abs(out - ref).max()) <= _tolerance(ref)
