"""Prometheus metrics for the server: per-request histograms plus the engine's live state.

Request-level series (counts, TTFT, TPOT) are recorded when a request ends;
engine-level series (running/waiting, KV blocks, prefix-cache hit rate, token
counters) are read from ``LLMEngine.stats()`` at scrape time by a collector,
so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenloom.metrics import EngineStats, RequestMetrics

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, float("inf"))


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator:
        s = self.stats()
        total_blocks = s.kv_blocks_used + s.kv_blocks_free
        gauges = [
            ("tokenloom_num_requests_running", "Requests in the running batch", s.num_running),
            ("tokenloom_num_requests_waiting", "Requests waiting for admission", s.num_waiting),
            ("tokenloom_kv_cache_blocks_used", "KV cache blocks held by requests", s.kv_blocks_used),
            ("tokenloom_kv_cache_blocks_free", "KV cache blocks free (cached or empty)", s.kv_blocks_free),
            (
                "tokenloom_kv_cache_usage_ratio",
                "Fraction of KV cache blocks in use",
                s.kv_blocks_used / total_blocks if total_blocks else 0.0,
            ),
            (
                "tokenloom_prefix_cache_hit_rate",
                "Cached prompt tokens / prompt tokens looked up",
                s.prefix_cache_hit_rate,
            ),
            ("tokenloom_spec_decode_acceptance_rate", "Accepted / verified draft tokens", s.spec_acceptance_rate),
            (
                "tokenloom_spec_decode_mean_accepted_per_step",
                "Tokens produced per speculative request-step",
                s.spec_mean_accepted_per_step,
            ),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("tokenloom_prompt_tokens", "Prompt positions run through the model", s.prompt_tokens_computed),
            ("tokenloom_generation_tokens", "Tokens generated", s.generated_tokens),
            ("tokenloom_preemptions", "Requests preempted for lack of KV blocks", s.num_preemptions),
            ("tokenloom_spec_decode_draft_tokens", "Speculative draft tokens verified", s.spec_draft_tokens),
            ("tokenloom_spec_decode_accepted_tokens", "Speculative draft tokens accepted", s.spec_accepted_tokens),
            ("tokenloom_spec_decode_steps", "Request-steps that verified drafts", s.spec_steps),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """One registry per server: ``record_finished`` per request, ``render`` for GET /metrics."""

    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tokenloom_requests", "Requests ended, by finish reason", ["finish_reason"], registry=self.registry
        )
        self.ttft = Histogram(
            "tokenloom_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "tokenloom_time_per_output_token_seconds",
            "Mean time per output token after the first",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(stats))

    def record_finished(self, finish_reason: str | None, metrics: RequestMetrics | None) -> None:
        self.requests.labels(finish_reason or "unknown").inc()
        if metrics is not None:
            if metrics.ttft is not None:
                self.ttft.observe(metrics.ttft)
            if metrics.tpot is not None:
                self.tpot.observe(metrics.tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)
