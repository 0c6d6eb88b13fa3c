"""The cost of a grammar's token mask per token, against a demo decode step; prints JSON.

Measured in one run on the same machine:

- ``decode_step_ms``: one plain decode forward of the demo model (median);
- ``mask_ms``: what a constrained request adds per token in `TokenChooser` (median):
  llguidance's bitmask, its unpacking into an MLX bool array, the ``where`` on the
  logits and the grammar reading the chosen token, replayed over real answers;
- ``engine_ratio``: constrained over plain generation time per token through the
  engine at depth 0, which also pays for the unpipelined step (`engine.logits`);
- ``large_vocab``: the same mask work on a vocabulary of DeepSeek-V4's size
  (129,280). No such tokenizer ships offline, so one is made: a byte-level BPE
  trained with ``tokenizers`` on this interpreter's own Python sources (stdlib and
  site-packages, up to 60 MB; about 40 s on 2 CPU cores, once: it is cached in the
  temp folder). Its answers are walks of a random model through the grammar
  (random logits, the grammar's mask with its closing reserve, argmax), all within
  the reserve's horizon (`mlxserve.engine.sample.ending`): every token pays
  ``TokenChooser.allowed`` (bitmask, unpacking, every 4th a closing path), the
  ``where`` and the chooser's reading of the token; ``mask_mean_ms`` is the mean,
  the closing paths' positions included. ``walk_mask_ms_demo_vocab`` is the same walk
  on the demo's vocabulary, for comparison with ``mask_ms``.

``mask_over_step`` and ``large_vocab.mask_over_demo_step`` are the target ratio
(<= 0.10 of a demo decode step on the CPU).

Run: python benchmarks/grammar_mask.py [--tokens 48] [--repeats 3] [--large-vocab 129280]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.build import LoadedModel, adapter_for, grammars_for, materialize
from mlxserve.engine.core.drive import run_to_completion
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.sample.ending import Ending
from mlxserve.engine.sample.grammar import Grammars
from mlxserve.engine.sample.logits import TokenChooser

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
    },
    "required": ["name", "tags", "score"],
}


def decode_step_ms(loaded: LoadedModel, prompt: list[int], steps: int) -> float:
    adapter = loaded.adapter
    state = adapter.new_state(max_rollback=0)
    adapter.prefill(state, prompt[:-1])
    token = mx.array(prompt[-1:])
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = adapter.step(state, token)
        token = mx.argmax(logits, axis=-1).reshape(1)
        mx.eval(token)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times[2:])


def mask_ms(loaded: LoadedModel, grammar_text: str, answers: list[list[int]]) -> float:
    grammars = grammars_for(loaded)
    vocab = grammars.vocab_size
    logits = mx.random.normal((1, vocab))
    mx.eval(logits)
    times = []
    for tokens in answers:
        grammar = grammars.compile(grammar_text)
        for token in tokens:
            started = time.perf_counter()
            masked = mx.where(grammar.mask(), logits, -float("inf"))
            mx.eval(masked)
            grammar.accept(token)
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def engine_ratio(
    loaded: LoadedModel, prompt: tuple[int, ...], grammar_text: str, tokens: int, repeats: int
) -> tuple[float, list[list[int]]]:
    engine = Engine(
        adapter_for(loaded.model, 0),
        EngineConfig(prefix_cache_entries=0),
        grammars=grammars_for(loaded),
    )
    stops = tuple(loaded.tokenizer.eos_token_ids)
    plain, constrained, answers = [], [], []
    for repeat in range(repeats):
        sampling = SamplingParams(temperature=1.0, seed=repeat)
        done = run_to_completion(
            engine, GenerationRequest(f"p{repeat}", GenerationParams(prompt, tokens, sampling, ()))
        )
        plain.append((done.total_s - done.ttft_s) / max(len(done.tokens) - 1, 1))
        done = run_to_completion(
            engine,
            GenerationRequest(
                f"g{repeat}",
                GenerationParams(prompt, tokens, sampling, stops, grammar=grammar_text),
            ),
        )
        constrained.append((done.total_s - done.ttft_s) / max(len(done.tokens) - 1, 1))
        answers.append(done.tokens)
    return statistics.median(constrained) / statistics.median(plain), answers


#: DeepSeek-V4's vocabulary (its logits' width).
DEEPSEEK_V4_VOCAB = 129_280
#: Python sources the synthetic tokenizer is trained on, at most.
CORPUS_BYTES = 60_000_000


def _corpus() -> tuple[list[str], int]:
    """This interpreter's Python sources (stdlib first, then site-packages), in order."""
    files: list[str] = []
    total = 0
    for key in ("stdlib", "purelib"):
        root = Path(sysconfig.get_paths()[key])
        for path in sorted(root.rglob("*.py")):
            if total >= CORPUS_BYTES:
                return files, total
            try:
                total += path.stat().st_size
            except OSError:
                continue
            files.append(str(path))
    return files, total


def synthetic_tokenizer(vocab: int) -> tuple[Any, dict[str, float]]:
    """A fast HF tokenizer: byte-level BPE of ``vocab`` tokens (``<eos>`` is id 0)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    cache = Path(tempfile.gettempdir()) / f"mlxserve-bench-bpe-{vocab}.json"
    about = cache.with_suffix(".about.json")
    if not cache.exists() or not about.exists():
        files, total = _corpus()

        def texts() -> Iterator[str]:
            for name in files:
                with open(name, encoding="utf-8", errors="ignore") as handle:
                    yield handle.read()

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=["<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        started = time.perf_counter()
        tokenizer.train_from_iterator(texts(), trainer)
        trained = {
            "corpus_files": len(files),
            "corpus_mb": round(total / 1e6, 1),
            "train_s": round(time.perf_counter() - started, 1),
        }
        partial = cache.with_suffix(f".{os.getpid()}.tmp")
        tokenizer.save(str(partial))
        partial.replace(cache)
        about.write_text(json.dumps(trained))
    info: dict[str, float] = json.loads(about.read_text())
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_file=str(cache), eos_token="<eos>"
    )
    return TokenizerWrapper(fast, eos_token_ids=[0]), info


def walk_mask_ms(
    grammars: Grammars, grammar_text: str, tokens: int, walks: int
) -> tuple[float, float]:
    """Median and mean per-token mask cost over random-model walks through the grammar."""
    vocab = grammars.vocab_size
    times = []
    for walk in range(walks):
        ending = Ending(None, (0,), grammars.closing(), vocab)
        chooser = TokenChooser(SamplingParams(), grammars.compile(grammar_text), (), ending)
        rows = mx.random.normal((8, vocab), key=mx.random.key(walk))
        mx.eval(rows)
        for step in range(tokens):
            if chooser.finished:
                break
            started = time.perf_counter()
            allowed = chooser.allowed(tokens - step)
            assert allowed is not None
            token = mx.argmax(mx.where(allowed, rows[step % 8], -float("inf")))
            mx.eval(token)
            chooser.read(cast(int, token.item()))
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times), statistics.fmean(times)


def large_vocab(
    grammar_text: str, vocab: int, tokens: int, walks: int, step_ms: float
) -> dict[str, Any]:
    tokenizer, info = synthetic_tokenizer(vocab)
    started = time.perf_counter()
    grammars = Grammars(tokenizer, vocab)
    grammars.compile(grammar_text)  # builds llguidance's tokenizer once
    grammars.closing()  # and the closing paths' table
    setup_s = time.perf_counter() - started
    mask, mean = walk_mask_ms(grammars, grammar_text, tokens, walks)
    return {
        "vocab_size": vocab,
        "trained_tokens": len(tokenizer),
        **info,
        "grammars_setup_s": round(setup_s, 2),
        "mask_ms": round(mask, 4),
        "mask_mean_ms": round(mean, 4),
        "mask_over_demo_step": round(mask / step_ms, 4),
        "target_mask_over_step": 0.10,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--large-vocab", type=int, default=DEEPSEEK_V4_VOCAB, help="0: skip that measurement"
    )
    args = parser.parse_args(argv)
    from llguidance import LLMatcher

    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    loaded = LoadedModel(model, tokenizer, adapter_for(model, 0), 0)
    prompt = tokenizer.encode("<|user|>Describe a cat as JSON.<|end|><|assistant|>")
    options: Any = {"whitespace_flexible": False}
    grammar_text = LLMatcher.grammar_from_json_schema(SCHEMA, defaults=options)
    ratio, answers = engine_ratio(loaded, tuple(prompt), grammar_text, args.tokens, args.repeats)
    step = decode_step_ms(loaded, prompt, args.tokens)
    mask = mask_ms(loaded, grammar_text, answers)
    result = {
        "device": str(mx.default_device()),
        "vocab_size": grammars_for(loaded).vocab_size,
        "decode_step_ms": round(step, 4),
        "mask_ms": round(mask, 4),
        "mask_over_step": round(mask / step, 4),
        "target_mask_over_step": 0.10,
        "engine_ratio": round(ratio, 4),
        "tokens_per_answer": [len(a) for a in answers],
    }
    if args.large_vocab:
        walk, _ = walk_mask_ms(grammars_for(loaded), grammar_text, args.tokens, args.repeats)
        result["walk_mask_ms_demo_vocab"] = round(walk, 4)
        result["large_vocab"] = large_vocab(
            grammar_text, args.large_vocab, args.tokens, args.repeats, step
        )
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
