"""How many graph nodes a decode step and a verify forward make, by primitive; one JSON.

A small-batch GPU step is bound by launches and by the host building and queuing
them, so the node count of one forward is the number to drive down. This builds a
DeepSeek-V4-Flash-shaped model (`mtp_cost.flash_shaped`), prefills it, then exports
the lazy graph of one forward of S tokens (and the head) with `mx.export_to_dot` and
counts its nodes by primitive, views (reshapes, slices, broadcasts: no kernel) apart.
With ``--per-layer`` it counts each decoder layer's graph alone (its input evaluated
first), at each batch size of ``--batches`` (a batch of several rows decodes through
stacked caches, as the engine runs it), by layer kind.

What the graph executes: ``mx.compile`` does not make a compiled function one node;
it fuses each string of element-wise ops into one ``Compiled...`` node and leaves
every other primitive (matmuls, reductions, fast ops, gathers) a node of its own. So
the count is the number of kernels a step launches, compiled or not.

The graph is the default device's. On a CPU, MLX's fast ops (RMSNorm, RoPE, SDPA)
decompose into many ops, and the Sinkhorn runs as a compiled loop where CUDA and
Metal run one kernel. ``--fast-ops-as-one-node`` counts on a CPU what a GPU graph
holds: each of those calls is replaced, for counting only, by one node of a
primitive the model does not use otherwise (a cumulative op), under the fast op's
name; the numbers the forward computes are then meaningless, its graph is the GPU's.

Run: python benchmarks/graph_nodes.py [--layers 43] [--tokens 1,2,6] [--hc-ops]
                                      [--masked-attention] [--plain-layers]
                                      [--per-layer] [--batches 1,4]
                                      [--fast-ops-as-one-node] [--no-hc-kernel]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxserve.engine.spec.mtp import MTPAdapter, trim_exactly
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs
from mlxserve.hardware.probe import benchmark_device
from mlxserve.hardware.tuning import EngineTuning, default_tuning
from mlxserve.kernels import hyper_connection as hc_kernel_module
from mlxserve.kernels import sinkhorn as sinkhorn_module
from mlxserve.models.deepseek_v4 import hyper_connections

VIEWS = frozenset(
    [
        "Reshape",
        "ExpandDims",
        "Squeeze",
        "Broadcast",
        "Transpose",
        "Slice",
        "Unflatten",
        "Flatten",
        "StopGradient",
        "Depends",
    ]
)

#: The cumulative primitive that stands for each fast op under `fast_ops_as_one_node`,
#: and the name it is counted under.
STANDIN_NAMES = {
    "CumSum": "RMSNorm",
    "CumProd": "RoPE",
    "CumMax": "ScaledDotProductAttention",
    "CumMin": "CustomKernel(Sinkhorn)",
    "CumLogAddExp": "CustomKernel(HyperConnection)",
}


def count_nodes(outputs: list[Any]) -> collections.Counter[str]:
    """Nodes of the graph that computes `outputs`, by primitive name."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "graph.dot"
        mx.export_to_dot(str(path), *outputs)
        labels = re.findall(r'label\s*=\s*"([^"]+)"', path.read_text())
    counts = collections.Counter(label.split()[0] for label in labels)
    return collections.Counter({STANDIN_NAMES.get(k, k): v for k, v in counts.items()})


def kernels_of(counts: collections.Counter[str]) -> dict[str, int]:
    """The nodes that are not views, most frequent first."""
    kernels = {k: v for k, v in counts.items() if k not in VIEWS}
    return dict(sorted(kernels.items(), key=lambda kv: (-kv[1], kv[0])))


def _one_node(op: Any, x: mx.array, *others: Any) -> mx.array:
    """One node of `op` over `x` that depends on every array among `others`."""
    deps = [a for a in others if isinstance(a, mx.array)]
    out: mx.array = op(x, axis=-1)
    return mx.depends([out], deps)[0] if deps else out


def _outputs_of_one_node(
    inputs: list[mx.array], outputs: list[tuple[tuple[int, ...], Any]]
) -> list[mx.array]:
    """Arrays of these (shape, dtype)s, all views of one node (a cumulative op
    `STANDIN_NAMES` names) that depends on every array of `inputs`: what a custom
    kernel with several outputs is in a GPU graph."""
    sizes = [math.prod(shape) for shape, _ in outputs]
    seed = next(a for a in inputs if a.dtype == mx.float32).reshape(-1)[:1]
    flat = _one_node(mx.logcumsumexp, mx.broadcast_to(seed, (sum(sizes),)), *inputs)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [
        flat[start : start + size].reshape(shape).astype(dtype)
        for start, size, (shape, dtype) in zip(starts, sizes, outputs, strict=True)
    ]


def _hc_kernel_standins() -> tuple[Any, Any]:
    """One-node stand-ins for `mlxserve.kernels.hyper_connection`'s enter and
    leave_enter (their outputs' shapes and dtypes, not their values)."""

    def shapes(streams: mx.array, dtype: Any) -> list[tuple[tuple[int, ...], Any]]:
        batch, length, hc, dim = streams.shape
        return [
            ((batch, length, dim), dtype),
            ((batch, length, hc), mx.float32),
            ((batch, length, hc, hc), mx.float32),
        ]

    def enter(
        streams: mx.array, mix: Any, weight: mx.array, consts: mx.array, dtype: Any, iters: int
    ) -> tuple[mx.array, ...]:
        return tuple(_outputs_of_one_node([streams, *mix, weight, consts], shapes(streams, dtype)))

    def leave_enter(
        block_out: mx.array,
        streams: mx.array,
        post: mx.array,
        comb: mx.array,
        mix: Any,
        weight: mx.array,
        consts: mx.array,
        dtype: Any,
        iters: int,
    ) -> tuple[mx.array, ...]:
        outs = [(tuple(streams.shape), streams.dtype), *shapes(streams, dtype)]
        inputs = [block_out, streams, post, comb, *mix, weight, consts]
        return tuple(_outputs_of_one_node(inputs, outs))

    return enter, leave_enter


def check_fast_paths(args: Any) -> None:
    """Let the layers' fast paths check themselves (against the real fast ops) before
    `fast_ops_as_one_node` replaces those: under it every check would fail."""
    from mlxserve.models.deepseek_v4.rope import whole_head_agrees

    for width in (args.head_dim, args.index_head_dim):
        whole_head_agrees(width, args.qk_rope_head_dim)


@contextlib.contextmanager
def fast_ops_as_one_node(args: Any, hc_kernel: bool = True) -> Iterator[None]:
    """Count a GPU's graph on a CPU: RMSNorm, RoPE, SDPA and the Sinkhorn one node each
    (module docstring), for a model of ``args``; with ``hc_kernel``, the CUDA
    hyper-connection kernel (``mlxserve.kernels.hyper_connection``) taken as on CUDA,
    each call one node. Counting only: the values are not the model's. Compiled
    functions traced inside keep the stand-ins, so use it in a process of its own."""
    check_fast_paths(args)
    fast: Any = mx.fast  # its functions replaced for a while
    saved = (fast.rms_norm, fast.rope, fast.scaled_dot_product_attention)
    saved_sinkhorn = sinkhorn_module.sinkhorn_compiled

    def rms_norm(x: mx.array, weight: mx.array | None, eps: float, **_: Any) -> mx.array:
        return _one_node(mx.cumsum, x, weight)

    def rope(x: mx.array, dims: int, **kw: Any) -> mx.array:
        return _one_node(mx.cumprod, x, kw.get("offset"), kw.get("freqs"))

    def sdpa(q: mx.array, k: mx.array, v: mx.array, **kw: Any) -> mx.array:
        if v.shape[-1] != q.shape[-1]:
            raise ValueError("the SDPA stand-in needs V as wide as Q")
        return _one_node(mx.cummax, q, k, v, kw.get("mask"), kw.get("sinks"))

    def sinkhorn(comb: mx.array, *, iters: int, eps: mx.array) -> mx.array:
        return _one_node(mx.cummin, comb, eps)

    fast.rms_norm, fast.rope, fast.scaled_dot_product_attention = rms_norm, rope, sdpa
    sinkhorn_module.sinkhorn_compiled = sinkhorn
    kernel: Any = hc_kernel_module  # its functions replaced for a while
    saved_kernel = (kernel.available, kernel.enter, kernel.leave_enter)
    saved_agrees = hyper_connections.cuda_agrees
    if hc_kernel:
        kernel.enter, kernel.leave_enter = _hc_kernel_standins()
        kernel.available = lambda: True
        hyper_connections.cuda_agrees = lambda *_: True  # type: ignore[assignment]
    try:
        yield
    finally:
        fast.rms_norm, fast.rope, fast.scaled_dot_product_attention = saved
        sinkhorn_module.sinkhorn_compiled = saved_sinkhorn
        kernel.available, kernel.enter, kernel.leave_enter = saved_kernel
        hyper_connections.cuda_agrees = saved_agrees


def decode_layer_counts(
    model: Any, caches: list[list[Any]], tokens: mx.array
) -> list[collections.Counter[str]]:
    """Each decoder layer's nodes in one decode step of the rows `caches` (one
    model cache each; several rows are stacked as the engine stacks them), `tokens`
    [rows, 1]; the caches advance by the step."""
    rows = len(caches)
    layers = model.layers
    if rows == 1:
        per_layer: list[Any] = caches[0]
    else:
        per_layer = [type(caches[0][i]).stack([c[i] for c in caches]) for i in range(len(layers))]
        mx.eval([cache.state for cache in per_layer])  # the stacking is not the step's
    h = model.model.embed_tokens(tokens)
    streams = mx.broadcast_to(h[:, :, None, :], (rows, 1, model.model.hc_mult, h.shape[-1]))
    counts = []
    for layer, cache in zip(layers, per_layer, strict=True):
        mx.eval(streams)
        streams = layer(streams, tokens, cache)
        counts.append(count_nodes([streams, *cache.state]))
        mx.eval(streams, cache.state)
    if rows > 1:
        for cache in per_layer:
            cache.unstack()
    return counts


def summarize_layers(model: Any, counts: list[collections.Counter[str]]) -> dict[str, Any]:
    """Mean non-view nodes per layer, by primitive, and per layer kind."""
    args = model.args
    total: collections.Counter[str] = collections.Counter()
    kinds: dict[str, list[int]] = collections.defaultdict(list)
    for layer_type, mlp_type, count in zip(
        args.layer_types, args.mlp_layer_types, counts, strict=True
    ):
        kernels = kernels_of(count)
        total.update(kernels)
        kinds[f"{layer_type}+{mlp_type}"].append(sum(kernels.values()))
    layers = len(counts)
    return {
        "non_view_per_layer": sum(total.values()) / layers,
        "by_primitive_per_layer": {k: v / layers for k, v in kernels_of(total).items()},
        "by_kind": {k: {"layers": len(v), "non_view": sum(v) / len(v)} for k, v in kinds.items()},
    }


def prefilled_rows(model: Any, rows: int, context: int, margin: int) -> list[list[Any]]:
    """`rows` caches, each prefilled with `context` (+ its row index) random tokens."""
    vocab = int(model.args.vocab_size)
    caches = []
    for row in range(rows):
        cache = model.make_cache(margin)
        prompt = mx.random.randint(0, vocab, (1, context + row), key=mx.random.key(row))
        streams = model.forward_hidden(prompt, cache)
        mx.eval(model.head_from_streams(streams[:, -1:]), [c.state for c in cache])
        caches.append(cache)
    return caches


def per_layer_report(
    model: Any, batches: list[int], context: int, tuning: EngineTuning
) -> dict[str, Any]:
    """`decode_layer_counts` at each batch size, summarised."""
    model.tune(tuning)
    vocab = int(model.args.vocab_size)
    report = {}
    for rows in batches:
        caches = prefilled_rows(model, rows, context, margin=8)
        tokens = mx.random.randint(0, vocab, (rows, 1), key=mx.random.key(99))
        report[str(rows)] = summarize_layers(model, decode_layer_counts(model, caches, tokens))
    return report


def whole_forwards(model: Any, lengths: list[int], tuning: EngineTuning) -> dict[str, Any]:
    """Nodes of one forward of each length (and the head), after a 64-token prefill."""
    adapter = MTPAdapter(model)
    adapter.tune(tuning)
    state = adapter.new_state(max_rollback=8)
    adapter.prefill(state, list(range(1, 65)))
    layers = len(model.layers)
    forwards = {}
    for length in lengths:
        streams = model.forward_hidden(mx.arange(3, 3 + length)[None], state.cache)
        logits = model.head_from_streams(streams)
        counts = count_nodes([logits, *[c.state for c in state.cache]])
        mx.eval(logits, [c.state for c in state.cache])
        for cache in state.cache:
            trim_exactly(cache, length)
        kernels = kernels_of(counts)
        forwards[str(length)] = {
            "nodes": sum(counts.values()),
            "non_view_nodes": sum(kernels.values()),
            "non_view_per_layer": sum(kernels.values()) / layers,
            "by_primitive": kernels,
        }
    return forwards


def main() -> None:
    from mtp_cost import DENSE_FORMATS, flash_shaped  # beside this file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--tokens", default="1,2,6", help="forward lengths S, comma-separated")
    parser.add_argument("--hc-ops", action="store_true", help="hyper-connections as ops")
    parser.add_argument(
        "--plain-layers",
        action="store_true",
        help="the layers' small ops unfused (tuning compiled_decode_max_rows=0), to compare",
    )
    parser.add_argument(
        "--masked-attention", action="store_true", help="one masked attention call per forward"
    )
    parser.add_argument(
        "--per-layer", action="store_true", help="count each decoder layer of a decode step"
    )
    parser.add_argument("--batches", default="1,4", help="decode batch sizes for --per-layer")
    parser.add_argument("--context", type=int, default=64, help="prefilled tokens per row")
    parser.add_argument("--dense", choices=DENSE_FORMATS, default="mxfp8")
    parser.add_argument(
        "--fast-ops-as-one-node",
        action="store_true",
        help="count a GPU's graph on a CPU (fast ops and the Sinkhorn one node each)",
    )
    parser.add_argument(
        "--no-hc-kernel",
        action="store_true",
        help="with --fast-ops-as-one-node: count without the CUDA hyper-connection kernel "
        "(what Metal runs)",
    )
    args = parser.parse_args()
    tuning = default_tuning()
    if args.hc_ops:
        tuning = tuning.replace(compiled_hc_max_rows=0)
    if args.plain_layers:
        tuning = tuning.replace(compiled_decode_max_rows=0)
    if args.masked_attention:
        tuning = tuning.replace(split_attention_queries=False)
    configure_cuda_graphs()
    model = flash_shaped(args.layers, 512, 64, 8192, dense=args.dense)
    standins = (
        fast_ops_as_one_node(model.args, hc_kernel=not args.no_hc_kernel)
        if args.fast_ops_as_one_node
        else contextlib.nullcontext()
    )
    result: dict[str, Any] = {
        "benchmark": "graph_nodes",
        "layers": args.layers,
        "dense_projections": args.dense,
        "hyper_connections_compiled": not args.hc_ops,
        "layers_fused": not args.plain_layers,
        "attention_split_per_query": tuning.split_attention_queries,
        "fast_ops_as_one_node": args.fast_ops_as_one_node,
        "hc_kernel_counted": args.fast_ops_as_one_node and not args.no_hc_kernel,
        "device": benchmark_device(),
    }
    with standins:
        if args.per_layer:
            batches = [int(b) for b in args.batches.split(",")]
            result["context"] = args.context
            result["decode_layers"] = per_layer_report(model, batches, args.context, tuning)
        else:
            lengths = [int(t) for t in args.tokens.split(",")]
            result["forwards"] = whole_forwards(model, lengths, tuning)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
