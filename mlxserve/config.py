"""One settings model for the config file, the environment and the CLI.

Precedence, lowest to highest: `config.toml`, `MLXSERVE_*` environment
variables (nested with `__`, e.g. `MLXSERVE_POLICY__NAX_MOE`), CLI flags.
Every field's description is the documentation of that setting.
"""

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
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


class Settings(BaseSettings):
    """All of mlxserve's settings."""

    model_config = SettingsConfigDict(
        env_prefix="MLXSERVE_", env_nested_delimiter="__", extra="forbid"
    )

    model: str = Field("demo", description="Model to serve: 'demo' or a local model directory.")
    policy: PolicySettings = Field(default_factory=PolicySettings)  # type: ignore[arg-type]
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)  # type: ignore[arg-type]

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
        raise UsageError(_describe(exc, path, file_data)) from None
    except SettingsError as exc:
        # e.g. a list-valued MLXSERVE_* variable that is not JSON
        raise UsageError(f"environment: {exc} (lists and tables are written as JSON)") from None
    finally:
        _CONFIG_FILE.clear()


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


def _describe(exc: ValidationError, path: Path | None, file_data: dict[str, Any]) -> str:
    error = exc.errors()[0]
    loc = [str(part) for part in error["loc"] if not isinstance(part, int)]
    key = ".".join(loc) or "(top level)"
    where = str(path) if path is not None and _has_key(file_data, loc) else _env_name(loc)
    more = f" (and {len(exc.errors()) - 1} more problems)" if len(exc.errors()) > 1 else ""
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown key '{key}'{more}"
    return f"{where}: invalid value for '{key}': {error['msg']}{more}"


def _has_key(data: dict[str, Any], loc: list[str]) -> bool:
    node: Any = data
    for part in loc:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _env_name(loc: list[str]) -> str:
    return "environment/command line (MLXSERVE_" + "__".join(p.upper() for p in loc) + ")"
