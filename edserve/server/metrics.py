"""Prometheus metrics for one server (its own registry; nothing global).

Engine gauges (queue length, running requests, KV slots used/free, generated tokens) come from
the engine's stats snapshot (refreshed once per engine step: a scrape costs the engine
nothing); request counters and latency histograms are updated by the handlers and by
:class:`StatusCounterMiddleware`, which also turns any unhandled exception into an OpenAI-shaped
500 so that every answer is counted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.requests import ClientDisconnect

from edserve.server.errors import send_error

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
logger = logging.getLogger("edserve.server")


class EngineCollector:
    """Engine gauges from :meth:`EngineClient.stats` (the latest per-step snapshot)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def collect(self) -> Iterator[Metric]:
        s = self.client.stats()
        yield GaugeMetricFamily("edserve_queue_length", "Requests waiting for admission.",
                                value=s.waiting)
        yield GaugeMetricFamily("edserve_running_requests", "Requests being decoded.",
                                value=s.running)
        yield GaugeMetricFamily("edserve_kv_slots_free", "Free KV-cache slots.", value=s.kv_free)
        yield GaugeMetricFamily("edserve_kv_slots_used", "KV-cache slots in use.",
                                value=s.kv_used)
        yield GaugeMetricFamily("edserve_kv_slots_total", "KV-cache slots.", value=s.kv_total)
        yield CounterMetricFamily("edserve_generated_tokens", "Tokens generated (all requests); "
                                  "rate() gives tokens/s.", value=s.generated_tokens)


class ServerMetrics:
    def __init__(self, client: Any) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(client))
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
    """Pure ASGI middleware (outermost of ours): counts responses by endpoint and status
    (streaming-safe) and is the catch-all: an exception escaping the app becomes a 500 in
    OpenAI's shape (logged once), a client that left mid-body one info line (status 499)."""

    KNOWN = ("/v1/audio/transcriptions", "/v1/audio/translations", "/v1/chat/completions",
             "/v1/models", "/health", "/metrics", "/debug/integrity")

    def __init__(self, app: Any, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in self.KNOWN else "other"
        started = False

        async def counting_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counter.labels(path, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except ClientDisconnect:
            logger.info("client disconnected before sending the whole request: %s %s",
                        scope["method"], scope["path"])
            if not started:
                self.counter.labels(path, "499").inc()
        except Exception:
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if not started:
                await send_error(counting_send, 500, "internal server error", None,
                                 "server_error")
