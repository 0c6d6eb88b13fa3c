"""Token ids to text for one response, with stop strings.

Text is released only when it cannot be the start of a stop string, so a stop
string split across tokens is never half-sent; when one appears, the text ends
just before it (OpenAI semantics: the stop string is not part of the output).
"""

from mlxserve.server.tokenizer import Detokenizer


class TextStream:
    def __init__(self, detokenizer: Detokenizer, stops: list[str]) -> None:
        self._detokenizer = detokenizer
        self._stops = [stop for stop in stops if stop]
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text that is now safe to send."""
        if self.stopped:
            return ""
        for token in token_ids:
            self._detokenizer.add_token(token)
            self._pending += self._detokenizer.last_segment
            if self._stops and self._cut_at_stop():
                return self._release_all()
        return self._release(self._held_back())

    def finish(self) -> str:
        """The end of the generation: flush what the detokenizer and the hold-back kept."""
        if self.stopped:
            return ""
        self._detokenizer.finalize()
        self._pending += self._detokenizer.last_segment
        if self._stops:
            self._cut_at_stop()
        return self._release_all()

    def _cut_at_stop(self) -> bool:
        hits = [(i, stop) for stop in self._stops if (i := self._pending.find(stop)) >= 0]
        if not hits:
            return False
        at, self.matched = min(hits, key=lambda hit: hit[0])
        self._pending = self._pending[:at]
        self.stopped = True
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the pending text that starts a stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _release(self, keep: int) -> str:
        cut = len(self._pending) - keep
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text

    def _release_all(self) -> str:
        return self._release(0)
