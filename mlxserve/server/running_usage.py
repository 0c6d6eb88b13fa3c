"""Usage on every streamed chunk: vLLM's ``stream_options.continuous_usage_stats``.

Benchmark tools (GuideLLM, vLLM's own ``bench serve``) ask for it to count tokens
as they arrive instead of re-tokenizing the text. vLLM's shape is followed so
their counts read the same here: with ``include_usage`` and
``continuous_usage_stats`` both true, every chunk of a choice (its role chunk,
each content chunk, its finish chunk) carries ``usage`` with the prompt's tokens,
that choice's completion tokens so far and their sum; the closing usage chunk
(empty ``choices``) is the usual total. Without ``include_usage`` it is off, as in
vLLM.
"""

from __future__ import annotations

from mlxserve.server.generation import Delta
from mlxserve.server.protocol import Usage


class RunningUsage:
    """Each choice's completion tokens so far, for the chunks of one stream."""

    def __init__(self, prompt_tokens: int, on: bool) -> None:
        self.prompt_tokens = prompt_tokens
        self.on = on
        self._completion: dict[int, int] = {}

    def add(self, index: int, delta: Delta) -> None:
        """Count ``delta``'s tokens; the last delta's count is the choice's whole count
        (a stop string can end the text before tokens already generated)."""
        if delta.finish_reason is not None:
            self._completion[index] = delta.completion_tokens
        else:
            self._completion[index] = self._completion.get(index, 0) + delta.new_tokens

    def of(self, index: int) -> Usage | None:
        """The usage a chunk of choice ``index`` carries now; None when not asked for."""
        if not self.on:
            return None
        completion = self._completion.get(index, 0)
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
        )
