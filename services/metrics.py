"""Prometheus metrics of the ingress: requests, tokens, speculation per domain, routing, latency.

Every request passes through the ingress and its last chunk carries the request's speculation
stats, so one registry here sees everything; GET /metrics serves it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("flashspec_requests", "Requests by endpoint and HTTP status.", ["endpoint", "status"], registry=r)
        self.tokens = Counter("flashspec_tokens", "Tokens by kind (prompt, completion).", ["kind"], registry=r)
        self.drafted = Counter("flashspec_draft_tokens", "Drafted tokens per domain.", ["domain"], registry=r)
        self.accepted = Counter("flashspec_accepted_tokens", "Accepted draft tokens per domain.", ["domain"], registry=r)
        self.acceptance = Gauge("flashspec_acceptance_rate", "Accepted / drafted tokens per domain since start.",
                                ["domain"], registry=r)
        self.accepted_length = Gauge("flashspec_mean_accepted_length",
                                     "Tokens per speculative round, last finished request, per domain.", ["domain"], registry=r)
        self.routed = Counter("flashspec_router_decisions", "Router decisions by domain and whether the fallback was used.",
                              ["domain", "fallback"], registry=r)
        self.speculation = Counter("flashspec_speculation_requests", "Requests by domain and speculation on/off.",
                                   ["domain", "speculation"], registry=r)
        self.drafter = Counter("flashspec_drafter_requests",
                               "Requests that ran speculative rounds, by domain and what drafted them: the domain's "
                               "trained draft or the n-gram lookup drafter (the governor's choice).",
                               ["domain", "drafter"], registry=r)
        self.ttft = Histogram("flashspec_time_to_first_token_seconds", "Time to first token.", ["domain"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("flashspec_time_per_output_token_seconds", "Time per output token after the first.",
                              ["domain"], buckets=LATENCY_BUCKETS, registry=r)
        self._totals: dict[str, list[int]] = {}

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def route(self, domain: str, fallback: bool) -> None:
        self.routed.labels(domain, str(bool(fallback)).lower()).inc()

    def finished(self, domain: str, speculation: bool, prompt_tokens: int, completion_tokens: int,
                 ttft_s: float | None, total_s: float, stats: dict | None) -> None:
        self.tokens.labels("prompt").inc(prompt_tokens)
        self.tokens.labels("completion").inc(completion_tokens)
        self.speculation.labels(domain, str(speculation).lower()).inc()
        if ttft_s is not None:
            self.ttft.labels(domain).observe(ttft_s)
            if completion_tokens > 1:
                self.tpot.labels(domain).observe((total_s - ttft_s) / (completion_tokens - 1))
        if stats:
            self.drafter.labels(domain, stats.get("drafter", "draft")).inc()
            self.drafted.labels(domain).inc(stats["drafted"])
            self.accepted.labels(domain).inc(stats["accepted"])
            totals = self._totals.setdefault(domain, [0, 0])
            totals[0] += stats["drafted"]
            totals[1] += stats["accepted"]
            if totals[0]:
                self.acceptance.labels(domain).set(totals[1] / totals[0])
            self.accepted_length.labels(domain).set(stats.get("mean_accepted_length", 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
