"""The `mlxserve` command line.

Flags override `MLXSERVE_*` variables, which override the config file. Every
operator mistake ends as one line on stderr and exit code 2.
"""

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from mlxserve.errors import UsageError
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.torchless import hide_torch

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line, not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="config file (TOML); see config.toml")
    parser.add_argument(
        "--cluster",
        metavar="CHIPS",
        help="plan for a simulated cluster, e.g. 'Apple M3 Ultra,Apple M5 Max' "
        "(per rank: CHIP[:macos=V][:mlx=V][:memory=GiB]; 'cpu' or 'cuda' for a Linux CPU or "
        "NVIDIA rank)",
    )
    parser.add_argument(
        "--backend",
        choices=["auto", "ring", "jaccl", "mpi", "nccl"],
        help="distributed backend of the (simulated) cluster",
    )
    parser.add_argument(
        "--nax-moe-policy",
        choices=["auto", "skip", "full"],
        help="force the NAX MoE kernel on ranks with a NAX path (default: auto, the rules)",
    )
    parser.add_argument(
        "--policy",
        action="append",
        metavar="KEY=VALUE",
        help="override a plan decision; KEY@RANK=VALUE for one rank (repeatable)",
    )


def _depth(text: str) -> int | str:
    """``--speculative-depth``: 0-5 or ``auto``."""
    if text == "auto":
        return text
    if text.isdigit() and 0 <= int(text) <= 5:
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not 0-5 or 'auto'")


def _cli_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The CLI layer of the settings: only what was given on the command line."""
    values: dict[str, Any] = {"policy": {}, "cluster": {}, "speculative": {}, "server": {}}
    if getattr(args, "model", None):
        values["model"] = args.model
    if getattr(args, "speculative_depth", None) is not None:
        values["speculative"]["depth"] = args.speculative_depth
    if getattr(args, "host", None):
        values["server"]["host"] = args.host
    if getattr(args, "port", None) is not None:
        values["server"]["port"] = args.port
    if getattr(args, "served_model_name", None):
        values["server"]["model_name"] = args.served_model_name
    if getattr(args, "cluster", None):
        from mlxserve.hardware.simulate import parse_cluster_spec

        values["cluster"]["simulate"] = parse_cluster_spec(args.cluster)
    if getattr(args, "backend", None):
        values["cluster"]["backend"] = args.backend
    if getattr(args, "nax_moe_policy", None):
        values["policy"]["nax_moe"] = args.nax_moe_policy
    if getattr(args, "policy", None):
        values["policy"]["overrides"] = args.policy
    return {key: value for key, value in values.items() if value}


def _cmd_probe(args: argparse.Namespace) -> int:
    from mlxserve.hardware.probe import probe_local

    summary = probe_local().summary()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        width = max(len(key) for key in summary)
        for key, value in summary.items():
            print(f"{key.ljust(width)}  {value}")
    return 0


def _cmd_policy_explain(args: argparse.Namespace) -> int:
    from mlxserve.config import load_settings
    from mlxserve.policy.explain import explain_text
    from mlxserve.startup.plan import build_plan

    settings = load_settings(args.config, _cli_settings(args))
    plan, _ = build_plan(settings)
    if args.json:
        print(json.dumps(plan.document(), indent=2))
    else:
        print(explain_text(plan))
    return 0


def _cmd_policy_calibrate(args: argparse.Namespace) -> int:
    from mlxserve.commands.calibrate import run_calibrate
    from mlxserve.config import load_settings

    settings = load_settings(args.config, _cli_settings(args))
    return run_calibrate(
        settings,
        chunks=args.chunk or (),
        repeats=args.repeats,
        budget_s=args.budget,
        dtype=args.dtype,
        progress=not args.quiet,
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def _add_calibrate(policy_commands: Any) -> None:
    calibrate = policy_commands.add_parser(
        "calibrate", help="time the MoE kernel variants on this device; the plan reads it"
    )
    calibrate.add_argument("--config", type=Path, help="config file (TOML); see config.toml")
    calibrate.add_argument("--model", help="model directory or 'demo' (default: from config)")
    calibrate.add_argument(
        "--chunk",
        type=_positive_int,
        action="append",
        metavar="TOKENS",
        help="prefill chunk to measure (repeatable; default: the engine's prefill step)",
    )
    calibrate.add_argument(
        "--repeats", type=_positive_int, default=3, help="timed rounds per shape (default: 3)"
    )
    calibrate.add_argument(
        "--budget",
        type=_positive_float,
        default=120.0,
        metavar="SECONDS",
        help="larger chunks are left out once this is spent (default: 120)",
    )
    calibrate.add_argument(
        "--dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        default="auto",
        help="activation dtype (default: the model's)",
    )
    calibrate.add_argument("--quiet", action="store_true", help="no progress bar")
    calibrate.set_defaults(handler=_cmd_policy_calibrate)


def _cmd_policy_incidents(args: argparse.Namespace) -> int:
    from mlxserve.config import load_settings, state_dir
    from mlxserve.reliability.incidents import IncidentStore

    settings = load_settings(args.config, _cli_settings(args))
    store = IncidentStore(state_dir(settings.server))
    if args.clear:
        print(f"cleared {store.clear()} incident(s) from {store.path}")
        return 0
    records = store.load()
    if args.json:
        print(json.dumps([r.model_dump(mode="json") for r in records], indent=2))
        return 0
    if not records:
        print(f"no incidents remembered ({store.path})")
        return 0
    print(f"{len(records)} incident(s) remembered in {store.path}, newest last:")
    for r in records:
        nax = ",".join(str(d.get("nax_moe", "?")) for d in r.decisions.get("ranks", []))
        print(
            f"  {r.when()}  {r.kind:<8} backend {r.backend}  plan {r.plan_hash[:12]}  "
            f"{r.composition} [{', '.join(r.chips)}]  nax_moe {nax}  step {r.step_kind or '?'}"
        )
        if r.evidence:
            print("    evidence: " + ", ".join(f"{k}={v}" for k, v in r.evidence.items()))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from mlxserve.commands.generate import run_generate
    from mlxserve.config import load_settings

    return run_generate(load_settings(args.config, _cli_settings(args)), args)


def _add_generate(commands: Any) -> None:
    generate = commands.add_parser("generate", help="run one generation through the engine")
    _add_config_flags(generate)
    generate.add_argument("--model", help="model directory or 'demo' (default: from config)")
    generate.add_argument("--prompt", required=True, help="the user message (or raw text)")
    generate.add_argument("--max-tokens", type=int, default=256, help="default: 256")
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    generate.add_argument("--seed", type=int, help="seed for sampling")
    generate.add_argument(
        "--speculative-depth",
        type=_depth,
        metavar="{0..5,auto}",
        help="MTP draft depth (0: off; auto: chosen per round; default: config, auto for "
        "MTP models)",
    )
    generate.add_argument(
        "--stop", action="append", metavar="TEXT", help="stop before this text (repeatable)"
    )
    generate.add_argument("--raw", action="store_true", help="do not apply the chat template")
    generate.add_argument("--json", action="store_true", help="print one JSON document")
    generate.set_defaults(handler=_cmd_generate)


def _cmd_serve(args: argparse.Namespace) -> int:
    from mlxserve.commands.serve import run_serve
    from mlxserve.config import load_settings

    return run_serve(load_settings(args.config, _cli_settings(args)))


def _add_serve(commands: Any) -> None:
    serve = commands.add_parser(
        "serve", help="serve the OpenAI-compatible API (also: mlxserve --config F)"
    )
    _add_config_flags(serve)
    serve.add_argument("--model", help="model directory or 'demo' (default: from config)")
    serve.add_argument("--host", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, help="TCP port (default: 8000; 0: any free port)")
    serve.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model id clients send and /v1/models lists (server.model_name; default: "
        "--model); the model's path stays accepted",
    )
    serve.add_argument(
        "--speculative-depth",
        type=_depth,
        metavar="{0..5,auto}",
        help="MTP draft depth (0: off; auto: chosen per round; default: config, auto for "
        "MTP models)",
    )
    serve.set_defaults(handler=_cmd_serve)


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from mlxserve.commands.demo_model import run_demo_model

    return run_demo_model(
        args.out, progress=not args.quiet, deepseek_format=args.deepseek_format, dspark=args.dspark
    )


def _add_demo_model(commands: Any) -> None:
    demo = commands.add_parser(
        "demo-model", help="build the built-in demo checkpoint and print its directory"
    )
    demo.add_argument(
        "--out", type=Path, help="target directory (default: the cache, as model = 'demo' uses)"
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument(
        "--deepseek-format",
        action="store_true",
        help="the variant with DeepSeek-V4's special tokens and no chat template "
        "(prompts from DeepSeek-V4's own encoder)",
    )
    demo.add_argument(
        "--dspark",
        action="store_true",
        help="the -0731-style variant: a DSpark draft head in place of the MTP block",
    )
    demo.set_defaults(handler=_cmd_demo_model)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mlxserve", description=__doc__.splitlines()[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    probe = commands.add_parser("probe", help="show this machine's hardware profile")
    probe.add_argument("--json", action="store_true", help="print JSON")
    probe.set_defaults(handler=_cmd_probe)

    policy = commands.add_parser("policy", help="inspect or calibrate the kernel-policy plan")
    policy_commands = policy.add_subparsers(
        dest="policy_command", metavar="COMMAND", parser_class=_Parser
    )
    policy_commands.required = True
    explain = policy_commands.add_parser("explain", help="print the plan and why")
    _add_config_flags(explain)
    explain.add_argument("--json", action="store_true", help="print the plan as JSON")
    explain.add_argument(
        "--model",
        help="model directory the tensor-parallel split is planned for (default: from config)",
    )
    explain.set_defaults(handler=_cmd_policy_explain)
    _add_calibrate(policy_commands)
    incidents = policy_commands.add_parser(
        "incidents", help="list (or --clear) the remembered hangs the plan reads"
    )
    incidents.add_argument("--config", type=Path, help="config file (TOML); see config.toml")
    incidents.add_argument("--json", action="store_true", help="print the records as JSON")
    incidents.add_argument("--clear", action="store_true", help="forget every incident")
    incidents.set_defaults(handler=_cmd_policy_incidents)
    _add_generate(commands)
    _add_serve(commands)
    _add_demo_model(commands)
    return parser


def _with_default_command(argv: Sequence[str]) -> list[str]:
    """`mlxserve --config F` (flags, no command) means `mlxserve serve --config F`."""
    args = list(argv)
    if args and args[0].startswith("-") and args[0] not in ("-h", "--help"):
        return ["serve", *args]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_with_default_command(sys.argv[1:] if argv is None else argv))
    handler: Callable[[argparse.Namespace], int] = args.handler
    configure_cuda_graphs()  # before any device work; engine processes inherit it
    try:
        return handler(args)
    except UsageError as exc:
        print(f"mlxserve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): not an error of ours.
        sys.stderr.close()
        return 0


def entry() -> NoReturn:
    """The ``mlxserve`` program (and ``python -m mlxserve``): `main` in a process that
    keeps PyTorch out (`mlxserve.torchless`); tests call `main` in their own process."""
    hide_torch()
    sys.exit(main())


if __name__ == "__main__":
    entry()
