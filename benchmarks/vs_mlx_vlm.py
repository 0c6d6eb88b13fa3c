"""mlxserve against mlx-vlm on one checkpoint, in one process; prints one JSON document.

Why: mlx-vlm (0.7.10, MLX-native, DeepSeek-V4 with MTP and DSpark drafters) is the
closest peer that runs on the same framework, so it is the opponent whose numbers
say whether mlxserve's serving path earns its keep. Both sides read the SAME
directory: a DeepSeek-V4-Flash-shaped model (V4-Flash's layer pattern, hash layers,
hc_mult 4, top-6 MoE, one MTP block, as `mtp_cost.flash_shaped` builds it, at small
width, random weights) written in DeepSeek's published layout by
`mlxserve.models.deepseek_v4.publish`.

Per side it reports: decode tok/s at depth 0 (greedy, same prompt, same token
count), MTP at each depth each side supports (mlxserve: fixed 1..3 and auto;
mlx-vlm: its `deepseek_v4_mtp` drafter at each ``draft_block_size``) and the best of
them, TTFT, and the non-view graph nodes of one decode step (the method of
`graph_nodes.py`: one one-token forward's lazy graph, with the cache, counted by
primitive). It checks that the greedy tokens of depth 0 agree.

The heads are random, so drafts are almost never accepted: "MTP at its best depth"
here measures what each side's speculative loop costs when it does not pay, not
the speed-up a trained head gives. DSpark is not compared (the JSON says why).

mlx-vlm accepts compression ratios 0, 4 and 128 only (V4-Flash's), and its CSA
(ratio 4) decode drops the previous window's overlap (docs/deepseek-v4-flash.md), so
greedy tokens through CSA layers may differ after a few decode steps; the agreement
check is therefore also run on a CSA-free variant (CSA layers made HCA).

Run: python benchmarks/vs_mlx_vlm.py [--layers 8] [--hidden 256] [--tokens 24]
CPU, short: python benchmarks/vs_mlx_vlm.py --layers 8 --hidden 256 --tokens 24 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mtp_cost
from graph_nodes import count_nodes, kernels_of

from mlxserve.channel.request import GenerationParams
from mlxserve.engine.core.drive import run_to_completion
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.adapter import PlainAdapter
from mlxserve.engine.spec.mtp import MTPAdapter
from mlxserve.hardware.probe import benchmark_device

MLXSERVE_DEPTHS: tuple[int | str, ...] = (1, 2, 3, "auto")
#: mlx-vlm's ``draft_block_size``: the bonus token plus the drafts (1 + depth).
MLX_VLM_BLOCKS = (2, 3, 4)
DSPARK_NOT_COMPARED = (
    "not run on either side: mlx-vlm's deepseek_v4_dspark drafter loads a head only "
    "from the -0731 published stage names (mtp.0..N with main_proj, markov_head, "
    "confidence_head), and mlxserve has no writer of its DSpark head in those names "
    "(publish.py writes the main model and MTP blocks only), so there is no one "
    "directory both can draft from; writing that inverse of sanitize_head was outside "
    "this stop's time box"
)


def flash_config(
    layers: int, hidden: int, experts: int, vocab: int, csa: bool = True
) -> dict[str, Any]:
    """`mtp_cost.flash_shaped`'s config (V4-Flash's layer pattern at ``hidden`` width);
    ``csa`` False makes its CSA layers HCA (ratio 128), which mlx-vlm decodes exactly."""
    from mlxserve.models.deepseek_v4 import ModelArgs
    from mlxserve.models.deepseek_v4.config import CSA, HCA

    config = mtp_cost.flash_config(layers, hidden, experts, vocab)
    if not csa:
        types = ModelArgs.from_dict(config).layer_types or []
        config["layer_types"] = [HCA if t == CSA else t for t in types]
    return config


def write_published(directory: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """A random model of ``config`` (with its MTP block) in DeepSeek's published layout,
    weights scaled like `mtp_cost.flash_shaped`'s (float32: both loaders read it as is)."""
    from mlxserve.models.deepseek_v4 import Model, ModelArgs
    from mlxserve.models.deepseek_v4.model import MTPBlock
    from mlxserve.models.deepseek_v4.publish import published_config, published_weights

    args = ModelArgs.from_dict(config)
    model = Model(args)
    model.mtp = [MTPBlock(args, t) for t in args.mtp_layer_types or []]
    mx.random.seed(seed)
    mtp_cost.randomize(model, args.n_routed_experts, norms_near_one=True)
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), published_weights(model))
    config_json = published_config(args, {"bos_token_id": 0, "eos_token_id": 1})
    (directory / "config.json").write_text(json.dumps(config_json))
    return directory


# --- mlxserve -------------------------------------------------------------------------


def load_mlxserve(directory: Path) -> Any:
    from mlxserve.engine.core.build import materialize
    from mlxserve.models.loader import load_model

    model, _ = load_model(directory, memory_bytes=0)
    materialize(model)
    return model


def mlxserve_run(engine: Engine, prompt: list[int], tokens: int, name: str) -> dict[str, Any]:
    """One greedy request through the engine: decode tok/s (after the first token),
    TTFT, the tokens and the speculative summary."""
    done = run_to_completion(
        engine, GenerationRequest(name, GenerationParams(tuple(prompt), tokens))
    )
    decode_s = done.total_s - done.ttft_s
    spec = done.finish.speculative or {}
    return {
        "decode_tok_s": (len(done.tokens) - 1) / decode_s,
        "ttft_s": done.ttft_s,
        "tokens": list(done.tokens),
        "acceptance_per_position": spec.get("acceptance_rate_per_depth"),
    }


def mlxserve_side(
    model: Any, prompt: list[int], tokens: int, repeats: int, depths: tuple[int | str, ...]
) -> dict[str, Any]:
    plain = Engine(PlainAdapter(model), EngineConfig(speculative_depth=0, prefix_cache_entries=0))
    out: dict[str, Any] = {
        "depth0": measured(lambda n: mlxserve_run(plain, prompt, tokens, n), repeats)
    }
    mtp: dict[str, Any] = {}
    for depth in depths:
        config = EngineConfig(speculative_depth=depth, prefix_cache_entries=0)  # type: ignore[arg-type]
        engine = Engine(MTPAdapter(model), config)
        mtp[str(depth)] = measured(partial(mlxserve_run, engine, prompt, tokens), repeats)
    out["mtp"] = mtp
    return out


def mlxserve_decode_nodes(model: Any, prompt: list[int]) -> dict[str, Any]:
    """Non-view nodes of one decode step: a one-token forward plus the head, with the
    prefilled cache (`graph_nodes.whole_forwards`' method)."""
    adapter = MTPAdapter(model)
    state = adapter.new_state(max_rollback=4)
    adapter.prefill(state, prompt)
    streams = model.forward_hidden(mx.array([[prompt[-1]]]), state.cache)
    logits = model.head_from_streams(streams)
    return node_summary(count_nodes([logits, *[c.state for c in state.cache]]))


# --- mlx-vlm --------------------------------------------------------------------------


def mlx_vlm_run(
    model: Any,
    prompt: list[int],
    tokens: int,
    drafter: Any = None,
    block: int | None = None,
) -> dict[str, Any]:
    """One greedy generation through mlx-vlm's `generate_step` (its decode loop, or
    its speculative rounds with ``drafter``): decode tok/s after the first token, TTFT."""
    from mlx_vlm.generate.ar import generate_step

    started = time.perf_counter()
    kwargs: dict[str, Any] = {"max_tokens": tokens, "temperature": 0.0}
    if drafter is not None:
        kwargs.update(draft_model=drafter, draft_kind="mtp", draft_block_size=block)
    steps: Iterator[Any] = generate_step(mx.array([prompt]), model, None, None, **kwargs)
    out: list[int] = []
    ttft = 0.0
    for token, _ in steps:
        out.append(int(token))
        if len(out) == 1:
            ttft = time.perf_counter() - started
        if len(out) >= tokens:
            break
    total = time.perf_counter() - started
    return {
        "decode_tok_s": (len(out) - 1) / (total - ttft),
        "ttft_s": ttft,
        "tokens": out,
    }


def mlx_vlm_side(
    directory: Path, model: Any, prompt: list[int], tokens: int, repeats: int
) -> dict[str, Any]:
    from mlx_vlm.speculative.drafters import load_drafter

    out: dict[str, Any] = {
        "depth0": measured(lambda _n: mlx_vlm_run(model, prompt, tokens), repeats)
    }
    try:
        drafter, kind = load_drafter(str(directory), kind="mtp")
    except Exception as error:  # mlx-vlm's loader: record why, do not fail the run
        out["mtp"] = {"not_run": f"load_drafter failed: {error!r}"}
        return out
    mtp: dict[str, Any] = {"drafter_kind": kind}
    for block in MLX_VLM_BLOCKS:
        try:
            mtp[f"depth{block - 1}"] = measured(
                partial(_vlm_named, model, prompt, tokens, drafter, block), repeats
            )
        except Exception as error:
            mtp[f"depth{block - 1}"] = {"not_run": repr(error), "where": _last_frame()}
    out["mtp"] = mtp
    return out


def mlx_vlm_decode_nodes(model: Any, prompt: list[int]) -> dict[str, Any]:
    """Non-view nodes of mlx-vlm's one-token forward (logits) with its prefilled cache."""
    from mlx_vlm.models.cache import make_prompt_cache

    lm = model.language_model
    cache = make_prompt_cache(lm)
    mx.eval(lm(mx.array([prompt]), cache=cache).logits, [c.state for c in cache])
    logits = lm(mx.array([[prompt[-1]]]), cache=cache).logits
    return node_summary(count_nodes([logits, *_arrays([c.state for c in cache])]))


def _vlm_named(
    model: Any, prompt: list[int], tokens: int, drafter: Any, block: int, _name: str
) -> dict[str, Any]:
    return mlx_vlm_run(model, prompt, tokens, drafter, block)


# --- shared ---------------------------------------------------------------------------


def _last_frame() -> str:
    frames = traceback.extract_tb(sys.exc_info()[2])
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _arrays(tree: Any) -> list[mx.array]:
    """The arrays in ``tree`` (mlx-vlm's cache states hold None and nested lists too)."""
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [a for item in tree for a in _arrays(item)]
    if isinstance(tree, dict):
        return [a for item in tree.values() for a in _arrays(item)]
    return []


def node_summary(counts: Any) -> dict[str, Any]:
    kernels = kernels_of(counts)
    return {"non_view_nodes": sum(kernels.values()), "by_primitive": kernels}


def measured(run: Callable[[str], dict[str, Any]], repeats: int) -> dict[str, Any]:
    """One untimed warm-up, then the median decode rate and TTFT over ``repeats``."""
    run("warm-up")
    runs = [run(f"r{i}") for i in range(repeats)]
    out = {
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "ttft_s": statistics.median(r["ttft_s"] for r in runs),
        "tokens": runs[-1]["tokens"],
    }
    if runs[-1].get("acceptance_per_position") is not None:
        out["acceptance_per_position"] = runs[-1]["acceptance_per_position"]
    return out


def best_speculative(side: dict[str, Any]) -> dict[str, Any] | None:
    rates = {
        k: v["decode_tok_s"]
        for k, v in side.get("mtp", {}).items()
        if isinstance(v, dict) and "decode_tok_s" in v
    }
    if not rates:
        return None
    depth = max(rates, key=lambda k: rates[k])
    return {"depth": depth, "decode_tok_s": rates[depth]}


def agreement(a: list[int], b: list[int]) -> dict[str, Any]:
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    return {
        "identical": first is None and len(a) == len(b),
        "first_difference": first,
        "compared": n,
    }


def greedy_agreement(directory: Path, prompt: list[int], tokens: int) -> dict[str, Any]:
    """Depth-0 greedy tokens of both loaders on ``directory``."""
    import mlx_vlm.utils

    ours = load_mlxserve(directory)
    theirs = mlx_vlm.utils.load_model(directory)
    plain = Engine(PlainAdapter(ours), EngineConfig(speculative_depth=0, prefix_cache_entries=0))
    a = mlxserve_run(plain, prompt, tokens, "agree")["tokens"]
    b = mlx_vlm_run(theirs, prompt, tokens)["tokens"]
    return agreement(a, b)


def compare(
    layers: int,
    hidden: int,
    experts: int,
    vocab: int,
    prompt_tokens: int,
    tokens: int,
    repeats: int,
    depths: tuple[int | str, ...] = MLXSERVE_DEPTHS,
    agreement_tokens: int = 24,
) -> dict[str, Any]:
    """The whole comparison (see the module docstring), as a dict."""
    import mlx_vlm
    import mlx_vlm.utils

    prompt = [random.Random(1).randrange(2, vocab) for _ in range(prompt_tokens)]
    result: dict[str, Any] = {
        "benchmark": "vs_mlx_vlm",
        "device": benchmark_device(),
        "mlx_vlm_version": getattr(mlx_vlm, "__version__", "unknown"),
        "model": {
            "shape": "DeepSeek-V4-Flash layer pattern (mtp_cost.flash_shaped), random weights",
            "layers": layers,
            "hidden": hidden,
            "routed_experts": experts,
            "vocab": vocab,
            "mtp_blocks": 1,
            "weights": "float32, DeepSeek's published names (publish.py), one directory",
        },
        "prompt_tokens": prompt_tokens,
        "tokens": tokens,
        "repeats": repeats,
        "greedy": True,
    }
    with tempfile.TemporaryDirectory() as folder:
        directory = write_published(
            Path(folder) / "flash", flash_config(layers, hidden, experts, vocab)
        )
        ours = load_mlxserve(directory)
        theirs = mlx_vlm.utils.load_model(directory)
        result["layer_types"] = ours.args.layer_types
        mlxserve = mlxserve_side(ours, prompt, tokens, repeats, depths)
        mlxserve["graph_nodes_per_decode_step"] = mlxserve_decode_nodes(ours, prompt)
        vlm = mlx_vlm_side(directory, theirs, prompt, tokens, repeats)
        vlm["graph_nodes_per_decode_step"] = mlx_vlm_decode_nodes(theirs, prompt)
        for side in (mlxserve, vlm):
            side["best_mtp"] = best_speculative(side)
            side["dspark"] = {"not_run": DSPARK_NOT_COMPARED}
        result["mlxserve"], result["mlx_vlm"] = mlxserve, vlm
        depth0 = agreement(mlxserve["depth0"]["tokens"], vlm["depth0"]["tokens"])
        result["greedy_depth0_agree"] = {"flash_pattern_with_csa": depth0}
        csa_free = write_published(
            Path(folder) / "no-csa", flash_config(layers, hidden, experts, vocab, csa=False)
        )
        result["greedy_depth0_agree"]["csa_free_variant"] = greedy_agreement(
            csa_free, prompt, agreement_tokens
        )
    result["ratios"] = {
        "depth0_mlxserve_over_mlx_vlm": mlxserve["depth0"]["decode_tok_s"]
        / vlm["depth0"]["decode_tok_s"],
        "ttft_mlx_vlm_over_mlxserve": vlm["depth0"]["ttft_s"] / mlxserve["depth0"]["ttft_s"],
    }
    if mlxserve["best_mtp"] and vlm["best_mtp"]:
        result["ratios"]["best_speculative_mlxserve_over_mlx_vlm"] = (
            mlxserve["best_mtp"]["decode_tok_s"] / vlm["best_mtp"]["decode_tok_s"]
        )
    best_ours = max(
        mlxserve["depth0"]["decode_tok_s"], (mlxserve["best_mtp"] or {}).get("decode_tok_s", 0)
    )
    best_theirs = max(vlm["depth0"]["decode_tok_s"], (vlm["best_mtp"] or {}).get("decode_tok_s", 0))
    result["ratios"]["best_setting_mlxserve_over_mlx_vlm"] = best_ours / best_theirs
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    started = time.perf_counter()
    result = compare(
        args.layers, args.hidden, args.experts, args.vocab, args.prompt, args.tokens, args.repeats
    )
    result["wall_s"] = time.perf_counter() - started
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
