"""The demo corpus: ``pydoc_data.topics`` (Python's reference text, shipped with Python).

Each topic is cut into paragraph chunks, and every chunk becomes one chat exchange
(the user names the topic, the assistant answers with the chunk), so the model learns
the chat format and to end its turn with the EOS token. Whole topics are held out
(sorted topic index ``% HOLDOUT_EVERY == HOLDOUT_PHASE``): evaluation text is never
seen in training, not even as a neighbouring chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxserve.models.demo.spec import ASSISTANT, END, USER

HOLDOUT_EVERY = 10
HOLDOUT_PHASE = 3
CHUNK_CHARS = 400


@dataclass(frozen=True)
class Sample:
    """One chat exchange: a topic name and a chunk of its text."""

    topic: str
    text: str

    @property
    def prompt(self) -> str:
        return f"Python reference: {self.topic}"

    def render(self) -> str:
        """The exchange as the chat template renders it (plus the assistant's text)."""
        return f"{USER}{self.prompt}{END}{ASSISTANT}{self.text}{END}"


def topics() -> dict[str, str]:
    from pydoc_data.topics import topics as table

    return dict(sorted(table.items()))


def is_heldout(index: int) -> bool:
    return index % HOLDOUT_EVERY == HOLDOUT_PHASE


def chunks(text: str, limit: int = CHUNK_CHARS) -> list[str]:
    """Greedy paragraph packing up to ``limit`` characters (long paragraphs stay whole)."""
    out: list[str] = []
    current = ""
    for paragraph in (p.strip("\n") for p in text.split("\n\n")):
        if not paragraph.strip():
            continue
        if current and len(current) + len(paragraph) + 2 > limit:
            out.append(current)
            current = paragraph
        else:
            current = f"{current}\n\n{paragraph}" if current else paragraph
    if current:
        out.append(current)
    return out


def split() -> tuple[list[Sample], list[Sample]]:
    """``(train, heldout)`` samples, in a fixed order."""
    train: list[Sample] = []
    heldout: list[Sample] = []
    for index, (topic, text) in enumerate(topics().items()):
        target = heldout if is_heldout(index) else train
        target.extend(Sample(topic, chunk) for chunk in chunks(text))
    return train, heldout


def heldout_topics() -> list[str]:
    return [t for i, t in enumerate(topics()) if is_heldout(i)]
