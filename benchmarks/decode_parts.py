"""Where a real-width decode step's layer time goes, op group by op group; one JSON.

`prefill_parts.py --chunk 1` says a decode layer's attention block costs far more than
its weights' read; this says which of its ops do. One DeepSeek-V4-Flash layer of each
attention kind (`--kinds`: csa, hca, sliding) at the published widths
(`real_width.build`) decodes one token per row over caches seeded with `--context`
tokens (`prefill_attention.seed_cache`; rows ``context + r`` when stacked), at each
batch of `--batches` (batch 1 a plain `LayerCache`, more rows `StackedRows`, as the
engine decodes). The layer runs as a chain of steps that call the model's own
modules in the order its forward does (`attention.Attention._attend_one` for one
row, `_attend_stacked` for several; `MoE.fused`), each step evaluated before the
next; each step is then timed alone (median of `--repeats` after a warm-up, the
cache fresh and the steps before it replayed untimed, so a step that appends to the
cache times the same append):

- `hc_enter`, `hc_leave_enter`, `hc_leave`: the hyper-connections (with the norms);
- `q_path` (wq_a, q_norm, wq_b, per-head norm, RoPE), `kv_path` (wkv, norm, RoPE);
- `projections`: the compressors' and the indexer's input projections, one matmul;
- `compressor`: the compressor's decode step (raw rows appended; pooling, norm and
  RoPE when a window closes: `closes` says whether one does at this position);
- `indexer`: the indexer's step (its compressor, wq_b, scores, top-k), and apart
  `indexer_compressor` and `indexer_scores` (scores without the top-k);
- `keys`: the cache update (window rows kept, the picks gathered, the keys joined);
- `core`: the attention over the window and the entries, sinks included (SDPA);
- `out_rope` (the inverse rotation), `wo_a` (grouped), `wo_b`;
- `gate`, `routed_experts` (three quantised gathers and the SwiGLU), `shared_expert`,
  `mix`: `MoE.fused`'s steps.

Each step reports its ms, the weight bytes it reads (routed experts: those the rows'
picks touch, expected under uniform routing), bytes/ms as GB/s, and its non-view
graph nodes (`graph_nodes.count_nodes`: the kernels it launches; on a CPU the fast
ops decompose). Whole references, each one `mx.eval`: `layer`, `attention`, `moe`,
against the sums of their steps (the gap is what one graph saves or costs over
separate evaluations; `eval_floor_ms`, one `mx.eval` of a one-element add, is what
each separate evaluation costs at least). `chain_max_abs_diff` checks that the
chain computes what the layer does (0: the same ops in the same order). `bound_ms`:
a step's weight bytes over the measured copy bandwidth. At `--context 4096` no row
of batch 1 closes a compressor window (`closes`); `--context 4095` times the closing
step of both ratios.

GPU: python benchmarks/decode_parts.py --context 4096 --batches 1,4 --repeats 20
CPU (about 2 min on 2 cores; the attention's widths are the published ones):
    python benchmarks/decode_parts.py --kinds csa --experts 16 --repeats 1 --copy-mb 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device
from mlxserve.models.deepseek_v4.attention import rope_offset
from mlxserve.models.deepseek_v4.config import CSA, SLIDING
from mlxserve.models.deepseek_v4.fused_linears import fused
from mlxserve.models.deepseek_v4.moe import (
    SORTED_FROM,
    _compiled,
    _compiled_swiglu,
    _plainly_quantized,
    quantized_experts,
)
from mlxserve.models.deepseek_v4.stacked import StackedRows

GB = 1e9
Env = dict[str, Any]
#: A step: its name, what it computes from the chain so far (and the cache), and the
#: modules (or arrays) whose bytes it reads.
Step = tuple[str, Callable[[Env, Any], Env], list[Any]]


def _arrays(value: Any) -> list[mx.array]:
    """Every array in a step's outputs (dicts, tuples, None)."""
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays(v)]
    if isinstance(value, list | tuple):
        return [a for v in value for a in _arrays(v)]
    return []


def _bytes(parts: list[Any]) -> float:
    from real_width import _nbytes  # beside this file

    return float(sum(int(p.nbytes) if isinstance(p, mx.array) else _nbytes(p) for p in parts))


def attention_steps(attn: Any, stacked: bool) -> list[Step]:
    """The attention block's decode steps, as `_attend_one` (one row) or
    `_attend_stacked` (``stacked``) runs them."""
    steps: list[Step] = []

    def q_path(env: Env, cache: Any) -> Env:
        x = env["x"]
        batch = x.shape[0]
        q_residual = attn.q_norm(attn.wq_a(x))
        q = attn.wq_b(q_residual).reshape(batch, 1, attn.num_heads, attn.head_dim)
        q = mx.fast.rms_norm(q, None, attn.eps).swapaxes(1, 2)
        return {"q_residual": q_residual, "q": attn.rope(q, offset=rope_offset(cache))}

    def kv_path(env: Env, cache: Any) -> Env:
        return {"kv": attn.rope(attn.norm(attn.wkv(env["x"])), offset=rope_offset(cache))}

    steps += [("q_path", q_path, [attn.wq_a, attn.q_norm, attn.wq_b])]
    steps += [("kv_path", kv_path, [attn.wkv, attn.norm])]
    if stacked:

        def window(env: Env, cache: Any) -> Env:
            keys, mask = cache.update_window(env["kv"])
            return {"window": keys, "mask": mask}

        steps.append(("keys_window", window, []))
    csa = attn.layer_type == CSA
    if attn.layer_type != SLIDING:
        comp = attn.compressor
        inputs = [comp.wkv, comp.wgate]
        if csa:
            index = attn.indexer
            inputs += [index.compressor.wkv, index.compressor.wgate, index.weights_proj]

        def projections(env: Env, cache: Any) -> Env:
            return {"projected": attn._projections(env["x"])}

        def compressor(env: Env, cache: Any) -> Env:
            own = (env["projected"]["kv"], env["projected"]["gate"])
            state = cache.compressors["compressor"]
            if stacked:
                entries, valid = comp.step_stacked(env["x"], state, cache.offsets, attn.rope, own)
                return {"entries": entries, "valid": valid}
            return {"entries": comp(env["x"], state, cache.offset, attn.rope, own)}

        steps += [("projections", projections, inputs)]
        steps += [("compressor", compressor, [comp.ape, comp.norm])]
        if csa:
            steps += indexer_steps(attn, stacked)
    steps.append(("keys", _keys_step(attn, stacked), []))

    def core(env: Env, cache: Any) -> Env:
        mask = env.get("keys_mask")
        return {"attended": attn._sdpa(env["q"], env["keys"], None if mask is None else mask)}

    def out_rope(env: Env, cache: Any) -> Env:
        batch = env["x"].shape[0]
        out = attn.rope(env["attended"], offset=env["offset"], inverse=True).swapaxes(1, 2)
        return {"out": out.reshape(batch, attn.o_groups, 1, -1)}

    def wo_a(env: Env, cache: Any) -> Env:
        return {"grouped": attn._output_groups(env["out"])}

    def wo_b(env: Env, cache: Any) -> Env:
        return {"h": attn.wo_b(env["grouped"].reshape(env["x"].shape[0], 1, -1))}

    steps += [("core", core, [attn.attn_sink]), ("out_rope", out_rope, [])]
    steps += [("wo_a", wo_a, [attn.wo_a]), ("wo_b", wo_b, [attn.wo_b])]
    return steps


def indexer_steps(attn: Any, stacked: bool) -> list[Step]:
    """The indexer's step (`Indexer.__call__` or `select_stacked`, the chain's), and
    apart its compressor and its scores (neither feeds the chain)."""
    index = attn.indexer

    def projected(env: Env) -> tuple[mx.array, mx.array, mx.array]:
        p = env["projected"]
        return p["index_kv"], p["index_gate"], p["index_weights"]

    def whole(env: Env, cache: Any) -> Env:
        state = cache.compressors["indexer"]
        x, q_residual = env["x"], env["q_residual"]
        if stacked:
            picked = index.select_stacked(
                x, q_residual, state, cache.offsets, env["offset"], attn.rope, projected(env)
            )
            return {"picked": picked}
        return {"picked": index(x, q_residual, state, cache.offset, attn.rope, projected(env))}

    def compressor(env: Env, cache: Any) -> Env:
        state = cache.compressors["indexer"]
        own = projected(env)[:2]
        if stacked:
            step = index.compressor.step_stacked
            return {"index_keys": step(env["x"], state, cache.offsets, attn.rope, own)}
        return {"index_keys": index.compressor(env["x"], state, cache.offset, attn.rope, own)}

    def scores(env: Env, cache: Any) -> Env:
        keys = cache.compressors["indexer"].entries
        ranked = index._ranked(env["q_residual"], keys, env["offset"], attn.rope, projected(env)[2])
        return {"ranked": ranked}

    comp = [index.compressor.ape, index.compressor.norm]
    return [
        ("indexer_compressor", compressor, comp),
        ("indexer_scores", scores, [index.wq_b]),
        ("indexer", whole, [index.wq_b, *comp]),
    ]


def _keys_step(attn: Any, stacked: bool) -> Callable[[Env, Any], Env]:
    """The cache update and the keys the query sees, as `_attend_one` (window, new
    row and picked entries as one concatenation) or `_attend_stacked` joins them."""

    def one(env: Env, cache: Any) -> Env:
        previous = 0 if cache.window is None else int(cache.window.shape[1])
        previous = min(previous, attn.sliding_window - 1)
        seen = None
        entries, chosen = env.get("entries"), env.get("picked")
        if entries is not None:
            if chosen is not None:
                entries = mx.take_along_axis(entries, chosen[:, 0, :, None], axis=1)
            seen = entries.astype(env["kv"].dtype)
        keys = cache.update_window(env["kv"], seen)
        cache.advance(1)
        first = keys.shape[1] - (0 if seen is None else seen.shape[1]) - previous - 1
        return {"keys": keys[:, first:], "keys_mask": None}

    def rows(env: Env, cache: Any) -> Env:
        keys, mask = env["window"], env["mask"]
        entries, picked = env.get("entries"), env.get("picked")
        if entries is not None:
            keys, mask = attn.join_entries(keys, mask, entries, env["valid"], picked)
        cache.advance()
        return {"keys": keys, "keys_mask": None if mask is None else mask[:, None]}

    return rows if stacked else one


def moe_steps(layer: Any) -> list[Step]:
    """`MoE.fused`'s steps (the decode path of a few rows)."""
    moe = layer.ffn
    experts = moe.switch_mlp
    act = _compiled_swiglu(moe.limit)

    def gate(env: Env, cache: Any) -> Env:
        flat = env["x"].reshape(-1, moe.hidden_size)
        chosen, scores = moe.gate.fused(flat, env["tokens"])
        return {"flat": flat, "chosen": chosen, "gate_scores": scores}

    def routed(env: Env, cache: Any) -> Env:
        flat, chosen = env["flat"], env["chosen"]
        if chosen.size < SORTED_FROM and _plainly_quantized(experts):
            h = mx.expand_dims(flat, (-2, -3))
            up = quantized_experts(experts.up_proj, h, chosen)
            g = quantized_experts(experts.gate_proj, h, chosen)
            return {"routed": quantized_experts(experts.down_proj, act(up, g), chosen).squeeze(-2)}
        return {"routed": experts(flat, chosen)}

    def shared(env: Env, cache: Any) -> Env:
        mlp = moe.shared_experts
        flat = env["flat"]
        up, g = fused(moe, "_shared_in", (mlp.up_proj, mlp.gate_proj))(flat)
        return {"shared": mlp.down_proj(act(up, g).astype(flat.dtype))}

    def mix(env: Env, cache: Any) -> Env:
        out = _compiled("mixed", scale=moe.gate.scale)(
            env["routed"], env["gate_scores"], env["shared"]
        )
        return {"h": out.reshape(env["x"].shape).astype(env["x"].dtype)}

    return [
        ("gate", gate, [moe.gate]),
        ("routed_experts", routed, [experts]),
        ("shared_expert", shared, [moe.shared_experts]),
        ("mix", mix, []),
    ]


def layer_steps(layer: Any, stacked: bool) -> tuple[list[Step], list[Step], list[Step]]:
    """The layer's steps: the hyper-connections around the attention's and the MoE's."""

    def hc_enter(env: Env, cache: Any) -> Env:
        x, post, comb = layer.hc_attn.enter(env["streams"], layer.attn_norm)
        return {"x": x, "post": post, "comb": comb, "offset": rope_offset(cache)}

    def hc_leave_enter(env: Env, cache: Any) -> Env:
        streams, x, post, comb = layer.hc_attn.leave_enter(
            env["h"], env["streams"], env["post"], env["comb"], layer.hc_ffn, layer.ffn_norm
        )
        return {"streams": streams, "x": x, "post": post, "comb": comb}

    def hc_leave(env: Env, cache: Any) -> Env:
        return {"out": layer.hc_ffn.leave(env["h"], env["streams"], env["post"], env["comb"])}

    attention = attention_steps(layer.attn, stacked)
    moe = moe_steps(layer)
    whole = [("hc_enter", hc_enter, [layer.hc_attn, layer.attn_norm]), *attention]
    whole += [("hc_leave_enter", hc_leave_enter, [layer.hc_ffn, layer.ffn_norm]), *moe]
    whole.append(("hc_leave", hc_leave, []))
    return whole, attention, moe


#: Steps timed apart that feed nothing (the indexer's step does their work).
APART = ("indexer_compressor", "indexer_scores")
#: Steps that change the cache: rerun (on their chain inputs) before a later step.
CACHE_STEPS = ("keys_window", "compressor", "indexer", "keys")


def _chain(steps: list[Step], env: Env, cache: Any) -> list[Env]:
    """Run the chain (each step evaluated before the next); the inputs each step
    sees, and last what the chain ends with."""
    seen = []
    for name, fn, _ in steps:
        seen.append(dict(env))
        if name in APART:
            continue
        made = fn(env, cache)
        env.update(made)
        mx.eval(_arrays(made), cache.state)
    seen.append(dict(env))
    return seen


def _replay(steps: list[Step], upto: int, inputs: list[Env], cache: Any) -> None:
    """Bring a fresh ``cache`` to where the chain had it before step ``upto``: the
    cache steps before it rerun on their chain inputs (the others change nothing)."""
    for i, (name, fn, _) in enumerate(steps[:upto]):
        if name in CACHE_STEPS:
            fn(inputs[i], cache)
    mx.eval(cache.state)


def breakdown(
    layer: Any,
    args: Any,
    rows: int,
    context: int,
    repeats: int,
    streams_dtype: mx.Dtype = mx.bfloat16,
) -> dict[str, Any]:
    """Each step's ms, bytes, GB/s and nodes for one decode step of ``rows`` rows of a
    model of ``args``, the whole references and the chain's check (module docstring)."""
    from graph_nodes import count_nodes, kernels_of  # beside this file
    from prefill_attention import seed_cache
    from prefill_parts import median_seconds
    from real_width import _block_input

    dtype = _block_input(layer, streams_dtype)
    hc, hidden, vocab = args.hc_mult, args.hidden_size, args.vocab_size
    picks, experts = args.num_experts_per_tok, args.n_routed_experts
    expert_share = 1 - (1 - picks / experts) ** rows  # distinct experts touched, uniform
    streams = (mx.random.normal((rows, 1, hc, hidden), key=mx.random.key(11)) * 0.5).astype(
        streams_dtype
    )
    tokens = mx.random.randint(0, vocab, (rows, 1), key=mx.random.key(12))
    mx.eval(streams, tokens)
    stacked = rows > 1

    def fresh() -> Any:
        caches = [
            seed_cache(layer.attn, context + r, mx.random.key(7 + r), dtype) for r in range(rows)
        ]
        if not stacked:
            return caches[0]
        cache = StackedRows(caches)
        mx.eval(cache.state)
        return cache

    whole, attention, moe = layer_steps(layer, stacked)
    inputs = _chain(whole, {"streams": streams, "tokens": tokens}, fresh())
    holder: dict[str, Any] = {}
    out: dict[str, Any] = {"rows": rows, "positions": [context + r for r in range(rows)]}
    if layer.attn.layer_type != SLIDING:
        ratio = layer.attn.ratio
        out["closes"] = [(context + r + 1) % ratio == 0 for r in range(rows)]

    def timed(run: Callable[[Env, Any], Any], upto: int) -> tuple[float, Callable[[], Any]]:
        """Median seconds of ``run`` on step ``upto``'s inputs (a fresh cache each
        time, brought to that step), and a call of it on a fresh cache."""

        def setup() -> None:
            holder["cache"] = fresh()
            _replay(whole, upto, inputs, holder["cache"])

        def call() -> Any:
            return [*_arrays(run(inputs[upto], holder["cache"])), *holder["cache"].state]

        seconds = median_seconds(call, repeats, setup)
        setup()
        return seconds, call

    parts: dict[str, Any] = {}
    for i, (name, fn, reads) in enumerate(whole):
        seconds, call = timed(fn, i)
        nodes = sum(kernels_of(count_nodes(call())).values())
        read = _bytes(reads) * (expert_share if name == "routed_experts" else 1.0)
        parts[name] = {"ms": seconds * 1e3, "weight_bytes": read, "gb_s": read / seconds / GB}
        parts[name]["nodes"] = nodes
        print(json.dumps({"rows": rows, "part": name, **parts[name]}), file=sys.stderr, flush=True)
    out["parts"] = parts
    first_attention = next(i for i, s in enumerate(whole) if s[0] == attention[0][0])
    first_moe = next(i for i, s in enumerate(whole) if s[0] == moe[0][0])

    wholes = {
        "layer": timed(lambda env, cache: layer(streams, tokens, cache), 0)[0],
        "attention": timed(lambda env, cache: layer.attn(env["x"], cache), first_attention)[0],
        "moe": timed(lambda env, cache: layer.ffn(env["x"], tokens), first_moe)[0],
    }
    sums = {
        "layer": [s[0] for s in whole],
        "attention": [s[0] for s in attention],
        "moe": [s[0] for s in moe],
    }
    for name, s in wholes.items():
        total = sum(parts[p]["ms"] for p in sums[name] if p not in APART)
        out[name] = {"ms": s * 1e3, "sum_of_parts_ms": total, "parts_over_whole": total / s / 1e3}
    check = fresh()
    theirs = layer(streams, tokens, check)
    ours = inputs[-1]["out"].astype(mx.float32)
    out["chain_max_abs_diff"] = float(mx.abs(ours - theirs.astype(mx.float32)).max())
    holder.clear()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="csa,hca,sliding", help="layer kinds, one layer each")
    parser.add_argument("--context", type=int, default=4096, help="tokens seeded per row")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--copy-mb", type=int, default=2048, help="bandwidth copy size")
    parser.add_argument(
        "--norm-dtype", choices=("float32", "bfloat16"), default="float32", help="RMSNorm weights"
    )
    args = parser.parse_args()
    from real_width import LAYER_KINDS, build, copy_bandwidth  # beside this file

    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in LAYER_KINDS]
    if unknown:
        parser.error(f"--kinds: {unknown[0]!r} is not one of {', '.join(LAYER_KINDS)}")
    configure_cuda_graphs()
    started = time.perf_counter()
    model = build(len(kinds), args.experts, layer_types=kinds, norm_dtype=args.norm_dtype)
    bandwidth = copy_bandwidth(args.copy_mb)
    from prefill_parts import median_seconds  # beside this file

    one = mx.zeros((1,))
    mx.eval(one)
    floor = median_seconds(lambda: one + 1, max(args.repeats, 5), lambda: None)
    margs = model.args
    result: dict[str, Any] = {
        "benchmark": "decode_parts",
        "device": benchmark_device(),
        "context": args.context,
        "experts": args.experts,
        "norm_dtype": args.norm_dtype,
        "bandwidth_gb_s": bandwidth,
        "eval_floor_ms": floor * 1e3,
        "kinds": {},
    }
    for kind, layer in zip(kinds, model.layers, strict=True):
        per_batch = {}
        for rows in (int(b) for b in args.batches.split(",")):
            dtype = model.model.embed_tokens.weight.dtype
            run = breakdown(layer, margs, rows, args.context, args.repeats, dtype)
            for row in run["parts"].values():
                row["bound_ms"] = row["weight_bytes"] / (bandwidth * GB) * 1e3
            per_batch[str(rows)] = run
        result["kinds"][kind] = per_batch
    result["wall_s"] = time.perf_counter() - started
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
