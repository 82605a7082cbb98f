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
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0, 30.0, 60.0, 120.0)
# One audio request's stages, in order: the upload read and parsed, the wait for an audio
# worker (+ the transfer to it and back), the audio decoded, its log-mel computed, then per
# engine window (summed over a request's windows) the wait for admission, the prefill
# (encoder + prompt), the decode steps, and the response rendered.
STAGES = ("upload_read", "audio_wait", "audio_decode", "features", "queue_wait", "prefill",
          "decode", "response")
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
        yield from step_metrics(s.steps)


class GuessCollector:
    """The language guesses of detecting windows (:class:`~edserve.whisper.language.
    LanguageGuess`): each wrong one costs its window a second prefill."""

    def __init__(self, guess: Any) -> None:
        self.guess = guess

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily("edserve_language_guesses", "Windows that guessed their "
                                  "language, by whether the prefill confirmed it (a wrong "
                                  "guess decodes the window again).", labels=["result"])
        fam.add_metric(["right"], self.guess.right)
        fam.add_metric(["wrong"], self.guess.wrong)
        yield fam


def step_metrics(steps: dict[str, Any]) -> Iterator[Metric]:
    """The engine's step totals by kind (``decode``, ``prefill``, ``mixed``; see
    :mod:`edserve.engine.step_stats`) as counters."""
    families = {
        "steps": CounterMetricFamily("edserve_engine_steps", "Engine steps by kind.",
                                     labels=["kind"]),
        "rows": CounterMetricFamily("edserve_engine_step_rows", "Rows carried by engine steps "
                                    "(running + admitted), by kind of step.", labels=["kind"]),
        "new_rows": CounterMetricFamily("edserve_engine_step_new_rows", "Rows admitted "
                                        "(prefilled) by engine steps, by kind of step.",
                                        labels=["kind"]),
        "seconds": CounterMetricFamily("edserve_engine_step_seconds", "Wall seconds inside "
                                       "engine steps, by kind.", labels=["kind"]),
        "wait_seconds": CounterMetricFamily(
            "edserve_engine_step_wait_seconds", "Host seconds blocked on engine steps' results "
            "(the rest of a step's wall seconds is host work), by kind.", labels=["kind"]),
        "device_seconds": CounterMetricFamily(
            "edserve_engine_step_device_seconds", "Device seconds of engine steps, by kind "
            "(CUDA; 0 elsewhere).", labels=["kind"]),
        "gap_seconds": CounterMetricFamily(
            "edserve_engine_step_gap_seconds", "Device idle seconds before engine steps "
            "launched while the previous step was in flight (the host came late), by kind.",
            labels=["kind"]),
    }
    for kind, totals in sorted(steps.items()):
        for name, fam in families.items():
            fam.add_metric([kind], getattr(totals, name, 0.0))
    yield from families.values()


class ServerMetrics:
    def __init__(self, client: Any, language_guess: Any) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(client))
        self.registry.register(GuessCollector(language_guess))
        self.requests = Counter("edserve_http_requests", "HTTP requests by endpoint and status.",
                                ("endpoint", "status"), registry=self.registry)
        self.latency = Histogram("edserve_request_latency_seconds",
                                 "Transcription request latency (upload parsed -> response).",
                                 ("endpoint",), buckets=LATENCY_BUCKETS, registry=self.registry)
        self.audio_seconds = Counter("edserve_audio_seconds", "Seconds of audio transcribed.",
                                     registry=self.registry)
        self.stages = Histogram("edserve_request_stage_seconds",
                                "Seconds per audio request in each stage: " + ", ".join(STAGES)
                                + " (engine stages summed over the request's windows).",
                                ("stage",), buckets=STAGE_BUCKETS, registry=self.registry)
        for name in STAGES:  # every stage on /metrics from the start (count 0)
            self.stages.labels(name)

    def stage(self, name: str, seconds: float) -> None:
        """Observe one request's time in stage ``name`` (one of :data:`STAGES`; any thread)."""
        self.stages.labels(name).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineTimes:
    """The engine stage times (queue wait, prefill, decode) of one request's windows, summed
    from each output's :class:`~edserve.engine.request.RequestTiming`; observed once."""

    def __init__(self) -> None:
        self.totals = {"queue_wait": 0.0, "prefill": 0.0, "decode": 0.0}
        self.windows = 0

    def add(self, request: Any, output: Any) -> None:
        """``transcribe_async``'s ``on_output`` hook (the request is not needed)."""
        timing = getattr(output, "timing", None)
        if timing is None:
            return
        self.windows += 1
        for name in self.totals:
            self.totals[name] += getattr(timing, name)

    def observe(self, metrics: ServerMetrics) -> None:
        if self.windows:
            for name, seconds in self.totals.items():
                metrics.stage(name, seconds)


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
