"""The edserve side of ``mllama_gpu.py``: requests, timed runs, decode-step measurements
(synced and back to back, syncs, GPU busy, the kernel table) and the weight + K/V read floor.

Every decode-step figure is taken with every request of the batch running (prefilled first by
:func:`start_decoding`), after the timed generation run of the same batch.
"""

from __future__ import annotations

import time

import torch
from mllama_hf import sync  # imported from mllama_gpu.py, which puts benchmarks/ on the path
from whisper_gpu import median_step_ms, step_gpu_busy, step_kernels, step_syncs

from edserve.engine.step_stats import STEP_KINDS


def requests(engine, case_list, new_tokens: int):
    from edserve.chat.mllama_request import make_mllama_request
    from edserve.engine.request import SamplingParams

    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    return [make_mllama_request(engine.model, p, imgs, sp) for p, imgs in case_list]


def run_edserve(engine, case_list, new_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy tokens and seconds in ``generate`` (preprocessing is done before the clock);
    ``engine.last_steps`` becomes the run's steps by kind (``StepCounters`` delta)."""
    reqs = requests(engine, case_list, new_tokens)
    dev = str(engine.device)
    before = engine.step_counters.snapshot()
    sync(dev)
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    sync(dev)
    dt = time.perf_counter() - t0
    after = engine.step_counters.snapshot()
    engine.last_steps = {k: (after[k].steps - before[k].steps,
                             after[k].seconds - before[k].seconds) for k in STEP_KINDS}
    engine.check_integrity()
    assert all(len(o.token_ids) == new_tokens for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs], dt


def start_decoding(engine, case_list, steps: int) -> None:
    """Submit ``case_list`` with room for ``steps`` timed steps; prefill until every request
    is decoding."""
    for r in requests(engine, case_list, steps + 12):
        engine.add_request(r)
    engine.step()
    while engine.scheduler.waiting:
        engine.step()


def finish(engine) -> None:
    while engine.has_work():
        engine.step()
    engine.check_integrity()


def overlapped_step_ms(engine, steps: int) -> float:
    """Mean interval (ms) of ``steps`` back-to-back decode steps as the engine runs them (with
    overlap scheduling the host prepares step N+1 while the device runs step N), unlike
    :func:`median_step_ms`, which syncs around every step."""
    dev = str(engine.device)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(dev)
    return 1000 * (time.perf_counter() - t0) / steps


def decode_stats(engine, case_list, steps: int) -> dict:
    """Decode step ms (median synced, and back-to-back), syncs per step and GPU busy share,
    every request running."""
    start_decoding(engine, case_list, 3 * steps)
    dev = str(engine.device)
    out = dict(step_ms=median_step_ms(engine, dev, steps),
               overlapped_step_ms=overlapped_step_ms(engine, steps), syncs_per_step=None,
               gpu_busy=None)
    if dev.startswith("cuda"):
        out["syncs_per_step"] = len(step_syncs(engine, 4)) / 4
        out["gpu_busy"] = step_gpu_busy(engine, steps)
    finish(engine)
    return out


@torch.inference_mode()
def engine_vision_seconds(model, image_inputs: list) -> float:
    dev = str(model.lm_head.weight.device)
    sync(dev)
    t0 = time.perf_counter()
    model.encode(image_inputs)
    sync(dev)
    return time.perf_counter() - t0


def text_weight_bytes(hf) -> int:
    """Weights a decode step reads: the text layers, final norm and lm_head (no embedding)."""
    return sum(p.numel() * p.element_size() for k, p in hf.named_parameters()
               if ("language_model" in k and "embed_tokens" not in k) or "lm_head" in k)


def floor_ms(d: dict, w: int, case_list: list, tiles: list[int], bw: float) -> float:
    """Bytes one decode step must read (``w`` weight bytes, self KV of every row, cross KV of
    the image rows' valid tiles) / copy bandwidth."""
    per_tok = d["kv"] * (d["hidden"] // d["heads"]) * 2 * 2  # K and V, bf16, one layer
    P = (d["image"] // 14) ** 2 + 1
    self_layers, cross_layers = d["layers"] - len(d["cross"]), len(d["cross"])
    kv = sum(self_layers * per_tok * (len(p) + 16) for p, _ in case_list)
    kv += sum(cross_layers * per_tok * P * t for t in tiles)
    return 1000 * (w + kv) / bw


def profile_step(engine, case_list, steps: int = 4, top: int = 15) -> None:
    """The CUDA kernels of ``steps`` decode steps with every request running, by device time
    per step, and the device time of a whole step."""
    start_decoding(engine, case_list, steps)
    for _ in range(2):
        engine.step()
    lines, device_ms = step_kernels(engine, steps, top, with_total=True)
    print(f"# decode step kernels, {len(case_list)} rows: device {device_ms:.2f} ms per step",
          flush=True)
    for line in lines:
        print("#  ", line, flush=True)
    finish(engine)
