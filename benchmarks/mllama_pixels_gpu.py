"""How long an Mllama prefill's pixel values take to reach the GPU: the host concatenation and
cast the engine did until wave 39 (``torch.cat(pixel_values).to(device, bf16)``) vs
:func:`~edserve.multimodal.mllama_image.stack_pixels` (valid tiles only, each image's straight
from its own tensor, cast on the device). Images of 4, 1, 2, 3, ... tiles at 560 px as in
``mllama_gpu.py``; ms per batch (medians), host ms (the time the calling thread is held), and
the two results' equality.

  python benchmarks/mllama_pixels_gpu.py --images 16 64
  python benchmarks/mllama_pixels_gpu.py --dry-run      # CPU, tiny images: the script runs
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from edserve.multimodal.mllama_image import MllamaImageConfig, preprocess_images, stack_pixels

TILE_SHAPES = {1: (560, 560), 2: (1120, 560), 3: (1680, 560), 4: (1120, 1120)}  # (W, H)


def images(n: int, size: int) -> list:
    from PIL import Image

    cfg, out = MllamaImageConfig(image_size=size), []
    for i in range(n):
        w, h = TILE_SHAPES[(i + 3) % 4 + 1]
        g = torch.Generator().manual_seed(i)
        px = torch.randint(0, 256, (h * size // 560, w * size // 560, 3), generator=g)
        out.append(preprocess_images([Image.fromarray(px.to(torch.uint8).numpy())], cfg))
    return out


def old_way(reqs, dev, dtype):
    return torch.cat([x.pixel_values for x in reqs]).to(dev, dtype)


def timed(fn, dev: torch.device, runs: int) -> tuple[float, float]:
    """(ms until the result is on the device, ms the calling thread was held) medians."""
    wall, host = [], []
    for _ in range(runs):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        wall.append(time.perf_counter() - t0)
        host.append(t1 - t0)
    return 1000 * statistics.median(wall), 1000 * statistics.median(host)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("no CUDA device; use --dry-run")
        return 2
    dev, size = (torch.device("cuda"), 560) if cuda else (torch.device("cpu"), 56)
    sizes = [2] if args.dry_run else args.images
    print(f"# {torch.cuda.get_device_name(dev) if cuda else 'cpu'}, {size} px tiles, bfloat16")
    print("images  tiles (slots)   host MB | cat+cast ms (host ms) | stack_pixels ms (host ms) "
          "| equal")
    for n in sizes:
        reqs = images(n, size)
        tiles = sum(sum(x.num_tiles) for x in reqs)
        slots = sum(x.pixel_values.shape[0] * x.pixel_values.shape[1] for x in reqs)
        mb = sum(x.pixel_values.numel() * 4 for x in reqs) / 1e6
        a = timed(lambda r=reqs: old_way(r, dev, torch.bfloat16), dev, args.runs)
        b = timed(lambda r=reqs: stack_pixels(r, dev, torch.bfloat16, staged=True), dev,
                  args.runs)
        same = torch.equal(old_way(reqs, dev, torch.bfloat16),
                           stack_pixels(reqs, dev, torch.bfloat16, staged=True))
        print(f"{n:6d} {tiles:6d} ({slots:4d}) {mb:9.0f} | {a[0]:10.1f} ({a[1]:7.1f}) | "
              f"{b[0]:14.1f} ({b[1]:7.1f}) | {same}", flush=True)
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
