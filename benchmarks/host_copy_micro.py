"""Host cost of one small host list -> device tensor copy (the engine's ``to_device``), per
variant, with the device busy (a queued matmul loop) so no call can wait on it:

  pinned-new   ``torch.tensor(values, pin_memory=True).to(dev, non_blocking=True)`` (today)
  ring         ``torch.tensor(values)`` copied into a slice of one page-locked buffer, then
               ``.to(dev, non_blocking=True)`` from the slice
  pageable     ``torch.tensor(values).to(dev)``

  python benchmarks/host_copy_micro.py [--n 64 256 1024] [--calls 2000]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", nargs="+", type=int, default=[8, 64, 256, 1024])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    dev = torch.device("cuda")
    ring = torch.empty(1 << 22, dtype=torch.int64, pin_memory=True)
    pos = [0]

    def pinned_new(v):
        return torch.tensor(v, dtype=torch.int64, pin_memory=True).to(dev, non_blocking=True)

    def ring_copy(v):
        t = torch.tensor(v, dtype=torch.int64)
        if pos[0] + t.numel() > ring.numel():
            pos[0] = 0
        s = ring[pos[0]:pos[0] + t.numel()]
        pos[0] += t.numel()
        s.copy_(t)
        return s.to(dev, non_blocking=True)

    def pageable(v):
        return torch.tensor(v, dtype=torch.int64).to(dev)

    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    print("| values | variant | host us per call (device busy) |\n|---:|---|---:|")
    for n in args.n:
        vals = list(range(n))
        for name, fn in (("pinned-new", pinned_new), ("ring", ring_copy), ("pageable", pageable)):
            for _ in range(50):
                fn(vals)
            torch.cuda.synchronize()
            for _ in range(40):  # ~40 ms of queued device work
                a @ a
            calls = args.calls if name != "pageable" else 50
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(vals)
            us = (time.perf_counter() - t0) / calls * 1e6
            torch.cuda.synchronize()
            print(f"| {n} | {name} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
