"""Prefill speed on the GPU: edserve's Whisper encoder and prefill step, per prefill path
(``prefill_variants.VARIANTS``: the path before issue 19's fusion work, the contiguous residual
stream, Triton cross-K/V writes, separate vs fused residual add + LayerNorm,
``--compile-encoder``, encoder CUDA graphs, fp8 encoder eager and compiled) vs HF's
WhisperEncoder on the same random weights, in one process (runs
alternate; medians of ``--repeats``).

Per batch size (30 s clips), per clip:
  encode    ``model.encode(mels)``: the encoder alone (host log-mels uploaded inside)
  prefill   one engine step admitting every clip: encoder + cross-K/V projection and pool
            write + decoder prompt + first token (what a request waits for)
  HF        ``WhisperEncoder(mels)`` (sdpa), log-mels already on the device
  floor     encoder FLOPs / the measured bf16 matmul rate (8192^3 GEMM)
First each path's first call (compilation included) and its encoder output's relative error
against the eager bf16 path; at the end torch-profiler tables of one prefill step (per op:
device time, GFLOP, achieved TFLOP/s; then kernels) for the fastest path and the default one.
``--sdpa`` also times the SDPA backends on the encoder's 1500 x 1500 self-attention.

  python benchmarks/prefill_gpu.py --arch large-v3 --batch 2 16 32
  python benchmarks/prefill_gpu.py --dry-run      # toy shapes on CPU: the script runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--dry-run" in sys.argv:  # the Triton KV-write kernel runs under the CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import whisper_gpu as wg  # noqa: E402
from prefill_variants import VARIANTS, Variants  # noqa: E402

from edserve.engine.request import GenerateRequest, SamplingParams  # noqa: E402


def timed_ms(fn, dev: str, repeats: int) -> float:
    """Median wall time of ``fn()`` in ms, device work included (one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        wg.sync(dev)
        t0 = time.perf_counter()
        fn()
        wg.sync(dev)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def encoder_flops(arch: str) -> float:
    """FLOPs of one 30 s window through the encoder (GEMMs, attention, convolutions)."""
    a = wg.ARCHS[arch]
    d, L, f, S = a["d_model"], a["layers"], a["ffn"], 1500
    gemms = 2 * S * L * (4 * d * d + 2 * d * f)
    attention = 4 * L * S * S * d
    convs = 2 * 3 * (2 * S * a["n_mels"] * d + S * d * d)
    return gemms + attention + convs


def prefill_step(engine, mels: list[torch.Tensor]):
    """A callable running one engine step that admits every clip (then finishes them)."""
    tok = engine.tokenizer
    sp = SamplingParams(max_new_tokens=1, ignore_eos=True)

    def run():
        for m in mels:
            engine.add_request(GenerateRequest([tok.sot], m, sp))
        engine.step()
        assert not engine.scheduler.waiting, "raise --max-prefill-tokens: clips left waiting"
        wg.drain(engine)
    return run


def host_profile(fn, dev: str, rows: int) -> None:
    """Wall time of one call of ``fn`` and its Python functions by own time (cProfile)."""
    import cProfile
    import pstats

    wg.sync(dev)
    t0 = time.perf_counter()
    with cProfile.Profile() as pr:
        fn()
        wg.sync(dev)
    print(f"\n# one prefill step under cProfile: {1000 * (time.perf_counter() - t0):.1f} ms wall")
    pstats.Stats(pr).sort_stats("tottime").print_stats(rows)


def profile_table(fn, dev: str, flops_rate: float, rows: int) -> None:
    """One call of ``fn`` under the torch profiler: the ops with the most device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    fn()
    wg.sync(dev)
    with profile(activities=acts, with_flops=True) as prof:
        fn()
        wg.sync(dev)
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    timeof = (lambda e: e.self_device_time_total) if dev == "cuda" \
        else (lambda e: e.self_cpu_time_total)
    total = sum(timeof(e) for e in events) or 1.0
    print(f"\n# one prefill step, ops by {'device' if dev == 'cuda' else 'CPU'} time "
          f"(total {total / 1000:.2f} ms)")
    print("op                                  calls   time ms  share   GFLOP  TFLOP/s  "
          "% matmul rate")
    for e in sorted(events, key=timeof, reverse=True)[:rows]:
        t_us = timeof(e)
        gflop = (e.flops or 0) / 1e9
        rate = gflop / 1e3 / (t_us / 1e6) if t_us and gflop else 0.0
        pct = f"{100 * rate * 1e12 / flops_rate:6.1f}" if rate else "     -"
        print(f"{e.key[:35]:35s} {e.count:6d} {t_us / 1000:9.3f} {100 * t_us / total:5.1f}% "
              f"{gflop:7.1f} {rate:8.1f}  {pct}")
    host = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    print("\n# host ops by self CPU time")
    for e in host[:rows]:
        print(f"{e.self_cpu_time_total / 1000:9.3f} ms  {e.count:5d}x  {e.key[:90]}")
    host_profile(fn, dev, rows)
    if dev == "cuda":
        kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        print("\n# kernels by device time")
        for e in sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:rows]:
            print(f"{e.self_device_time_total / 1000:9.3f} ms  {e.count:5d}x  {e.key[:90]}")


def sdpa_backends(arch: str, dev: str, dtype: torch.dtype, batch: int, repeats: int) -> None:
    """Each SDPA backend on the encoder's self-attention shape (no mask, 1500 x 1500)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    a = wg.ARCHS[arch]
    H, hd = a["heads"], a["d_model"] // a["heads"]
    # q, k, v as the encoder makes them: views of one [N, S, 3, H, hd] projection
    qkv = torch.randn(batch, 1500, 3, H, hd, device=dev, dtype=dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    flops = 4 * batch * H * 1500 * 1500 * hd
    print(f"\n# SDPA, {batch} x {H} heads x 1500 x 1500, head dim {hd}, {dtype}")
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            print(f"{name:20s} not in this torch")
            continue
        try:
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
                ms = timed_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                              dev, repeats)
        except RuntimeError as e:
            print(f"{name:20s} unsupported: {str(e).splitlines()[0][:90]}")
            continue
        err = (out.float() - ref).abs().max().item()
        print(f"{name:20s} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s  max|err| {err:.1e}")


def first_calls(vs: Variants, model, host: list[torch.Tensor], names: list[str],
                dev: str) -> list[str]:
    """Each path's first encode (compiles) and its relative error against eager bf16; a path
    that fails is reported and dropped. Returns the paths that ran."""
    vs.use("eager")
    ref = torch.stack(model.encode(host)).float()
    print("\n# first call (s, compilation included), encoder output vs eager bf16 "
          "(|a - b| / |b|)")
    ok = []
    for name in names:
        try:
            vs.use(name)
            wg.sync(dev)
            t0 = time.perf_counter()
            out = torch.stack(model.encode(host)).float()
            wg.sync(dev)
        except Exception as e:  # noqa: BLE001 - report and measure the others
            print(f"{name:13s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            continue
        err = float((out - ref).norm() / ref.norm())
        print(f"{name:13s} {time.perf_counter() - t0:8.2f} s   rel err {err:.2e}")
        ok.append(name)
    from torch._dynamo.utils import counters

    print(f"dynamo graphs compiled: {counters['stats']['unique_graphs']} (one per compiled "
          f"path expected: the layers share theirs)")
    return ok


def measure(vs: Variants, engine, hf, names: list[str], n: int, args, dev: str,
            dtype: torch.dtype, floor_ms: float) -> dict[str, float]:
    """Per-clip ms of every path at batch ``n`` (printed); returns prefill ms per path."""
    n_mels = wg.ARCHS[args.arch]["n_mels"]
    gen = torch.Generator().manual_seed(n)
    host = [torch.randn(n_mels, 3000, generator=gen) * 0.5 for _ in range(n)]
    feats = torch.stack(host).to(device=dev, dtype=dtype)
    on_dev = [m.to(dev) for m in host]  # the encoder without the host stack + upload
    # as the engine gets them since wave 10: page-locked at submission (MelStager)
    staged = [engine.model.stage_encoder_input(m) for m in host]
    step = prefill_step(engine, host)
    t: dict[str, list[float]] = {"hf": []}
    with torch.inference_mode():
        for _ in range(args.repeats):  # alternate so drift hits all equally
            t["hf"].append(timed_ms(lambda: hf.model.encoder(feats), dev, 1))
            for name in names:
                vs.use(name)
                t.setdefault(f"enc {name}", []).append(
                    timed_ms(lambda: engine.model.encode(host), dev, 1))
                t.setdefault(f"dev {name}", []).append(
                    timed_ms(lambda: engine.model.encode(on_dev), dev, 1))
                t.setdefault(f"stg {name}", []).append(
                    timed_ms(lambda: engine.model.encode(staged), dev, 1))
                t.setdefault(f"pre {name}", []).append(timed_ms(step, dev, 1))
    m = {k: statistics.median(v) / n for k, v in t.items()}
    print(f"\n# batch {n}: ms per 30 s clip; HF encoder {m['hf']:.3f}, floor {floor_ms:.2f}")
    print("(encode: plain host log-mels in; staged: page-locked at submission, as the engine "
          "gets them; mels on GPU: HF's input)")
    print("path           encode  staged  mels on GPU  prefill  encode/HF  staged/HF  "
          "GPU-mels/HF  prefill/HF  %floor (encode)")
    for name in names:
        e, st, g, p = (m[f"{k} {name}"] for k in ("enc", "stg", "dev", "pre"))
        print(f"{name:13s} {e:7.3f}  {st:6.3f}  {g:11.3f}  {p:7.3f}  {e / m['hf']:9.2f}  "
              f"{st / m['hf']:9.2f}  {g / m['hf']:11.2f}  {p / m['hf']:10.2f}  "
              f"{100 * floor_ms / e:15.1f}")
    return {name: m[f"pre {name}"] for name in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="large-v3", choices=sorted(wg.ARCHS))
    ap.add_argument("--batch", nargs="+", type=int, default=[2, 16, 32],
                    help="batch sizes (2 and up: a compiled encoder compiles batch 1 apart)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-batch", type=int, default=16)
    ap.add_argument("--rows", type=int, default=15, help="rows of the profiler tables")
    ap.add_argument("--config", default="flat:128", help="strategy:page_size of the engine")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                    help="prefill paths to compare (prefill_variants.py)")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend (default inductor; aot_eager with --dry-run)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--sdpa", action="store_true", help="also time the SDPA backends")
    ap.add_argument("--dry-run", action="store_true", help="toy model on CPU")
    args = ap.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    if args.dry_run:
        args.arch, args.batch, args.repeats, args.profile_batch = "toy", [2, 3], 2, 2
    backend = args.compile_backend or ("aot_eager" if args.dry_run else "inductor")
    _, flops_rate = wg.ceilings(dev)
    per_clip = encoder_flops(args.arch)
    floor_ms = 1000 * per_clip / flops_rate
    print(f"# {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, {args.arch}, "
          f"{dtype}, KV {args.kv_cache_dtype}, compile backend {backend}: bf16 matmul "
          f"{flops_rate / 1e12:.0f} TFLOP/s; encoder "
          f"{per_clip / 1e12:.3f} TFLOP per 30 s clip -> floor {floor_ms:.2f} ms per clip")
    hf = wg.build_hf(args.arch, dev, dtype)
    strategy, ps = args.config.split(":")
    conc = max(args.batch + [args.profile_batch])
    engine = wg.make_engine(hf, args.arch, conc, 2, device=dev, dtype=str(dtype)[6:],
                            encoder_kv=strategy, page_size=ps,
                            max_prefill_tokens=conc * 1600, debug_checks=False,
                            kv_cache_dtype=args.kv_cache_dtype)
    if dev != "cuda":  # CUDA graphs and the TMA kernel (bf16, Hopper+): CUDA only
        args.variants = [v for v in args.variants if v not in ("graphs", "tma", "fa3")]
    if not os.environ.get("EDSERVE_FA3_LIB"):  # FlashAttention-3's library: tools/build_fa3.sh
        args.variants = [v for v in args.variants if v != "fa3"]
    vs = Variants(engine, backend, fp8=any(v.startswith("fp8") for v in args.variants),
                  graph_max_bs=max(args.batch + [args.profile_batch]))
    n_mels = wg.ARCHS[args.arch]["n_mels"]
    gen = torch.Generator().manual_seed(0)
    host = [torch.randn(n_mels, 3000, generator=gen) * 0.5 for _ in range(args.profile_batch)]
    with torch.inference_mode():
        names = first_calls(vs, engine.model, host, args.variants, dev)
    prefill = {}
    for n in args.batch:
        prefill[n] = measure(vs, engine, hf, names, n, args, dev, dtype, floor_ms)
    at = prefill.get(args.profile_batch) or prefill[args.batch[-1]]
    best = min(at, key=at.get)
    for name in dict.fromkeys([best, "eager"]):
        if name in names:
            vs.use(name)
            print(f"\n## profile: {name}")
            with torch.inference_mode():
                profile_table(prefill_step(engine, host), dev, flops_rate, args.rows)
    vs.use("eager")
    if args.sdpa:
        sdpa_backends(args.arch, dev, dtype, args.profile_batch, args.repeats)


if __name__ == "__main__":
    main()
