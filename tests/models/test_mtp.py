"""DeepSeek-V4 MTP forward against an independent torch reference.

The checkpoint is a tiny random ``transformers`` DeepSeek-V4 saved with
``save_pretrained`` plus ``mtp.0.*`` tensors: the MTP block's decoder layer comes from
a second (one sliding layer) ``transformers`` model saved the same way, so its tensor
names are the real checkpoint names; ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``,
``norm`` and ``hc_head_*`` are random tensors made here. The reference runs that
``transformers`` decoder layer and writes the rest of the MTP equations by hand, and
recomputes every draft step from scratch over the whole sequence (no cache).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (CPU) is the numerical reference")
transformers = pytest.importorskip("transformers", reason="transformers holds the reference")
mx = pytest.importorskip("mlx.core")

from safetensors.torch import load_file, save_file  # noqa: E402

from mlxserve.models.deepseek_v4.mtp import greedy_draft  # noqa: E402
from mlxserve.models.loader import load_model  # noqa: E402

pytestmark = pytest.mark.torch

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
VOCAB, HIDDEN, HC, WINDOW = 256, 64, 2, 8
PROMPT = 21  # longer than the sliding window, and past a few CSA windows


def _config(layer_types: list[str], mlp_types: list[str]) -> Any:
    return transformers.DeepseekV4Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        moe_intermediate_size=32,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=32,
        num_experts_per_tok=2,
        n_routed_experts=4,
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        sliding_window=WINDOW,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=16,
        index_head_dim=16,
        index_topk=3,
        hc_mult=HC,
        partial_rotary_factor=0.25,
        compress_rates={CSA: 4, "heavily_compressed_attention": 16},
    )


def _randomized(config: Any, seed: int) -> Any:
    """A float32 eval model whose zero-initialised parts get real values too."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in ("position_bias", "sinks", "base")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            elif param.dim() >= 2:
                param.mul_(5.0)
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                rows = [torch.randperm(4, generator=gen)[:2] for _ in range(VOCAB)]
                buf.copy_(torch.stack(rows))
            elif name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
    return model


class Reference:
    """The main model and the MTP equations in torch (float32, no cache)."""

    def __init__(self, path: Path, main_only: Path) -> None:
        self.main = _randomized(_config([SLIDING, CSA], ["hash_moe", "moe"]), seed=0)
        self.main.save_pretrained(main_only)
        self.main.save_pretrained(path)
        block_model = _randomized(_config([SLIDING], ["moe"]), seed=1)
        self.layer = block_model.model.layers[0]
        self.rotary = block_model.model.rotary_emb
        block_model.save_pretrained(path / "block")
        gen = torch.Generator().manual_seed(2)
        self.extra = {
            "e_proj.weight": torch.randn(HIDDEN, HIDDEN, generator=gen) * HIDDEN**-0.5,
            "h_proj.weight": torch.randn(HIDDEN, HIDDEN, generator=gen) * HIDDEN**-0.5,
            "enorm.weight": 1.0 + 0.3 * torch.randn(HIDDEN, generator=gen),
            "hnorm.weight": 1.0 + 0.3 * torch.randn(HIDDEN, generator=gen),
            "norm.weight": 1.0 + 0.3 * torch.randn(HIDDEN, generator=gen),
            "hc_head_fn": torch.randn(HC, HC * HIDDEN, generator=gen),
            "hc_head_base": torch.randn(HC, generator=gen) * 0.5,
            "hc_head_scale": torch.rand(1, generator=gen) + 0.5,
        }
        tensors = load_file(path / "model.safetensors")
        for key, value in load_file(path / "block" / "model.safetensors").items():
            if key.startswith("model.layers.0."):
                tensors["mtp.0." + key.removeprefix("model.layers.0.")] = value
        tensors.update({f"mtp.0.{k}": v.contiguous() for k, v in self.extra.items()})
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})

    def streams(self, ids: np.ndarray) -> torch.Tensor:
        """Main-model residual streams before ``hc_head`` [1, S, hc, D]."""
        captured: list[torch.Tensor] = []
        hook = self.main.model.hc_head.register_forward_hook(
            lambda _m, args, _out: captured.append(args[0])
        )
        with torch.no_grad():
            self.main(torch.from_numpy(ids))
        hook.remove()
        return captured[0]

    def main_logits(self, ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.main(torch.from_numpy(ids)).logits[0].numpy()

    @staticmethod
    def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return x if weight is None else x * weight

    def mtp(self, streams: torch.Tensor, tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [1, S, V] and out streams for positions 0..S-1 (whole sequence at once)."""
        length = tokens.shape[1]
        ids = torch.from_numpy(tokens)
        with torch.no_grad():
            e = self.main.model.embed_tokens(ids)
            e[:, 0] = 0.0  # absolute position 0
            e = self._rms(e, self.extra["enorm.weight"]) @ self.extra["e_proj.weight"].T
            h = self._rms(streams, self.extra["hnorm.weight"]) @ self.extra["h_proj.weight"].T
            x = h + e[:, :, None, :]
            positions = torch.arange(length)[None]
            embeddings = {
                kind: self.rotary(x, position_ids=positions, layer_type=kind)
                for kind in ("main", "compress")
            }
            q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
            allowed = (k <= q) & (q - k < WINDOW)
            mask = torch.where(allowed, 0.0, float("-inf"))[None, None]
            out = self.layer(
                x,
                input_ids=ids,
                position_embeddings=embeddings,
                position_ids=positions,
                attention_mask=mask,
            )
            flat = self._rms(out.flatten(2), None)
            mix = flat @ self.extra["hc_head_fn"].T
            pre = torch.sigmoid(mix * self.extra["hc_head_scale"] + self.extra["hc_head_base"])
            y = ((pre + 1e-6)[..., None] * out).sum(dim=2)
            logits = self._rms(y, self.extra["norm.weight"]) @ self.main.lm_head.weight.T
        return logits, out


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Reference, np.ndarray, Path]:
    path = tmp_path_factory.mktemp("mtp")
    main_only = tmp_path_factory.mktemp("main_only")
    ref = Reference(path, main_only)
    model, _ = load_model(path)
    ids = np.random.default_rng(3).integers(0, VOCAB, size=(1, PROMPT)).astype(np.int64)
    return model, ref, ids, main_only


def _close(out: np.ndarray, ref: np.ndarray, what: str) -> None:
    tol = 1e-4 * max(1.0, float(np.abs(ref).max()))
    diff = float(np.abs(out - ref).max())
    assert diff <= tol, f"{what}: max abs diff {diff} > {tol}"


def test_mtp_weights_load_and_shapes(setup: tuple[Any, Reference, np.ndarray, Path]) -> None:
    model, ref, ids, main_only = setup
    assert model.num_mtp_blocks == 1
    block = model.mtp[0]
    assert np.array_equal(np.array(block.e_proj.weight), ref.extra["e_proj.weight"].numpy())
    assert np.array_equal(np.array(block.hc_head.hc_fn), ref.extra["hc_head_fn"].numpy())
    wq_a = ref.layer.self_attn.q_a_proj.weight.detach().numpy()
    assert np.array_equal(np.array(block.attn.wq_a.weight), wq_a)
    assert block.attn.layer_type == SLIDING

    caches = model.make_mtp_cache(max_rollback=2)
    assert len(caches) == 1 and caches[0].is_trimmable()
    streams = model.forward_hidden(mx.array(ids))
    assert streams.shape == (1, PROMPT, HC, HIDDEN)
    logits, out = model.mtp_forward(streams[:, :-1], mx.array(ids[:, 1:]), caches[0])
    assert logits.shape == (1, PROMPT - 1, VOCAB)
    assert out.shape == (1, PROMPT - 1, HC, HIDDEN)
    assert caches[0].offset == PROMPT - 1

    plain, _ = load_model(main_only)
    assert plain.num_mtp_blocks == 0 and plain.make_mtp_cache() == []


def test_depth1_matches_reference(setup: tuple[Any, Reference, np.ndarray, Path]) -> None:
    model, ref, ids, _ = setup
    ref_streams = ref.streams(ids)
    streams = model.forward_hidden(mx.array(ids))
    _close(np.array(streams), ref_streams.numpy(), "main streams")

    cache = model.make_mtp_cache()[0]
    logits, out = model.mtp_forward(streams[:, :-1], mx.array(ids[:, 1:]), cache)
    ref_logits, ref_out = ref.mtp(ref_streams[:, :-1], ids[:, 1:])
    _close(np.array(logits), ref_logits.numpy(), "depth-1 logits")
    _close(np.array(out), ref_out.numpy(), "depth-1 out streams")
    drafts = np.array(mx.argmax(logits, axis=-1))
    assert np.array_equal(drafts, ref_logits.argmax(-1).numpy())


def test_depth3_chained_matches_reference(setup: tuple[Any, Reference, np.ndarray, Path]) -> None:
    """Draft 3 tokens past the prompt + the main model's greedy token, feeding each step
    the block's own out streams and greedy token."""
    model, ref, ids, _ = setup
    greedy = int(ref.main_logits(ids)[-1].argmax())
    streams = model.forward_hidden(mx.array(ids))
    assert int(mx.argmax(model.head_from_streams(streams)[0, -1]).item()) == greedy
    tokens = np.concatenate([ids[:, 1:], [[greedy]]], axis=1)  # token t+1 for t < PROMPT

    # Reference: recompute the whole MTP sequence from scratch at every depth.
    ref_streams, ref_tokens = ref.streams(ids), tokens
    ref_drafts, ref_last_logits = [], []
    for _ in range(3):
        logits, out = ref.mtp(ref_streams, ref_tokens)
        draft = int(logits[0, -1].argmax())
        ref_drafts.append(draft)
        ref_last_logits.append(logits[0, -1].numpy())
        ref_streams = torch.cat([ref_streams, out[:, -1:]], dim=1)
        ref_tokens = np.concatenate([ref_tokens, [[draft]]], axis=1)

    # MLX: teacher-forced prefill of positions < PROMPT - 1, then cached steps.
    caches = model.make_mtp_cache(max_rollback=3)
    model.mtp_forward(streams[:, :-1], mx.array(tokens[:, :-1]), caches[0])
    step_streams, step_token = streams[:, -1:], mx.array(tokens[:, -1:])
    for depth in range(3):
        logits, step_streams = model.mtp_forward(step_streams, step_token, caches[0])
        _close(np.array(logits[0, -1]), ref_last_logits[depth], f"depth-{depth + 1} logits")
        step_token = mx.argmax(logits, axis=-1)
        assert int(step_token.item()) == ref_drafts[depth]

    # The helper gives the same chain, and the drafted rows can be rolled back.
    assert caches[0].trim(3) == 3
    drafts = greedy_draft(model, streams[:, -1:], mx.array(tokens[:, -1:]), caches, depth=3)
    assert [int(d.item()) for d in drafts] == ref_drafts
    assert caches[0].offset == PROMPT + 2


@pytest.mark.parametrize("chunks", [(1,) * (PROMPT - 1), (5, 1, 3, PROMPT - 10)])
def test_teacher_forcing_equals_cached_steps(
    setup: tuple[Any, Reference, np.ndarray, Path], chunks: tuple[int, ...]
) -> None:
    model, _, ids, _ = setup
    streams = model.forward_hidden(mx.array(ids))[:, :-1]
    tokens = mx.array(ids[:, 1:])
    full_logits, full_out = model.mtp_forward(streams, tokens, model.make_mtp_cache()[0])

    cache = model.make_mtp_cache()[0]
    parts, outs, pos = [], [], 0
    for size in chunks:
        logits, out = model.mtp_forward(
            streams[:, pos : pos + size], tokens[:, pos : pos + size], cache
        )
        parts.append(np.array(logits))
        outs.append(np.array(out))
        pos += size
    _close(np.concatenate(parts, axis=1), np.array(full_logits), "stepwise logits")
    _close(np.concatenate(outs, axis=1), np.array(full_out), "stepwise out streams")


def test_position_zero_embedding_is_masked(
    setup: tuple[Any, Reference, np.ndarray, Path],
) -> None:
    """At absolute position 0 the next token does not matter; later it does."""
    model, _, ids, _ = setup
    streams = model.forward_hidden(mx.array(ids))[:, :2]
    a = mx.array([[3, 4]])
    b = mx.array([[9, 4]])
    la, _ = model.mtp_forward(streams, a, model.make_mtp_cache()[0])
    lb, _ = model.mtp_forward(streams, b, model.make_mtp_cache()[0])
    assert np.array_equal(np.array(la[:, 0]), np.array(lb[:, 0]))
    c = mx.array([[3, 9]])
    lc, _ = model.mtp_forward(streams, c, model.make_mtp_cache()[0])
    assert not np.allclose(np.array(la[:, 1]), np.array(lc[:, 1]))

    with pytest.raises(IndexError):
        model.mtp_forward(streams, a, model.make_mtp_cache()[0], block=1)
