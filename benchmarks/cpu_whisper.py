"""edserve vs HF transformers on CPU: the embedded tiny.en, the bundled clips, same process.

Both run greedy float32 decoding of the same log-mels with the same weights until end of text.
Reports wall time per clip (one at a time) and for the whole batch, and checks that both
systems produce the same tokens.

  python benchmarks/cpu_whisper.py [--repeat 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from edserve.audio.decode import load_audio
from edserve.audio.mel import whisper_features
from edserve.engine.engine import Engine
from edserve.engine.request import GenerateRequest
from edserve.models.weights import load_checkpoint

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
CLIPS = ["jfk", "librivox_0870", "cards_005"]
PROMPT = [50257, 50362]


def hf_model():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    ckpt = load_checkpoint(None)
    model = WhisperForConditionalGeneration(WhisperConfig(**ckpt.config)).eval()
    model.load_state_dict({k: v.float() for k, v in ckpt.state_dict.items()}, strict=False)
    model.tie_weights()
    model.generation_config.eos_token_id = 50256
    model.generation_config.pad_token_id = 50256
    return model


def hf_generate(model, feats: torch.Tensor) -> list[list[int]]:
    from transformers.generation.utils import GenerationMixin

    prompt = torch.tensor([PROMPT] * feats.shape[0])
    with torch.inference_mode():
        out = GenerationMixin.generate(model, input_features=feats, decoder_input_ids=prompt,
                                       max_new_tokens=200, do_sample=False)
    rows = out[:, len(PROMPT):].tolist()
    return [r[: r.index(50256)] if 50256 in r else r for r in rows]


def ours_generate(engine: Engine, feats: torch.Tensor) -> list[list[int]]:
    outs = engine.generate([GenerateRequest(PROMPT, f) for f in feats])
    return [o.token_ids for o in outs]


def timed(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    feats = torch.stack([whisper_features(load_audio(DATA / f"{c}.wav"), 80) for c in CLIPS])
    hf = hf_model()
    engine = Engine(device="cpu")
    hf_generate(hf, feats[:1])  # warm-up
    ours_generate(engine, feats[:1])
    print(f"# CPU threads {args.threads}; median of {args.repeat}; greedy fp32, until EOT")
    print(f"{'input':16s} {'tokens':>6s} {'HF s':>7s} {'edserve s':>9s} {'speed-up':>8s} same")
    for i, clip in enumerate(CLIPS):
        t_hf, r_hf = timed(lambda i=i: hf_generate(hf, feats[i:i + 1]), args.repeat)
        t_ed, r_ed = timed(lambda i=i: ours_generate(engine, feats[i:i + 1]), args.repeat)
        print(f"{clip:16s} {len(r_ed[0]):6d} {t_hf:7.3f} {t_ed:9.3f} {t_hf / t_ed:7.2f}x "
              f"{r_hf == r_ed}")
    t_hf, r_hf = timed(lambda: hf_generate(hf, feats), args.repeat)
    t_ed, r_ed = timed(lambda: ours_generate(engine, feats), args.repeat)
    print(f"{'batch of 3':16s} {sum(map(len, r_ed)):6d} {t_hf:7.3f} {t_ed:9.3f} "
          f"{t_hf / t_ed:7.2f}x {r_hf == r_ed}")
    engine.check_integrity()


if __name__ == "__main__":
    main()
