"""Prometheus metrics of the front, in a registry of its own.

A registry per server (not the process-global default) so tests can run several
apps in one process and every number on /metrics belongs to this server.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: what an engine reports with each finished request (``FinishEvent.memory``)
MEMORY_KINDS = (
    "active_bytes",
    "peak_bytes",
    "busy_peak_bytes",
    "weights_bytes",
    "cache_bytes",
    "prefix_cache_bytes",
)
#: Fine enough below a second for the dashboard's percentiles (read from these buckets).
LATENCY_BUCKETS = (
    0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25,
    0.35, 0.5, 0.75, 1, 1.5, 2.5, 5, 10, 30, 60,
)  # fmt: skip


class Metrics:
    def __init__(self) -> None:
        self._drafted = 0
        self._accepted = 0
        #: Each backend's memory at its last finished request (``MEMORY_KINDS``).
        self.backend_memory: dict[str, dict[str, int]] = {}
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "mlxserve_requests",
            "HTTP API requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "mlxserve_prompt_tokens", "Prompt tokens of completed requests", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "mlxserve_prompt_cached_tokens",
            "Prompt tokens of completed requests reused from the prefix cache",
            registry=r,
        )
        self.prefilled_prompt_tokens = Counter(
            "mlxserve_prompt_prefilled_tokens",
            "Prompt tokens of completed requests the model had to prefill (not reused)",
            registry=r,
        )
        self.completion_tokens = Counter(
            "mlxserve_completion_tokens", "Tokens generated for clients", registry=r
        )
        self.ttft = Histogram(
            "mlxserve_time_to_first_token_seconds",
            "From request arrival to the first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "mlxserve_inter_token_latency_seconds",
            "Time between generated tokens of one request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "mlxserve_request_duration_seconds",
            "Generation requests, arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "mlxserve_queue_depth", "Requests waiting for a generation slot", registry=r
        )
        self.running = Gauge(
            "mlxserve_running_requests", "Requests holding a generation slot", registry=r
        )
        self.drafted = Counter(
            "mlxserve_speculative_drafted_tokens", "MTP draft tokens proposed", registry=r
        )
        self.accepted = Counter(
            "mlxserve_speculative_accepted_tokens", "MTP draft tokens accepted", registry=r
        )
        self.depth_steps = Counter(
            "mlxserve_speculative_depth_steps",
            "Decode steps of speculative requests, by the depth each ran at (0: plain "
            "step; with an automatic depth, the depths it chose)",
            ["depth"],
            registry=r,
        )
        self.position_drafted = Counter(
            "mlxserve_speculative_position_drafted",
            "MTP rounds that drafted a token at this draft position (1: the first draft)",
            ["position"],
            registry=r,
        )
        self.position_accepted = Counter(
            "mlxserve_speculative_position_accepted",
            "MTP draft tokens accepted at this draft position",
            ["position"],
            registry=r,
        )
        self.acceptance_rate = Gauge(
            "mlxserve_speculative_acceptance_rate",
            "Accepted / drafted MTP tokens since start",
            registry=r,
        )
        self.engine_memory = Gauge(
            "mlxserve_engine_memory_bytes",
            "The engine's MLX memory at the last finished request: active, peak (since "
            "start), busy_peak (since the engine was last idle), weights, that request's "
            "share of the decode caches (cache) and the prefix cache",
            ["kind"],
            registry=r,
        )
        self.failovers = Counter(
            "mlxserve_failovers",
            "Times traffic moved to a later backend because the active one failed",
            ["from_backend", "to_backend"],
            registry=r,
        )
        self.failbacks = Counter(
            "mlxserve_failbacks",
            "Times traffic returned to an earlier backend that became healthy again",
            ["to_backend"],
            registry=r,
        )
        self.retries = Counter(
            "mlxserve_request_retries",
            "Requests resumed after their backend failed, by the failed backend",
            ["backend"],
            registry=r,
        )
        self.backend_healthy = Gauge(
            "mlxserve_backend_healthy",
            "1 if the backend passes health checks",
            ["backend"],
            registry=r,
        )
        self.backend_active = Gauge(
            "mlxserve_backend_active",
            "1 for the backend new requests go to",
            ["backend"],
            registry=r,
        )
        self.engine_restarts = Counter(
            "mlxserve_engine_restarts",
            "Local engine processes restarted",
            ["backend"],
            registry=r,
        )
        self.incidents = Counter(
            "mlxserve_incidents",
            "Engine failures (kind: watchdog = exit 75, crash, killed, unresponsive), "
            "with the hash of the policy plan the engine ran under",
            ["backend", "kind", "plan_hash"],
            registry=r,
        )

    def record_memory(self, memory: dict[str, int], backend: str | None = None) -> None:
        kept = {key: int(value) for key, value in memory.items() if key in MEMORY_KINDS}
        for key, value in kept.items():
            self.engine_memory.labels(key).set(value)
        if backend is not None:
            self.backend_memory[backend] = kept

    def record_speculative(
        self,
        drafted: int,
        accepted: int,
        depths: dict[str, int] | None = None,
        rates_per_position: list[float] | None = None,
    ) -> None:
        """One request's drafts. ``rates_per_position`` (the engine's acceptance per draft
        position) with ``depths`` (its rounds per depth) gives counts per position: a round
        at depth d drafts positions 1..d, so position j was drafted in the rounds at depth
        >= j."""
        for depth, steps in (depths or {}).items():
            self.depth_steps.labels(depth=depth).inc(steps)
        for index, rate in enumerate(rates_per_position or []):
            rounds = sum(n for d, n in (depths or {}).items() if d.isdigit() and int(d) > index)
            if rounds:
                position = str(index + 1)
                self.position_drafted.labels(position).inc(rounds)
                self.position_accepted.labels(position).inc(round(rate * rounds))
        if drafted <= 0:
            return
        self._drafted += drafted
        self._accepted += accepted
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        self.acceptance_rate.set(self._accepted / self._drafted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
