"""Prometheus metrics for one server (its own registry; nothing global).

Engine gauges (queue length, running requests, KV slots used/free, generated tokens) are read
at scrape time by a collector; request counters and latency histograms are updated by the
handlers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class EngineCollector:
    """Reads the engine's scheduler and allocator when Prometheus scrapes (approximate: the
    engine thread may be mid-step)."""

    def __init__(self, aengine: Any) -> None:
        self.aengine = aengine

    def collect(self) -> Iterator[Metric]:
        engine = self.aengine.engine
        sched, alloc = engine.scheduler, engine.pools.allocator
        free = alloc.available_size()
        yield GaugeMetricFamily("edserve_queue_length", "Requests waiting for admission.",
                                value=len(sched.waiting))
        yield GaugeMetricFamily("edserve_running_requests", "Requests being decoded.",
                                value=len(sched.running))
        yield GaugeMetricFamily("edserve_kv_slots_free", "Free KV-cache slots.", value=free)
        yield GaugeMetricFamily("edserve_kv_slots_used", "KV-cache slots in use.",
                                value=alloc.size - free)
        yield GaugeMetricFamily("edserve_kv_slots_total", "KV-cache slots.", value=alloc.size)
        yield CounterMetricFamily("edserve_generated_tokens", "Tokens generated (all requests); "
                                  "rate() gives tokens/s.", value=sched.num_generated_tokens)


class ServerMetrics:
    def __init__(self, aengine: Any) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(aengine))
        self.requests = Counter("edserve_http_requests", "HTTP requests by endpoint and status.",
                                ("endpoint", "status"), registry=self.registry)
        self.latency = Histogram("edserve_request_latency_seconds",
                                 "Transcription request latency (upload parsed -> response).",
                                 ("endpoint",), buckets=LATENCY_BUCKETS, registry=self.registry)
        self.audio_seconds = Counter("edserve_audio_seconds", "Seconds of audio transcribed.",
                                     registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatusCounterMiddleware:
    """Pure ASGI middleware counting responses by endpoint and status (streaming-safe)."""

    KNOWN = ("/v1/audio/transcriptions", "/v1/audio/translations", "/v1/models", "/health",
             "/metrics", "/debug/integrity")

    def __init__(self, app: Any, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in self.KNOWN else "other"

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
