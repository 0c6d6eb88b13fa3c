"""Train and save the demo's byte-level BPE tokenizer (offline, ``tokenizers``).

The role markers and ``<|end|>`` are special tokens (one id each, never split or
merged), ``<|end|>`` is the EOS, and the chat template in ``tokenizer_config.json``
renders conversations exactly like ``corpus.Sample.render`` does for training.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from mlxserve.models.demo.spec import BOS, CHAT_TEMPLATE, END, PAD, SPECIAL_TOKENS, VOCAB_SIZE


def train_tokenizer(texts: Iterable[str], out_dir: Path) -> None:
    """Fit BPE on ``texts`` and write ``tokenizer.json`` + ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw,
        bos_token=BOS,
        eos_token=END,
        pad_token=PAD,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (BOS, END, PAD)],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    fast.save_pretrained(str(out_dir))
    embed_chat_template(out_dir)


def embed_chat_template(out_dir: Path) -> None:
    """Put the chat template in ``tokenizer_config.json`` (one self-contained file).

    Recent ``transformers`` write it to a separate ``chat_template.jinja``; the config
    entry is read by every version, so the demo keeps it there and drops the extra file.
    """
    import json

    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
