"""Phases 3 and 4 of the demo's training, on the main model's own greedy text.

Speculative decoding accepts a draft when it equals the main model's greedy token, so
what counts is agreement between two predictors of token ``t + 2``: the main model at
``t + 1`` and the MTP block at ``t``. On held-out prompts the tiny main model is often
unsure (top-1 probability 0.1-0.4), and its argmax between near-equal candidates is what
the block misses. Both phases train on ``onpolicy.greedy_sequences`` of training-split
prompts, the kind of text decoding produces.

* Phase 3, ``agree``: main model and MTP block together, on the continuation
  positions of the sequences. The block learns the main model's choice for ``t + 2``
  (``distill_loss``); that loss also reaches the main model through the streams the
  block reads, as in DeepSeek's joint MTP training. The main model learns the block's
  choice, with weight ``--agree-weight``, at every continuation position: where they
  differ this settles near-ties towards what the block predicts; where they agree it
  sharpens the main model. It keeps its next-token cross-entropy on corpus windows so
  its text stays the corpus's. A large weight collapses the main model into loops that
  are trivially predictable (acceptance 0.99 with "They.  They.  They."); weight 0.1
  left distinct 4-grams in held-out continuations at 0.88 (0.96 before), and the main
  model's corpus cross-entropy about where it was (``training.json``).
* Phase 4, ``distill_onpolicy``: only the MTP block, towards the main model *as
  shipped* (``onpolicy.deployed_main``: float16, 4-bit experts), whose greedy tokens
  are the ones measured, on sequences decoded again after phase 3, over every
  position (the prompt positions are training-split corpus text).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.nn.losses import cross_entropy
from mlx.nn.utils import value_and_grad

from mlxserve.models.deepseek_v4 import Model

from . import onpolicy
from .corpus import Sample
from .schedule import lr_at, scalar, train_all, train_only_mtp


def log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def distill_loss(draft_logits: mx.array, target_logits: mx.array, soft: float) -> mx.array:
    """Per-position loss of a draft towards a target's choice (no gradient to the target).

    ``1 - soft`` of it is cross-entropy to the target's argmax, ``soft`` of it to its
    whole distribution (the KL divergence up to a constant), which also teaches the
    order of the runners-up that decide near-ties.
    """
    target_logp = mx.stop_gradient(log_softmax(target_logits))
    greedy = mx.argmax(target_logp, axis=-1)
    logp = log_softmax(draft_logits)
    hard = -mx.take_along_axis(logp, greedy[..., None], axis=-1)[..., 0]
    dense = -(mx.exp(target_logp) * logp).sum(axis=-1)
    return (1 - soft) * hard + soft * dense


def _sequences(
    model: Model, tokenizer: Any, train: list[Sample], opts: argparse.Namespace
) -> tuple[Model, onpolicy.Sequences, list[int], float]:
    """The shipped main model's greedy continuations of training prompts (and the time)."""
    started = time.time()
    chars = [int(c) for c in opts.onpolicy_chars.split(",")]
    teacher = onpolicy.deployed_main(model)
    prompts = onpolicy.training_prompts(tokenizer, train, chars, opts.onpolicy_length - 16)
    data = onpolicy.greedy_sequences(teacher, prompts, opts.onpolicy_length)
    seconds = time.time() - started
    print(f"on-policy: {data.tokens.shape[0]} sequences in {seconds:.0f}s", flush=True)
    return teacher, data, chars, seconds


def agree(
    model: Model,
    tokenizer: Any,
    train: list[Sample],
    train_ids: np.ndarray,
    opts: argparse.Namespace,
) -> dict[str, Any] | None:
    """Phase 3: main model and MTP block trained towards each other's choices."""
    if opts.agree_steps <= 0:
        return None
    started = time.time()
    _, data, chars, generate_seconds = _sequences(model, tokenizer, train, opts)
    mask = data.continuation_mask(offset=2)
    train_all(model)
    soft, weight, span = opts.onpolicy_soft, opts.agree_weight, opts.length + 1

    def parts(m: Model, ids: mx.array, keep: mx.array, corpus_ids: mx.array) -> list[mx.array]:
        streams = m.forward_hidden(ids)
        main_logits = m.head_from_streams(streams)[:, 1:-1]  # token t + 2, from t + 1
        draft_logits, _ = m.mtp_forward(streams[:, :-1], ids[:, 1:], m.make_mtp_cache()[0])
        draft_logits = draft_logits[:, :-1]  # token t + 2, from t
        count = keep.sum() + 1e-6
        to_main = (distill_loss(draft_logits, main_logits, soft) * keep).sum() / count
        to_draft = (distill_loss(main_logits, draft_logits, 0.0) * keep).sum() / count
        corpus_streams = m.forward_hidden(corpus_ids[:, :-1])
        corpus_ce = cross_entropy(m.head_from_streams(corpus_streams), corpus_ids[:, 1:]).mean()
        return [to_main, to_draft, corpus_ce]

    def loss_fn(m: Model, ids: mx.array, keep: mx.array, corpus_ids: mx.array) -> mx.array:
        to_main, to_draft, corpus_ce = parts(m, ids, keep, corpus_ids)
        total: mx.array = to_main + weight * to_draft + corpus_ce
        return total

    grad_fn = value_and_grad(model, loss_fn)
    optimizer = optim.AdamW(learning_rate=opts.agree_lr, weight_decay=0.01)
    rng = np.random.default_rng(opts.seed + 3)
    history: list[dict[str, Any]] = []
    for step in range(opts.agree_steps):
        rows = rng.integers(0, data.tokens.shape[0], size=opts.onpolicy_batch)
        starts = rng.integers(0, train_ids.size - span, size=opts.agree_corpus_batch)
        corpus_ids = mx.array(np.stack([train_ids[s : s + span] for s in starts]))
        ids, keep = mx.array(data.tokens[rows]), mx.array(mask[rows])
        optimizer.learning_rate = lr_at(step, opts.agree_steps, opts.agree_lr, warmup=20)
        loss, grads = grad_fn(model, ids, keep, corpus_ids)
        optimizer.update(model, grads)
        mx.eval(model.trainable_parameters(), optimizer.state, loss)  # type: ignore[no-untyped-call]
        if step % 50 == 0 or step == opts.agree_steps - 1:
            values = [round(scalar(v), 4) for v in parts(model, ids, keep, corpus_ids)]
            print(f"agree {step} mtp/main/corpus {values} {time.time() - started:.0f}s", flush=True)
            history.append({"step": step, "mtp": values[0], "main": values[1], "corpus": values[2]})
    return {
        "steps": opts.agree_steps,
        "lr": opts.agree_lr,
        "agree_weight": weight,
        "batch": opts.onpolicy_batch,
        "corpus_batch": opts.agree_corpus_batch,
        "sequence_length": opts.onpolicy_length,
        "answer_chars": chars,
        "soft_weight": soft,
        "sequences": int(data.tokens.shape[0]),
        "generate_seconds": round(generate_seconds, 1),
        "seconds": round(time.time() - started, 1),
        "history": history,
    }


def distill_onpolicy(
    model: Model, tokenizer: Any, train: list[Sample], opts: argparse.Namespace
) -> dict[str, Any] | None:
    """Phase 4: only the MTP block, towards the shipped main model's choices."""
    if opts.onpolicy_steps <= 0:
        return None
    started = time.time()
    teacher, data, chars, generate_seconds = _sequences(model, tokenizer, train, opts)
    train_only_mtp(model)
    soft = opts.onpolicy_soft

    def loss_fn(m: Model, streams: mx.array, ids: mx.array) -> mx.array:
        target_logits = teacher.head_from_streams(streams[:, 1:])
        draft_logits, _ = m.mtp_forward(streams[:, :-1], ids[:, 1:], m.make_mtp_cache()[0])
        loss: mx.array = distill_loss(draft_logits, target_logits, soft).mean()
        return loss

    grad_fn = value_and_grad(model, loss_fn)
    optimizer = optim.AdamW(learning_rate=opts.onpolicy_lr, weight_decay=0.01)
    rng = np.random.default_rng(opts.seed + 2)
    history: list[dict[str, float]] = []
    steps = opts.onpolicy_steps
    for step in range(steps):
        rows = rng.integers(0, data.tokens.shape[0], size=opts.onpolicy_batch)
        optimizer.learning_rate = lr_at(step, steps, opts.onpolicy_lr, warmup=20)
        loss, grads = grad_fn(model, mx.array(data.streams[rows]), mx.array(data.tokens[rows]))
        optimizer.update(model, grads)
        mx.eval(model.trainable_parameters(), optimizer.state, loss)  # type: ignore[no-untyped-call]
        if step % 100 == 0 or step == steps - 1:
            value = scalar(loss)
            print(f"on-policy {step} loss {value:.4f} {time.time() - started:.0f}s", flush=True)
            history.append({"step": step, "loss": value})
    train_all(model)
    return {
        "steps": steps,
        "lr": opts.onpolicy_lr,
        "batch": opts.onpolicy_batch,
        "sequence_length": opts.onpolicy_length,
        "answer_chars": chars,
        "soft_weight": soft,
        "sequences": int(data.tokens.shape[0]),
        "tokens": int(data.tokens.size),
        "generate_seconds": round(generate_seconds, 1),
        "seconds": round(time.time() - started, 1),
        "history": history,
    }
