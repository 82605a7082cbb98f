"""Summaries of a benchmark run: throughput, latency percentiles, failures by status, and the
server's per-stage breakdown (the delta of ``edserve_request_stage_seconds`` between a scrape
of ``/metrics`` before and after the run; absent for servers without that histogram)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import numpy as np

from edserve.bench.client import RequestResult

STAGE_METRIC = "edserve_request_stage_seconds"
STEP_METRICS = {"edserve_engine_steps": "steps", "edserve_engine_step_rows": "rows",
                "edserve_engine_step_new_rows": "new_rows",
                "edserve_engine_step_seconds": "seconds",
                "edserve_engine_step_wait_seconds": "wait_seconds",
                "edserve_engine_step_device_seconds": "device_seconds",
                "edserve_engine_step_gap_seconds": "gap_seconds"}
GUESS_METRIC = "edserve_language_guesses"
PERCENTILES = (50, 95, 99)


def _families(base_url: str, headers: dict[str, str] | None) -> list | None:
    """The metric families of the server's ``/metrics``; None when it has no such endpoint
    or does not answer in Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers or {}, timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        return list(text_string_to_metric_families(r.text))
    except ValueError:  # not Prometheus text
        return None


def scrape(base_url: str, headers: dict[str, str] | None = None
           ) -> tuple[dict[str, tuple[float, float]] | None, dict[str, dict[str, float]] | None]:
    """One read of the server's ``/metrics``: (:func:`scrape_stages`'s stages,
    the engine step totals, ``kind -> {steps, rows, new_rows, seconds}`` from edserve's
    ``edserve_engine_step*``); each None when the server has none (vLLM, Speaches, ...)."""
    families = _families(base_url, headers) or []
    return _stages(families), _steps(families)


def scrape_stages(base_url: str, headers: dict[str, str] | None = None
                  ) -> dict[str, tuple[float, float]] | None:
    """``stage -> (sum seconds, count)`` from the server's ``/metrics``; None when the server
    has no such endpoint or histogram (vLLM, Speaches, ...)."""
    return _stages(_families(base_url, headers) or [])


def scrape_guesses(base_url: str, headers: dict[str, str] | None = None
                   ) -> dict[str, float] | None:
    """edserve's ``edserve_language_guesses_total`` by result (``right`` / ``wrong``: a wrong
    guess costs its window a second prefill); None when the server has none."""
    out = {s.labels["result"]: s.value for family in _families(base_url, headers) or []
           if family.name == GUESS_METRIC for s in family.samples
           if s.name.endswith("_total") and "result" in s.labels}
    return out or None


def _stages(families: list) -> dict[str, tuple[float, float]] | None:
    stages: dict[str, list[float]] = {}
    for family in families:
        if family.name != STAGE_METRIC:
            continue
        for s in family.samples:
            stage = s.labels.get("stage")
            if stage is None:
                continue
            acc = stages.setdefault(stage, [0.0, 0.0])
            if s.name.endswith("_sum"):
                acc[0] = s.value
            elif s.name.endswith("_count"):
                acc[1] = s.value
    return {k: (v[0], v[1]) for k, v in stages.items()} or None


def _steps(families: list) -> dict[str, dict[str, float]] | None:
    out: dict[str, dict[str, float]] = {}
    for family in families:
        field = STEP_METRICS.get(family.name)
        if field is None:
            continue
        for s in family.samples:
            if s.name.endswith("_total") and "kind" in s.labels:
                out.setdefault(s.labels["kind"], {})[field] = s.value
    return out or None


def step_delta(before: dict | None, after: dict | None, wall: float
               ) -> dict[str, dict[str, float]] | None:
    """Per kind of engine step over a run of ``wall`` seconds: steps/s, mean rows and new rows
    per step, mean ms per step and the share of the run spent in such steps (``idle``: the
    engine loop asleep with no work); per step also the host's wait for the results, the
    device's time and the device's idle time before the step (0 where the server has none)."""
    if before is None or after is None or wall <= 0:
        return None
    out = {}
    for kind, a in after.items():
        b = before.get(kind, {})
        d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in STEP_METRICS.values()}
        n = d["steps"]
        out[kind] = {"steps": int(n), "steps_per_s": n / wall,
                     "rows_per_step": d["rows"] / n if n else 0.0,
                     "new_rows_per_step": d["new_rows"] / n if n else 0.0,
                     "ms_per_step": 1000 * d["seconds"] / n if n else 0.0,
                     "share": d["seconds"] / wall,
                     **{f"{k[:-8]}_ms_per_step": 1000 * d[k] / n if n else 0.0
                        for k in ("wait_seconds", "device_seconds", "gap_seconds")}}
    return out


def stage_delta(before: dict | None, after: dict | None) -> dict[str, dict[str, float]] | None:
    """Per stage: observations and mean milliseconds between two scrapes."""
    if before is None or after is None:
        return None
    out = {}
    for stage, (total, count) in after.items():
        t0, c0 = before.get(stage, (0.0, 0.0))
        n = count - c0
        out[stage] = {"count": int(n), "mean_ms": 1000 * (total - t0) / n if n else 0.0,
                      "total_s": total - t0}
    return out


def _dist(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ms = np.asarray(values) * 1000
    out = {"mean": float(ms.mean())}
    out.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    return out


#: A client busier than this share of one core may be what limits the measurement.
CLIENT_BUSY_WARN = 0.8


def summarize(results: list[RequestResult], wall: float, config: dict[str, Any],
              stages: dict | None = None, steps: dict | None = None,
              client_cpu_s: float | None = None) -> dict[str, Any]:
    """The machine-readable result (``--json``); throughput counts successful requests.
    ``client_cpu_s``: the client process's CPU seconds over the run (its load: a Python
    client is one event loop, so near one core it limits what it measures)."""
    good = [r for r in results if r.ok]
    failures = Counter(r.status for r in results if not r.ok)
    audio = sum(r.seconds for r in good)
    return {
        "config": config,
        "num_requests": len(results),
        "completed": len(good),
        "failed": len(results) - len(good),
        "failures": dict(sorted(failures.items())),
        "duration_s": wall,
        "requests_per_s": len(good) / wall if wall > 0 else 0.0,
        "audio_seconds": audio,
        "audio_seconds_per_s": audio / wall if wall > 0 else 0.0,
        "latency_ms": _dist([r.latency for r in good]),
        "ttft_ms": _dist([r.ttft for r in good if r.ttft is not None]),
        "stages": stages,
        "engine_steps": steps,
        "errors": sorted({r.error for r in results if r.error})[:10],
        "client_cpu_ms_per_request": None if client_cpu_s is None or not results
        else 1000 * client_cpu_s / len(results),
        "client_busy": None if client_cpu_s is None or wall <= 0 else client_cpu_s / wall,
    }


def format_summary(s: dict[str, Any]) -> str:
    """The printed table (in the spirit of ``vllm bench serve``'s)."""
    lines = ["============ edserve bench result ============",
             f"{'Successful requests:':<36}{s['completed']}",
             f"{'Failed requests:':<36}{s['failed']}"]
    for status, n in s["failures"].items():
        lines.append(f"{'  status ' + status + ':':<36}{n}")
    lines += [f"{'Benchmark duration (s):':<36}{s['duration_s']:.2f}",
              f"{'Request throughput (req/s):':<36}{s['requests_per_s']:.2f}",
              f"{'Audio throughput (audio s/s):':<36}{s['audio_seconds_per_s']:.2f}"]
    for key, title in (("latency_ms", "End-to-end latency"), ("ttft_ms", "Time to first delta")):
        if s[key] is None:
            continue
        lines.append(f"{'-' * 12}{title}{'-' * max(0, 34 - len(title))}")
        for stat, value in s[key].items():
            lines.append(f"{f'{stat.capitalize()} (ms):':<36}{value:.1f}")
    if s["stages"]:
        lines.append(f"{'-' * 12}Server stages (mean ms per request)")
        for stage, d in s["stages"].items():
            lines.append(f"{stage + ':':<36}{d['mean_ms']:.2f}  (n={d['count']})")
    if s.get("engine_steps"):
        lines.append(f"{'-' * 12}Engine steps (per kind)")
        for kind, d in s["engine_steps"].items():
            lines.append(f"{kind + ':':<12}{d['steps_per_s']:7.1f}/s  {d['ms_per_step']:6.2f} ms  "
                         f"rows {d['rows_per_step']:5.1f}  new {d['new_rows_per_step']:5.1f}  "
                         f"{100 * d['share']:5.1f} % of the run"
                         + (f"  device {d['device_ms_per_step']:.2f} ms, idle before "
                            f"{d['gap_ms_per_step']:.2f}, host wait {d['wait_ms_per_step']:.2f}"
                            if d.get("device_ms_per_step") else ""))
    if s.get("client_busy") is not None:
        lines.append(f"{'-' * 12}Client")
        lines.append(f"{'CPU per request (ms):':<36}{s['client_cpu_ms_per_request']:.2f}")
        lines.append(f"{'Busy (share of one core):':<36}{100 * s['client_busy']:.0f} %")
        if s["client_busy"] >= CLIENT_BUSY_WARN:
            lines.append("warning: the client was near one core busy and may have limited "
                         "this run; split the load over more processes")
    lines.append("=" * 46)
    return "\n".join(lines)
