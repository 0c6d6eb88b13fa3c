"""mlxserve against mlx-vlm on the same checkpoints, in one process; prints one JSON document.

Why: mlx-vlm (0.7.10, MLX-native, DeepSeek-V4 with MTP and DSpark drafters) is the
closest peer that runs on the same framework, so it is the opponent whose numbers
say whether mlxserve's serving path earns its keep. Both sides read the SAME
directories, written in DeepSeek's published layout by
`mlxserve.models.deepseek_v4.publish` (main model, MTP block, DSpark head). Two groups:

* ``flash``: a DeepSeek-V4-Flash-shaped model (V4-Flash's layer pattern, hash layers,
  hc_mult 4, top-6 MoE, `mtp_cost.flash_config` at small width, random float32
  weights), written twice with the same main weights: with its MTP block, and with a
  random -0731-style DSpark head (``--stages`` stages, blocks of ``--block``, taps of
  three layers) in its place. Random heads draft wrong, so the speculative rows
  measure what each side's loop costs when drafting does not pay.
* ``demo``: the demo's trained MTP and DSpark heads, on a variant of the demo that
  mlx-vlm can build: mlx-vlm accepts compression ratios 0, 4 and 128 only, so the
  demo's HCA layer (ratio 16) is written at ratio 128 (its positional bias tiled).
  Below 128 positions such a layer never compresses, so it is the demo's network with
  that layer's compressed entries gone; both sides run that same function, and its
  heads still draft right most of the time (the JSON has the acceptance).

Per side and group: decode tok/s at depth 0 (greedy, same prompt, same token count),
MTP at each depth each side has (mlxserve: 1..3 and auto; mlx-vlm: its
``deepseek_v4_mtp`` drafter at ``draft_block_size`` 2..4), DSpark (mlxserve: its
adaptive verification under the automatic depth and at the block as ceiling; mlx-vlm:
its ``deepseek_v4_dspark`` drafter at each ``draft_block_size`` up to the block),
each side's best setting, TTFT, and the non-view graph nodes of one decode step (the
method of `graph_nodes.py`), mlxserve's both as one sequence's forward and as its
engine runs one request (a decode batch of one row, stacked caches). Every runner is
warmed once, then the runs are interleaved (one of each, ``--repeats`` times, until
``--budget-s``), medians reported. ``loops`` times the bare models in the same hand
written decode loop (forward, argmax, ``async_eval`` of the next step before the
current token is read), so the gap between the engines splits into the models' and
the loops' shares.

mlx-vlm's CSA (ratio 4) decode drops the previous window's overlap
(docs/deepseek-v4-flash.md), so greedy tokens through CSA layers part after a few
steps; the agreement check also runs on the Flash pattern with its CSA layers made
HCA. Both sides run in one process, so MLX settings are shared (on CUDA mlxserve's
graph cache size, `configure_cuda_graphs`, which helps both).

Run: python benchmarks/vs_mlx_vlm.py [--layers 8] [--hidden 256] [--tokens 24]
CPU, short: python benchmarks/vs_mlx_vlm.py --layers 8 --hidden 256 --tokens 24 --repeats 1
GPU (H100, ~6 min): python benchmarks/vs_mlx_vlm.py --layers 43 --hidden 512 --experts 64
  --tokens 48 --repeats 3 --budget-s 300
Partial results go to stderr as JSON lines while it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
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
from mlxserve.engine.runner.batch import RowBatch
from mlxserve.engine.spec.dspark import DSparkAdapter
from mlxserve.engine.spec.mtp import MTPAdapter
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device

MLXSERVE_DEPTHS: tuple[int | str, ...] = (1, 2, 3, "auto")
#: mlx-vlm's ``draft_block_size``: the bonus token plus the drafts (1 + depth).
MLX_VLM_BLOCKS = (2, 3, 4)
#: The demo's prompt (a chat turn it was trained on the like of).
DEMO_TEXT = "<|user|>Python reference: the for statement<|end|><|assistant|>"

#: One timed run: its name -> decode tok/s, TTFT, tokens (and acceptance, if it drafts).
Runner = Callable[[str], dict[str, Any]]


def note(record: dict[str, Any]) -> None:
    """A partial result, as one JSON line on stderr (a run cut short still leaves them)."""
    print(json.dumps(record, default=str), file=sys.stderr, flush=True)


# --- checkpoints ----------------------------------------------------------------------


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


def flash_model(config: dict[str, Any], seed: int = 0) -> Any:
    """A random model of ``config`` with its MTP block, weights scaled like
    `mtp_cost.flash_shaped`'s, float32 (both loaders read it as is)."""
    from mlxserve.models.deepseek_v4 import Model, ModelArgs
    from mlxserve.models.deepseek_v4.model import MTPBlock

    args = ModelArgs.from_dict(config)
    model = Model(args)
    model.mtp = [MTPBlock(args, t) for t in args.mtp_layer_types or []]
    mx.random.seed(seed)
    mtp_cost.randomize(model, args.n_routed_experts, norms_near_one=True)
    return model


def with_dspark_head(model: Any, block: int, stages: int, seed: int = 1) -> Any:
    """``model`` (its MTP blocks dropped) with a random -0731-style DSpark head in their
    place: ``stages`` stages, blocks of ``block``, taps of the first, middle and last
    layer (distinct from 3 layers on), as ``config.json``'s ``dspark_*`` keys say."""
    from mlxserve.models.deepseek_v4.dspark import DSparkHead, DSparkSpec

    layers = model.args.num_hidden_layers
    taps = tuple(sorted({0, layers // 2, layers - 1}))
    model.args = dataclasses.replace(
        model.args,
        num_nextn_predict_layers=0,
        mtp_layer_types=[],
        dspark_block_size=block,
        dspark_target_layer_ids=list(taps),
        dspark_markov_rank=64,
        dspark_noise_token_id=0,
    )
    model.mtp = []
    spec = DSparkSpec(block, taps, 0, stages, 64, confidence_with_markov=True)
    head = DSparkHead(model.args, spec)
    mx.random.seed(seed)
    mtp_cost.randomize(head, model.args.n_routed_experts, norms_near_one=True)
    model["dspark"] = head
    return model


def write(model: Any, directory: Path) -> Path:
    from mlxserve.models.deepseek_v4.publish import write_published

    return write_published(model, directory, {"bos_token_id": 0, "eos_token_id": 1})


def ratio_128_variant(source: Path, directory: Path) -> Path:
    """``source`` (a DeepSeek-V4 checkpoint mlxserve loads) in the published layout with
    its HCA layers at ratio 128 (their positional bias tiled to 128 rows): what mlx-vlm
    builds (see the module docstring); the CSA ratio must be 4."""
    from mlxserve.models.deepseek_v4.config import CSA, HCA
    from mlxserve.models.deepseek_v4.publish import published_config, published_weights
    from mlxserve.models.loader import load_model

    model, config = load_model(source, memory_bytes=0)
    args = model.args
    if args.compress_ratio(CSA) != 4:
        raise ValueError(f"{source}: CSA ratio {args.compress_ratio(CSA)}, mlx-vlm needs 4")
    ratio = args.compress_ratio(HCA)
    weights = published_weights(model)
    for index, kind in enumerate(args.layer_types or []):
        if kind == HCA:
            name = f"layers.{index}.attn.compressor.ape"
            weights[name] = mx.tile(weights[name], (128 // ratio, 1))
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "pt"})
    tokens: dict[str, Any] = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    variant = dataclasses.replace(args, compress_rates={CSA: 4, HCA: 128})
    (directory / "config.json").write_text(json.dumps(published_config(variant, tokens)))
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


def mlxserve_runners(model: Any, prompt: list[int], tokens: int, drafter: str) -> dict[str, Runner]:
    """mlxserve's settings on ``model``: plain, and ``drafter`` ("mtp", "dspark") at its
    depths, each its own engine (prefix cache off: every run prefills)."""

    def engine(adapter: Any, depth: int | str) -> Runner:
        config = EngineConfig(speculative_depth=depth, prefix_cache_entries=0)  # type: ignore[arg-type]
        built = Engine(adapter, config)
        return lambda name: mlxserve_run(built, prompt, tokens, name)

    runners = {"depth0": engine(PlainAdapter(model), 0)}
    if drafter == "mtp":
        for depth in MLXSERVE_DEPTHS:
            runners[f"mtp_{depth}"] = engine(MTPAdapter(model), depth)
    else:
        block = DSparkAdapter(model).max_draft_depth
        runners["dspark_auto"] = engine(DSparkAdapter(model), "auto")
        runners[f"dspark_{block}"] = engine(DSparkAdapter(model), block)
    return runners


def mlxserve_decode_nodes(model: Any, prompt: list[int]) -> dict[str, Any]:
    """Non-view nodes of one decode step with the prefilled cache: one sequence's
    one-token forward plus the head (`graph_nodes.whole_forwards`' method), and the
    step as the engine runs a lone request (a `RowBatch` of one row, stacked caches)."""
    adapter = PlainAdapter(model)
    state = adapter.new_state(0)
    adapter.prefill(state, prompt)
    cache = state.cache
    logits = model(mx.array([[prompt[-1]]]), cache)
    single = node_summary(count_nodes([mx.argmax(logits[0, -1]), *[c.state for c in cache]]))
    state = adapter.new_state(0)
    adapter.prefill(state, prompt)
    batch = RowBatch(model, [state])
    logits = batch.step(mx.array([prompt[-1]]))
    caches = batch.decode_caches()
    batched = node_summary(count_nodes([mx.argmax(logits, -1), *[c.state for c in caches]]))
    return {"one_sequence": single, "engine_decode_batch_of_one": batched}


# --- mlx-vlm --------------------------------------------------------------------------


def mlx_vlm_run(
    model: Any,
    prompt: list[int],
    tokens: int,
    drafter: Any = None,
    kind: str = "mtp",
    block: int | None = None,
) -> dict[str, Any]:
    """One greedy generation through mlx-vlm's `generate_step` (its decode loop, or its
    speculative rounds with ``drafter`` of ``kind``): decode tok/s after the first token,
    TTFT, and the drafts kept per drafted (its own round counters)."""
    from mlx_vlm.generate.ar import generate_step

    before = _vlm_counters(drafter)
    started = time.perf_counter()
    kwargs: dict[str, Any] = {"max_tokens": tokens, "temperature": 0.0}
    if drafter is not None:
        kwargs.update(draft_model=drafter, draft_kind=kind, draft_block_size=block)
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
    result: dict[str, Any] = {
        "decode_tok_s": (len(out) - 1) / (total - ttft),
        "ttft_s": ttft,
        "tokens": out,
    }
    if drafter is not None:
        after = _vlm_counters(drafter)
        drafted = after[1] - before[1]
        result["accepted_per_drafted"] = (after[0] - before[0]) / drafted if drafted else None
    return result


def _vlm_counters(drafter: Any) -> tuple[float, int]:
    return (
        float(getattr(drafter, "speculative_total_accepted", 0.0)),
        int(getattr(drafter, "speculative_total_drafted", 0)),
    )


def mlx_vlm_runners(
    directory: Path, model: Any, prompt: list[int], tokens: int, drafter_kind: str, block: int
) -> tuple[dict[str, Runner], dict[str, Any]]:
    """mlx-vlm's settings on ``directory``: plain, and its ``drafter_kind`` drafter ("mtp":
    ``deepseek_v4_mtp``; "dspark": ``deepseek_v4_dspark``) at each block size; and what
    its drafter loader said."""
    from mlx_vlm.speculative.drafters import load_drafter

    runners: dict[str, Runner] = {"depth0": lambda _n: mlx_vlm_run(model, prompt, tokens)}
    kind = "mtp" if drafter_kind == "mtp" else "dflash"
    try:
        drafter, resolved = load_drafter(str(directory), kind=kind)
    except Exception as error:  # mlx-vlm's loader: record why, do not fail the run
        return runners, {"not_run": f"load_drafter failed: {error!r}"}
    blocks = MLX_VLM_BLOCKS if drafter_kind == "mtp" else tuple(range(2, block + 2))
    for size in blocks:
        runners[f"{drafter_kind}_{size - 1}"] = _vlm_runner(
            model, prompt, tokens, drafter, resolved, size
        )
    return runners, {"drafter": type(drafter).__name__, "kind": resolved}


def _vlm_runner(
    model: Any, prompt: list[int], tokens: int, drafter: Any, kind: str, block: int
) -> Runner:
    return lambda _name: mlx_vlm_run(model, prompt, tokens, drafter, kind, block)


def mlx_vlm_decode_nodes(model: Any, prompt: list[int]) -> dict[str, Any]:
    """Non-view nodes of mlx-vlm's one-token forward (logits) with its prefilled cache."""
    from mlx_vlm.models.cache import make_prompt_cache

    lm = model.language_model
    cache = make_prompt_cache(lm)
    mx.eval(lm(mx.array([prompt]), cache=cache).logits, [c.state for c in cache])
    logits = lm(mx.array([[prompt[-1]]]), cache=cache).logits
    return node_summary(count_nodes([mx.argmax(logits[0, -1]), *_arrays([c.state for c in cache])]))


# --- the bare models in one loop ------------------------------------------------------


def hand_loop(step: Callable[[mx.array], mx.array], first: mx.array, tokens: int) -> dict[str, Any]:
    """mlx-lm's decode loop: the next step is queued before the current token is read
    (`pipelined.pipelined_steps`); ``tokens`` tokens, ``first`` included."""
    from pipelined import pipelined_steps  # beside this file

    seconds, read = pipelined_steps(step, first, tokens - 1)
    return {"decode_tok_s": 1 / seconds, "ttft_s": 0.0, "tokens": read[:tokens]}


def loop_runners(ours: Any, theirs: Any, prompt: list[int], tokens: int) -> dict[str, Runner]:
    """The bare models in `hand_loop`: mlxserve's forward on one sequence's caches, the
    same through a one-row `RowBatch` (what the engine steps), and mlx-vlm's forward."""
    from mlx_vlm.models.cache import make_prompt_cache

    def ours_one_sequence(_name: str) -> dict[str, Any]:
        cache = ours.make_cache()
        ours(mx.array([prompt[:-1]]), cache)
        mx.eval([c.state for c in cache])
        first = mx.argmax(ours(mx.array([prompt[-1:]]), cache)[0, -1])
        return hand_loop(lambda y: mx.argmax(ours(y.reshape(1, 1), cache)[0, -1]), first, tokens)

    def ours_decode_batch(_name: str) -> dict[str, Any]:
        adapter = PlainAdapter(ours)
        state = adapter.new_state(0)
        adapter.prefill(state, prompt[:-1])
        first = mx.argmax(adapter.step(state, mx.array(prompt[-1:])))
        mx.eval(first)
        batch = RowBatch(ours, [state])
        return hand_loop(lambda y: mx.argmax(batch.step(y.reshape(1)), -1)[0], first, tokens)

    lm = theirs.language_model

    def theirs_one_sequence(_name: str) -> dict[str, Any]:
        cache = make_prompt_cache(lm)
        lm(mx.array([prompt[:-1]]), cache=cache)
        mx.eval([c.state for c in cache])
        first = mx.argmax(lm(mx.array([prompt[-1:]]), cache=cache).logits[0, -1])
        return hand_loop(
            lambda y: mx.argmax(lm(y.reshape(1, 1), cache=cache).logits[0, -1]), first, tokens
        )

    return {
        "mlxserve_one_sequence": ours_one_sequence,
        "mlxserve_decode_batch_of_one": ours_decode_batch,
        "mlx_vlm_one_sequence": theirs_one_sequence,
        # mlx-vlm's generate_step builds and runs its steps on a thread-local stream of
        # its own (``generation_stream``); the same loops on one say what that is worth.
        "mlxserve_one_sequence_own_stream": on_own_stream(ours_one_sequence),
        "mlx_vlm_one_sequence_own_stream": on_own_stream(theirs_one_sequence),
    }


def on_own_stream(run: Runner) -> Runner:
    """``run`` inside a thread-local stream of its own on the default device, as
    mlx-vlm's ``generate_step`` decodes (``mlx_vlm.generate.common.generation_stream``)."""
    stream = mx.new_thread_local_stream(mx.default_device())

    def streamed(name: str) -> dict[str, Any]:
        with mx.stream(stream):
            return run(name)

    return streamed


# --- measuring ------------------------------------------------------------------------


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


def interleaved(
    group: str, runners: dict[str, Runner], repeats: int, deadline: float
) -> dict[str, dict[str, Any]]:
    """Each runner warmed once, then one run of each in turn, ``repeats`` times or until
    ``deadline`` (``time.monotonic``; at least one timed run each); per runner the
    median decode rate and TTFT, the last run's tokens and acceptance."""
    for name, run in runners.items():
        began = time.monotonic()
        run("warm-up")
        note({"group": group, "warmed": name, "s": round(time.monotonic() - began, 2)})
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    for index in range(repeats):
        if index and time.monotonic() > deadline:
            note({"group": group, "repeats_cut_at": index, "reason": "--budget-s"})
            break
        for name, run in runners.items():
            runs[name].append(run(f"r{index}"))
        note(
            {
                "group": group,
                "repeat": index,
                "decode_tok_s": {n: round(r[-1]["decode_tok_s"], 2) for n, r in runs.items()},
            }
        )
    return {name: summary(result) for name, result in runs.items()}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "ttft_s": statistics.median(r["ttft_s"] for r in runs),
        "runs": len(runs),
        "tokens": runs[-1]["tokens"],
    }
    for key in ("acceptance_per_position", "accepted_per_drafted"):
        if runs[-1].get(key) is not None:
            out[key] = runs[-1][key]
    return out


def best(side: dict[str, Any], prefix: str = "") -> dict[str, Any] | None:
    """The fastest of ``side``'s settings whose name starts with ``prefix``."""
    rates = {
        name: value["decode_tok_s"]
        for name, value in side.items()
        if name.startswith(prefix) and isinstance(value, dict) and "decode_tok_s" in value
    }
    if not rates:
        return None
    name = max(rates, key=lambda k: rates[k])
    return {"setting": name, "decode_tok_s": rates[name]}


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


def head_to_head(
    group: str,
    directories: dict[str, Path],
    prompt: list[int],
    tokens: int,
    repeats: int,
    deadline: float,
    block: int,
    loops: bool = False,
) -> dict[str, Any]:
    """Both sides on ``directories`` ({"mtp": with its MTP block, "dspark": with its
    DSpark head}, the same main weights), interleaved; with ``loops`` the bare models
    in the hand loop too."""
    import mlx_vlm.utils

    ours: dict[str, Any] = {}
    theirs: dict[str, Any] = {}
    runners: dict[str, Runner] = {}
    drafters: dict[str, Any] = {}
    for drafter, directory in directories.items():
        ours[drafter] = load_mlxserve(directory)
        theirs[drafter] = mlx_vlm.utils.load_model(directory)
        for name, run in mlxserve_runners(ours[drafter], prompt, tokens, drafter).items():
            if name != "depth0" or drafter == "mtp":
                runners[f"mlxserve.{name}"] = run
        vlm, loaded = mlx_vlm_runners(directory, theirs[drafter], prompt, tokens, drafter, block)
        drafters[drafter] = loaded
        for name, run in vlm.items():
            if name != "depth0" or drafter == "mtp":
                runners[f"mlx_vlm.{name}"] = run
    if loops:
        for name, run in loop_runners(ours["mtp"], theirs["mtp"], prompt, tokens).items():
            runners[f"loop.{name}"] = run
    measured = interleaved(group, runners, repeats, deadline)
    sides: dict[str, dict[str, Any]] = {"mlxserve": {}, "mlx_vlm": {}, "loop": {}}
    for name, value in measured.items():
        side, setting = name.split(".", 1)
        sides[side][setting] = value
    result: dict[str, Any] = {
        "mlxserve": sides["mlxserve"],
        "mlx_vlm": {**sides["mlx_vlm"], "drafters": drafters},
        "layer_types": ours["mtp"].args.layer_types,
        "graph_nodes_per_decode_step": {
            "mlxserve": mlxserve_decode_nodes(ours["mtp"], prompt),
            "mlx_vlm": mlx_vlm_decode_nodes(theirs["mtp"], prompt),
        },
    }
    if loops:
        result["loops"] = sides["loop"]
    for key in ("mlxserve", "mlx_vlm"):
        result[key]["best"] = {
            "overall": best(sides[key]),
            "mtp": best(sides[key], "mtp"),
            "dspark": best(sides[key], "dspark"),
        }
    result["ratios"] = ratios(sides["mlxserve"], sides["mlx_vlm"])
    depth0 = agreement(sides["mlxserve"]["depth0"]["tokens"], sides["mlx_vlm"]["depth0"]["tokens"])
    result["greedy_depth0_agree"] = depth0
    note({"group": group, "ratios": result["ratios"]})
    return result


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """mlxserve over mlx-vlm: decode at depth 0, each one's best MTP, best DSpark and best
    setting of all; TTFT as mlx-vlm's over mlxserve's (above 1: mlxserve's is shorter)."""
    out: dict[str, Any] = {
        "depth0_mlxserve_over_mlx_vlm": ours["depth0"]["decode_tok_s"]
        / theirs["depth0"]["decode_tok_s"],
        "ttft_mlx_vlm_over_mlxserve": theirs["depth0"]["ttft_s"] / ours["depth0"]["ttft_s"],
    }
    for prefix, key in (
        ("mtp", "best_mtp_mlxserve_over_mlx_vlm"),
        ("dspark", "best_dspark_mlxserve_over_mlx_vlm"),
        ("", "best_setting_mlxserve_over_mlx_vlm"),
    ):
        a, b = best(ours, prefix), best(theirs, prefix)
        if a and b:
            out[key] = a["decode_tok_s"] / b["decode_tok_s"]
    return out


def demo_directories(folder: Path) -> tuple[dict[str, Path], list[int]]:
    """The demo's ratio-128 variants (with its MTP block; with its DSpark head) and the
    demo prompt's tokens."""
    from mlxserve.models import load
    from mlxserve.models.demo.build import build_demo_model
    from mlxserve.models.demo.dspark import build_dspark_demo

    base = build_demo_model(progress=False)
    directories = {
        "mtp": ratio_128_variant(base, folder / "demo-128-mtp"),
        "dspark": ratio_128_variant(build_dspark_demo(progress=False), folder / "demo-128-dspark"),
    }
    _, tokenizer = load(str(base))
    return directories, list(tokenizer.encode(DEMO_TEXT))


def _top_two_margin(logits: mx.array) -> float:
    """The gap between the two largest logits: how far greedy is from a tie."""
    top = mx.sort(logits)[-2:]
    return float(top[1] - top[0])


def first_logits(directory: Path, prompt: list[int]) -> dict[str, Any]:
    """Both loaders' logits for the token after ``prompt`` (one forward each): their
    largest difference against their scale and each side's top-two margin, so a greedy
    split at the first token reads as a near tie or as a real disagreement. Also the
    device's float32 matmul error against the CPU's (TF32 shows as ~1e-3)."""
    import mlx_vlm.utils

    ours = load_mlxserve(directory)
    theirs = mlx_vlm.utils.load_model(directory)
    from mlx_vlm.models.cache import make_prompt_cache

    tokens = mx.array([prompt])
    lm = theirs.language_model

    def their_logits() -> mx.array:
        # With a cache: mlx-vlm's cacheless prefill lets CSA queries see later entries.
        out: mx.array = lm(tokens, cache=make_prompt_cache(lm)).logits[0, -1]
        return out

    a = ours(tokens)[0, -1].astype(mx.float32)
    b = their_logits().astype(mx.float32)
    on_cpu_side: dict[str, Any] = {}
    if mx.default_device() != mx.cpu:
        # The same forwards on the CPU: which side moved from its own CPU result.
        with mx.stream(mx.cpu):
            forwards: list[tuple[str, mx.array, Callable[[], mx.array]]] = [
                ("mlxserve", a, lambda: ours(tokens)[0, -1]),
                ("mlx_vlm", b, their_logits),
            ]
            for label, logits, run in forwards:
                try:
                    here = run().astype(mx.float32)
                    on_cpu_side[label] = float(mx.abs(logits - here).max())
                except Exception as error:  # a GPU-only kernel: say so
                    on_cpu_side[label] = str(error)[:160]
    left = mx.random.normal((512, 512), key=mx.random.key(5))
    right = mx.random.normal((512, 512), key=mx.random.key(6))
    on_device = left @ right
    on_cpu = mx.matmul(left, right, stream=mx.cpu)
    return {
        "max_abs_diff": float(mx.abs(a - b).max()),
        "logits_abs_max": float(mx.abs(b).max()),
        "top_two_margin": {"mlxserve": _top_two_margin(a), "mlx_vlm": _top_two_margin(b)},
        "argmax": {"mlxserve": int(mx.argmax(a)), "mlx_vlm": int(mx.argmax(b))},
        "same_first_token": bool(mx.argmax(a) == mx.argmax(b)),
        "max_abs_diff_device_vs_cpu": on_cpu_side,
        "float32_matmul_rel_err_vs_cpu": float(
            mx.abs(on_device - on_cpu).max() / mx.abs(on_cpu).max()
        ),
    }


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """The whole comparison (see the module docstring), as a dict."""
    import mlx_vlm

    started = time.monotonic()
    deadline = started + args.budget_s
    vocab = args.vocab
    prompt = [random.Random(1).randrange(2, vocab) for _ in range(args.prompt)]
    result: dict[str, Any] = {
        "benchmark": "vs_mlx_vlm",
        "device": benchmark_device(),
        "mlx_vlm_version": getattr(mlx_vlm, "__version__", "unknown"),
        "prompt_tokens": args.prompt,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "budget_s": args.budget_s,
        "greedy": True,
        "groups": {},
    }
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        if "flash" in args.groups:
            config = flash_config(args.layers, args.hidden, args.experts, vocab)
            directories = {
                "mtp": write(flash_model(config), folder / "flash"),
                "dspark": write(
                    with_dspark_head(flash_model(config), args.block, args.stages),
                    folder / "flash-dspark",
                ),
            }
            share = deadline if "demo" not in args.groups else started + args.budget_s * 0.6
            flash = head_to_head(
                "flash", directories, prompt, args.tokens, args.repeats, share, args.block, True
            )
            flash["model"] = {
                "shape": "DeepSeek-V4-Flash layer pattern (mtp_cost.flash_config), random",
                "layers": args.layers,
                "hidden": args.hidden,
                "routed_experts": args.experts,
                "vocab": vocab,
                "dspark": {"block": args.block, "stages": args.stages},
                "weights": "float32, DeepSeek's published names (publish.py)",
            }
            csa_free = write(
                flash_model(flash_config(args.layers, args.hidden, args.experts, vocab, False)),
                folder / "no-csa",
            )
            flash["greedy_depth0_agree_csa_free_variant"] = greedy_agreement(
                csa_free, prompt, args.agreement_tokens
            )
            result["groups"]["flash"] = flash
        if "demo" in args.groups:
            directories, demo_prompt = demo_directories(folder)
            demo = head_to_head(
                "demo", directories, demo_prompt, args.demo_tokens, args.repeats, deadline, 4
            )
            demo["model"] = {
                "shape": "the demo with its HCA layer at ratio 128 (mlx-vlm's), trained heads",
                "prompt": DEMO_TEXT,
                "prompt_tokens": len(demo_prompt),
                "tokens": args.demo_tokens,
            }
            result["groups"]["demo"] = demo
    return result


def first_logits_report(args: argparse.Namespace) -> dict[str, Any]:
    """`first_logits` on the Flash shape and on its CSA-free variant."""
    prompt = [random.Random(1).randrange(2, args.vocab) for _ in range(args.prompt)]
    out: dict[str, Any] = {"benchmark": "vs_mlx_vlm first logits", "device": benchmark_device()}
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        for label, csa in (("flash", True), ("csa_free", False))[: 1 if args.flash_only else 2]:
            config = flash_config(args.layers, args.hidden, args.experts, args.vocab, csa)
            directory = write(flash_model(config), folder / label)
            out[label] = first_logits(directory, prompt)
    return out


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The Flash-shaped model's and the request's options (`flash_config`), shared by the
    benchmarks that build this model (`engine_overhead.py`)."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--demo-tokens", type=int, default=64)
    parser.add_argument("--agreement-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--block", type=int, default=4, help="the Flash DSpark head's block")
    parser.add_argument("--stages", type=int, default=3, help="the Flash DSpark head's stages")
    parser.add_argument("--groups", default="flash,demo", help="flash, demo or both")
    parser.add_argument(
        "--budget-s", type=float, default=330.0, help="stop adding repeats past this"
    )
    parser.add_argument("--cpu", action="store_true", help="run on MLX's CPU device")
    parser.add_argument(
        "--first-logits-only",
        action="store_true",
        help="only the first token's logits of both loaders on the Flash shape (and its "
        "CSA-free variant): why greedy tokens part",
    )
    parser.add_argument("--flash-only", action="store_true", help="with --first-logits-only")
    args = parser.parse_args()
    if args.flash_only and not args.first_logits_only:
        parser.error("--flash-only goes with --first-logits-only")
    configure_cuda_graphs()  # as the CLI does, before any device work (both sides share it)
    if args.cpu:
        mx.set_default_device(mx.cpu)
    started = time.perf_counter()
    result = first_logits_report(args) if args.first_logits_only else compare(args)
    result["wall_s"] = time.perf_counter() - started
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
