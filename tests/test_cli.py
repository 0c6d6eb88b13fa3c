"""The command line as a user runs it: a real subprocess, exit codes, one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def mlxserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxserve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
    )


def test_probe_json() -> None:
    run = mlxserve("probe", "--json")
    assert run.returncode == 0, run.stderr
    profile = json.loads(run.stdout)
    for key in (
        "hostname",
        "chip",
        "gpu_architecture",
        "nax",
        "os_name",
        "os_version",
        "mlx_version",
        "mlx_lm_version",
        "memory_bytes",
        "device_type",
    ):
        assert key in profile


def test_probe_text() -> None:
    run = mlxserve("probe")
    assert run.returncode == 0
    assert "mlx_version" in run.stdout


def test_policy_explain_table_for_the_reported_pair() -> None:
    run = mlxserve(
        "policy", "explain", "--config", "config.toml", "--cluster", "Apple M3 Ultra,Apple M5 Max"
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "simulated cluster: 2 rank(s)" in lines[0]
    rank0 = next(line for line in lines if line.startswith("0 "))
    rank1 = next(line for line in lines if line.startswith("1 "))
    assert "Apple M3 Ultra (simulated)" in rank0 and "off [nax-moe-no-path]" in rank0
    assert "Apple M5 Max (simulated)" in rank1 and "full [nax-moe-mixed-cluster-full]" in rank1


def test_policy_explain_json_with_contradicting_override() -> None:
    run = mlxserve(
        "policy",
        "explain",
        "--cluster",
        "Apple M3 Ultra,Apple M5 Max",
        "--nax-moe-policy",
        "skip",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert plan["ranks"][1]["decisions"]["nax_moe"]["value"] == "skip"
    assert plan["ranks"][1]["decisions"]["nax_moe"]["rule"] == "override"
    assert plan["overrides"][0]["key"] == "nax_moe"
    assert plan["warnings"][0]["rule"] == "nax-moe-mixed-cluster-full"
    assert plan["simulated"] is True and len(plan["plan_hash"]) == 64


def test_policy_explain_on_this_machine() -> None:
    run = mlxserve("policy", "explain", "--json")
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert plan["world_size"] == 1 and plan["simulated"] is False


def test_config_flag_precedence_over_environment(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "MLXSERVE_POLICY__NAX_MOE": "full"}
    base = ["policy", "explain", "--cluster", "Apple M5 Max", "--json"]
    from_env = json.loads(mlxserve(*base, env=env).stdout)
    from_cli = json.loads(mlxserve(*base, "--nax-moe-policy", "skip", env=env).stdout)
    assert from_env["ranks"][0]["decisions"]["nax_moe"]["value"] == "full"
    assert from_cli["ranks"][0]["decisions"]["nax_moe"]["value"] == "skip"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["policy", "explain", "--config", "missing.toml"], "missing.toml: config file not found"),
        (["policy", "explain", "--cluster", "Apple M9"], "unknown chip 'Apple M9'"),
        (["policy", "explain", "--policy", "nax_moe=fast"], "nax_moe must be one of"),
        (["policy", "explain", "--nax-moe-policy", "fast"], "invalid choice: 'fast'"),
        (
            ["policy", "explain", "--cluster", "Apple M5 Max", "--policy", "nax_moe@3=full"],
            "rank 3 does not exist",
        ),
        (["teleport"], "invalid choice: 'teleport'"),
        ([], "required: COMMAND"),
    ],
)
def test_errors_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    run = mlxserve(*args)
    assert run.returncode == 2
    assert message in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert "Traceback" not in run.stderr


def test_bad_config_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[policy]\nnax_moe = "sometimes"\n')
    run = mlxserve("policy", "explain", "--config", str(path))
    assert run.returncode == 2
    assert run.stderr.startswith(f"mlxserve: error: {path}: invalid value for 'policy.nax_moe'")
    assert len(run.stderr.strip().splitlines()) == 1


def test_a_split_the_model_cannot_take_is_one_line(tmp_path: Path) -> None:
    """``[cluster] split`` is checked against the model's groups before anything starts."""
    from tests.models.published_layouts import write_checkpoint

    config = {"model_type": "deepseek_v4", "o_groups": 2, "moe_intermediate_size": 64}
    weight = ("BF16", (2, 2), bytes(8))
    model = write_checkpoint(tmp_path / "m", config, {"head.weight": weight}, shards=1)
    path = tmp_path / "split.toml"
    simulate = '["Apple M3 Ultra", "Apple M5 Max"]'
    path.write_text(f'model = "{model}"\n[cluster]\nsimulate = {simulate}\nsplit = [3, 1]\n')
    run = mlxserve("policy", "explain", "--config", str(path))
    assert run.returncode == 2
    assert "cluster.split [3, 1]: 4 parts do not divide the model's 2" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_an_uneven_split_of_another_model_type_is_one_line(tmp_path: Path) -> None:
    """Only DeepSeek-V4 takes uneven shares: `serve` refuses before anything starts."""
    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3_moe"}')
    path = tmp_path / "split.toml"
    simulate = '["Apple M3 Ultra", "Apple M5 Max"]'
    path.write_text(f'model = "{model}"\n[cluster]\nsimulate = {simulate}\nsplit = [3, 1]\n')
    run = mlxserve("serve", "--config", str(path))
    assert run.returncode == 2
    assert "an uneven split needs a DeepSeek-V4 model" in run.stderr and "'qwen3_moe'" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_refused_plan_is_explained_not_started() -> None:
    run = mlxserve(
        "policy",
        "explain",
        "--cluster",
        "Apple M5 Max:mlx=0.31.2,Apple M5 Max",
        "--backend",
        "jaccl",
    )
    assert run.returncode == 0
    assert "startup: refuse [jaccl-mesh-allreduce-race]" in run.stdout


def test_closed_pipe_is_not_a_crash() -> None:
    many = ",".join(["Apple M5 Max"] * 100)
    with subprocess.Popen(
        # 100 ranks of JSON overflow the pipe buffer, so the write must meet the closed pipe.
        [sys.executable, "-m", "mlxserve", "policy", "explain", "--json", "--cluster", many],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.read(10)
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 0
    assert "Traceback" not in err
