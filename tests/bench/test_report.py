"""The bench report: throughput, latency and the client's own load (a warning when the client
itself was near one core busy, since it then limits what it measures)."""

from __future__ import annotations

from edserve.bench.client import RequestResult
from edserve.bench.report import format_summary, summarize


def _results(n: int) -> list[RequestResult]:
    return [RequestResult("200", 0.1 + i / 1000, 11.0) for i in range(n)] + \
        [RequestResult("400", 0.01, 11.0, error="bad")]


def test_client_load_is_reported_and_warned():
    calm = summarize(_results(9), 2.0, {}, client_cpu_s=0.5)
    assert calm["completed"] == 9 and calm["failed"] == 1 and calm["requests_per_s"] == 4.5
    assert calm["client_cpu_ms_per_request"] == 50.0 and calm["client_busy"] == 0.25
    text = format_summary(calm)
    assert "Busy (share of one core):" in text and "25 %" in text and "warning" not in text
    busy = summarize(_results(9), 2.0, {}, client_cpu_s=1.9)
    assert "warning: the client was near one core busy" in format_summary(busy)
    unknown = summarize(_results(9), 2.0, {})
    assert unknown["client_busy"] is None and "Client" not in format_summary(unknown)
