"""Stop strings over a streaming detokenizer: never half-sent, cut before the match."""

from mlxserve.server.codec import Codec
from mlxserve.server.stops import TextStream


def stream_text(codec: Codec, text: str, stops: list[str]) -> tuple[list[str], bool]:
    stream = TextStream(codec.detokenizer(), stops)
    parts = [stream.push([token]) for token in codec.text_ids(text)]
    if not stream.stopped:
        parts.append(stream.finish())
    return parts, stream.stopped


def test_without_stops_the_text_is_unchanged(codec: Codec) -> None:
    text = "def main():\n    return 42\n"
    parts, stopped = stream_text(codec, text, [])
    assert "".join(parts) == text and not stopped


def test_stop_string_cuts_before_it(codec: Codec) -> None:
    parts, stopped = stream_text(codec, "The answer is 42. More text follows.", ["42."])
    assert stopped
    assert "".join(parts) == "The answer is "


def test_a_partial_match_is_held_back_then_released(codec: Codec) -> None:
    parts, stopped = stream_text(codec, "abc END? no, ENDING is not it", ["END!"])
    assert not stopped
    assert "".join(parts) == "abc END? no, ENDING is not it"
    assert not any(part.endswith("EN") for part in parts[:-1] if part)


def test_earliest_of_several_stops_wins(codec: Codec) -> None:
    parts, _ = stream_text(codec, "one two three", ["three", "two"])
    assert "".join(parts) == "one "
