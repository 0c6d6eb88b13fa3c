"""What an operator sees on the terminal while the server starts, serves and stops.

Plain lines on stderr, one per event (no progress bars: they garble logs). The
plan summary is shown because the plan decides which kernels run; the full
document is at GET /v1/policy.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from mlxserve.server.backends.base import BackendInfo


def plan_summary(plan: dict[str, Any] | None) -> str:
    """One line: hash, cluster shape, per-rank nax_moe, watchdog timeout, warnings."""
    if not plan:
        return "no plan (remote backend)"
    world = plan.get("world", {})
    ranks = plan.get("ranks", [])
    nax = ", ".join(
        f"rank {r.get('rank')}: nax_moe {r.get('decisions', {}).get('nax_moe', {}).get('value')}"
        for r in ranks
    )
    timeout = world.get("progress_timeout_s", {}).get("value")
    warnings = len(plan.get("warnings", []))
    return (
        f"plan {str(plan.get('plan_hash', ''))[:12]}: {plan.get('world_size')} rank(s), "
        f"{str(plan.get('composition', '')).replace('_', ' ')}; {nax}; "
        f"watchdog {timeout} s" + (f"; {warnings} warning(s)" if warnings else "")
    )


class Console:
    def __init__(self, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.stream = stream
        self.enabled = enabled
        self._announced_ready = False

    def say(self, message: str) -> None:
        if self.enabled:
            print(f"mlxserve: {message}", file=self.stream or sys.stderr, flush=True)

    def engine_up(self, name: str, info: BackendInfo, seconds: float, restart: bool) -> None:
        what = "restarted" if restart else "up"
        pid = f"pid {info.pid}, " if info.pid else ""
        depth = info.speculative_depth
        shown = f"auto (up to {depth})" if info.speculative_auto else str(depth)
        self.say(
            f"backend '{name}' {what} in {seconds:.1f} s ({pid}model {info.model}, "
            f"context {info.context_length}, speculative depth {shown})"
        )
        if info.plan and not restart:
            self.say(plan_summary(info.plan))

    def ready(self, url: str, model: str, backends: str = "") -> None:
        """Once: the URL, and which backends are up (a fallback may serve alone)."""
        if self._announced_ready:
            return
        self._announced_ready = True
        more = f"; {backends}" if backends else ""
        self.say(f"ready: {url}  (model '{model}'; OpenAI base URL {url}/v1{more})")
