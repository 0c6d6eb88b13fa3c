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


@pytest.fixture
def llama_model() -> Module:
    return tiny_llama()
