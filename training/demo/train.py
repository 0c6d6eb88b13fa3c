"""Train the demo model (main model + MTP jointly) and write ``weights/``.

Exact commands that produced the shipped files (seed 0, on a shared 2-core x86 CPU;
the OpenBLAS preload makes MLX's CPU matmuls ~30x faster). Each phase starts from the
previous one's output (``--init-from``) and keeps its report in ``training.json``::

    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
    W=mlxserve/models/demo/weights
    # Phase 1 (~25 min): tokenizer, then main model + MTP jointly.
    python -m training.demo.train --out $W --steps 1000 --seed 0
    # Phase 2 (~5 min): MTP self-distillation on corpus windows.
    python -m training.demo.train --out $W --init-from $W --steps 0 \\
        --distill-steps 600 --distill-lr 3e-3 --seed 0
    # Phases 3 and 4 (~20 min): on the main model's own greedy text.
    python -m training.demo.train --out $W --init-from $W --steps 0 \\
        --agree-steps 400 --onpolicy-steps 1500 --eval-prompts 48 --seed 0

Phase 1 loss: main next-token cross-entropy plus ``--mtp-weight`` times the MTP
block's cross-entropy for token ``t + 2`` (teacher forcing: the block reads the main
model's streams at ``t`` and the true token ``t + 1``).

Phase 2 (``--distill-steps``) trains only the MTP block, towards the main model's own
greedy choice for ``t + 2`` (``argmax`` of its logits at ``t + 1``) instead of the
corpus token: speculative decoding accepts a draft when it equals the main model's
choice, and the tiny main model overfits the corpus (held-out CE ~4 vs ~1.6), so its
choices on new text differ from the corpus labels phase 1 taught the MTP block.

Phases 3 (``--agree-steps``) and 4 (``--onpolicy-steps``) train on the main model's
greedy continuations of training-split prompts; ``finetune`` explains them.

Held-out greedy acceptance at depth 1 after each phase: 0.37 and 0.495 (12 prompts),
then 0.727 (48 prompts; depths 1-5: 0.73 / 0.51 / 0.38 / 0.30 / 0.25). Main model
cross-entropy on corpus windows, train / held-out: 1.62 / 4.00 after phase 2, 1.70 /
3.91 after phase 4. Distinct 4-grams in 48-token held-out continuations
(``evaluate.heldout_distinct_ngrams``, 48 prompts, measured after the fact, so not in
that ``training.json``): 0.96 after phase 2, 0.88 after phase 4.

Training uses fixed seeds (MLX init, window sampling); MLX's multithreaded CPU
reductions may still differ in the last bits between machines, which is why the
*weights* are shipped rather than rebuilt.
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
from mlx.nn.losses import cross_entropy
from mlx.nn.utils import value_and_grad
from mlx.utils import tree_unflatten

from mlxserve.models.deepseek_v4 import Model, ModelArgs
from mlxserve.models.deepseek_v4.model import MTPBlock
from mlxserve.models.demo.build import flat_parameters, shipped_weights
from mlxserve.models.demo.spec import MODEL_CONFIG

from . import corpus, finetune
from .schedule import freeze_non_trainable, lr_at, scalar, train_all, train_only_mtp

WEIGHTS_FILE = "model.fp16.safetensors"
REPORT_FILE = "training.json"


def make_model(seed: int) -> Model:
    """A freshly initialised demo model with its MTP block (deterministic in ``seed``)."""
    mx.random.seed(seed)
    args = ModelArgs.from_dict(MODEL_CONFIG)
    model = Model(args)
    model.mtp = [MTPBlock(args, t) for t in args.mtp_layer_types or []]
    rng = np.random.default_rng(seed)
    experts, top_k = args.n_routed_experts, args.num_experts_per_tok
    params = dict(flat_parameters(model))
    for key, value in params.items():
        if key.endswith("gate.tid2eid"):
            # The hash table: distinct experts per token (zeros would send all to expert 0).
            rows = [rng.permutation(experts)[:top_k] for _ in range(args.vocab_size)]
            params[key] = mx.array(np.stack(rows).astype(np.int32))
        elif key.endswith("gate.weight") or key.endswith(".fn") or key.endswith("hc_fn"):
            # Break the symmetry the zero init leaves in routers and hyper-connections.
            params[key] = mx.random.normal(value.shape) * 0.02
    model.load_weights(list(params.items()))
    freeze_non_trainable(model)
    return model


def losses(model: Model, batch: mx.array) -> tuple[mx.array, mx.array]:
    """Mean main CE (next token) and MTP CE (token after next) over ``batch`` [B, L+1]."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    streams = model.forward_hidden(inputs)
    main = cross_entropy(model.head_from_streams(streams), targets).mean()
    cache = model.make_mtp_cache()[0]
    logits, _ = model.mtp_forward(streams[:, :-1], inputs[:, 1:], cache)
    mtp = cross_entropy(logits, targets[:, 1:]).mean()
    return main, mtp


def token_stream(tokenizer: Any, samples: list[corpus.Sample]) -> np.ndarray:
    ids: list[int] = []
    for sample in samples:
        ids.extend(tokenizer.encode(sample.render(), add_special_tokens=False))
    return np.array(ids, dtype=np.int32)


def save_weights(model: Model, path: Path) -> None:
    """float16 weights, except the few tensors the reference keeps in float32 / int."""
    mx.save_safetensors(str(path), shipped_weights(model), metadata={"format": "mlx"})


def _copy_init(source: Path, out: Path) -> dict[str, Any] | None:
    """Reuse ``source``'s tokenizer; return its training report (kept in the new one)."""
    import shutil

    from mlxserve.models.demo.build import TOKENIZER_FILES

    if source.resolve() != out.resolve():
        for name in TOKENIZER_FILES:
            shutil.copyfile(source / name, out / name)
    report = source / REPORT_FILE
    loaded: dict[str, Any] | None = json.loads(report.read_text()) if report.exists() else None
    return loaded


def distill_mtp(model: Model, train_ids: np.ndarray, opts: argparse.Namespace) -> list[Any]:
    """Train only the MTP block towards the main model's greedy token for ``t + 2``."""
    if opts.distill_steps <= 0:
        return []
    train_only_mtp(model)

    def loss_fn(m: Model, batch: mx.array) -> mx.array:
        streams = mx.stop_gradient(m.forward_hidden(batch))
        targets = mx.stop_gradient(mx.argmax(m.head_from_streams(streams), axis=-1))
        logits, _ = m.mtp_forward(streams[:, :-1], batch[:, 1:], m.make_mtp_cache()[0])
        loss: mx.array = cross_entropy(logits, targets[:, 1:]).mean()
        return loss

    grad_fn = value_and_grad(model, loss_fn)
    optimizer = optim.AdamW(learning_rate=opts.distill_lr, weight_decay=0.01)
    rng = np.random.default_rng(opts.seed + 1)
    span = opts.length
    history: list[Any] = []
    started = time.time()
    for step in range(opts.distill_steps):
        starts = rng.integers(0, train_ids.size - span, size=opts.batch)
        batch = mx.array(np.stack([train_ids[s : s + span] for s in starts]))
        optimizer.learning_rate = lr_at(step, opts.distill_steps, opts.distill_lr, warmup=20)
        loss, grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        mx.eval(model.trainable_parameters(), optimizer.state, loss)  # type: ignore[no-untyped-call]
        if step % 50 == 0 or step == opts.distill_steps - 1:
            value = scalar(loss)
            print(f"distill {step} loss {value:.4f} {time.time() - started:.0f}s", flush=True)
            history.append({"step": step, "loss": value})
    train_all(model)
    return history


def _as_float32(value: mx.array) -> mx.array:
    return value.astype(mx.float32) if value.dtype == mx.float16 else value


def build_parser() -> argparse.ArgumentParser:
    """Every phase's options (a phase runs when its ``--*-steps`` is positive)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--mtp-weight", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-prompts", type=int, default=12)
    parser.add_argument("--init-from", type=Path, help="start from these shipped weights")
    parser.add_argument("--distill-steps", type=int, default=0)
    parser.add_argument("--distill-lr", type=float, default=1e-3)
    parser.add_argument("--agree-steps", type=int, default=0)
    parser.add_argument("--agree-lr", type=float, default=1e-3)
    parser.add_argument("--agree-weight", type=float, default=0.1)
    parser.add_argument("--agree-corpus-batch", type=int, default=8)
    parser.add_argument("--onpolicy-steps", type=int, default=0)
    parser.add_argument("--onpolicy-lr", type=float, default=4e-3)
    parser.add_argument("--onpolicy-batch", type=int, default=16)
    parser.add_argument("--onpolicy-length", type=int, default=96)
    parser.add_argument("--onpolicy-chars", default="20,40,60,80,120,180")
    parser.add_argument("--onpolicy-soft", type=float, default=0.5)
    parser.add_argument("--eval-depth", type=int, default=5)
    return parser


def main(argv: list[str] | None = None) -> None:
    opts = build_parser().parse_args(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    from .tokenizer import train_tokenizer

    train, heldout = corpus.split()
    previous: dict[str, Any] | None = None
    if opts.init_from is None:
        train_tokenizer((s.render() for s in train), opts.out)
    else:
        previous = _copy_init(opts.init_from, opts.out)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(opts.out))
    train_ids = token_stream(tokenizer, train)
    heldout_ids = token_stream(tokenizer, heldout)
    print(f"train tokens {train_ids.size}, held-out tokens {heldout_ids.size}", flush=True)

    model = make_model(opts.seed)
    if opts.init_from is not None:
        model.load_weights(str(opts.init_from / WEIGHTS_FILE))
        params = dict(flat_parameters(model))
        model.update(tree_unflatten([(k, _as_float32(v)) for k, v in params.items()]))
    optimizer = optim.AdamW(learning_rate=opts.lr, weight_decay=0.01)
    weight = opts.mtp_weight

    def loss_fn(m: Model, batch: mx.array) -> mx.array:
        main_loss, mtp_loss = losses(m, batch)
        total: mx.array = main_loss + weight * mtp_loss
        return total

    grad_fn = value_and_grad(model, loss_fn)
    rng = np.random.default_rng(opts.seed)
    span = opts.length + 1
    history: list[dict[str, float]] = []
    for step in range(opts.steps):
        starts = rng.integers(0, train_ids.size - span, size=opts.batch)
        batch = mx.array(np.stack([train_ids[s : s + span] for s in starts]))
        optimizer.learning_rate = lr_at(step, opts.steps, opts.lr, warmup=50)
        loss, grads = grad_fn(model, batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)  # type: ignore[no-untyped-call]
        optimizer.update(model, grads)
        mx.eval(model.trainable_parameters(), optimizer.state, loss)  # type: ignore[no-untyped-call]
        if step % 50 == 0 or step == opts.steps - 1:
            value = scalar(loss)
            print(f"step {step} loss {value:.4f} {time.time() - started:.0f}s", flush=True)
            history.append({"step": step, "loss": value})

    distill_history = distill_mtp(model, train_ids, opts)
    agree_report = finetune.agree(model, tokenizer, train, train_ids, opts)
    onpolicy_report = finetune.distill_onpolicy(model, tokenizer, train, opts)

    # Final losses on fixed windows of both splits (no gradient, same loss as training).
    def split_losses(ids: np.ndarray, windows: int = 32) -> dict[str, float]:
        starts = np.linspace(0, ids.size - span - 1, windows).astype(int)
        batch = mx.array(np.stack([ids[s : s + span] for s in starts]))
        main_loss, mtp_loss = losses(model, batch)
        return {"main_ce": scalar(main_loss), "mtp_ce": scalar(mtp_loss)}

    final = {"train": split_losses(train_ids), "heldout": split_losses(heldout_ids)}
    print(f"final {final}", flush=True)
    save_weights(model, opts.out / WEIGHTS_FILE)
    config = {
        **MODEL_CONFIG,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    (opts.out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    train_seconds = time.time() - started

    # Acceptance as shipped: the checkpoint build assembles (fp16 round trip, 4-bit experts).
    import tempfile

    from mlxserve.models.demo.build import build_demo_model

    from .evaluate import eval_samples, heldout_acceptance, heldout_distinct_ngrams

    with tempfile.TemporaryDirectory() as tmp:
        path = build_demo_model(Path(tmp) / "demo", progress=False, source=opts.out)
        from mlxserve.models.loader import load

        built, built_tok = load(path)
        assert isinstance(built, Model)
        prompts = eval_samples(heldout, opts.eval_prompts)
        acc = heldout_acceptance(built, built_tok, prompts, max_new=32)
        deep = heldout_acceptance(built, built_tok, prompts, max_new=32, depth=opts.eval_depth)
        distinct = heldout_distinct_ngrams(built, built_tok, prompts)

    report = {
        "seed": opts.seed,
        "steps": opts.steps,
        "batch": opts.batch,
        "sequence_length": opts.length,
        "peak_lr": opts.lr,
        "mtp_loss_weight": weight,
        "train_seconds": round(train_seconds, 1),
        "final_losses": final,
        "loss_history": history,
        "init_from": None if opts.init_from is None else str(opts.init_from),
        "initial_report": previous,
        "distill_steps": opts.distill_steps,
        "distill_lr": opts.distill_lr,
        "distill_history": distill_history,
        "agree": agree_report,
        "onpolicy": onpolicy_report,
        "heldout_mtp_depth1_acceptance": round(acc.rates[0], 4),
        "acceptance_trials": acc.trials[0],
        "acceptance_prompts": len(prompts),
        "heldout_mtp_acceptance_per_depth": [round(r, 4) for r in deep.rates],
        "acceptance_trials_per_depth": deep.trials,
        "mean_accepted_per_draft_step": round(deep.accepted_tokens / max(deep.steps, 1), 3),
        "heldout_distinct_4grams": round(distinct, 4),
        "corpus": {
            "source": "pydoc_data.topics.topics",
            "chunking": f"paragraph chunks of <= {corpus.CHUNK_CHARS} chars, one chat per chunk",
            "heldout_rule": (
                f"topics (sorted by name) with index % {corpus.HOLDOUT_EVERY} == "
                f"{corpus.HOLDOUT_PHASE}"
            ),
            "heldout_topics": corpus.heldout_topics(),
            "train_samples": len(train),
            "heldout_samples": len(heldout),
            "train_tokens": int(train_ids.size),
            "heldout_tokens": int(heldout_ids.size),
        },
    }
    (opts.out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    keys = (
        "final_losses",
        "heldout_mtp_depth1_acceptance",
        "heldout_mtp_acceptance_per_depth",
        "heldout_distinct_4grams",
    )
    print(json.dumps({k: report[k] for k in keys}))


if __name__ == "__main__":
    main()
