"""Stop strings over a streaming detokenizer: never half-sent, cut before the match."""

from mlxserve.server.stops import TextStream
from mlxserve.server.tokenizer import FrontTokenizer


def stream_text(tokenizer: FrontTokenizer, text: str, stops: list[str]) -> tuple[list[str], bool]:
    stream = TextStream(tokenizer.detokenizer(), stops)
    parts = [stream.push([token]) for token in tokenizer.text_ids(text)]
    if not stream.stopped:
        parts.append(stream.finish())
    return parts, stream.stopped


def test_without_stops_the_text_is_unchanged(tokenizer: FrontTokenizer) -> None:
    text = "def main():\n    return 42\n"
    parts, stopped = stream_text(tokenizer, text, [])
    assert "".join(parts) == text and not stopped


def test_stop_string_cuts_before_it(tokenizer: FrontTokenizer) -> None:
    parts, stopped = stream_text(tokenizer, "The answer is 42. More text follows.", ["42."])
    assert stopped
    assert "".join(parts) == "The answer is "


def test_a_partial_match_is_held_back_then_released(tokenizer: FrontTokenizer) -> None:
    parts, stopped = stream_text(tokenizer, "abc END? no, ENDING is not it", ["END!"])
    assert not stopped
    assert "".join(parts) == "abc END? no, ENDING is not it"
    assert not any(part.endswith("EN") for part in parts[:-1] if part)


def test_earliest_of_several_stops_wins(tokenizer: FrontTokenizer) -> None:
    parts, _ = stream_text(tokenizer, "one two three", ["three", "two"])
    assert "".join(parts) == "one "
