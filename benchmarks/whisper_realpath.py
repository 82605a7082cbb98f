"""The real transcription path on the GPU: edserve with openai-whisper's logits filters vs HF
``generate`` with its Whisper logits processors (random weights, forced length, one process).

Modes (all print one table row each; HF and edserve runs alternate, medians of ``--repeats``):
  filters  every request carries SuppressBlank + SuppressTokens + ApplyTimestampRules
           (timestamps on); HF runs SuppressTokens(AtBegin) + WhisperTimeStampLogitsProcessor
  driver   the actual transcription driver (audio -> log-mel -> windows -> segments) on many
           clips of noise, one 30 s window each, filters on, no fallback
Also per engine: decode-step time with and without the filters at full concurrency, host<->
device syncs per decode step (``torch.cuda.set_sync_debug_mode``), the GPU-busy share of a
decode step (torch profiler: union of kernel intervals / wall), prefill time per clip (encoder +
prompt + cross-KV write) vs HF's encoder time per clip, and the roofline floor.

  python benchmarks/whisper_realpath.py --arch large-v3 --concurrency 64
  python benchmarks/whisper_realpath.py --dry-run      # toy model on CPU: the script runs
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import whisper_gpu as wg

from edserve.engine.request import GenerateRequest, SamplingParams


def filters(tok):
    from edserve.whisper.logits import (
        ApplyTimestampRules,
        SuppressBlank,
        SuppressTokens,
        default_suppress_tokens,
    )

    return [SuppressBlank.of(tok), SuppressTokens.of(default_suppress_tokens(tok)),
            ApplyTimestampRules.of(tok)]


def ours_requests(engine, feats, new_tokens: int, with_filters: bool):
    tok = engine.tokenizer
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    procs = filters(tok) if with_filters else []
    return [GenerateRequest([tok.sot], f, sp, logits_processors=list(procs)) for f in feats]


def run_ours(engine, feats, new_tokens: int, with_filters: bool = True) -> float:
    dev = str(feats.device)
    reqs = ours_requests(engine, feats, new_tokens, with_filters)
    wg.sync(dev)
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    wg.sync(dev)
    assert all(len(o.token_ids) == new_tokens for o in outs), [o.error for o in outs]
    return time.perf_counter() - t0


def hf_processors(model, tok, device):
    import copy

    from transformers.generation.logits_process import (
        LogitsProcessorList,
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    from edserve.whisper.logits import default_suppress_tokens

    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id, cfg.no_timestamps_token_id = tok.eot, tok.no_timestamps
    cfg.max_initial_timestamp_index = 50
    return LogitsProcessorList([
        SuppressTokensAtBeginLogitsProcessor(tok.encode(" ") + [tok.eot], 1, device),
        SuppressTokensLogitsProcessor(default_suppress_tokens(tok), device),
        WhisperTimeStampLogitsProcessor(cfg, begin_index=1)])


def run_hf(model, procs, tok, feats, new_tokens: int) -> float:
    from transformers.generation.utils import GenerationMixin

    prompt = torch.tensor([[tok.sot]] * feats.shape[0], device=feats.device)
    model.generation_config.eos_token_id = None  # forced length
    with torch.inference_mode():
        wg.sync(str(feats.device))
        t0 = time.perf_counter()
        out = GenerationMixin.generate(model, input_features=feats, decoder_input_ids=prompt,
                                       max_new_tokens=new_tokens, do_sample=False,
                                       logits_processor=procs)
        wg.sync(str(feats.device))
    assert out.shape[1] == 1 + new_tokens, out.shape
    return time.perf_counter() - t0


def hf_encoder_s(model, feats) -> float:
    with torch.inference_mode():
        model.model.encoder(feats)
        wg.sync(str(feats.device))
        t0 = time.perf_counter()
        model.model.encoder(feats)
        wg.sync(str(feats.device))
    return time.perf_counter() - t0


def _steady(engine, feats, with_filters: bool):
    """Submit requests and step until all of them decode; returns a finisher."""
    for r in ours_requests(engine, feats, 60, with_filters):
        engine.add_request(r)
    engine.step()
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()


def prefill_s(engine, feats) -> float:
    """Wall time of the prefill steps of ``len(feats)`` new requests (encoder + prompt +
    cross-KV write), device work included."""
    dev = str(feats.device)
    for r in ours_requests(engine, feats, 2, True):
        engine.add_request(r)
    wg.sync(dev)
    t0 = time.perf_counter()
    engine.step()
    while engine.scheduler.waiting:
        engine.step()
    wg.sync(dev)
    dt = time.perf_counter() - t0
    wg.drain(engine)
    return dt


def step_ms(engine, feats, with_filters: bool, steps: int = 20) -> float:
    _steady(engine, feats, with_filters)
    ms = wg.median_step_ms(engine, str(feats.device), steps)
    wg.drain(engine)
    return ms


def syncs_per_step(engine, feats, steps: int = 10) -> float:
    if feats.device.type != "cuda":
        return float("nan")
    _steady(engine, feats, True)
    syncs = [str(w.message) for w in wg.step_syncs(engine, steps)]
    wg.drain(engine)
    for text in sorted(set(syncs))[:3]:
        print("#   sync:", text.splitlines()[0][:160])
    return len(syncs) / steps


def gpu_busy(engine, feats, steps: int = 10) -> float:
    """Share of the decode steps' wall time during which some kernel ran."""
    if feats.device.type != "cuda":
        return float("nan")
    _steady(engine, feats, True)
    busy = wg.step_gpu_busy(engine, steps)
    wg.drain(engine)
    return busy


def host_profile(engine, feats, steps: int = 20) -> None:
    """cProfile of steady decode steps with the filters (host time by function)."""
    _steady(engine, feats, True)

    def run() -> None:
        for _ in range(steps):
            engine.step()
    wg.cprofiled(run, 22, ("cumulative",), f"# host profile of {steps} decode steps "
                 "(cumulative s):")
    wg.drain(engine)


def kernel_table(engine, feats, rows: int, bw: float, steps: int = 10) -> None:
    """Steady decode steps with the filters: wall, device time and the top kernels, against
    the step's memory floor (decoder weights + every row's cross K/V at the copy rate)."""
    _steady(engine, feats, True)
    wall = wg.median_step_ms(engine, str(feats.device), steps)
    lines, device_ms = wg.step_kernels(engine, steps, rows, with_total=True)
    wg.drain(engine)
    cfg = engine.model.config
    d, layers, conc = cfg.d_model, cfg.decoder_layers, feats.shape[0]
    weights = 2 * (layers * 14 * d * d + cfg.vocab_size * d)  # q,k,v,o x2 (cross q,o), fc1/2
    cross_kv = 2 * 2 * layers * conc * 1500 * d  # K and V, bf16, every row's 1500 keys
    floor = 1000 * (weights + cross_kv) / bw
    print(f"# decode step, {conc} rows: wall {wall:.2f} ms, device {device_ms:.2f} ms "
          f"({100 * device_ms / wall:.0f} % of the wall), floor {floor:.2f} ms "
          f"(weights {weights / 1e9:.2f} GB + cross K/V {cross_kv / 1e9:.2f} GB at "
          f"{bw / 1e12:.2f} TB/s)")
    for line in lines:
        print("#  ", line)


def run_driver(engine, clips: list[np.ndarray], new_tokens: int) -> tuple[float, int]:
    from edserve.whisper.options import TranscribeOptions
    from edserve.whisper.transcribe import transcribe

    opts = TranscribeOptions(temperatures=(0.0,), compression_ratio_threshold=None,
                             logprob_threshold=None, no_speech_threshold=None,
                             timestamps=True, max_new_tokens=new_tokens)
    wg.sync(str(engine.device))
    t0 = time.perf_counter()
    results = transcribe(engine, clips, options=opts)
    wg.sync(str(engine.device))
    return time.perf_counter() - t0, sum(len(s.tokens) for r in results for s in r.segments)


def _sampling_replays(engine) -> int | None:
    """Steps sampled by a replayed graph so far (None: no sampling graphs)."""
    sampling = getattr(engine.runner.graph_runner, "sampling", None)
    return None if sampling is None else sampling.replays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="large-v3", choices=sorted(wg.ARCHS))
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--config", default="flat:128", help="strategy:page_size")
    ap.add_argument("--new-tokens", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--overlap", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--sampling-graph", default="on", choices=("on", "off"),
                    help="replay graph steps' sampling as CUDA graphs (--sampling-cuda-graph)")
    ap.add_argument("--host-profile", action="store_true", help="cProfile decode steps only")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="only: the N kernels with the most device time per steady decode step")
    ap.add_argument("--no-hf", action="store_true",
                    help="skip HF's runs and encoder (an A/B of two edserve trees)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    if args.dry_run:
        args.arch, args.concurrency, args.new_tokens, args.repeats = "toy", 2, 4, 1
    conc, n_new = args.concurrency, args.new_tokens
    strategy, ps = args.config.split(":")
    bw, flops = wg.ceilings(dev)
    hf = wg.build_hf(args.arch, dev, dtype)
    engine = wg.make_engine(hf, args.arch, conc, n_new + 60, device=dev,
                            dtype="bfloat16" if dev == "cuda" else "float32",
                            encoder_kv=strategy, page_size=ps, overlap_schedule=args.overlap,
                            sampling_cuda_graph=args.sampling_graph == "on")
    tok = engine.tokenizer
    gen = torch.Generator().manual_seed(conc)
    feats = (torch.randn(conc, wg.ARCHS[args.arch]["n_mels"], 3000, generator=gen) * 0.5).to(
        device=dev, dtype=dtype)
    if args.host_profile:
        run_ours(engine, feats, 3)
        host_profile(engine, feats)
        return
    if args.kernels:
        run_ours(engine, feats, 3)
        kernel_table(engine, feats, args.kernels, bw)
        return
    procs = hf_processors(hf, tok, dev)
    floor = conc * 30 / wg.floor_seconds(args.arch, conc, n_new, bw, flops)
    if not args.no_hf:
        run_hf(hf, procs, tok, feats, 3)  # warm-ups at the timed shapes
    run_ours(engine, feats, 3)
    t_hf, t_ours = [], []
    for _ in range(args.repeats):  # alternate: HF's speed swings between runs
        if not args.no_hf:
            t_hf.append(run_hf(hf, procs, tok, feats, n_new))
        t_ours.append(run_ours(engine, feats, n_new))
    hf_rate = conc * 30 / statistics.median(t_hf) if t_hf else float("nan")
    ours_rate = conc * 30 / statistics.median(t_ours)
    clips = [np.random.default_rng(i).standard_normal(16000 * 30).astype(np.float32) * 0.1
             for i in range(conc)]
    run_driver(engine, clips[:2], 3)
    t_drv, n_tok = run_driver(engine, clips, n_new)
    enc_hf = float("nan") if args.no_hf else hf_encoder_s(hf, feats) / conc
    pre = prefill_s(engine, feats) / conc
    s_plain, s_filt = step_ms(engine, feats, False), step_ms(engine, feats, True)
    syncs, busy = syncs_per_step(engine, feats), gpu_busy(engine, feats)
    engine.check_integrity()
    print(f"# {args.arch} conc {conc} {strategy}/{ps} overlap={engine.overlap} "
          f"graphs={engine.runner.graph_runner is not None} "
          f"sampling graph replays={_sampling_replays(engine)} bw {bw / 1e12:.2f} TB/s "
          f"bf16 {flops / 1e12:.0f} TFLOP/s; HF runs {[round(t, 3) for t in t_hf]} s, "
          f"edserve {[round(t, 3) for t in t_ours]} s")
    print("arch      conc  HF a-s/s  edserve a-s/s  x HF  floor a-s/s  %floor  driver a-s/s "
          "(tok)  step ms plain/filters  syncs/step  GPU busy  prefill/clip ms  HF enc/clip ms")
    print(f"{args.arch:9s} {conc:4d}  {hf_rate:8.0f}  {ours_rate:13.0f}  "
          f"{ours_rate / hf_rate:4.2f}  {floor:11.0f}  {100 * ours_rate / floor:6.1f}  "
          f"{conc * 30 / t_drv:8.0f} ({n_tok})  {s_plain:7.2f}/{s_filt:7.2f}  {syncs:10.1f}  "
          f"{100 * busy:7.1f}%  {1000 * pre:15.2f}  {1000 * enc_hf:14.2f}", flush=True)


if __name__ == "__main__":
    main()
