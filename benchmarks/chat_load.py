"""Chat serving under load: N concurrent clients on ``/v1/chat/completions`` with images.

Every client sends streamed requests (``stream=true``, usage included) one after another until
the total is reached; each request carries one synthetic image (1-4 tiles, cycling) and a
short instruction, greedy. Prints requests/s, completion tokens/s, time to first content
token p50/p95 and request latency p50/p95 (client side, wall clock).

  # a running server
  python benchmarks/chat_load.py --url http://127.0.0.1:8000 --model-name NAME --clients 32
  # or start one in this process on an HF folder (random-weight Mllama: --save-random)
  python benchmarks/chat_load.py --save-random /tmp/mllama_small --size small   # ~6.5 GB
  python benchmarks/chat_load.py --serve /tmp/mllama_small --clients 32 --requests 256
  python benchmarks/chat_load.py --dry-run   # CPU server on the tiny chat model, 4 clients
  # JSON mode (grammar-constrained): the folder needs a byte-level tokenizer llguidance reads
  python benchmarks/chat_load.py --save-random /tmp/mllama_small_bytes --byte-tokenizer
  python benchmarks/chat_load.py --serve /tmp/mllama_small_bytes --response-format json_object
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TILE_SHAPES = [(400, 300), (800, 400), (1200, 400), (1000, 1000)]  # 1..4 tiles at 560 px


def image_url(width: int, height: int, seed: int) -> str:
    """A smooth synthetic PNG (compresses well: the request body stays small)."""
    import numpy as np
    from PIL import Image

    yy, xx = np.mgrid[0:height, 0:width]
    arr = np.stack([xx * 255 // max(width - 1, 1), yy * 255 // max(height - 1, 1),
                    np.full((height, width), (37 * seed) % 256)], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def bodies(n: int, image_px: int, model: str, max_tokens: int,
           response_format: str = "text") -> list[dict]:
    scale = image_px / 560
    urls = [image_url(max(1, int(w * scale)), max(1, int(h * scale)), i)
            for i, (w, h) in enumerate(TILE_SHAPES)]
    extra = {} if response_format == "text" else {"response_format": {"type": response_format}}
    return [{"model": model, "temperature": 0, "max_tokens": max_tokens, "stream": True,
             "stream_options": {"include_usage": True}, **extra,
             "messages": [{"role": "user", "content": [
                 {"type": "image_url", "image_url": {"url": urls[i % len(urls)]}},
                 {"type": "text", "text": "describe the image"}]}]} for i in range(n)]


async def one(client, url: str, body: dict) -> tuple[float, float, int]:
    """(seconds to the first content delta, seconds to the end, completion tokens)."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices") or [{}]
            if first is None and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter() - t0
    end = time.perf_counter() - t0
    return (end if first is None else first), end, tokens


async def drive(base: str, key: str | None, reqs: list[dict], clients: int) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    results: list[tuple[float, float, int]] = []
    queue = list(reversed(reqs))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(headers=headers, timeout=600, limits=limits) as client:
        async def worker() -> None:
            while queue:
                results.append(await one(client, base + "/v1/chat/completions", queue.pop()))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    ttft = sorted(r[0] for r in results)
    lat = sorted(r[1] for r in results)

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return dict(clients=clients, requests=len(results), seconds=wall,
                requests_per_s=len(results) / wall,
                tokens_per_s=sum(r[2] for r in results) / wall,
                completion_tokens=sum(r[2] for r in results),
                ttft_p50=statistics.median(ttft), ttft_p95=pct(ttft, 0.95),
                latency_p50=statistics.median(lat), latency_p95=pct(lat, 0.95))


def save_random(folder: Path, size: str, byte_tokenizer: bool = False) -> Path:
    """A random-weight Mllama of ``size`` (mllama_hf.SIZES) in bf16 + a chat tokenizer
    (word-level, or byte-level BPE for JSON mode)."""
    import torch
    from mllama_hf import SIZES, build_hf, hf_config

    from tests.models.mllama.chat_tiny import save_byte_chat_tokenizer, save_chat_tokenizer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    d = SIZES[size]
    model = build_hf(hf_config(d), dev, torch.bfloat16 if dev == "cuda" else torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)
    save = save_byte_chat_tokenizer if byte_tokenizer else save_chat_tokenizer
    return save(folder, d["vocab"])


def serve_in_process(folder: str, args):
    from edserve.config import EngineConfig
    from edserve.server.config import ServerConfig
    from edserve.server.launch import ServerThread, build

    engine = EngineConfig(model=folder, device=args.device, context_length=512,
                          max_running_requests=args.max_running)  # None: auto
    aengine, app = build(engine, ServerConfig(served_model_name=args.model_name))
    return aengine, ServerThread(app, "127.0.0.1", 0).start()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="base URL of a running server")
    ap.add_argument("--serve", help="start a server in this process on this HF folder")
    ap.add_argument("--save-random", help="write a random-weight Mllama folder here and exit")
    ap.add_argument("--size", default="small", choices=("small", "11b", "toy"))
    ap.add_argument("--byte-tokenizer", action="store_true",
                    help="--save-random: a byte-level tokenizer (needed by --response-format)")
    ap.add_argument("--response-format", default="text", choices=("text", "json_object"),
                    help="json_object: every request in JSON mode (grammar-constrained)")
    ap.add_argument("--model-name", default="mllama")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--image-px", type=int, default=560, help="the model's tile size")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-running", type=int, default=None,
                    help="server --max-running-requests (default: auto)")
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU server on the tiny chat model, 4 clients, 8 requests")
    args = ap.parse_args(argv)
    if args.save_random:
        save_random(Path(args.save_random), args.size, args.byte_tokenizer)
        print(f"saved {args.save_random}")
        return 0
    tmp = None
    if args.dry_run:
        from tests.models.mllama.chat_tiny import save_byte_chat_tokenizer, save_chat_model

        tmp = tempfile.TemporaryDirectory()
        args.serve = str(save_chat_model(Path(tmp.name)))
        if args.response_format != "text":
            save_byte_chat_tokenizer(Path(tmp.name))
        args.device, args.image_px, args.max_running = "cpu", 56, 4
        args.clients, args.requests, args.max_tokens = 4, 8, 8
    server = aengine = None
    if args.serve:
        aengine, server = serve_in_process(args.serve, args)
        args.url = server.url
    if not args.url:
        ap.error("give --url, --serve or --dry-run")
    try:
        reqs = bodies(args.requests, args.image_px, args.model_name, args.max_tokens,
                      args.response_format)
        asyncio.run(drive(args.url, args.api_key, reqs[:args.clients], args.clients))  # warm
        r = asyncio.run(drive(args.url, args.api_key, reqs, args.clients))
    finally:
        if server is not None:
            server.stop()
            aengine.shutdown()
        if tmp is not None:
            tmp.cleanup()
    print(f"{r['clients']} clients, {r['requests']} image requests in {r['seconds']:.1f} s: "
          f"{r['requests_per_s']:.2f} req/s, {r['tokens_per_s']:.0f} completion tok/s; TTFT "
          f"p50 {1000 * r['ttft_p50']:.0f} ms p95 {1000 * r['ttft_p95']:.0f} ms; latency p50 "
          f"{1000 * r['latency_p50']:.0f} ms p95 {1000 * r['latency_p95']:.0f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
