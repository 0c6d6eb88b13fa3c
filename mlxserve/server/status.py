"""The dashboard's data: one snapshot of what an operator checks first.

Readiness and backends (as `/ready` reports them), traffic (slots, queue, tokens,
speculative acceptance, failovers, from the server's own metrics registry), the
policy plan per rank with the rule behind every decision, the incidents with their
evidence, the recent history (`mlxserve.server.history`) and a timeline of failovers
and incidents. Built only from what the runtime already tracks: the page costs no
backend a request.
"""

from __future__ import annotations

import time
from typing import Any

from mlxserve.server.history import WINDOW_S
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
        "failbacks": int(_total(runtime, "mlxserve_failbacks_total")),
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
    split = plan.get("split") or {}
    estimates = {e.get("rank"): e for e in split.get("estimates", [])}
    shares = split.get("shares") or []
    for entry in ranks:
        estimate = estimates.get(entry["rank"], {})
        rank_profile: dict[str, Any] = next(
            (r.get("profile", {}) for r in plan.get("ranks", []) if r.get("rank") == entry["rank"]),
            {},
        )
        index = entry["rank"]
        entry["share"] = shares[index] if isinstance(index, int) and index < len(shares) else None
        entry["memory_bytes"] = rank_profile.get("memory_bytes")
        entry["held_bytes"] = estimate.get("held_bytes")
        entry["usable_bytes"] = estimate.get("usable_bytes")
    keys = ("plan_hash", "simulated", "world_size", "backend", "composition")
    return {
        **{key: plan.get(key) for key in keys},
        "ranks": ranks,
        "world": plan.get("world", {}),
        "split": {key: split.get(key) for key in ("shares", "rule", "reason")} if split else None,
        "overrides": plan.get("overrides", []),
        "warnings": plan.get("warnings", []),
    }


def _events(runtime: Runtime) -> list[dict[str, Any]]:
    """Failovers, failbacks and incidents, oldest first, for the timeline."""
    events: list[dict[str, Any]] = []
    for switch in runtime.router.switches:
        if switch.kind == "failover":
            text = f"failover: '{switch.from_backend}' -> '{switch.to_backend}'"
        elif switch.kind == "failback":
            text = f"failback: traffic back on '{switch.to_backend}'"
        elif switch.kind == "none":
            text = f"no healthy backend (last: '{switch.from_backend}')"
        else:
            text = f"'{switch.to_backend}' serves ({switch.kind})"
        events.append({"at": switch.at, "kind": switch.kind, "text": text})
    for incident in runtime.supervisor.incidents:
        code = "" if incident.exit_code is None else f", exit code {incident.exit_code}"
        events.append(
            {
                "at": incident.at,
                "kind": "incident",
                "text": f"incident: '{incident.backend}' {incident.kind}{code}",
            }
        )
    return sorted(events, key=lambda event: float(event["at"]))


def _backends(runtime: Runtime, listed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The backends as /ready lists them, with what their engine said about itself."""
    by_name = {b.name: b for b in runtime.backends}
    out = []
    for entry in listed:
        info = by_name[entry["name"]].info
        out.append(
            {
                **entry,
                "model": info.model if info else None,
                "plan_hash": info.plan_hash if info else None,
                "speculative_depth": (
                    None
                    if info is None
                    else f"auto (up to {info.speculative_depth})"
                    if info.speculative_auto
                    else info.speculative_depth
                ),
            }
        )
    return out


def _incidents(runtime: Runtime) -> list[dict[str, Any]]:
    return [
        {
            **i.summary(),
            "output_tail": [line for line in i.output_tail[-OUTPUT_LINES:] if line.strip()],
        }
        for i in runtime.supervisor.incidents
    ]


OUTPUT_LINES = 5  # an incident's last lines of engine output shown as evidence


def snapshot(runtime: Runtime, since: float | None = None) -> dict[str, Any]:
    """The dashboard's document; ``since`` (a sample's ``t``) keeps only newer samples."""
    ready, detail = runtime.readiness()
    history = runtime.history
    return {
        "model": runtime.model_name,
        "model_aliases": list(runtime.settings.server.model_aliases),
        "url": runtime.url,
        "ready": ready,
        "status": detail["status"],
        "draining": detail["draining"],
        "now": round(time.time(), 3),
        "uptime_s": int(time.time() - runtime.created),
        "active_backend": detail["active"],
        "backends": _backends(runtime, detail["backends"]),
        "incidents": _incidents(runtime),
        "events": _events(runtime),
        "traffic": _traffic(runtime),
        "plan": _plan(runtime.plan()),
        "history": {
            "interval_s": history.interval_s,
            "window_s": WINDOW_S,
            "keep": history.samples.maxlen,
            "samples": history.since(since),
        },
    }
