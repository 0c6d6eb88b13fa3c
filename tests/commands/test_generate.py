"""`mlxserve generate` on the demo model, run as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROMPT = "What does the assert statement do?"

pytestmark = pytest.mark.slow


def generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxserve", "generate", "--model", "demo", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )


def generate_json(*args: str) -> dict[str, object]:
    run = generate("--json", *args)
    assert run.returncode == 0, run.stderr
    document: dict[str, object] = json.loads(run.stdout)
    return document


@pytest.fixture(scope="module")
def plain() -> dict[str, object]:
    """Greedy, no drafting: the reference the other runs are compared with."""
    return generate_json("--prompt", PROMPT, "--max-tokens", "48", "--speculative-depth", "0")


def test_greedy_text_is_identical_at_every_depth(plain: dict[str, object]) -> None:
    assert plain["speculative"] == {"depth": 0, "drafted": 0, "accepted": 0, "acceptance_rate": 0.0}
    for depth in ("1", "5", "auto"):
        spec = generate_json("--prompt", PROMPT, "--max-tokens", "48", "--speculative-depth", depth)
        assert spec["token_ids"] == plain["token_ids"]
        assert spec["text"] == plain["text"]
        stats = spec["speculative"]
        assert isinstance(stats, dict)
        chosen = stats["depths_chosen"]
        assert isinstance(chosen, dict) and sum(chosen.values()) > 0
        if depth == "auto":
            # The depths it chose, each a round (or, as "0", a plain step).
            assert stats["depth"] == "auto"
            assert set(chosen) <= {str(k) for k in range(6)}
            continue
        assert stats["depth"] == int(depth) and stats["drafted"] > 0
        assert sum(int(k) * n for k, n in chosen.items()) == stats["drafted"]
        assert stats["accepted"] > 0  # the trained MTP head does get drafts accepted
        assert len(stats["acceptance_rate_per_depth"]) == int(depth)


def test_json_document_fields(plain: dict[str, object]) -> None:
    document = plain
    assert set(document) >= {"text", "token_ids", "finish_reason", "usage", "speculative"}
    usage = document["usage"]
    assert isinstance(usage, dict) and isinstance(document["token_ids"], list)
    assert usage["completion_tokens"] == len(document["token_ids"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert document["finish_reason"] in ("stop", "length")


def test_seeded_sampling_is_reproducible() -> None:
    args = ("--prompt", PROMPT, "--max-tokens", "16", "--temperature", "0.9", "--seed", "5")
    assert generate_json(*args)["token_ids"] == generate_json(*args)["token_ids"]


def test_stop_string_ends_the_text_before_it(plain: dict[str, object]) -> None:
    text = plain["text"]
    assert isinstance(text, str) and len(text) > 10
    stop = text[5:9]
    cut = generate_json("--prompt", PROMPT, "--max-tokens", "48", "--stop", stop)
    assert cut["text"] == text[: text.index(stop)]
    assert cut["finish_reason"] == "stop"


def test_plain_text_output() -> None:
    run = generate("--prompt", PROMPT, "--max-tokens", "12")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", "x", "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt", "x", "--model", "/no/such/model"], "no such model directory"),
        (["--prompt", "x", "--config", "/no/such.toml"], "config file not found"),
        (["--prompt", "x", "--speculative-depth", "9"], "'9' is not 0-5 or 'auto'"),
    ],
)
def test_bad_input_is_one_line(args: list[str], message: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mlxserve", "generate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert run.returncode == 2
    assert message in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
