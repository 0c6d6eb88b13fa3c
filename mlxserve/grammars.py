"""llguidance helpers shared by the front and the engine, so neither imports the other.

The front checks a request's grammar before admitting it (`start_problem`), under a
tokenizer built as the engine builds its own (`ll_tokenizer`): a grammar that starts
there starts in the engine's first step too (`mlxserve.engine.sample.grammar`).
"""

from __future__ import annotations

from typing import Any


def ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of an mlx-lm `TokenizerWrapper` (about a second for a large
    vocabulary: build it once). The engine's and the front's are built alike, so a
    grammar the front found to start (`start_problem`) starts in the engine too."""
    from llguidance.hf import from_tokenizer

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = sorted(int(t) for t in getattr(tokenizer, "eos_token_ids", ()))
    return from_tokenizer(hf, n_vocab=max(vocab_size, len(hf)), eos_token=eos or None)


def start_problem(tokenizer: Any, grammar: str) -> str | None:
    """Why ``grammar`` cannot even start under ``tokenizer`` (an `ll_tokenizer`), in
    one line; None: it can.

    Compiling is not enough: llguidance compiles a JSON schema with no finite value
    (a ``$ref`` to itself) and fails only when the first mask is computed, which in
    the engine is inside a step. So this compiles the grammar and computes that
    mask, as the engine's first step will (well under a millisecond for a JSON
    schema).
    """
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if not matcher.is_error():
        return None
    first = str(matcher.get_error()).strip().splitlines()
    reason = first[0] if first else "unknown error"
    if reason == "NoExtensionBias":  # llguidance's stop reason: nothing can come next
        return "no text can match it (llguidance: NoExtensionBias)"
    return reason
