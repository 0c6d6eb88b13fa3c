"""Helpers for tests of the engine process: a tiny model directory and a socket client.

Not a conftest (pytest does not load it by name): test modules import from it.
The model is a random two-layer llama with a byte-level BPE tokenizer, built
offline in a temporary directory, so a process starts in about a second.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

CONTEXT_LENGTH = 512
START_TIMEOUT_S = 90.0
REPLY_TIMEOUT_S = 30.0
EOS = "<|end|>"

_CORPUS = [
    "The engine process owns the model; the front process owns the clients.",
    "A wedged collective never returns, so the watchdog ends the process.",
    "def add(a, b):\n    return a + b\n",
    "Tokens stream to the front one line at a time over a unix socket.",
] * 20


def build_tiny_model(directory: Path) -> Path:
    """A loadable mlx-lm model directory: random llama weights, config and a tokenizer."""
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)  # type: ignore[no-untyped-call]
    fast.save_pretrained(directory)

    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": tokenizer.get_vocab_size(),
        "max_position_embeddings": CONTEXT_LENGTH,
        "tie_word_embeddings": False,
        "eos_token_id": tokenizer.token_to_id(EOS),
    }
    mx.random.seed(0)
    args = llama.ModelArgs(**{k: v for k, v in config.items() if k != "eos_token_id"})
    model = llama.Model(args)
    mx.eval(model.parameters())
    save_model(directory, model)
    save_config(config, directory / "config.json")
    return directory


class EngineProcess:
    """A running `python -m mlxserve.engine` and one connection to it."""

    def __init__(
        self,
        tmp: Path,
        model: Path | str,
        *,
        policy: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.socket_path = tmp / "sock" / "engine.sock"
        self.stderr_path = tmp / "engine.stderr"
        command = [sys.executable, "-m", "mlxserve.engine"]
        command += ["--socket", str(self.socket_path), "--model", str(model)]
        for item in policy:
            command += ["--policy", item]
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("MLXSERVE_")}
        full_env.update(env or {})
        self._stderr = self.stderr_path.open("wb")
        self.proc = subprocess.Popen(command, stderr=self._stderr, env=full_env)
        self.sock: socket.socket | None = None
        self._buffer = b""
        self.progress: list[dict[str, Any]] = []  # the engine's step-counter reports

    # -- lifecycle ------------------------------------------------------------

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self.socket_path.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"engine exited {self.proc.returncode}:\n{self.stderr()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not ready in {timeout} s:\n{self.stderr()}")
            time.sleep(0.05)

    def connect(self) -> dict[str, Any]:
        """Connect and return the hello message."""
        self.wait_ready()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(REPLY_TIMEOUT_S)
        sock.connect(str(self.socket_path))
        self.sock, self._buffer = sock, b""
        hello = self.recv()
        assert hello["type"] == "hello", hello
        return hello

    def disconnect(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def terminate(self) -> int:
        self.disconnect()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(REPLY_TIMEOUT_S)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            message = f"engine still running after {timeout} s:\n{self.stderr()}"
            raise AssertionError(message) from None

    def close(self) -> None:
        self.disconnect()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._stderr.close()

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    # -- messages ---------------------------------------------------------------

    def send_raw(self, data: bytes) -> None:
        assert self.sock is not None
        self.sock.sendall(data)

    def send(self, **message: Any) -> None:
        self.send_raw(json.dumps(message).encode() + b"\n")

    def recv(self, timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        """The next message; `progress` reports are kept aside in `self.progress`."""
        while True:
            message = self._recv(timeout)
            if message.get("type") != "progress":
                return message
            self.progress.append(message)

    def _recv(self, timeout: float) -> dict[str, Any]:
        assert self.sock is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no message in {timeout} s:\n{self.stderr()}")
            self.sock.settimeout(remaining)
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the engine closed the connection")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        message: dict[str, Any] = json.loads(line)
        return message

    def generate(self, request_id: str, prompt_ids: list[int], **params: Any) -> None:
        """A `generate` message; ``params``: the other fields of its `GenerationParams`."""
        self.send(type="generate", id=request_id, params={"prompt_ids": prompt_ids, **params})

    def collect(self, request_id: str) -> tuple[list[int], dict[str, Any], list[dict[str, Any]]]:
        """Tokens and the finish of `request_id`; other messages received meanwhile."""
        tokens: list[int] = []
        others: list[dict[str, Any]] = []
        for _ in range(100_000):
            message = self.recv()
            if message.get("id") != request_id:
                others.append(message)
            elif message["type"] == "tokens":
                tokens.extend(message["token_ids"])
            elif message["type"] == "finish":
                return tokens, message, others
            else:
                others.append(message)
        raise AssertionError("no finish")

    def messages_until(self, kind: str) -> Iterator[dict[str, Any]]:
        for _ in range(100_000):
            message = self.recv()
            yield message
            if message["type"] == kind:
                return
