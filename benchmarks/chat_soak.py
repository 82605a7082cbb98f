"""Soak the chat server: N requests at concurrency C mixing every answer kind, bad inputs and
clients that leave.

Good requests (greedy, seeded kinds): free text, an image, JSON schema, a forced tool call,
``guided_choice``, ``n=2``; a third of them streamed. Each must answer exactly what the same
body answered alone (a sequential reference pass, one request per distinct body): the text or
the tool calls of every choice. ``--bad`` of them are bad inputs (a schema keyword llguidance
lacks, a corrupt image, a bad tool name, ``top_k``, a malformed JSON body), each of which must
get its 400; ``--disconnect`` are streamed requests whose client leaves after the first chunk.
Afterwards ``/debug/integrity`` must be ok with 0 KV slots used, and the server's RSS (in
process: this process and its children) within ``--rss-tolerance`` of its value once the first
``w = max(10 % of N, 2 C)`` requests of the concurrent pass are done (the warm-up).

  python benchmarks/chat_soak.py --requests 400 --concurrency 32 --json /tmp/chat_soak.json
  python benchmarks/chat_soak.py --url http://host:8000 --model NAME   # a running server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from proc_stats import tree_rss_bytes  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "n"],
          "properties": {"kind": {"enum": ["cat", "dog"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "additionalProperties": False,
    "properties": {"city": {"enum": ["Oslo", "Paris"]}}}}}
KINDS = ("text", "image", "json", "tool", "choice", "n2")
BAD = {
    "schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"not": {}}}}}, "response_format"),
    "image": ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
        "messages"),
    "tool": ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    "top_k": ({"top_k": 5}, "top_k"),
}


def png_url() -> str:
    from tests.models.mllama.chat_tiny import png_data_url
    return png_data_url(80, 40)


def body(kind: str, model: str, variant: int, image: str) -> dict:
    """A good request of ``kind``; ``variant`` changes its prompt (so references differ)."""
    text = f"item {variant}"
    content: object = text
    if kind in ("image", "json", "n2"):
        content = [{"type": "image_url", "image_url": {"url": image}},
                   {"type": "text", "text": text}]
    out = {"model": model, "messages": [{"role": "user", "content": content}],
           "max_tokens": 16, "temperature": 0}
    if kind == "json":
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "pet", "schema": SCHEMA}}
        out["max_tokens"] = 40
    elif kind == "tool":
        out.update(tools=[TOOL], tool_choice="required", max_tokens=64)  # whole, not cut
    elif kind == "choice":
        out["guided_choice"] = ["yes", "no", "maybe not"]
    elif kind == "n2":
        out["n"] = 2
    return out


def answer(message: dict) -> object:
    calls = message.get("tool_calls")
    if calls:
        return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    return message["content"]


async def ask(client: httpx.AsyncClient, url: str, req: dict, stream: bool) -> list:
    """Every choice's answer (text, or [(name, arguments)] for tool calls)."""
    if not stream:
        r = await client.post(url, json=req)
        r.raise_for_status()
        return [answer(c["message"]) for c in r.json()["choices"]]
    texts: dict[int, str] = {}
    calls: dict[int, dict[int, list[str]]] = {}  # choice -> call index -> [name, arguments]
    async with client.stream("POST", url, json={**req, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                d = ch["delta"]
                texts[ch["index"]] = texts.get(ch["index"], "") + (d.get("content") or "")
                for t in d.get("tool_calls") or []:  # a call's name, then its arguments
                    call = calls.setdefault(ch["index"], {}).setdefault(t["index"], ["", ""])
                    call[0] += t["function"].get("name") or ""
                    call[1] += t["function"]["arguments"]
    return [[(name, json.loads(args)) for name, args in calls[i].values()] if i in calls
            else texts[i] for i in sorted(texts)]


async def soak(url: str, model: str, n: int, concurrency: int, bad: float, leave: float,
               seed: int, rss=None) -> dict:
    rng = random.Random(seed)
    image = png_url()
    plan = []
    for i in range(n):
        roll = rng.random()
        kind = "bad" if roll < bad else "leave" if roll < bad + leave else rng.choice(KINDS)
        plan.append((i, kind, rng.randrange(4), rng.random() < 1 / 3, rng.choice(list(BAD))))
    chat_url = url + "/v1/chat/completions"
    counts: Counter = Counter()
    wrong: list[str] = []
    async with httpx.AsyncClient(timeout=600) as client:
        refs = {}
        for kind in KINDS:  # the sequential reference: each distinct body alone
            for variant in range(4):
                refs[kind, variant] = await ask(client, chat_url,
                                                body(kind, model, variant, image), False)
        warm, rss_warm = max(n // 10, 2 * concurrency), [None]
        queue = list(reversed(plan))
        t0 = time.perf_counter()

        async def one(i: int, kind: str, variant: int, stream: bool, bad_kind: str) -> None:
            if kind == "bad":
                fields, param = BAD[bad_kind]
                req = {**body("text", model, variant, image), **fields}
                r = await client.post(chat_url, json=req)
                ok = r.status_code == 400 and r.json()["error"]["param"] == param
                counts["bad_400" if ok else "bad_wrong"] += 1
                if not ok:
                    wrong.append(f"{i} bad {bad_kind}: {r.status_code} {r.text[:120]}")
                return
            if kind == "leave":
                req = {**body(rng.choice(KINDS), model, variant, image), "stream": True}
                async with client.stream("POST", chat_url, json=req) as r:
                    async for _ in r.aiter_lines():
                        break  # gone after the first chunk
                counts["left"] += 1
                return
            got = await ask(client, chat_url, body(kind, model, variant, image), stream)
            if got == refs[kind, variant]:
                counts["good_equal"] += 1
            else:
                counts["good_wrong"] += 1
                wrong.append(f"{i} {kind}/{variant} stream={stream}: {got!r:.120} != "
                             f"{refs[kind, variant]!r:.120}")

        async def worker() -> None:
            while queue:
                await one(*queue.pop())
                if rss and rss_warm[0] is None and sum(counts.values()) >= warm:
                    rss_warm[0] = rss()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - t0
        report = {}
        for _ in range(600):  # aborted rows free at the next steps
            report = (await client.get(url + "/debug/integrity")).json()
            if report.get("ok") and report["inflight"] == report["running"] == 0:
                break
            await asyncio.sleep(0.05)
    return {"requests": n, "concurrency": concurrency, "seconds": seconds,
            "counts": dict(counts), "wrong": wrong[:20], "integrity": report,
            "rss_after_warmup": rss_warm[0], "rss_end": rss() if rss else None}


def check(result: dict, rss_tolerance: float) -> list[str]:
    """What failed ([] when the soak passed)."""
    fails = list(result["wrong"])
    rep = result["integrity"]
    if not rep.get("ok") or rep.get("kv_slots_used") != 0:
        fails.append(f"integrity after the soak: {rep}")
    before, after = result["rss_after_warmup"], result["rss_end"]
    if before and after and after > before * (1 + rss_tolerance):
        fails.append(f"RSS grew {after / before:.3f}x (tolerance {1 + rss_tolerance:.2f}x)")
    return fails


def serve_tiny(tmp: Path):
    """The tiny random Mllama with the byte-level chat tokenizer, served in this process
    (compact JSON: the random weights cannot pad)."""
    from edserve.config import EngineConfig
    from edserve.server.config import ServerConfig
    from edserve.server.launch import ServerThread, build
    from tests.models.mllama.chat_tiny import save_byte_chat_tokenizer
    from tests.models.mllama.hf_tiny import build_hf_tiny, save_hf_tiny

    save_hf_tiny(build_hf_tiny(), tmp)
    save_byte_chat_tokenizer(tmp)
    client, app = build(EngineConfig(model=str(tmp), device="cpu", dtype="float32",
                                     context_length=1024, max_running_requests=8),
                        ServerConfig(served_model_name="tiny", json_whitespace=False,
                                     enable_debug_endpoints=True, debug_rate_limit=1000.0))
    return client, ServerThread(app, "127.0.0.1", 0).start()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (with --enable-debug-endpoints)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--bad", type=float, default=0.1)
    ap.add_argument("--disconnect", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-tolerance", type=float, default=0.10)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    client = server = tmp = None
    url = args.url
    if url is None:
        tmp = tempfile.TemporaryDirectory()
        client, server = serve_tiny(Path(tmp.name))
        url = server.url
    rss = None if args.url else (lambda: tree_rss_bytes(os.getpid()))
    try:
        result = asyncio.run(soak(url, args.model, args.requests, args.concurrency, args.bad,
                                  args.disconnect, args.seed, rss))
    finally:
        if server is not None:
            server.stop()
            client.shutdown()
            tmp.cleanup()
    fails = check(result, args.rss_tolerance)
    result["passed"] = not fails
    print(f"{result['requests']} chat requests at {result['concurrency']}: "
          f"{result['seconds']:.1f} s, {result['counts']}; integrity ok="
          f"{result['integrity'].get('ok')} kv={result['integrity'].get('kv_slots_used')}; "
          + ("PASSED" if not fails else "FAILED:\n  " + "\n  ".join(fails)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
