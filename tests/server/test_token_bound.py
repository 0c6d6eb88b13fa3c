"""The size bound: a text's token count from its bytes, and refusing from it untokenized."""

import random
from typing import Any

import pytest
from starlette.testclient import TestClient
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from mlxserve.server.app import create_app
from mlxserve.server.token_bound import UNICODE_SHRINK, bytes_per_token, min_tokens
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.conftest import make_runtime
from tests.server.fakes import FakeBackend

LONGEST = "-----------+--------------------------------"  # the demo's longest token


def test_the_demo_bound_is_its_longest_token(tokenizer: FrontTokenizer) -> None:
    assert tokenizer.bytes_per_token == len(LONGEST)
    # Tight: a text made of the longest token has exactly the bound's count.
    text = LONGEST * 50
    assert tokenizer.min_tokens(text) == len(tokenizer.text_ids(text)) == 50


def test_the_bound_never_exceeds_the_real_count(tokenizer: FrontTokenizer) -> None:
    rng = random.Random(0)
    texts = [
        " " * 3000,
        "hello world " * 200,
        "<|user|><|assistant|>" * 40,  # added tokens: each one token
        "é日本🙂" * 100,
        "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(2000)),
        "".join(rng.choice(["-", "+", "=", " ", "\n", "a"]) for _ in range(4000)),
    ]
    for text in texts:
        assert 0 < tokenizer.min_tokens(text) <= len(tokenizer.text_ids(text)), text[:40]


def bpe(**parts: Any) -> Tokenizer:
    vocab = {"a": 0, "b": 1, "ab": 2, "abab": 3}
    tokenizer = Tokenizer(models.BPE(vocab, [("a", "b"), ("ab", "ab")], **parts))
    return tokenizer


@pytest.mark.parametrize(
    ("normalizer", "pre_tokenizer", "expected"),
    [
        (None, None, 4.0),  # "abab", but never under one character's 4 bytes
        (normalizers.NFKC(), None, 4.0 * UNICODE_SHRINK),
        (normalizers.Sequence([normalizers.Lowercase(), normalizers.NFC()]), None, 64.0),
        (normalizers.Replace("  ", " "), None, 8.0),
        (normalizers.Replace(" ", "\u2581"), pre_tokenizers.Metaspace(), 4.0),
        (normalizers.Replace(" ", ""), None, None),  # deletes
        (normalizers.Strip(), None, None),
        (normalizers.BertNormalizer(), None, None),
        (None, pre_tokenizers.Whitespace(), None),  # drops whitespace
        (None, pre_tokenizers.Split(" ", "removed"), None),
        (None, pre_tokenizers.Split(" ", "isolated"), 4.0),
        (None, pre_tokenizers.ByteLevel(), 4.0),
    ],
)
def test_each_step_of_the_pipeline(
    normalizer: Any, pre_tokenizer: Any, expected: float | None
) -> None:
    tokenizer = bpe()
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    if pre_tokenizer is not None:
        tokenizer.pre_tokenizer = pre_tokenizer
    assert bytes_per_token(tokenizer) == expected


def test_models_without_a_bound() -> None:
    fused = bpe(unk_token="?", fuse_unk=True)
    assert bytes_per_token(fused) is None  # a run of unknown characters is one token
    assert bytes_per_token(bpe(unk_token="?", fuse_unk=True, byte_fallback=True)) == 4.0
    word = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert bytes_per_token(word) is None  # a whole unknown word is one token
    unigram = Tokenizer(models.Unigram([("<unk>", 0.0), ("abc", -1.0)], 0, byte_fallback=False))
    assert bytes_per_token(unigram) is None
    fallback = Tokenizer(models.Unigram([("<unk>", 0.0), ("abcdef", -1.0)], 0, byte_fallback=True))
    assert bytes_per_token(fallback) == 6.0


def test_added_tokens() -> None:
    tokenizer = bpe()
    tokenizer.add_special_tokens(["<|a long special token|>"])
    assert bytes_per_token(tokenizer) == len("<|a long special token|>")
    tokenizer.add_tokens([AddedToken("<mask>", lstrip=True)])  # swallows any whitespace
    assert bytes_per_token(tokenizer) is None


def test_min_tokens_counts_utf8_bytes() -> None:
    assert min_tokens("abcd" * 10, 4.0) == 10
    assert min_tokens("é", 1.0) == 2  # two bytes
    assert min_tokens("a", 4.0) == 1
    assert min_tokens("", 4.0) == 0
    assert min_tokens("anything", None) == 0


@pytest.fixture
def big_client(tokenizer: FrontTokenizer, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    """An app whose tokenizer must not be asked to encode a huge text."""
    fake = FakeBackend("primary", context_length=256).up()
    runtime = make_runtime(tokenizer, [fake], max_body_bytes=1 << 20)
    encode = tokenizer.text_ids

    def guarded(text: str) -> list[int]:
        assert len(text) < 100_000, "a prompt refused by its size was tokenized"
        return encode(text)

    monkeypatch.setattr(tokenizer, "text_ids", guarded)
    return TestClient(create_app(runtime), raise_server_exceptions=False)


HUGE = "Python reference: the for statement. " * 10_000  # 370 kB: over 256 x 44 bytes


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}]}, "messages"),
        ("/v1/completions", {"prompt": HUGE}, "prompt"),
        ("/v1/responses", {"input": HUGE}, "input"),
        (
            "/v1/messages",
            {"max_tokens": 4, "messages": [{"role": "user", "content": HUGE}]},
            "messages",
        ),
    ],
)
def test_a_prompt_too_large_is_refused_untokenized(
    big_client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    response = big_client.post(path, json={"model": "demo", **body})
    assert response.status_code == 400, response.text
    if path == "/v1/messages":  # Anthropic's error shape names no param
        assert "at least" in response.json()["error"]["message"]
        return
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == param
    assert "at least" in error["message"] and "context is 256" in error["message"]


def test_counting_routes_still_count_a_long_prompt(
    big_client: TestClient, tokenizer: FrontTokenizer
) -> None:
    """/tokenize and count_tokens generate nothing: the prompt is counted, whatever its size."""
    text = "Python reference. " * 1000  # 18 kB: over the bound of a 256-token context
    response = big_client.post("/tokenize", json={"model": "demo", "prompt": text})
    assert response.status_code == 200, response.text
    assert response.json()["count"] == len(tokenizer.text_ids(text)) > 256
    count = big_client.post(
        "/v1/messages/count_tokens",
        json={"model": "demo", "messages": [{"role": "user", "content": text}]},
    )
    assert count.status_code == 200, count.text
    assert count.json()["input_tokens"] > 256
