"""One settings model for the config file, the environment and the CLI.

Precedence, lowest to highest: `config.toml`, `MLXSERVE_*` environment
variables (nested with `__`, e.g. `MLXSERVE_POLICY__NAX_MOE`), CLI flags.
Every field's description is the documentation of that setting.
"""

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from mlxserve.errors import UsageError
from mlxserve.hardware.simulate import SimulatedRank


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def check_group_hosts(hosts: list[str]) -> None:
    """A group mlxserve starts: two or more hosts, rank 0 on this machine (its socket)."""
    if not hosts:
        return
    if len(hosts) < 2:
        raise ValueError("a group needs two or more hosts (one host is a plain local engine)")
    if hosts[0] not in LOCAL_HOSTS:
        raise ValueError(
            f"the first host runs rank 0, which the front reaches over a unix socket: it must "
            f"be this machine ({', '.join(LOCAL_HOSTS)}), got {hosts[0]!r}"
        )


class PolicySettings(_Section):
    nax_moe: Literal["auto", "skip", "full"] = Field(
        "auto",
        description="Force the NAX MoE kernel choice on ranks that have a NAX path "
        "(auto: let the rules decide).",
    )
    overrides: list[str] = Field(
        default_factory=list,
        description="Generic overrides, KEY=VALUE or KEY@RANK=VALUE, e.g. 'nax_moe@1=full'.",
    )
    rules_dir: Path | None = Field(
        None, description="Directory of rule files (*.toml); default: the built-in policies/."
    )


class ClusterSettings(_Section):
    simulate: list[str | SimulatedRank] = Field(
        default_factory=list,
        description="Plan for a simulated cluster instead of probing: one entry per rank, a chip "
        "name ('Apple M5 Max', 'cpu') or a table {chip, macos, mlx}.",
    )
    simulate_self: str | SimulatedRank | None = Field(
        None,
        description="Present this rank as the named chip instead of probing it (for testing "
        "plans on real ranks; also applies to a single machine).",
    )
    backend: Literal["auto", "ring", "jaccl", "mpi", "nccl"] = Field(
        "auto",
        description="Distributed backend. auto: under mlx.launch, jaccl when MLX_JACCL_COORDINATOR "
        "is set, else ring; for a simulated cluster of Macs, jaccl, else ring.",
    )
    wires: int = Field(
        0,
        ge=0,
        description="Links per direction between neighbouring ranks (ring backend). "
        "0: read it from MLX_HOSTFILE, else 1.",
    )
    hosts: list[str] = Field(
        default_factory=list,
        description="Run the primary as a tensor-parallel group that mlxserve starts itself "
        "with mlx.launch's machinery (its --hosts; ring or jaccl per `backend`), supervises "
        "and restarts whole. The first host must be this machine (127.0.0.1 or localhost); "
        "empty: a single local engine (or the group `mlx.launch` started this process in).",
    )

    split: list[int] | None = Field(
        None,
        description="Tensor-parallel split: each rank's share of the sharded weights in "
        "whole parts, e.g. [3, 1] (rank 0 holds 3/4 of every head group and expert column, "
        "rank 1 1/4). The parts, sum(split), must divide the model's output groups and "
        "quantisation groups. Unset: the policy's choice (`mlxserve policy explain`).",
    )

    @field_validator("hosts")
    @classmethod
    def _group_hosts(cls, hosts: list[str]) -> list[str]:
        check_group_hosts(hosts)
        return hosts

    @field_validator("split")
    @classmethod
    def _whole_shares(cls, split: list[int] | None) -> list[int] | None:
        if split is not None and (len(split) < 2 or any(share < 1 for share in split)):
            raise ValueError(
                f"a split is one whole share >= 1 per rank, two ranks or more; got {split}"
            )
        return split

    @model_validator(mode="after")
    def _real_or_simulated(self) -> "ClusterSettings":
        if self.hosts and self.simulate:
            raise ValueError("hosts (a real group) and simulate (a planned one) exclude each other")
        ranks = len(self.hosts) or len(self.simulate)
        if self.split is not None and ranks and len(self.split) != ranks:
            raise ValueError(
                f"split {self.split} has {len(self.split)} shares for {ranks} ranks "
                f"({'hosts' if self.hosts else 'simulate'}); give one share per rank"
            )
        return self


class TuningSettings(_Section):
    """Knobs that trade speed against memory. Unset, each takes the default of the device
    the engine computes on, chosen from measurements (docs/engine.md#tuning)."""

    verify_queue_every_layers: int | None = Field(
        None,
        ge=0,
        description="A speculative verify forward (and the drafts before it) is queued for "
        "the device every this many layers, so the device runs while the host builds the "
        "rest of the round; 0: never. Default: 4.",
    )
    prefill_queue_every_layers: int | None = Field(
        None,
        ge=0,
        description="A prefill chunk is queued for the device every this many layers, so "
        "the device frees a layer's activations while the host builds the next; 0: "
        "evaluated in one piece. Default: 1.",
    )
    compiled_hc_max_rows: int | None = Field(
        None,
        ge=0,
        description="DeepSeek-V4: forwards of at most this many rows (batch x tokens) run "
        "the hyper-connections compiled (mx.compile), larger ones as ops; 0: always the "
        "ops. Default: 64.",
    )
    compiled_decode_max_rows: int | None = Field(
        None,
        ge=0,
        description="DeepSeek-V4: forwards of at most this many rows (batch x tokens) run "
        "the layers' small-op chains fused (the attention's projections, norms and "
        "rotations, the compressors, the router; mx.compile), larger ones as ops; 0: "
        "always the ops. Default: 64.",
    )
    split_attention_queries: bool | None = Field(
        None,
        description="DeepSeek-V4: a forward of 2-8 queries (a verify) attends one query at "
        "a time, unmasked, instead of one masked call. Default: true on CUDA, false on "
        "Metal and the CPU.",
    )
    speculative_batch: int | None = Field(
        None,
        ge=0,
        description="Up to this many requests decoding together draft together, at "
        "speculative_batch_depth; larger batches decode plainly. Default: 2.",
    )
    speculative_batch_depth: int | None = Field(
        None,
        ge=0,
        le=5,
        description="The draft depth of a batch drafting together (at most the engine's "
        "depth); 0: batches never draft. Default: 2.",
    )
    batch_reserve_positions: int | None = Field(
        None,
        ge=1,
        description="Positions a request joining a decode batch of plain KV caches "
        "reserves ahead at most (its remaining tokens when fewer); a row decoding past "
        "them makes the batch's buffers grow (a copy, one layer at a time). Default: 1024.",
    )


class EngineSettings(_Section):
    max_running: int = Field(
        16, ge=1, description="Requests generating at once; more wait in the queue."
    )
    prefill_step: int = Field(
        512,
        ge=16,
        description="Prompt tokens per prefill chunk; the plan may raise it (MoE row floor). "
        "Smaller chunks keep other streams flowing during a long prefill.",
    )
    prefix_cache_entries: int = Field(
        16, ge=0, description="Prompt states kept for exact prefix reuse (0: off)."
    )
    prefix_cache_mb: int = Field(
        1024, ge=0, description="Memory bound of the prefix cache, in MiB."
    )
    warm_up: bool | Literal["auto"] = Field(
        "auto",
        description="Run a few requests through the engine before serving, so kernels that "
        "compile on first use (a GPU: tens of seconds on CUDA) do not stall the first "
        "client. 'auto': on a GPU, off on a CPU. A tensor-parallel group warms up on "
        "every rank.",
    )
    tuning: TuningSettings = Field(default_factory=TuningSettings)  # type: ignore[arg-type]


class SpeculativeSettings(_Section):
    depth: int | Literal["auto"] | None = Field(
        None,
        description="MTP draft depth, 1-5, 0 for off, or 'auto': chosen per request and "
        "round from its acceptance and the measured costs. Unset: 'auto' for models with "
        "an MTP module, 0 otherwise.",
    )

    @field_validator("depth", mode="before")
    @classmethod
    def _depth(cls, value: Any) -> Any:
        """One message for every bad depth (not one per member of the union)."""
        if value is None or value == "auto":
            return value
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 5:
            return value
        raise ValueError("must be 0-5 or 'auto'")


class ChatSettings(_Section):
    """How chat prompts are built when the request does not say."""

    thinking: bool | None = Field(
        None,
        description="Thinking mode by default (a request's `thinking` or "
        "`chat_template_kwargs.thinking` overrides it). Unset: on for DeepSeek-V4's own "
        "prompt encoder, as in DeepSeek's API; the template's own default otherwise. "
        "Applies only to models that have a thinking mode.",
    )


class ServerSettings(_Section):
    """The HTTP front: where it listens, who may call it, and how it protects itself."""

    host: str = Field(
        "127.0.0.1", description="Address to listen on (127.0.0.1: this machine only)."
    )
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on (0: any free port).")
    api_keys: list[str] = Field(
        default_factory=list,
        description="Accepted API keys (Bearer tokens) for /v1/*; empty: no auth. "
        "MLXSERVE_API_KEY adds one more key.",
    )
    model_name: str | None = Field(
        None,
        description="The served model name: the id /v1/models lists and clients send as "
        "`model`; default: `model`. The `model` setting itself (a directory's full path) is "
        "always accepted too.",
    )
    model_aliases: list[str] = Field(
        default_factory=list,
        description="More names clients may send as `model`; /v1/models lists them too.",
    )
    max_body_bytes: int = Field(
        4 << 20, ge=1024, description="Largest request body accepted, in bytes (else 413)."
    )
    max_json_depth: int = Field(
        64,
        ge=8,
        le=200,
        description="Deepest nesting of a request body's JSON (the body's own object is level "
        "1); deeper is a 400 naming the field.",
    )
    max_number_chars: int = Field(
        64,
        ge=16,
        le=1000,
        description="Longest number literal in a request body's JSON, in characters (sign, "
        "point and exponent included); longer is a 400 naming the field.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Time a request's headers may take to arrive, from the connection's start "
        "(or, on a kept-alive connection, from the request's first byte); then the "
        "connection is answered 408 and closed.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Time a request's body may take to arrive once its headers have; then "
        "the request is answered 408 and its connection closed.",
    )
    max_connections: int = Field(
        512,
        ge=1,
        description="Client connections open at once; a request on one beyond it is "
        "answered 503 and its connection closed.",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Without api_keys: Host names accepted besides IP addresses, localhost "
        "(and *.localhost) and `host`; a leading '*.' matches subdomains, '*' any name. "
        "Other names get 421 (DNS rebinding).",
    )
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="Without api_keys: browser origins (scheme://host[:port]) that may call "
        "the API besides the server's own; '*' any. Other origins get 403 (cross-site "
        "requests).",
    )
    max_queue: int = Field(
        64,
        ge=0,
        description="Requests waiting for a slot (beyond engine.max_running); more get 429.",
    )
    request_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest time a backend may show no sign of life (no token, no finished "
        "step) while a request waits on it before the front treats it as failed and resumes "
        "the request on the next one. A long prefill whose steps finish is not silence.",
    )
    hang_floor_s: float = Field(
        3.0,
        gt=0,
        description="A local engine with work whose step counter stands still for "
        "max(hang_floor_s, 20 x the p99 of its recent steps of that kind) is declared hung: "
        "its requests resume on the next backend at once (its own watchdog still ends it).",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM / Ctrl-C: how long in-flight requests may finish before they "
        "are cancelled.",
    )
    ready_timeout_s: float = Field(
        10.0, gt=0, description="Time limit of the one-token health generation."
    )
    ready_interval_s: float = Field(
        5.0,
        gt=0,
        description="How often an idle backend is health-checked with a one-token generation; "
        "/ready fails when the last success is older than three intervals.",
    )
    startup_timeout_s: float = Field(
        600.0, gt=0, description="Longest an engine may take to load and say hello."
    )
    retry_attempts: int = Field(
        4, ge=1, description="Backends tried for one request (first try included)."
    )
    retry_backoff_s: float = Field(
        0.2, ge=0, description="First retry delay; doubles per attempt, with jitter."
    )
    retry_backoff_max_s: float = Field(5.0, ge=0, description="Largest retry delay.")
    client_write_timeout_s: float = Field(
        30.0,
        ge=0,
        description="A client whose response cannot be written for this long (it reads "
        "nothing: its socket's buffers are full) loses its connection, and its request is "
        "cancelled with its slot freed. Never counted against the engine. 0: never.",
    )
    restart_wait_s: float = Field(
        30.0,
        ge=0,
        description="While no backend is healthy (every one restarting), how long an "
        "admitted request waits for one to come back before it fails with 503; it then "
        "resumes exactly where it stopped. The demo engine restarts in about 3 s.",
    )
    restart_backoff_s: float = Field(
        1.0, ge=0, description="First delay before restarting a failed local engine; doubles."
    )
    restart_backoff_max_s: float = Field(
        60.0, ge=0, description="Largest delay between restarts of a failed local engine."
    )
    retry_after_s: int = Field(
        1, ge=1, description="Retry-After (seconds) sent with 429 and 503 answers."
    )
    status_sample_s: float = Field(
        2.0,
        ge=0.05,
        le=60.0,
        description="How often the dashboard's history (/status, /v1/status) takes a "
        "sample of throughput, latency, step times, memory, acceptance and the queue.",
    )
    status_history_samples: int = Field(
        450,
        ge=10,
        le=5000,
        description="Samples the dashboard's history keeps in memory (the newest); "
        "with status_sample_s, how far back its charts reach.",
    )
    state_dir: Path | None = Field(
        None,
        description="Directory of what mlxserve remembers across runs: `mlxserve policy "
        "calibrate`'s records (read by the speed rule) and incidents.json (the hangs "
        "and watchdog exits the incident-pinned rule reads). Default: "
        "$MLXSERVE_CACHE_DIR, else ~/.cache/mlxserve.",
    )
    engine_env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment of the primary engine process. MLXSERVE_FAULT_* "
        "entries (fault injection for tests) apply to its first start only.",
    )


def state_dir(server: "ServerSettings") -> Path:
    """Where state that outlives a run lives: `server.state_dir`, else the user's cache
    (`$MLXSERVE_CACHE_DIR`, else `~/.cache/mlxserve`)."""
    if server.state_dir is not None:
        return server.state_dir.expanduser()
    cache = os.environ.get("MLXSERVE_CACHE_DIR")
    return Path(cache) if cache else Path.home() / ".cache" / "mlxserve"


class FallbackSettings(_Section):
    """One backend tried after the primary: a local engine or another server's URL."""

    name: str | None = Field(None, description="Name in logs and metrics; default: fallbackN.")
    model: str | None = Field(
        None, description="Local engine: its model ('demo' or a directory) (exclusive with url)."
    )
    policy: list[str] = Field(
        default_factory=list,
        description="Local engine: its policy overrides (replace [policy] overrides).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Local engine: extra environment (MLXSERVE_FAULT_* on first start only).",
    )
    hosts: list[str] = Field(
        default_factory=list,
        description="Local engine: run it as a tensor-parallel group on these hosts, as "
        "[cluster] hosts does for the primary.",
    )
    url: str | None = Field(
        None, description="Remote OpenAI-compatible server, e.g. http://127.0.0.1:8001/v1."
    )
    api_key: str | None = Field(None, description="Remote server: Bearer token to send.")

    @model_validator(mode="after")
    def _one_kind(self) -> "FallbackSettings":
        if (self.model is None) == (self.url is None):
            raise ValueError("a fallback needs exactly one of 'model' (local) or 'url' (remote)")
        if self.hosts and self.url is not None:
            raise ValueError("'hosts' starts a local group; a remote 'url' has none")
        return self

    @field_validator("hosts")
    @classmethod
    def _group_hosts(cls, hosts: list[str]) -> list[str]:
        check_group_hosts(hosts)
        return hosts

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        """An address the remote backend can call; anything else is refused at startup
        (it would only fail, with a log line, once the server was serving)."""
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http:// or https:// address with a host")
        try:
            parts.port  # noqa: B018 (raises ValueError for a port out of range or not a number)
        except ValueError as exc:
            raise ValueError(f"{url!r}: {exc}") from None
        return url


class Settings(BaseSettings):
    """All of mlxserve's settings."""

    model_config = SettingsConfigDict(
        env_prefix="MLXSERVE_", env_nested_delimiter="__", extra="forbid"
    )

    model: str = Field("demo", description="Model to serve: 'demo' or a local model directory.")
    policy: PolicySettings = Field(default_factory=PolicySettings)  # type: ignore[arg-type]
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)  # type: ignore[arg-type]
    engine: EngineSettings = Field(default_factory=EngineSettings)  # type: ignore[arg-type]
    speculative: SpeculativeSettings = Field(default_factory=SpeculativeSettings)  # type: ignore[arg-type]
    server: ServerSettings = Field(default_factory=ServerSettings)  # type: ignore[arg-type]
    chat: ChatSettings = Field(default_factory=ChatSettings)  # type: ignore[arg-type]
    fallback: list[FallbackSettings] = Field(
        default_factory=list,
        description="Backends tried in order when the primary engine is not healthy "
        "([[fallback]] tables).",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_file = _CONFIG_FILE.get("path")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)


# The TOML source needs the path at construction time; `load_settings` sets it
# for the duration of one call only.
_CONFIG_FILE: dict[str, Path | None] = {}


def load_settings(path: Path | None = None, cli: dict[str, Any] | None = None) -> Settings:
    """Settings from the file at `path` (optional), the environment and CLI values.

    A bad file, key or value raises `UsageError` with one line naming it.
    """
    file_data: dict[str, Any] = {}
    if path is not None:
        file_data = _read_toml(path)
    _CONFIG_FILE["path"] = path
    try:
        return Settings(**(cli or {}))
    except ValidationError as exc:
        raise UsageError(_describe(exc, path, file_data, cli or {})) from None
    except SettingsError as exc:
        # e.g. a list-valued MLXSERVE_* variable that is not JSON
        raise UsageError(_describe_env_error(exc)) from None
    finally:
        _CONFIG_FILE.clear()


def _describe_env_error(exc: SettingsError) -> str:
    """One line naming the variable(s) pydantic-settings could not parse."""
    match = re.search(r'field "([^"]+)"', str(exc))
    prefix = f"MLXSERVE_{match.group(1).upper()}" if match else "MLXSERVE_"
    names = sorted(n for n in os.environ if n.upper().startswith(prefix))
    where = ", ".join(names) or "environment"
    return f"{where}: cannot parse the value (lists and tables are written as JSON): {exc}"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise UsageError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read config file: {exc.strerror}") from None


def _describe(
    exc: ValidationError, path: Path | None, file_data: dict[str, Any], cli: dict[str, Any]
) -> str:
    error = exc.errors()[0]
    loc = [str(part) for part in error["loc"] if not isinstance(part, int)]
    key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"]).lstrip(".")
    key = key or "(top level)"
    where = _source_of(loc, path, file_data, cli, list(error["loc"]))
    more = f" (and {len(exc.errors()) - 1} more problems)" if len(exc.errors()) > 1 else ""
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown key '{key}'{more}"
    return f"{where}: invalid value for '{key}': {error['msg']}{more}"


def _has_key(data: dict[str, Any], loc: list[str] | list[str | int]) -> bool:
    """Whether `data` holds the key at `loc` (an int steps into a list: [[fallback]])."""
    node: Any = data
    for part in loc:
        if isinstance(part, int):
            if not isinstance(node, list) or not 0 <= part < len(node):
                return False
        elif not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _source_of(
    loc: list[str],
    path: Path | None,
    file_data: dict[str, Any],
    cli: dict[str, Any],
    indexed: list[str | int],
) -> str:
    """Where the bad value came from, by precedence: command line, a variable, the file.

    Why by precedence: a key may be in the file *and* in a variable; the value
    that failed is the one that won, and the operator must fix that one. ``loc``
    names the key as flags and variables do; ``indexed`` keeps the list indices the
    file needs (a [[fallback]] table).
    """
    if _has_key(cli, loc):
        return "command line"
    variable = _env_variable(loc)
    if variable is not None:
        return variable
    if path is not None and _has_key(file_data, indexed):
        return str(path)
    return "MLXSERVE_" + "__".join(p.upper() for p in loc)


def _env_variable(loc: list[str]) -> str | None:
    """The set MLXSERVE_* variable that carries `loc`: the key's own, or a section's (JSON)."""
    present = {name.upper(): name for name in os.environ}
    for depth in range(len(loc), 0, -1):
        name = "MLXSERVE_" + "__".join(p.upper() for p in loc[:depth])
        if name in present:
            return present[name]
    return None
