"""Map checkpoint tensors to the parameter names of ``Model``.

Accepted layouts (each may carry a leading ``model.``, as ``transformers``'
``save_pretrained`` writes it):

* DeepSeek leaf names: ``embed_tokens`` / ``embed``, ``head``, ``norm``,
  ``hc_head.hc_fn`` / ``hc_head_fn``, ``layers.N.{attn,ffn,attn_norm,ffn_norm,hc_attn_*,
  hc_ffn_*}`` with one tensor per expert (``ffn.experts.E.w1``), and
  ``mtp.I.*`` (MTP blocks, same per-layer names plus ``e_proj``, ``h_proj``, ``enorm``,
  ``hnorm``, ``norm`` and ``hc_head_*``). The attention's kv norm is published as
  ``attn.kv_norm`` (``attn.norm`` in ``transformers``' names and in MLX's).
* The output of this function (already converted / quantised MLX checkpoints): it is
  idempotent.

Experts are stacked into ``switch_mlp.{gate,up,down}_proj`` (w1, w3, w2), the shared
expert gets ``mlx_lm``'s names, ``wo_a`` is split into its output groups and
``tid2eid`` becomes int32.

FP8 / FP4 packed weights (DeepSeek's published checkpoints: ``X.weight`` codes plus
``X.scale``, per expert too) stay packed: they become ``X.weight`` (uint32 view) plus
``X.scales`` (e8m0, one per 32 input elements of each row) in MLX's ``mxfp8`` /
``mxfp4`` layouts (see ``packed.py``), which ``mlx_lm``'s loader quantises the matching
modules for. Expert weights and their scales are stacked alike; ``wo_a``'s scales are
split into its output groups like its weight.
"""

from __future__ import annotations

import re

import mlx.core as mx

from .packed import repack

_EXPERT = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_BLOCK_RENAMES = (
    (".hc_attn_fn", ".hc_attn.fn"),
    (".hc_attn_base", ".hc_attn.base"),
    (".hc_attn_scale", ".hc_attn.scale"),
    (".hc_ffn_fn", ".hc_ffn.fn"),
    (".hc_ffn_base", ".hc_ffn.base"),
    (".hc_ffn_scale", ".hc_ffn.scale"),
    (".hc_head_fn", ".hc_head.hc_fn"),
    (".hc_head_base", ".hc_head.hc_base"),
    (".hc_head_scale", ".hc_head.hc_scale"),
    (".shared_experts.w1.", ".shared_experts.gate_proj."),
    (".shared_experts.w2.", ".shared_experts.down_proj."),
    (".shared_experts.w3.", ".shared_experts.up_proj."),
    (".gate.e_score_correction_bias", ".gate.bias"),
    (".attn.kv_norm.", ".attn.norm."),
)
_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_tokens.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "lm_head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    "hc_head.hc_fn": "model.hc_head.hc_fn",
    "hc_head.hc_base": "model.hc_head.hc_base",
    "hc_head.hc_scale": "model.hc_head.hc_scale",
}


def _rename(key: str) -> str:
    if key in _TOP_LEVEL:
        return _TOP_LEVEL[key]
    if key.startswith("layers."):
        key = f"model.{key}"
    elif not key.startswith("mtp."):
        raise ValueError(f"Unexpected DeepSeek-V4 checkpoint tensor {key!r}.")
    for old, new in _BLOCK_RENAMES:
        key = key.replace(old, new)
    return key


def sanitize_weights(weights: dict[str, mx.array], o_groups: int) -> dict[str, mx.array]:
    """Return the weights renamed and reshaped for ``Model`` (see the module docstring)."""
    out: dict[str, mx.array] = {}
    experts: dict[tuple[str, str], dict[int, dict[str, mx.array]]] = {}
    stripped = {key.removeprefix("model."): value for key, value in weights.items()}
    for key, value in stripped.items():
        match = _EXPERT.match(key)
        if match is not None:
            kind, block, index, proj, part = match.groups()
            rows = experts.setdefault((f"{kind}.{block}", proj), {})
            rows.setdefault(int(index), {})[part] = value
            continue
        base = key.removesuffix(".scale")
        if base != key and f"{base}.weight" in stripped:
            continue  # packed together with its weight
        name = _rename(key)
        scales = None
        if key.endswith(".weight"):
            scale = stripped.get(f"{key.removesuffix('.weight')}.scale")
            if scale is not None:
                value, scales = repack(value, scale, key)
        if name.endswith(".attn.wo_a.weight") and value.ndim == 2:
            value = value.reshape(o_groups, -1, value.shape[-1])
            if scales is not None:
                scales = scales.reshape(o_groups, -1, scales.shape[-1])
        if name.endswith(".gate.tid2eid"):
            value = value.astype(mx.int32)
        out[name] = value
        if scales is not None:
            out[f"{name.removesuffix('.weight')}.scales"] = scales

    for (block, proj), rows in experts.items():
        if sorted(rows) != list(range(len(rows))):
            raise ValueError(f"{block} has experts {sorted(rows)} for {proj}: some are missing.")
        parts = [rows[i] for i in range(len(rows))]
        if any("weight" not in part for part in parts):
            raise ValueError(f"{block} has a scale but no weight for some {proj} experts.")
        prefix = f"model.{block}" if block.startswith("layers.") else block
        name = f"{prefix}.ffn.switch_mlp.{_PROJ[proj]}"
        with_scale = sum("scale" in part for part in parts)
        if with_scale and with_scale != len(parts):
            raise ValueError(f"{block}: only some {proj} experts have scales.")
        _same_shapes(parts, "weight", f"{block}.ffn.experts", proj)
        stacked = mx.stack([part["weight"] for part in parts])
        if with_scale:
            _same_shapes(parts, "scale", f"{block}.ffn.experts", proj)
            scales = mx.stack([part["scale"] for part in parts])
            stacked, out[f"{name}.scales"] = repack(
                stacked, scales, f"{block}.ffn.experts.*.{proj}"
            )
        out[f"{name}.weight"] = stacked
    return out


def mtp_block_count(weights: dict[str, mx.array]) -> int:
    """How many MTP blocks the (sanitised) weights hold."""
    ids = {int(k.split(".")[1]) for k in weights if k.startswith("mtp.")}
    return max(ids) + 1 if ids else 0


def _same_shapes(parts: list[dict[str, mx.array]], part: str, where: str, proj: str) -> None:
    """Experts stack into one tensor, so each must have expert 0's shape (named if not)."""
    first = tuple(parts[0][part].shape)
    for index, tensors in enumerate(parts):
        shape = tuple(tensors[part].shape)
        if shape != first:
            raise ValueError(
                f"{where}.{index}.{proj}.{part} has shape {list(shape)}; "
                f"expert 0 has {list(first)}."
            )


def check_weights(weights: dict[str, mx.array], params: dict[str, mx.array]) -> None:
    """Raise ``ValueError`` with one line naming the first tensor that does not fit.

    ``weights`` are the sanitised checkpoint tensors, ``params`` the model's (after
    quantisation). Shapes only: nothing is read or evaluated.
    """
    missing = sorted(set(params) - set(weights))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"the checkpoint lacks {missing[0]}{more}.")
    extra = sorted(set(weights) - set(params))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ValueError(f"the checkpoint has {extra[0]}{more}, which the config does not.")
    for name in sorted(params):
        got, want = tuple(weights[name].shape), tuple(params[name].shape)
        if got != want:
            raise ValueError(f"{name} has shape {list(got)}; the config gives {list(want)}.")
