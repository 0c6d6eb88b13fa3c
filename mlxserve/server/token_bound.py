"""A lower bound on a text's token count from its size alone, read off tokenizer.json.

Why: tokenizing takes time and memory in proportion to the text (seconds and
hundreds of megabytes for a few megabytes of prompt), and a prompt that cannot
fit the context is refused anyway. If no token can stand for more than ``B``
bytes of text, a text of ``n`` UTF-8 bytes has at least ``n / B`` tokens, so a
prompt whose bound reaches the context is refused without being tokenized.

``B`` holds only for some tokenizers, so it is derived from the tokenizer's own
pipeline and is None (no bound: every prompt is tokenized) wherever a step could
make one token stand for unboundedly much text:

- the model: BPE (byte-level, or merging characters; an unknown character is one
  ``unk``, unless several are fused into one) or Unigram with byte fallback
  (without it, a run of unknown characters is one ``unk``). WordPiece and
  WordLevel map a whole unknown word to one ``unk``: no bound.
- a token's bytes: its vocabulary string, one byte per character under a
  byte-level pre-tokenizer, else its UTF-8 length (a ``▁`` for a space, ``##``
  prefixes and ``<0x41>`` byte tokens only overstate it); an added token's
  content; and never under 4, the longest character, which ``unk`` can be.
- the normalizer may shrink the text before it is split: Unicode forms and
  lowercasing by at most 4x (NFKC makes the 4-byte U+1D400 an ``A``), a literal
  replacement by its lengths' ratio. One that deletes text (a replacement by
  nothing, a regex, stripping, BERT's cleanup, a precompiled map) gives no bound.
- a pre-tokenizer that drops text (whitespace splitters, a ``removed`` split),
  or an added token that swallows the whitespace beside it, gives no bound.
"""

from __future__ import annotations

import json
import math
from typing import Any

#: Most bytes one character can take in UTF-8: any one character may be one token.
CHAR_BYTES = 4
#: How much a Unicode normalization form or lowercasing can shrink UTF-8 text:
#: a 4-byte mathematical letter becomes a 1-byte ASCII one under NFKC.
UNICODE_SHRINK = 4.0
#: Normalizers that never shrink the text.
_KEEPING = {"Prepend", "Append", "ByteLevel"}
_UNICODE = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
#: Pre-tokenizers that keep every byte (they split, mark or map, never drop).
_SPLITTING = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}


def bytes_per_token(tokenizer: Any) -> float | None:
    """The most bytes of input text one token can stand for (None: no such bound).

    `tokenizer` is a `tokenizers.Tokenizer` (a fast tokenizer's ``backend_tokenizer``).
    """
    spec = json.loads(tokenizer.to_str())
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_text(spec.get("pre_tokenizer")):
        return None
    token = _longest_token(spec)
    return None if token is None else token * shrink


def min_tokens(text: str, bound: float | None) -> int:
    """At least how many tokens `text` has, given `bytes_per_token` (0: unknown)."""
    if bound is None:
        return 0
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / bound)


def _shrink(normalizer: dict[str, Any] | None) -> float | None:
    """By how much at most the normalizer shrinks UTF-8 text (None: unboundedly)."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind == "Sequence":
        total = 1.0
        for step in normalizer.get("normalizers", []):
            factor = _shrink(step)
            if factor is None:
                return None
            total *= factor
        return total
    if kind in _KEEPING:
        return 1.0
    if kind in _UNICODE:
        return UNICODE_SHRINK
    if kind == "Replace":
        pattern = normalizer.get("pattern", {}).get("String")
        content = str(normalizer.get("content", "")).encode()
        if not isinstance(pattern, str) or not content:
            return None  # a regex, or a deletion
        return max(1.0, len(pattern.encode()) / len(content))
    return None


def _keeps_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(step) for step in pre_tokenizer.get("pretokenizers", []))
    return kind in _SPLITTING and str(pre_tokenizer.get("behavior", "")).lower() != "removed"


def _byte_level(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_byte_level(step) for step in pre_tokenizer.get("pretokenizers", []))
    return bool(pre_tokenizer.get("type") == "ByteLevel")


def _longest_token(spec: dict[str, Any]) -> int | None:
    """The most input bytes one token stands for (None: a token can stand for any)."""
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind == "BPE":
        if model.get("fuse_unk") and model.get("unk_token") and not model.get("byte_fallback"):
            return None
        pieces = list(model.get("vocab", {}))
    elif kind == "Unigram" and model.get("byte_fallback"):
        pieces = [str(entry[0]) for entry in model.get("vocab", [])]
    else:
        return None
    byte_level = _byte_level(spec.get("pre_tokenizer"))
    longest = max((len(p) if byte_level else len(p.encode()) for p in pieces), default=0)
    for added in spec.get("added_tokens", []):
        if added.get("lstrip") or added.get("rstrip"):
            return None  # it also takes the whitespace beside it, however long
        longest = max(longest, len(str(added.get("content", "")).encode()))
    return max(longest, CHAR_BYTES)
