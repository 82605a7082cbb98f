"""Data-parallel engines on every GPU of a host (``--data-parallel-size``), measured.

Random-weight Whisper (``--arch``, bf16, flat/128, graphs), 30 s log-mels, forced length: the
same requests through ``DataParallelClient`` with 1 and with N workers (one GPU each), in one
run. Prints audio-s/s, requests per worker, the GPU each worker ran on, and checks that equal
inputs give equal tokens on every worker.

  python benchmarks/dp_gpu.py --workers 2 --requests 128     # a host with >= 2 GPUs
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


async def _run(client, reqs) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(client.generate(r) for r in reqs))
    return time.perf_counter() - t0, outs


def _requests(n: int, n_mels: int, new_tokens: int):
    from edserve.engine.request import GenerateRequest, SamplingParams

    gen = torch.Generator().manual_seed(0)
    mels = [torch.randn(n_mels, 3000, generator=gen) * 0.5 for _ in range(8)]
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    return [GenerateRequest([50257, 50362], mels[i % 8], sp) for i in range(n)]


def main() -> None:
    from whisper_fixtures import make_random_whisper

    from edserve.config import EngineConfig
    from edserve.dp.client import DataParallelClient

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=100)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    folder = make_random_whisper(Path(tempfile.mkdtemp()), d_model=args.d_model,
                                 layers=args.layers, heads=max(1, args.d_model // 64))
    cfg = EngineConfig(model=str(folder), encoder_kv="flat", page_size="128",
                       max_running_requests=64, max_new_tokens=args.new_tokens)
    rows = []
    for n in sorted({1, args.workers}):
        client = DataParallelClient(cfg, n).start()
        try:
            asyncio.run(_run(client, _requests(2 * n, 80, 4)))  # warm-up (graphs, JIT)
            smi = subprocess.run("nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory "
                                 "--format=csv,noheader 2>/dev/null || echo none", shell=True,
                                 capture_output=True, text=True)
            dt, outs = asyncio.run(_run(client, _requests(args.requests, 80, args.new_tokens)))
            routed = [w.routed for w in client.workers]
        finally:
            client.shutdown(10.0)
        by_mel: dict[int, list[int]] = {}
        same = all(by_mel.setdefault(i % 8, o.token_ids) == o.token_ids
                   for i, o in enumerate(outs))
        rate = args.requests * 30 / dt
        rows.append((n, rate))
        print(f"workers {n}: {rate:8.0f} audio-s/s  {dt:6.2f} s  routed {routed}  "
              f"equal tokens for equal inputs: {same}", flush=True)
        print("  GPU processes:", " | ".join(smi.stdout.strip().splitlines()), flush=True)
    if len(rows) == 2:
        print(f"DP {rows[1][0]} / DP 1 = {rows[1][1] / rows[0][1]:.2f}x")


if __name__ == "__main__":
    main()
