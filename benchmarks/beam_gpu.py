"""Beam search on the GPU: edserve beam 5 vs greedy vs HF transformers ``generate(num_beams=5)``
(random large-v3 weights in bf16, one process, the same weights and log-mels).

The real path without timestamps: every request is one 30 s window with prompt
``<|startoftranscript|><|notimestamps|>`` and openai-whisper's SuppressBlank + SuppressTokens
filters (HF: SuppressTokensAtBegin + SuppressTokens). **Forced length**: ``ignore_eos=True,
max_new_tokens=N`` (HF: ``eos_token_id=None``), so every beam runs N steps and all systems do
the same work. Runs alternate between systems; the tables give medians of ``--repeats``.

Per config (strategy:page_size) and concurrency (requests; beam rows = concurrency x beam):
  audio-s/s      concurrency x 30 s / wall of ``generate`` (prefill included)
  tok/s          output tokens / wall (the returned sequence: concurrency x N)
  step ms        median decode step with every request decoding (device work included)
  floor ms       (decoder weights + KV bytes read once per step) / 4.8 TB/s: encoder KV once
                 per request (the beams share its pages), self-attention KV of every row
  KV MB/req      peak ``allocator.num_used()`` during the run x bytes per slot / concurrency;
                 beside it 5 independent greedy copies: 5 x the measured greedy figure
  syncs/step     host<->device syncs per decode step (``torch.cuda.set_sync_debug_mode``)
  GPU busy       union of kernel intervals / wall over decode steps (torch profiler)

  python benchmarks/beam_gpu.py --concurrency 16 64 --configs flat:128 aligned:128
  python benchmarks/beam_gpu.py ... --per-row-cross   # A/B: no grouped cross-attention
  python benchmarks/beam_gpu.py ... --beam-on-device  # A/B: beams chosen on the device
  python benchmarks/beam_gpu.py ... --profile 15  # + the top kernels of a decode step
  python benchmarks/beam_gpu.py --dry-run      # toy model on CPU: the script runs
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
import whisper_gpu as wg

from edserve.engine.request import GenerateRequest, SamplingParams

HBM_BW = 4.8e12  # H200 datasheet HBM bandwidth, bytes/s (the floor's denominator)
PROMPT = wg.PROMPT  # <|startoftranscript|><|notimestamps|> (tiny.en ids; large-v3 random)
STEADY_TOKENS = 40  # request length for the per-step measurements (3 + 20 steps fit)


def filters(tok):
    from edserve.whisper.logits import SuppressBlank, SuppressTokens, default_suppress_tokens

    return [SuppressBlank.of(tok), SuppressTokens.of(default_suppress_tokens(tok))]


#: ``--eos-timestamps``: the transcription path's decoding (set by main)
MODE = {"timestamps": False}


def make_requests(engine, feats, n_new: int, beam: int, eos: bool = False
                  ) -> list[GenerateRequest]:
    """Forced length (``ignore_eos``) unless ``eos``; with ``--eos-timestamps`` the prompt is
    ``<|startoftranscript|>`` alone and openai-whisper's timestamp rules filter too."""
    tok = engine.tokenizer
    sp = SamplingParams(max_new_tokens=n_new, ignore_eos=not eos, beam_size=beam)
    procs = filters(tok)
    prompt = list(PROMPT)
    if MODE["timestamps"]:
        from edserve.whisper.logits import ApplyTimestampRules

        procs.append(ApplyTimestampRules.of(tok))
        prompt = prompt[:1]
    return [GenerateRequest(list(prompt), f, sp, logits_processors=list(procs)) for f in feats]


def make_engine(hf, arch: str, conc: int, beam: int, n_new: int, strategy: str, ps: str,
                 dev: str, grouped_cross: bool = True, beam_on_device: bool = False,
                 beam_choice: str = "auto"):
    from edserve.engine.groups import reserved_slots
    from edserve.models.weights import Checkpoint
    from edserve.runtime import build_engine

    ckpt = Checkpoint(Path(f"<random {arch}>"), "hf", wg.hf_config(arch),
                      dict(hf.state_dict()), wg.tokenizer_path())
    n_max = max(n_new, STEADY_TOKENS) + 8
    per_req = max(reserved_slots(region, len(PROMPT) + n_max, int(ps), beam, False)
                  for region in (1500, 1536))  # flat / aligned encoder regions
    dtype = "bfloat16" if dev == "cuda" else "float32"
    return build_engine(checkpoint=ckpt, device=dev, dtype=dtype,
                  encoder_kv=strategy, page_size=ps, max_running_requests=conc * beam,
                  cuda_graph_max_bs=conc * beam, max_total_tokens=conc * per_req + 4096,
                  max_new_tokens=n_max, debug_checks=False,
                  grouped_cross_attention=grouped_cross, beam_on_device=beam_on_device,
                  beam_choice=beam_choice)


def run_ours(engine, feats, n_new: int, beam: int) -> tuple[float, int]:
    """(wall seconds, peak KV slots in use) of one ``generate``-equivalent run."""
    dev = str(feats.device)
    outs = {}
    wg.sync(dev)
    t0 = time.perf_counter()
    eos = MODE["timestamps"]  # the transcription path stops at end-of-text
    reqs = make_requests(engine, feats, n_new, beam, eos=eos)
    for r in reqs:
        engine.add_request(r, lambda d: outs.__setitem__(d.rid, d.output) if d.finished
                           else None, stream=False)
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, engine.pools.allocator.num_used())  # host counter: no sync
    wg.sync(dev)
    dt = time.perf_counter() - t0
    bad = [o for o in outs.values() if o.error is not None
           or not (0 < len(o.token_ids) <= n_new if eos else len(o.token_ids) == n_new)]
    assert len(outs) == len(reqs) and not bad, [(o.error, len(o.token_ids)) for o in bad[:3]]
    MODE[f"tokens {beam}"] = sum(len(o.token_ids) for o in outs.values()) / len(outs)
    return dt, peak


def hf_processors(tok, device):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
    )

    from edserve.whisper.logits import default_suppress_tokens

    return LogitsProcessorList([
        SuppressTokensAtBeginLogitsProcessor(tok.encode(" ") + [tok.eot], len(PROMPT), device),
        SuppressTokensLogitsProcessor(default_suppress_tokens(tok), device)])


def run_hf(model, procs, feats, n_new: int, beam: int) -> float:
    from transformers.generation.utils import GenerationMixin

    prompt = torch.tensor([PROMPT] * feats.shape[0], device=feats.device)
    model.generation_config.eos_token_id = None  # forced length
    with torch.inference_mode():
        wg.sync(str(feats.device))
        t0 = time.perf_counter()
        out = GenerationMixin.generate(model, input_features=feats, decoder_input_ids=prompt,
                                       max_new_tokens=n_new, do_sample=False, num_beams=beam,
                                       logits_processor=procs)
        wg.sync(str(feats.device))
    assert out.shape == (feats.shape[0], len(PROMPT) + n_new), out.shape
    return time.perf_counter() - t0


def _steady(engine, feats, beam: int) -> None:
    """Submit requests and step until every one decodes (beams forked)."""
    for r in make_requests(engine, feats, STEADY_TOKENS, beam):
        engine.add_request(r)
    engine.step()
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    rows = len(engine.scheduler.running)
    assert rows == len(feats) * beam, f"{rows} rows decoding, expected {len(feats)} x {beam}"


def step_ms(engine, feats, beam: int, steps: int = 20) -> float:
    _steady(engine, feats, beam)
    ms = wg.median_step_ms(engine, str(feats.device), steps)
    wg.drain(engine)
    return ms


def syncs_per_step(engine, feats, beam: int, steps: int = 10) -> tuple[float, list[str]]:
    if feats.device.type != "cuda":
        return float("nan"), []
    _steady(engine, feats, beam)
    where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in wg.step_syncs(engine, steps))
    wg.drain(engine)
    return sum(where.values()) / steps, [f"{k} x{n}" for k, n in where.most_common()]


def gpu_busy(engine, feats, beam: int, steps: int = 10) -> float:
    if feats.device.type != "cuda":
        return float("nan")
    _steady(engine, feats, beam)
    busy = wg.step_gpu_busy(engine, steps)
    wg.drain(engine)
    return busy


def top_kernels(engine, feats, beam: int, rows: int) -> None:
    _steady(engine, feats, beam)
    for line in wg.step_kernels(engine, 5, rows):
        print("#  ", line)
    wg.drain(engine)


def floor_step_s(arch: str, conc: int, beam: int, n_new: int, dtype_bytes: int) -> float:
    """Bytes one decode step must read (mid-run average) / 4.8 TB/s: decoder weights once,
    each request's encoder KV once (shared by its beams), every row's self-attention KV."""
    a = wg.ARCHS[arch]
    d, L, f = a["d_model"], a["layers"], a["ffn"]
    weights = dtype_bytes * (L * (8 * d * d + 2 * d * f) + a["vocab"] * d)
    per_token = 2 * L * d * dtype_bytes
    kv = conc * per_token * (1500 + beam * (len(PROMPT) + n_new / 2))
    return (weights + kv) / HBM_BW


def measure(args, hf, procs, arch, conc, spec, dev, dtype, with_hf: bool) -> list[dict]:
    strategy, ps = spec.split(":")
    beam, n_new = args.beam, args.new_tokens
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    engine = make_engine(hf, arch, conc, beam, n_new, strategy, ps, dev,
                          grouped_cross=not args.per_row_cross,
                          beam_on_device=args.beam_on_device, beam_choice=args.beam_choice)
    m = engine.model
    dbytes = torch.empty((), dtype=engine.dtype).element_size()
    slot_bytes = 2 * m.num_kv_layers * m.num_kv_heads * m.head_dim * dbytes
    gen = torch.Generator().manual_seed(conc)
    feats = (torch.randn(conc, wg.ARCHS[arch]["n_mels"], 3000, generator=gen) * 0.5).to(
        device=dev, dtype=dtype)
    modes = {"beam": beam, "greedy": 1}
    for b in modes.values():  # warm-ups at the timed batch shapes (Triton JIT, graphs)
        run_ours(engine, feats, min(8, n_new), b)
        if with_hf:
            run_hf(hf, procs, feats, min(8, n_new), b)
    t_ours = {k: [] for k in modes}
    t_hf = {k: [] for k in modes}
    peak = dict.fromkeys(modes, 0)
    hf_err = None
    for _ in range(args.repeats):  # alternate systems and modes
        for k, b in modes.items():
            if with_hf and hf_err is None:
                try:
                    t_hf[k].append(run_hf(hf, procs, feats, n_new, b))
                except torch.OutOfMemoryError as exc:
                    hf_err = f"HF OOM ({k}): {str(exc).splitlines()[0][:120]}"
                    gc.collect()
                    torch.cuda.empty_cache()
            dt, p = run_ours(engine, feats, n_new, b)
            t_ours[k].append(dt)
            peak[k] = max(peak[k], p)
    if hf_err:
        print("#", hf_err)
    rows = []
    for k, b in modes.items():
        step = step_ms(engine, feats, b)
        syncs, kinds = syncs_per_step(engine, feats, b)
        busy = gpu_busy(engine, feats, b)
        if args.profile and dev == "cuda":
            print(f"# {spec} conc {conc} {k}: kernels by device time per decode step")
            top_kernels(engine, feats, b, args.profile)
        engine.check_integrity()
        wall = statistics.median(t_ours[k])
        hf_wall = statistics.median(t_hf[k]) if t_hf[k] else float("nan")
        rows.append(dict(
            config=spec, conc=conc, mode=f"{k} {b}" if b > 1 else k, rate=conc * 30 / wall,
            tok_s=conc * n_new / wall, row_tok_s=conc * b * n_new / wall,
            hf_rate=conc * 30 / hf_wall, step_ms=step,
            floor_ms=1000 * floor_step_s(arch, conc, b, n_new, dbytes),
            kv_mb=peak[k] * slot_bytes / conc / 1e6, syncs=syncs, busy=busy,
            runs=[round(t, 3) for t in t_ours[k]], hf_runs=[round(t, 3) for t in t_hf[k]]))
        if kinds:
            print(f"#   {k} syncs in 10 steps at: {', '.join(kinds[:8])}")
    engine.check_integrity()
    assert engine.pools.allocator.num_used() == 0, engine.pools.allocator.num_used()
    theory = beam * (1500 + len(PROMPT) + n_new) * slot_bytes / 1e6
    greedy_kv = rows[1]["kv_mb"]
    if MODE["timestamps"]:
        print(f"# {spec} conc {conc}: output tokens per request (last run): " + ", ".join(
            f"{k}: {MODE.get(f'tokens {b}', float('nan')):.1f}" for k, b in modes.items()))
    print(f"# {arch} {spec} conc {conc}: overlap={engine.overlap} "
          f"graphs={engine.runner.graph_runner is not None} "
          f"grouped_cross={engine.pools.backend.grouped_cross} slot {slot_bytes} B; "
          f"{beam} independent greedy copies would hold {beam * greedy_kv:.1f} MB/req measured "
          f"({beam} x {greedy_kv:.1f}), {theory:.1f} MB/req as {beam} x (1500 + "
          f"{len(PROMPT) + n_new}) slots; runs: " + "; ".join(
              f"{r['mode']} edserve {r['runs']} HF {r['hf_runs']}" for r in rows), flush=True)
    for r in rows:
        r["copies_mb"] = beam * greedy_kv
    del engine
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="large-v3", choices=sorted(wg.ARCHS))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--configs", nargs="+", default=["flat:128"], help="strategy:page_size")
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF reference")
    ap.add_argument("--per-row-cross", action="store_true",
                    help="read a beam group's encoder K/V once per row (no grouped "
                         "cross-attention kernel), for A/B against the default")
    ap.add_argument("--beam-on-device", action="store_true",
                    help="beams chosen on the device (fixed rows; the host reads done flags)")
    ap.add_argument("--beam-choice", default="auto", choices=("auto", "triton", "ops"),
                    help="with --beam-on-device: one Triton launch per step or the tensor ops "
                         "(--beam-choice of the engine), for A/B")
    ap.add_argument("--copy-whole-tail", action="store_true",
                    help="with --beam-on-device: a moved beam row copies its parent's whole "
                         "partial page (the path before wave 26), for A/B against copying from "
                         "the first token the two sequences do not share")
    ap.add_argument("--eos-timestamps", action="store_true",
                    help="the transcription path: stop at end-of-text (at most --new-tokens), "
                         "prompt <|startoftranscript|>, timestamp rules on (HF not run)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print the N kernels with the most device time per decode step")
    ap.add_argument("--torch-topk", action="store_true",
                    help="beam candidates by torch.topk (the path before wave 21), for A/B "
                         "against the one-pass Triton top-k")
    ap.add_argument("--dry-run", action="store_true", help="toy model on CPU")
    args = ap.parse_args()
    if args.torch_topk:
        from edserve.engine import sampler

        sampler._topk_rows = lambda logits, rows, k: torch.topk(  # the path before wave 21
            logits.index_select(0, rows), k, dim=-1)
    if args.copy_whole_tail:
        from edserve.engine.beam_rows import DeviceBeams

        DeviceBeams.copy_start = staticmethod(lambda plan, parents, history: plan.dec_start)
    dev = "cpu" if args.dry_run else "cuda"
    if args.eos_timestamps:
        MODE["timestamps"], args.no_hf = True, True
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    if args.dry_run:
        args.arch, args.concurrency, args.new_tokens, args.repeats = "toy", [2], 6, 1
        args.configs = [c.replace(":128", ":16") for c in args.configs]
    bw, _ = wg.ceilings(dev)
    print(f"# device {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}: measured copy "
          f"{bw / 1e12:.2f} TB/s (floor uses {HBM_BW / 1e12:.1f} TB/s); {args.arch} "
          f"{'bf16' if dev == 'cuda' else 'fp32'}, " + (
              f"EOS + timestamp rules, at most {args.new_tokens} tokens (per-step figures: "
              "forced length)" if args.eos_timestamps else
              f"forced length {args.new_tokens} tokens (ignore_eos)")
          + f", SuppressBlank + SuppressTokens, medians of {args.repeats}", flush=True)
    hf = wg.build_hf(args.arch, dev, dtype)
    from edserve.tokenizer import WhisperTokenizer

    tok = WhisperTokenizer.from_file(wg.tokenizer_path(), vocab_size=wg.ARCHS[args.arch]["vocab"])
    procs = hf_processors(tok, dev)
    header = ("config      conc  mode     edserve a-s/s   tok/s (row tok/s)  HF a-s/s  x HF  "
              "step ms  floor ms  %floor  KV MB/req  5 greedy MB/req  syncs/step  GPU busy")
    print(header)
    rows = []
    for i, spec in enumerate(args.configs):
        for conc in args.concurrency:  # rows print as measured (a timeout keeps them)
            new = measure(args, hf, procs, args.arch, conc, spec, dev, dtype,
                          with_hf=not args.no_hf and i == 0)
            for r in new:
                print(row_text(r), flush=True)
            rows += new
    print("# summary\n" + header)
    for r in rows:
        print(row_text(r))


def row_text(r: dict) -> str:
    return (f"{r['config']:11s} {r['conc']:4d}  {r['mode']:7s}  {r['rate']:13.0f}  "
            f"{r['tok_s']:6.0f} ({r['row_tok_s']:6.0f})  {r['hf_rate']:8.0f}  "
            f"{r['rate'] / r['hf_rate']:4.2f}  {r['step_ms']:7.2f}  {r['floor_ms']:8.3f}  "
            f"{100 * r['floor_ms'] / r['step_ms']:6.1f}  {r['kv_mb']:9.1f}  "
            f"{r['copies_mb']:15.1f}  {r['syncs']:10.2f}  {100 * r['busy']:7.1f}%")

if __name__ == "__main__":
    main()
