"""The demo's DSpark head (a -0731-style draft head), trained like its MTP head's last phase.

As for the MTP block (``finetune.distill_onpolicy``), the head learns the shipped main
model's greedy text: a draft is kept when it equals the main model's greedy token. The
main model is the demo as built (float32, 4-bit experts) and stays frozen; the data are
its greedy continuations of training-split prompts (``onpolicy.training_prompts``), with
the taps it gives at every position (the layers the head reads).

Each training row is one anchor position n of a sequence: the context rows are the taps
of the ``sliding_window`` positions before n (padded and masked at the start), the block
is [x_n, noise...], and the targets are the greedy tokens x_{n+1} .. x_{n+block}. The
loss is the cross-entropy of each draft's logits (base plus the Markov bias of the true
token before it, teacher forcing) plus the confidence head's binary cross-entropy
against whether that draft's argmax is the target (the event it predicts).

The stage starts from the demo's MTP block (same shapes: a sliding-attention MoE block),
its ``hc_head`` and ``norm`` too; ``main_proj``, the Markov and confidence heads from
scratch. Minutes on a 2-core CPU. Output: ``weights/dspark.fp16.safetensors`` (the head
in mlxserve's names) and ``weights/dspark.json`` (its config keys and the training
record).

Run: python -m training.demo.dspark [--steps 150] [--out mlxserve/models/demo/weights]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.nn.losses import binary_cross_entropy, cross_entropy
from mlx.nn.utils import value_and_grad
from mlx.utils import tree_unflatten

from mlxserve.models.deepseek_v4 import Model
from mlxserve.models.deepseek_v4.dspark import DSparkHead, DSparkSpec
from mlxserve.models.demo.build import flat_parameters
from mlxserve.models.demo.dspark import DSPARK_CONFIG, DSPARK_WEIGHTS, head_spec

from . import corpus, onpolicy
from .schedule import lr_at, scalar


def tapped_sequences(
    teacher: Model, prompts: list[list[int]], length: int, taps: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy continuations to ``length`` tokens: tokens [N, L], taps [N, L, targets * D]
    and prompt lengths [N] (prompts of one length decode together)."""
    by_length: dict[int, list[list[int]]] = {}
    for ids in prompts:
        if 0 < len(ids) < length:
            by_length.setdefault(len(ids), []).append(ids)
    tokens_out, taps_out, lengths_out = [], [], []
    for size, group in sorted(by_length.items()):
        tokens = mx.array(group)
        cache = teacher.make_cache()
        tapped: list[mx.array] = []
        hidden = teacher.forward_hidden(tokens, cache, taps=taps, tapped=tapped)
        token_parts, tap_parts = [tokens], [mx.concatenate(tapped, axis=-1)]
        for _ in range(length - size):
            tokens = mx.argmax(teacher.head_from_streams(hidden[:, -1:]), axis=-1)
            tapped = []
            hidden = teacher.forward_hidden(tokens, cache, taps=taps, tapped=tapped)
            token_parts.append(tokens)
            tap_parts.append(mx.concatenate(tapped, axis=-1))
        all_tokens, all_taps = mx.concatenate(token_parts, 1), mx.concatenate(tap_parts, 1)
        mx.eval(all_tokens, all_taps)
        tokens_out.append(np.asarray(all_tokens, dtype=np.int32))
        taps_out.append(np.asarray(all_taps, dtype=np.float32))
        lengths_out.append(np.full(len(group), size, dtype=np.int32))
    return np.concatenate(tokens_out), np.concatenate(taps_out), np.concatenate(lengths_out)


def anchor_rows(tokens: np.ndarray, prompt_lengths: np.ndarray, block: int) -> np.ndarray:
    """(sequence, n) of every anchor whose block lies inside its sequence, from the
    prompt's last token on (the positions decoding drafts from)."""
    rows = []
    for index, start in enumerate(prompt_lengths):
        for n in range(int(start) - 1, tokens.shape[1] - block):
            rows.append((index, n))
    return np.array(rows, dtype=np.int32)


def batch_arrays(
    tokens: np.ndarray, taps: np.ndarray, picks: np.ndarray, window: int, block: int
) -> tuple[mx.array, ...]:
    """Anchors [A], context taps [A, W, T], visible [A, W], starts [A], targets [A, block]
    and the tokens before each target [A, block]."""
    width = taps.shape[-1]
    context = np.zeros((len(picks), window, width), dtype=np.float32)
    visible = np.zeros((len(picks), window), dtype=bool)
    for row, (index, n) in enumerate(picks):
        first = max(0, n - window)
        context[row, window - (n - first) :] = taps[index, first:n]
        visible[row, window - (n - first) :] = True
    seq, n = picks[:, 0], picks[:, 1]
    anchors = tokens[seq, n]
    offsets = n[:, None] + np.arange(block + 1)[None, :]
    following = tokens[seq[:, None], offsets]
    return (
        mx.array(anchors),
        mx.array(context),
        mx.array(visible),
        mx.array(n),
        mx.array(following[:, 1:]),
        mx.array(following[:, :-1]),
    )


def block_losses(
    head: DSparkHead, teacher: Model, arrays: tuple[mx.array, ...], window: int
) -> tuple[mx.array, mx.array, mx.array]:
    """(draft cross-entropy, confidence BCE, share of drafts right) over a batch."""
    anchors, context, visible, starts, targets, previous = arrays
    keys = head.stage_keys(head.context(context), starts - window)
    hidden = head.hidden(teacher, anchors, keys, starts, visible)
    logits = head.step_logits(teacher.output_head(hidden), previous)
    ce = cross_entropy(logits, targets).mean()
    right = mx.stop_gradient((mx.argmax(logits, axis=-1) == targets).astype(mx.float32))
    confidence = head.confidence(hidden, previous)
    bce = binary_cross_entropy(mx.clip(confidence, 1e-6, 1 - 1e-6), right, with_logits=False)
    return ce, bce.mean(), right.mean()


def initial_head(teacher: Model, spec: DSparkSpec, mtp_weights: dict[str, mx.array]) -> DSparkHead:
    """A head whose stage, ``hc_head`` and ``norm`` start as the demo's MTP block."""
    head = DSparkHead(teacher.args, spec)
    mx.random.seed(0)
    params = dict(flat_parameters(head))
    for name in list(params):
        if name.startswith("stages.0."):
            source = "mtp.0." + name.removeprefix("stages.0.")
        elif name.startswith(("hc_head.", "norm.")):
            source = "mtp.0." + name
        else:
            continue
        if source in mtp_weights:
            params[name] = mtp_weights[source].astype(mx.float32)
    params["markov_head.markov_w2.weight"] = mx.zeros_like(params["markov_head.markov_w2.weight"])
    head.update(tree_unflatten(list(params.items())))
    return head


def train(opts: argparse.Namespace) -> dict[str, Any]:
    from mlxserve.models.demo.build import WEIGHTS_DIR, load_demo

    started = time.time()
    teacher, tokenizer = load_demo()
    teacher.freeze()
    spec = head_spec()
    shipped = mx.load(str(WEIGHTS_DIR / "model.fp16.safetensors"))
    assert isinstance(shipped, dict)
    head = initial_head(teacher, spec, {k: v for k, v in shipped.items() if k.startswith("mtp.")})
    train_samples, heldout_samples = corpus.split()
    prompts = onpolicy.training_prompts(tokenizer, train_samples, [0, 40, 120], opts.length // 2)
    prompts = [prompts[i] for i in np.random.default_rng(opts.seed).permutation(len(prompts))]
    prompts = prompts[: opts.prompts]
    tokens, taps, lengths = tapped_sequences(teacher, prompts, opts.length, spec.target_layers)
    window = teacher.args.sliding_window
    anchors = anchor_rows(tokens, lengths, spec.block_size)
    held_prompts = onpolicy.training_prompts(tokenizer, heldout_samples, [0, 60], opts.length // 2)
    held = tapped_sequences(teacher, held_prompts[:64], opts.length, spec.target_layers)
    held_anchors = anchor_rows(held[0], held[2], spec.block_size)
    rng = np.random.default_rng(opts.seed)
    held_pick = held_anchors[rng.choice(len(held_anchors), size=512, replace=False)]
    held_batch = batch_arrays(held[0], held[1], held_pick, window, spec.block_size)
    generated = time.time() - started

    def loss_fn(model: DSparkHead, *arrays: mx.array) -> mx.array:
        ce, bce, _ = block_losses(model, teacher, arrays, window)
        total: mx.array = ce + opts.confidence_weight * bce
        return total

    grad_fn = value_and_grad(head, loss_fn)
    optimizer = optim.AdamW(learning_rate=opts.lr, weight_decay=0.01)
    history: list[dict[str, float]] = []
    for step in range(opts.steps):
        pick = anchors[rng.integers(0, len(anchors), size=opts.batch)]
        arrays = batch_arrays(tokens, taps, pick, window, spec.block_size)
        optimizer.learning_rate = lr_at(step, opts.steps, opts.lr, warmup=20)
        loss, grads = grad_fn(head, *arrays)
        optimizer.update(head, grads)
        mx.eval(head.trainable_parameters(), optimizer.state, loss)  # type: ignore[no-untyped-call]
        if step % 50 == 0 or step == opts.steps - 1:
            ce, bce, right = (scalar(v) for v in block_losses(head, teacher, held_batch, window))
            print(f"dspark {step} ce {ce:.3f} bce {bce:.3f} right {right:.3f}", flush=True)
            history.append({"step": step, "heldout_ce": ce, "heldout_bce": bce, "right": right})
    ce, bce, right = (scalar(v) for v in block_losses(head, teacher, held_batch, window))
    per_position = _right_per_position(head, teacher, held_batch, window)
    save_head(head, Path(opts.out) / DSPARK_WEIGHTS)
    record = {
        **DSPARK_CONFIG,
        "training": {
            "steps": opts.steps,
            "batch": opts.batch,
            "lr": opts.lr,
            "confidence_weight": opts.confidence_weight,
            "sequence_length": opts.length,
            "prompts": opts.prompts,
            "sequences": int(tokens.shape[0]),
            "anchors": len(anchors),
            "generate_seconds": round(generated, 1),
            "seconds": round(time.time() - started, 1),
            "heldout": {"ce": ce, "confidence_bce": bce, "drafts_right": right},
            "heldout_right_per_position_teacher_forced": per_position,
            "history": history,
        },
    }
    (Path(opts.out) / "dspark.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _right_per_position(
    head: DSparkHead, teacher: Model, arrays: tuple[mx.array, ...], window: int
) -> list[float]:
    anchors, context, visible, starts, targets, previous = arrays
    keys = head.stage_keys(head.context(context), starts - window)
    hidden = head.hidden(teacher, anchors, keys, starts, visible)
    logits = head.step_logits(teacher.output_head(hidden), previous)
    right = (mx.argmax(logits, axis=-1) == targets).astype(mx.float32).mean(axis=0)
    values = right.tolist()
    assert isinstance(values, list)
    return [round(float(v), 4) for v in values]  # type: ignore[arg-type]


def save_head(head: DSparkHead, path: Path) -> None:
    """The head's parameters in float16 (``dspark.`` names), float32 where the
    reference keeps it (the hyper-connections, the sinks)."""
    keep = ("hc_attn.", "hc_ffn.", "hc_head.", "attn_sink", "gate.bias")
    out: dict[str, mx.array] = {}
    for name, value in flat_parameters(head):
        keep_float32 = any(part in name for part in keep)
        out[f"dspark.{name}"] = value if keep_float32 else value.astype(mx.float16)
    mx.save_safetensors(str(path), out, metadata={"format": "mlx"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=600, help="training prompts decoded")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--confidence-weight", type=float, default=0.5)
    parser.add_argument("--length", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="mlxserve/models/demo/weights")
    return parser


def main(argv: list[str] | None = None) -> None:
    record = train(build_parser().parse_args(argv))
    print(json.dumps(record["training"]["heldout"]))


if __name__ == "__main__":
    main()
