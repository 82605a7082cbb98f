"""What grammar-constrained rows (``response_format`` JSON) cost a decode step.

Builds the tiny random Mllama with a byte-level chat tokenizer of ``--vocab`` tokens (the
mask work grows with the vocabulary: Llama 3's is 128256), then runs the same ``--rows``
image requests with and without a JSON schema whose one field is a free string (so rows run
to ``--tokens``), alternating, and prints per step: wall ms, the grammar rows' host time
(``GrammarFilter.apply_rows``: one sync, the matchers, one upload) and, on CUDA, the
host<->device syncs (``torch.cuda.set_sync_debug_mode``).

  python benchmarks/grammar_steps.py                       # CPU, vocab 128256, rows 1,8,32
  python benchmarks/grammar_steps.py --device cuda --json /tmp/grammar.json   # H200
  python benchmarks/grammar_steps.py --dry-run             # small vocab, 2 rows, a few tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMA = {"type": "json_schema", "json_schema": {"name": "note", "schema": {
    "type": "object", "required": ["text"], "additionalProperties": False,
    "properties": {"text": {"type": "string"}}}}}


def build(vocab: int, device: str):
    import copy

    from edserve.runtime import build_engine
    from tests.models.mllama.chat_tiny import save_byte_chat_tokenizer
    from tests.models.mllama.hf_tiny import TINY_CONFIG, build_hf_tiny, save_hf_tiny

    cfg = copy.deepcopy(TINY_CONFIG)
    cfg["text_config"]["vocab_size"] = vocab
    cfg["image_token_index"] = vocab
    folder = Path(tempfile.mkdtemp(prefix="grammar_steps_"))
    save_hf_tiny(build_hf_tiny(cfg), folder)
    save_byte_chat_tokenizer(folder, vocab)
    return build_engine(model=str(folder), device=device,
                        dtype="float32" if device == "cpu" else "bfloat16",
                        context_length=256, max_running_requests=64)


def run(engine, rows: int, tokens: int, json_mode: bool) -> dict:
    import torch

    from edserve.chat.chat_api import prepare_chat
    from edserve.chat.grammar_filter import GrammarFilter
    from tests.models.mllama.hf_tiny import synthetic_image

    msgs = [{"role": "user", "content": [{"type": "image", "image": synthetic_image(80, 40)},
                                         {"type": "text", "text": "note"}]}]
    reqs = [prepare_chat(engine, msgs, max_tokens=tokens, temperature=1.0, seed=i,
                         response_format=SCHEMA if json_mode else None)[0] for i in range(rows)]
    spent = [0.0]
    batched = GrammarFilter.apply_rows.__func__

    def timed(cls, fs, logits, ctx):
        t = time.perf_counter()
        batched(cls, fs, logits, ctx)
        spent[0] += time.perf_counter() - t

    GrammarFilter.apply_rows = classmethod(timed)
    try:
        cuda = engine.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.generate(reqs)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        GrammarFilter.apply_rows = classmethod(batched)
    steps = max(len(o.token_ids) for o in outs) + 1
    return {"rows": rows, "json": json_mode, "steps": steps, "ms_per_step": 1e3 * wall / steps,
            "grammar_ms_per_step": 1e3 * spent[0] / steps,
            "tokens": sum(len(o.token_ids) for o in outs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.vocab, args.rows, args.tokens, args.repeat = 1024, "2", 6, 1
    t = time.perf_counter()
    engine = build(args.vocab, args.device)
    print(f"engine on {args.device}, vocab {args.vocab}: built in {time.perf_counter() - t:.1f} s")
    results = []
    run(engine, 2, 4, True)  # warm: the llguidance vocabulary (~1 s at 128k) and the kernels
    for rows in (int(r) for r in args.rows.split(",")):
        for json_mode in (False, True):
            runs = [run(engine, rows, args.tokens, json_mode) for _ in range(args.repeat)]
            best = min(runs, key=lambda r: r["ms_per_step"])
            best["ms_per_step_median"] = statistics.median(r["ms_per_step"] for r in runs)
            results.append(best)
            print(f"rows {rows:3d} {'json' if json_mode else 'free'}: "
                  f"{best['ms_per_step']:7.2f} ms/step (median {best['ms_per_step_median']:.2f}),"
                  f" grammar {best['grammar_ms_per_step']:6.2f} ms/step, {best['steps']} steps")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "vocab": args.vocab,
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
