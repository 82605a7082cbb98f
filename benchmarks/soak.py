"""Soak an audio server: N requests at concurrency C, with bad inputs and clients that leave.

Of the requests (seeded), ``--bad`` are bad inputs (corrupt bytes, an empty file, a float WAV
holding NaN, a crafted ffconcat file naming a local path, an upload over ``--max-upload-mb``),
each of which must get its 4xx; ``--disconnect`` are clients that leave at a random point
(mid-upload on a raw socket, while the server works, or after the first SSE event); the rest
are good requests (a quarter streamed) whose text must equal a sequential reference (first
pass, one request per clip). Afterwards: ``/debug/integrity`` ok with 0 KV slots used (and,
with engine worker processes, 0 held log-mels), the
``edserve_kv_slots_used`` gauge 0, and the server's RSS (with its audio worker processes;
sampled every 0.5 s) within
``--rss-tolerance`` of its post-warm-up plateau (the median while requests w..2w complete,
w = max(10 % of N, 2 C), at most N / 3). Starts ``python -m edserve serve`` (tiny.en)
unless ``--url`` is given.

  python benchmarks/soak.py --requests 2000 --concurrency 64 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from proc_stats import tree_rss_bytes  # noqa: E402

from edserve.bench.client import KEEPALIVE_EXPIRY_S  # noqa: E402

DATA = ROOT / "tests" / "data"
KINDS_BAD = ("corrupt", "empty", "nan", "ffconcat", "oversize")
KINDS_GONE = ("upload", "processing", "stream")


def _float_wav(samples: list[float], rate: int = 16000) -> bytes:
    data = struct.pack(f"<{len(samples)}f", *samples)
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)  # IEEE float, mono
    return b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" + \
        b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data


def bad_input(kind: str, rng: random.Random, max_upload_mb: float) -> tuple[str, bytes, set]:
    """(file name, bytes, accepted statuses) of one bad upload."""
    if kind == "corrupt":
        return "c.wav", b"RIFF" + rng.randbytes(rng.randint(16, 4096)), {400}
    if kind == "empty":
        return "e.wav", b"", {400}
    if kind == "nan":
        samples = [0.1 * rng.uniform(-1, 1) for _ in range(16000)]
        samples[rng.randrange(16000)] = float("nan")
        return "n.wav", _float_wav(samples), {400}
    if kind == "ffconcat":
        return "x.ffconcat", f"ffconcat version 1.0\nfile {DATA / 'jfk.wav'}\n".encode(), {400}
    return "big.wav", b"RIFF" + bytes(int(max_upload_mb * 2**20) + 1024), {413}


class Soak:
    def __init__(self, args, url: str, pid: int | None) -> None:
        self.args, self.url, self.pid = args, url, pid
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.clips = {Path(c).stem: Path(c).read_bytes() for c in args.clips}
        self.ref: dict[str, str] = {}
        self.counts: Counter = Counter()
        self.problems: list[str] = []
        self.done = 0
        self.rss: list[tuple[int, int]] = []  # (requests done, bytes)

    async def post(self, client, name: str, data: bytes, stream: bool = False):
        form = {"model": "whisper-1", **({"stream": "true"} if stream else {})}
        return client.stream("POST", "/v1/audio/transcriptions", data=form,
                             files={"file": (name, data)}, headers=self.headers)

    async def text_of(self, client, clip: str, stream: bool) -> tuple[int, str]:
        async with await self.post(client, f"{clip}.wav", self.clips[clip], stream) as r:
            if r.status_code != 200:
                return r.status_code, (await r.aread()).decode("utf-8", "replace")[:200]
            if not stream:
                return 200, json.loads(await r.aread())["text"]
            async for line in r.aiter_lines():
                if line.startswith("data:") and '"transcript.text.done"' in line:
                    return 200, json.loads(line[5:])["text"]
            return 599, "stream ended without transcript.text.done"

    async def good(self, client, clip: str, stream: bool) -> None:
        try:
            status, text = await self.text_of(client, clip, stream)
        except httpx.HTTPError as exc:
            status, text = 0, f"{type(exc).__name__}: {exc}"
        if status != 200:
            self.counts["lost"] += 1
            self.problems.append(f"good {clip} stream={stream}: {status} {text}")
        elif text != self.ref[clip]:
            self.counts["wrong"] += 1
            self.problems.append(f"wrong text for {clip}: {text!r}")
        else:
            self.counts["good_ok"] += 1

    async def bad(self, client, kind: str, rng: random.Random) -> None:
        name, data, accepted = bad_input(kind, rng, self.args.max_upload_mb)
        try:
            async with await self.post(client, name, data) as r:
                await r.aread()
                status = r.status_code
        except httpx.HTTPError as exc:
            status = f"{type(exc).__name__}"
        if status in accepted:
            self.counts["bad_refused"] += 1
        else:
            self.counts["bad_unexpected"] += 1
            self.problems.append(f"bad input {kind}: status {status}, expected {accepted}")

    async def leave(self, client, kind: str, clip: str, rng: random.Random) -> None:
        data = self.clips[clip]
        if kind == "upload":  # a raw socket that stops mid-body
            host, port = self.url.removeprefix("http://").split(":")
            _, writer = await asyncio.open_connection(host, int(port))
            body = b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"" \
                b"\r\n\r\n" + data + b"\r\n--b--\r\n"
            auth = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
            writer.write(f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: {host}\r\n{auth}"
                         "Content-Type: multipart/form-data; boundary=b\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode()
                         + body[:rng.randint(1, len(body) - 1)])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.2))
            writer.close()
        elif kind == "processing":
            try:
                await asyncio.wait_for(self.text_of(client, clip, False), rng.uniform(0.05, 2))
            except (asyncio.TimeoutError, httpx.HTTPError):
                pass
        else:
            async with await self.post(client, f"{clip}.wav", data, stream=True) as r:
                async for _ in r.aiter_lines():
                    break
        self.counts[f"left_{kind}"] += 1

    async def one(self, client, i: int, gate: asyncio.Semaphore) -> None:
        rng = random.Random(self.args.seed * 1_000_003 + i)
        clip = rng.choice(sorted(self.clips))
        x = rng.random()
        async with gate:
            if x < self.args.bad:
                await self.bad(client, rng.choice(KINDS_BAD), rng)
            elif x < self.args.bad + self.args.disconnect:
                await self.leave(client, rng.choice(KINDS_GONE), clip, rng)
            else:
                await self.good(client, clip, rng.random() < 0.25)
        self.done += 1

    async def sample_rss(self) -> None:
        while self.pid is not None:
            self.rss.append((self.done, tree_rss_bytes(self.pid)))
            await asyncio.sleep(0.5)

    async def run(self) -> dict:
        # idle pooled connections expire before the server's --timeout-keep-alive (5 s): a
        # request sent on a connection the server is closing at that moment gets a reset
        # (httpx's default expiry equals the server's), a client-side race, not a lost request
        limits = httpx.Limits(max_connections=self.args.concurrency,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        async with httpx.AsyncClient(base_url=self.url, timeout=600, limits=limits) as client:
            for clip in sorted(self.clips):  # the sequential reference
                status, text = await self.text_of(client, clip, False)
                assert status == 200, (clip, status, text)
                self.ref[clip] = text
            sampler = asyncio.create_task(self.sample_rss())
            gate = asyncio.Semaphore(self.args.concurrency)
            start = time.perf_counter()
            await asyncio.gather(*(self.one(client, i, gate) for i in range(self.args.requests)))
            wall = time.perf_counter() - start
            sampler.cancel()
            report = await self.after(client)
        return {"requests": self.args.requests, "concurrency": self.args.concurrency,
                "seconds": wall, "counts": dict(sorted(self.counts.items())), **report,
                "problems": self.problems[:20]}

    async def after(self, client) -> dict:
        for _ in range(1200):  # until idle (clients that left are aborted at the next step)
            r = await client.get("/debug/integrity", headers=self.headers)
            if r.status_code == 429:
                await asyncio.sleep(1)
                continue
            integ = r.json()
            if integ.get("inflight") == 0 and integ.get("running") == 0 \
                    and integ.get("waiting") == 0:
                break
            await asyncio.sleep(0.1)
        # with engine worker processes the gauge is their latest stats snapshot (sent every
        # 50 ms while it changes, else once a second): give it 3 s to reach the idle state
        for _ in range(30):
            metrics = (await client.get("/metrics")).text
            gauge = next(float(line.split()[-1]) for line in metrics.splitlines()
                         if line.startswith("edserve_kv_slots_used "))
            if gauge == 0:
                break
            await asyncio.sleep(0.1)
        out = {"integrity": integ, "kv_slots_used_metric": gauge}
        n, c = self.args.requests, self.args.concurrency
        w = min(max(0.1 * n, 2 * c), n / 3)  # warm-up: every slot has served twice
        plateau = [b for d, b in self.rss if w <= d <= 2 * w]
        if self.pid is not None and plateau:
            base = statistics.median(plateau)
            after = [b for d, b in self.rss if d > 2 * w] + [tree_rss_bytes(self.pid)]
            out.update(rss_plateau_mib=base / 2**20, rss_max_after_mib=max(after) / 2**20,
                       rss_final_mib=after[-1] / 2**20, rss_ratio=max(after) / base)
        return out


def verdict(s: dict, tolerance: float) -> list[str]:
    c, fails = s["counts"], []
    for key in ("lost", "wrong", "bad_unexpected"):
        if c.get(key):
            fails.append(f"{c[key]} {key}")
    if not s["integrity"].get("ok") or s["integrity"].get("kv_slots_used") != 0 \
            or s["integrity"].get("held_log_mels", 0) != 0:  # engine workers: nothing held
        fails.append(f"integrity {s['integrity']}")
    if s["kv_slots_used_metric"] != 0:
        fails.append(f"edserve_kv_slots_used {s['kv_slots_used_metric']}")
    if "rss_ratio" in s and s["rss_ratio"] > 1 + tolerance:
        fails.append(f"RSS {s['rss_max_after_mib']:.0f} MiB > {1 + tolerance:.2f} x plateau "
                     f"{s['rss_plateau_mib']:.0f} MiB")
    return fails


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--bad", type=float, default=0.1)
    ap.add_argument("--disconnect", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clips", nargs="+", default=[str(DATA / f"{c}.wav") for c in
                                                   ("jfk", "librivox_0870", "cards_005")])
    ap.add_argument("--url", default=None, help="a running server (needs debug endpoints)")
    ap.add_argument("--pid", type=int, default=None, help="its process id (for RSS)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--max-upload-mb", type=float, default=2.0)
    ap.add_argument("--rss-tolerance", type=float, default=0.10)
    ap.add_argument("--server-flags", default="--threads 1 --max-running-requests 16",
                    help="extra flags for the server this script starts")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    proc = None
    if args.url is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from tests.server.server_helpers import start_server

        proc, args.url = start_server(
            Path(tempfile.mkdtemp()) / "serve.log", "--enable-debug-endpoints",
            "--debug-rate-limit", "100", "--max-upload-mb", str(args.max_upload_mb),
            *args.server_flags.split())
        args.pid = proc.pid
    try:
        s = asyncio.run(Soak(args, args.url, args.pid).run())
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    s["failures"] = verdict(s, args.rss_tolerance)
    print(json.dumps({k: v for k, v in s.items() if k != "problems"}, indent=1))
    for p in s["problems"]:
        print("problem:", p)
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=2) + "\n")
    return s


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
