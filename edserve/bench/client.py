"""Send the benchmark's requests (httpx, async) at a fixed concurrency or a Poisson rate.

One request = one multipart upload to ``/v1/audio/{endpoint}``. Latency is client-side end to
end (request sent -> whole response read); with ``stream`` the time to the first
``transcript.text.delta`` event is recorded too (TTFT). A streamed answer counts as a success
only if it ends with ``transcript.text.done``; an ``event: error`` in the stream counts under
status ``stream-error``, a connection or timeout failure under ``transport``.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass, field

import httpx

from edserve.bench.load import AudioItem

# Idle pooled connections are dropped after this many seconds, before a server's keep-alive
# timeout (uvicorn's and `edserve serve`'s default: 5 s) can close them under a new request.
KEEPALIVE_EXPIRY_S = 2.0


@dataclass(frozen=True)
class BenchTarget:
    """Where and what to send (everything but the audio and the schedule)."""

    base_url: str
    endpoint: str = "transcriptions"  # or "translations"
    model: str = "whisper-1"
    response_format: str = "json"
    stream: bool = False
    api_key: str | None = None
    fields: tuple[tuple[str, str], ...] = ()  # extra form fields (beam_size, language, ...)
    timeout: float = 600.0

    @property
    def url(self) -> str:
        return f"{self.base_url.rstrip('/')}/v1/audio/{self.endpoint}"

    def form(self) -> dict[str, str | list[str]]:
        form: dict[str, str | list[str]] = {"model": self.model,
                                            "response_format": self.response_format}
        if self.stream:
            form["stream"] = "true"
        for key, value in self.fields:  # repeated keys (timestamp_granularities[]) -> lists
            if key in form and key not in ("model", "response_format", "stream"):
                old = form[key]
                form[key] = (old if isinstance(old, list) else [old]) + [value]
            else:
                form[key] = value
        return form

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestResult:
    """One request's outcome. ``status``: the HTTP status as text, ``transport`` (no answer)
    or ``stream-error``; ``ok`` only for a complete 200 answer."""

    status: str
    latency: float  # seconds, request sent -> response read
    seconds: float  # audio seconds of the upload
    ttft: float | None = None  # seconds to the first streamed text delta
    text: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "200"


async def _read_stream(response: httpx.Response, started: float, result: RequestResult
                       ) -> None:
    done, event = False, ""
    async for line in response.aiter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
            continue
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            continue
        msg = json.loads(payload)
        if event == "error" or msg.get("type") == "error":
            result.status, result.error = "stream-error", json.dumps(msg.get("error", msg))
            return
        if msg.get("type") == "transcript.text.delta" and result.ttft is None:
            result.ttft = time.perf_counter() - started
        elif msg.get("type") == "transcript.text.done":
            result.text, done = msg.get("text", ""), True
    if not done:
        result.status, result.error = "stream-error", "stream ended without text.done"


def encode_upload(target: BenchTarget, item: AudioItem) -> tuple[bytes, str]:
    """The multipart body of ``item``'s upload and its Content-Type (boundary included),
    encoded once by httpx and sent as is by every request of that item (encoding the form
    per request was a third of the client's CPU at 64 connections)."""
    files = {"file": (item.name, item.data, "application/octet-stream")}
    request = httpx.Request("POST", target.url, data=target.form(), files=files)
    return request.read(), request.headers["content-type"]


async def send_one(client: httpx.AsyncClient, target: BenchTarget, item: AudioItem,
                   encoded: tuple[bytes, str] | None = None) -> RequestResult:
    """Upload ``item`` once (``encoded``: its :func:`encode_upload`, made here if None);
    never raises for server or network failures (they are results)."""
    body, content_type = encoded or encode_upload(target, item)
    started = time.perf_counter()
    result = RequestResult("transport", 0.0, item.seconds)
    try:
        async with client.stream("POST", target.url, content=body,
                                 headers={**target.headers(), "content-type": content_type}
                                 ) as response:
            result.status = str(response.status_code)
            if response.status_code == 200 and target.stream:
                await _read_stream(response, started, result)
            else:
                body = await response.aread()
                if response.status_code == 200:
                    result.text = _text(body, target.response_format)
                else:
                    result.error = body.decode("utf-8", "replace")[:500]
    except httpx.HTTPError as exc:
        result.status, result.error = "transport", f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - started
    return result


def _text(body: bytes, response_format: str) -> str:
    if response_format in ("json", "verbose_json"):
        try:
            return str(json.loads(body).get("text", ""))
        except (ValueError, AttributeError):
            return ""
    return body.decode("utf-8", "replace")


@dataclass
class LoadPlan:
    """The schedule: ``items`` in order; ``offsets`` (seconds from the start, Poisson) or None
    to send as fast as ``concurrency`` allows; ``concurrency`` caps requests in flight."""

    items: list[AudioItem]
    concurrency: int
    offsets: list[float] | None = None
    on_done: list = field(default_factory=list)  # callbacks(result), e.g. a progress bar


class _Connections:
    """One-connection httpx clients, each lent to one request at a time (made on demand,
    closed at the end). httpx's shared pool re-scans all its connections and queued requests
    on every event: with 64 connections that was about half of the client's CPU (cProfile),
    and a client that cannot keep up slows the uploads it is timing."""

    def __init__(self, timeout: httpx.Timeout) -> None:
        self.timeout = timeout
        self.tls = ssl.create_default_context()  # one CA load for all (48 ms each, here)
        self.free: list[httpx.AsyncClient] = []
        self.made: list[httpx.AsyncClient] = []

    def take(self) -> httpx.AsyncClient:
        if self.free:
            return self.free.pop()
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        client = httpx.AsyncClient(limits=limits, timeout=self.timeout, verify=self.tls)
        self.made.append(client)
        return client

    def put(self, client: httpx.AsyncClient) -> None:
        """Give back a client :meth:`take` lent (its connection stays open for the next)."""
        self.free.append(client)

    async def close(self) -> None:
        for client in self.made:
            await client.aclose()


async def run_load(target: BenchTarget, plan: LoadPlan) -> tuple[list[RequestResult], float]:
    """Send every planned request; returns the results (plan order) and the wall seconds from
    the first send to the last answer."""
    timeout = httpx.Timeout(target.timeout, connect=min(30.0, target.timeout))
    results: list[RequestResult | None] = [None] * len(plan.items)
    gate = asyncio.Semaphore(plan.concurrency)
    encoded: dict[int, tuple[bytes, str]] = {}
    for item in plan.items:  # once per distinct upload, before the clock starts
        if id(item) not in encoded:
            encoded[id(item)] = encode_upload(target, item)
    pool = _Connections(timeout)
    try:
        start = time.perf_counter()

        async def one(i: int) -> None:
            if plan.offsets is not None:
                await asyncio.sleep(max(0.0, start + plan.offsets[i] - time.perf_counter()))
            async with gate:
                client = pool.take()
                try:
                    item = plan.items[i]
                    results[i] = res = await send_one(client, target, item, encoded[id(item)])
                finally:
                    pool.put(client)
            for callback in plan.on_done:
                callback(res)

        await asyncio.gather(*(one(i) for i in range(len(plan.items))))
        wall = time.perf_counter() - start
    finally:
        await pool.close()
    return [r for r in results if r is not None], wall
