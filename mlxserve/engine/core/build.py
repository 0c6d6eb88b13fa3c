"""Assemble an engine from settings and a plan: load, apply the kernel policy, pick the
adapter, and resolve the tuning for this device."""

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx

from mlxserve.config import Settings, state_dir
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.adapter import ModelAdapter, PlainAdapter
from mlxserve.engine.sample.grammar import Grammars
from mlxserve.engine.spec.cost_store import CostsPlace, run_identity
from mlxserve.engine.spec.dspark import DSparkAdapter
from mlxserve.engine.spec.mtp import MAX_DRAFT_DEPTH, MTPAdapter
from mlxserve.hardware.tuning import EngineTuning, tuning_for
from mlxserve.models.deepseek_v4.dspark import head_of
from mlxserve.policy.plan import Plan

log = logging.getLogger(__name__)

DEFAULT_MTP_DEPTH: Literal["auto"] = "auto"


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    adapter: ModelAdapter
    speculative_depth: int | Literal["auto"]


def speculative_depth(settings: Settings, model: Any) -> int | Literal["auto"]:
    """The configured depth, defaulting to "auto" for models with an MTP module or a
    DSpark head, else 0."""
    has_mtp = getattr(model, "num_mtp_blocks", 0) > 0 or head_of(model) is not None
    depth = settings.speculative.depth
    if depth is None:
        return DEFAULT_MTP_DEPTH if has_mtp else 0
    return depth if has_mtp else 0


def adapter_for(model: Any, depth: int | Literal["auto"]) -> ModelAdapter:
    """Without drafting the MTP module would only cost time: serve the main model alone."""
    if depth != "auto" and depth <= 0:
        return PlainAdapter(model)
    return DSparkAdapter(model) if head_of(model) is not None else MTPAdapter(model)


def materialize(model: Any) -> None:
    """Evaluate every array the modules hold, private ones (index tables, RoPE) too.

    The engine loop runs on its own thread and MLX streams are per thread: a
    lazy array built while loading would fail to evaluate there ("There is no
    Stream(cpu, 0) in current thread").
    """
    arrays = [
        value
        for module in model.modules()
        for value in (*vars(module).values(), *module.values())
        if isinstance(value, mx.array)
    ]
    mx.eval(arrays)


def load_for_serving(settings: Settings, plan: Plan, rank: int, group: Any = None) -> LoadedModel:
    """The model as this rank serves it: whole, or its shard of a tensor-parallel ``group``
    (its share of the plan's split)."""
    from mlxserve.kernels.apply import apply_moe_policy
    from mlxserve.models import load, sharded_load

    if group is not None:
        split = plan.tensor_split()
        log.info("tensor-parallel split %s (%s)", split, plan.split.rule if plan.split else "even")
        model, tokenizer = sharded_load(settings.model, group, split=split)
    else:
        model, tokenizer = load(settings.model)
    apply_moe_policy(model, plan, rank)  # logs what it did
    depth = speculative_depth(settings, model)
    materialize(model)
    return LoadedModel(model, tokenizer, adapter_for(model, depth), depth)


def engine_tuning(settings: Settings) -> EngineTuning:
    """The knobs of the device this engine computes on, with those `[engine.tuning]` sets."""
    from mlxserve.hardware.device import default_device_type

    configured = settings.engine.tuning.model_dump(exclude_none=True)
    return tuning_for(default_device_type(), configured)


def engine_config(settings: Settings, plan: Plan, loaded: LoadedModel) -> EngineConfig:
    """The engine's config. How the draft depth follows the batch size: alone, the
    configured depth (with "auto", the one the depth picker picks per round); up to the
    tuning's `speculative_batch` requests draft together at its
    `speculative_batch_depth`; larger batches decode plainly."""
    from mlxserve.hardware.probe import device_type, step_floor_s

    args = getattr(loaded.model, "args", None)
    experts = int(getattr(args, "n_routed_experts", 0) or 0)
    top_k = int(getattr(args, "num_experts_per_tok", 0) or 0)
    depth = loaded.speculative_depth
    tuning = engine_tuning(settings)
    log.info("engine tuning: %s", tuning)
    # An automatic depth chooses a lone request's rounds; a batch drafts at its fixed depth.
    deepest = MAX_DRAFT_DEPTH if depth == "auto" else depth
    batch_depth = min(tuning.speculative_batch_depth, deepest)
    return EngineConfig(
        max_running=settings.engine.max_running,
        prefill_step=plan.prefill_step_size(settings.engine.prefill_step, experts, top_k),
        speculative_depth=loaded.speculative_depth,
        prefix_cache_entries=settings.engine.prefix_cache_entries,
        prefix_cache_bytes=settings.engine.prefix_cache_mb << 20,
        max_speculative_batch=tuning.speculative_batch,
        batch_speculative_depth=batch_depth,
        step_floor_s=step_floor_s(device_type()),
        tuning=tuning,
    )


def costs_place(
    settings: Settings, plan: Plan, loaded: LoadedModel, rank: int, world_size: int
) -> CostsPlace | None:
    """Where the automatic depth's measured round costs are kept across runs: the state
    directory, keyed by this run's device, software, model and plan. Only with an
    automatic depth, and only on rank 0: it decides for its group (a follower takes
    the costs rank 0 sends, `lockstep`)."""
    if loaded.speculative_depth != "auto" or rank != 0:
        return None
    decisions = {
        "rank": {k: d.value for k, d in plan.ranks[rank].decisions.items()},
        "world": {k: d.value for k, d in plan.world.items()},
    }
    identity = run_identity(loaded.model, settings.model, decisions)
    return CostsPlace(state_dir(settings.server), identity, world_size)


def grammars_for(loaded: LoadedModel) -> Grammars:
    """Grammars over the model's logits, whose width may exceed the tokenizer's vocabulary."""
    args = getattr(loaded.model, "args", None)
    width = int(getattr(args, "vocab_size", 0) or 0)
    return Grammars(loaded.tokenizer, width or len(loaded.tokenizer))


def build_engine(
    settings: Settings, plan: Plan, rank: int = 0, group: Any = None
) -> tuple[Engine, LoadedModel]:
    """The engine of one rank. With a tensor-parallel ``group`` rank 0's leads the
    others in lockstep (``mlxserve.engine.process.lockstep``); followers run ``follow``."""
    from mlxserve.engine.process.lockstep import LockstepLeader

    if group is not None and group.size() == 1:
        group = None  # a group of one is no tensor parallelism
    loaded = load_for_serving(settings, plan, rank, group)
    leader = LockstepLeader(group) if group is not None and rank == 0 else None
    world_size = group.size() if group is not None else 1
    config = dataclasses.replace(
        engine_config(settings, plan, loaded),
        round_costs=costs_place(settings, plan, loaded, rank, world_size),
    )
    engine = Engine(
        loaded.adapter,
        config,
        lockstep=leader,
        grammars=grammars_for(loaded),
    )
    return engine, loaded
