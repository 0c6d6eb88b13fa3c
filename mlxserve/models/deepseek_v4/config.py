"""Model arguments for DeepSeek-V4, read from a ``config.json``.

Two spellings of the config exist in the wild: the one ``transformers`` writes
(``layer_types``, ``mlp_layer_types``, ``compress_rates`` and nested
``rope_parameters``) and DeepSeek's own (``compress_ratios``, ``num_hash_layers``,
``qk_rope_head_dim`` and a flat ``rope_scaling``). ``ModelArgs`` accepts both and
normalises them the way ``transformers``' ``DeepseekV4Config.__post_init__`` does, so
that the two spellings give the same model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from mlx_lm.models.base import BaseModelArgs

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
ROUTED_MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, ROUTED_MOE)

_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}


def _ratio_type(ratio: int, rates: dict[str, int]) -> str:
    """The attention type of a DeepSeek ``compress_ratios`` entry."""
    if ratio == 0:
        return SLIDING
    return CSA if ratio == rates[CSA] else HCA


_DEFAULT_NUM_HASH_LAYERS = 3
_DEFAULT_PARTIAL_ROTARY_FACTOR = 64 / 512


def _rope_type(params: dict[str, Any]) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


@dataclass
class ModelArgs(BaseModelArgs):
    """Hyper-parameters of a DeepSeek-V4 model.

    After ``__post_init__``, ``layer_types``, ``mlp_layer_types``, ``compress_rates``,
    ``qk_rope_head_dim`` and ``rope_parameters`` (``{"main": ..., "compress": ...}``)
    are always filled in; the legacy fields are only inputs.
    """

    model_type: str = "deepseek_v4"
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_parameters: dict[str, Any] | None = None
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    compress_rates: dict[str, int] | None = None
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1.0e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1.0e-6
    tie_word_embeddings: bool = False
    partial_rotary_factor: float | None = None
    qk_rope_head_dim: int | None = None
    # Attention type of each MTP block; DeepSeek's ``compress_ratios`` lists them after
    # the main layers. Defaults to sliding attention.
    mtp_layer_types: list[str] | None = None
    # DeepSeek-V4-Flash-0731 ships a DSpark draft head in ``mtp.*`` instead of MTP
    # blocks: its block, the layers it taps and its noise token (see ``dspark.py``).
    dspark_block_size: int | None = None
    dspark_target_layer_ids: list[int] | None = None
    dspark_markov_rank: int | None = None
    dspark_noise_token_id: int | None = None
    # Legacy (DeepSeek) spellings, folded into the fields above.
    compress_ratios: list[int] | None = None
    num_hash_layers: int | None = None
    rope_scaling: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs:
        """Build from a ``config.json`` dict; unknown keys are ignored."""
        if "text_config" in params:
            params = {**params["text_config"], "model_type": params["model_type"]}
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in params.items() if k in names})

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        rates = dict(_DEFAULT_COMPRESS_RATES)
        rates.update(self.compress_rates or {})
        legacy = [int(r) for r in self.compress_ratios or []]
        if HCA not in (self.compress_rates or {}):
            # DeepSeek's spelling gives ratios, not types: ratio 4 is CSA (overlapping
            # windows, an indexer), any other positive ratio HCA at that ratio.
            hca = sorted({r for r in legacy if r not in (0, rates[CSA])})
            if len(hca) > 1:
                raise ValueError(f"compress_ratios has several HCA ratios {hca}; one is read.")
            if hca:
                rates[HCA] = hca[0]
        self.compress_rates = rates
        if self.layer_types is None and legacy:
            self.layer_types = [_ratio_type(r, rates) for r in legacy[:n]]
        if self.layer_types is None:
            interleave = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            self.layer_types = [HCA] * min(n, 2) + interleave
        self.layer_types = list(self.layer_types[:n])

        if self.mlp_layer_types is None:
            n_hash = self.num_hash_layers
            if n_hash is None:
                n_hash = _DEFAULT_NUM_HASH_LAYERS
            self.mlp_layer_types = [HASH_MOE] * min(n, n_hash) + [ROUTED_MOE] * max(0, n - n_hash)
        self.mlp_layer_types = list(self.mlp_layer_types[:n])

        if self.mtp_layer_types is None:
            extra = [_ratio_type(r, rates) for r in legacy[n:]]
            n_mtp = self.num_nextn_predict_layers
            self.mtp_layer_types = (extra + [SLIDING] * n_mtp)[:n_mtp]

        if self.partial_rotary_factor is None:
            if self.qk_rope_head_dim is not None:
                self.partial_rotary_factor = self.qk_rope_head_dim / self.head_dim
            else:
                self.partial_rotary_factor = _DEFAULT_PARTIAL_ROTARY_FACTOR
        self.qk_rope_head_dim = int(self.head_dim * self.partial_rotary_factor)
        self.rope_parameters = self._nested_rope_parameters()
        self._validate()

    def _nested_rope_parameters(self) -> dict[str, Any]:
        """Return ``{"main": ..., "compress": ...}`` as ``transformers`` builds it.

        Sliding layers use plain RoPE at ``rope_theta``; compressed layers use
        ``compress_rope_theta`` with the (YaRN) scaling, whose attention factor
        defaults to 1 because the reference does not scale cos/sin.
        """
        flat = dict(self.rope_parameters or self.rope_scaling or {})
        main = flat.get("main")
        compress = flat.get("compress")
        if isinstance(main, dict) and isinstance(compress, dict):
            return {"main": dict(main), "compress": dict(compress)}
        yarn = {k: v for k, v in flat.items() if k not in ("main", "compress")}
        main = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
        }
        compress = {
            **yarn,
            "rope_theta": self.compress_rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
        }
        compress["rope_type"] = _rope_type(compress)
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
        return {"main": main, "compress": compress}

    def _validate(self) -> None:
        assert self.layer_types is not None and self.mlp_layer_types is not None
        for name, types, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES),
        ):
            if len(types) != self.num_hidden_layers:
                raise ValueError(
                    f"{name} has {len(types)} entries for {self.num_hidden_layers} layers."
                )
            bad = [t for t in types if t not in allowed]
            if bad:
                raise ValueError(f"{name} entries must be in {allowed}; got {bad}.")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError("o_groups must divide num_attention_heads * head_dim.")

    def compress_ratio(self, layer_type: str) -> int:
        """The number of source tokens per compressed entry (0 for sliding layers)."""
        if layer_type == SLIDING:
            return 0
        assert self.compress_rates is not None
        return int(self.compress_rates[layer_type])
