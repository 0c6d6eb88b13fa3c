"""Tiny random mlx-lm models, built offline, for engine tests."""

import mlx.core as mx
import pytest
from mlx.nn.layers.base import Module


def tiny_llama(seed: int = 0, vocab: int = 97) -> Module:
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_sliding_gemma(window: int) -> Module:
    """A two-layer gemma3: one sliding-window layer (a rotating cache of ``window``), one
    global."""
    from mlx_lm.models import gemma3_text

    mx.random.seed(3)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=2,
        head_dim=16,
        vocab_size=97,
        num_key_value_heads=1,
        query_pre_attn_scalar=16,
        sliding_window=window,
        sliding_window_pattern=2,
    )
    model = gemma3_text.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.fixture
def llama_model() -> Module:
    return tiny_llama()
