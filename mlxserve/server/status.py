"""The status page's data: one snapshot of what an operator checks first.

Readiness and backends (as `/ready` reports them), traffic (slots, queue, tokens,
speculative acceptance, failovers, from the server's own metrics registry), the
policy plan per rank with the rule behind every decision, and the incidents. Built
only from what the runtime already tracks: the page costs no backend a request.
"""

from __future__ import annotations

import time
from typing import Any

from mlxserve.server.runtime import Runtime


def _total(runtime: Runtime, name: str) -> float:
    """Sum of a metric over all its label sets (0 before the first sample)."""
    total = 0.0
    for family in runtime.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


def _traffic(runtime: Runtime) -> dict[str, Any]:
    admission = runtime.admission
    drafted = _total(runtime, "mlxserve_speculative_drafted_tokens_total")
    accepted = _total(runtime, "mlxserve_speculative_accepted_tokens_total")
    return {
        "running": admission.running,
        "waiting": admission.waiting,
        "max_running": admission.max_running,
        "max_queue": admission.max_queue,
        "prompt_tokens": int(_total(runtime, "mlxserve_prompt_tokens_total")),
        "completion_tokens": int(_total(runtime, "mlxserve_completion_tokens_total")),
        "speculative_drafted": int(drafted),
        "speculative_accepted": int(accepted),
        "speculative_acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "failovers": int(_total(runtime, "mlxserve_failovers_total")),
        "retries": int(_total(runtime, "mlxserve_request_retries_total")),
    }


def _plan(plan: dict[str, Any] | None) -> dict[str, Any] | None:
    """The plan, reduced to what the page shows: cluster facts and per-rank decisions."""
    if plan is None:
        return None
    ranks = []
    for rank in plan.get("ranks", []):
        profile = rank.get("profile", {})
        ranks.append(
            {
                "rank": rank.get("rank"),
                "chip": profile.get("chip"),
                "nax": profile.get("nax"),
                "simulated": profile.get("simulated"),
                "decisions": rank.get("decisions", {}),
            }
        )
    keys = ("plan_hash", "simulated", "world_size", "backend", "composition")
    return {**{key: plan.get(key) for key in keys}, "ranks": ranks}


def snapshot(runtime: Runtime) -> dict[str, Any]:
    ready, detail = runtime.readiness()
    return {
        "model": runtime.model_name,
        "url": runtime.url,
        "ready": ready,
        "status": detail["status"],
        "draining": detail["draining"],
        "uptime_s": int(time.time() - runtime.created),
        "active_backend": detail["active"],
        "backends": detail["backends"],
        "incidents": detail["incidents"],
        "traffic": _traffic(runtime),
        "plan": _plan(runtime.plan()),
    }
