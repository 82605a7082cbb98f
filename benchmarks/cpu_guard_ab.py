"""The compiled CPU decode step with and without dynamo's full guard check, alternating in one
process: ``CompiledDecodeRunner.replay`` checks only the guards that tell its cached graphs
apart once a key is compiled (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``);
``full`` runs the same engine with every guard checked (the step before that change). Embedded
tiny.en on jfk, ms per decode step (medians over ``--rounds``), and whether the text is equal.

  python benchmarks/cpu_guard_ab.py [--mode int8] [--beam 1] [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import cpu_step as cs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="int8", choices=sorted(cs.MODES))
    ap.add_argument("--beam", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from edserve.engine import cpu_compile

    skipping = cpu_compile.CompiledDecodeRunner.replay
    state = {"full": False}

    def replay(self, batch, input_ids):
        if state["full"]:  # every guard: the compiled key's first-call path
            self.compiled.discard(key := self.key(batch))
            try:
                return skipping(self, batch, input_ids)
            finally:
                self.compiled.add(key)
        return skipping(self, batch, input_ids)

    cpu_compile.CompiledDecodeRunner.replay = replay
    try:
        return _run(args, state)
    finally:
        cpu_compile.CompiledDecodeRunner.replay = skipping


def _run(args, state: dict) -> int:
    audio = cs._jfk()
    fn, clock = cs.build(args.mode, args.beam, True, args.threads)
    fn(audio)
    fn(audio)  # compiled, warm
    ms: dict[str, list[float]] = {"full": [], "skip": []}
    texts: dict[str, set[str]] = {"full": set(), "skip": set()}
    for _ in range(args.rounds):
        for name in ms:
            state["full"] = name == "full"
            clock.reset()
            texts[name].add(fn(audio))
            ms[name].append(1e3 * clock.mean_decode_s())
    print(f"# {cs.cpu_description()}; {args.mode}, beam {args.beam}, jfk, {args.rounds} rounds")
    for name, v in ms.items():
        print(f"{name}: median {statistics.median(v):.2f} ms/step; "
              + " ".join(f"{x:.2f}" for x in v))
    print("text equal:", texts["full"] == texts["skip"] and len(texts["skip"]) == 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
