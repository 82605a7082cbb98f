"""A change to the compiled CPU decode step, on and off, alternating in one process: the embedded
tiny.en on jfk, ms per decode step (medians over ``--rounds``) and whether the text is equal.

Changes (``--change``):

* ``aot``: each graph called as ``aot_compile``'s function, without dynamo's frame hook or
  guards (``CompiledDecodeRunner._compile``); ``off`` calls it through dynamo, evaluating only
  the guards that tell cached graphs apart (``skip_guard_eval_unsafe``, waves 28-30; wave 28's
  ``guards`` A/B measured that stance against every guard).
* ``cross-view``: each clip's encoder region read as a view of the KV pool (``_cross_anchors``);
  ``off`` gathers its 1500 K and V rows every layer and step (the step before that change).
* ``boxed``: fbgemm's dynamic int8 linear called through the dispatcher's boxed call
  (``quantize._LINEAR_DYNAMIC_CALL``); ``off`` calls the op overload's C++ callable ``_op``.
* ``sampling``: the step's sampling inside its compiled graph (``cpu_sample.SamplingKeys``);
  ``off`` samples the graph's logits eagerly.
* ``native``: int8 linears called in the graphs as the native op ``edserve_int8::linear``
  (``models/int8_native.py``); ``off`` through the opaque op (a Python kernel).
* ``cpp-wrapper``: graphs compiled with inductor's C++ wrapper
  (``CompiledDecodeRunner.cpp_wrapper``); ``off``: its Python wrapper.

Changes that alter what is compiled (``native``, ``cpp-wrapper``) compile every variant twice,
once each way, and call the graph of the side being timed.

  python benchmarks/cpu_step_ab.py [--change cross-view] [--mode int8] [--beam 1] [--rounds 10]
  python benchmarks/cpu_step_ab.py --clips 4     # four clips transcribed together
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Callable, Iterator

import cpu_step as cs


@contextlib.contextmanager
def _patched(owner: object, name: str, wrap: Callable) -> Iterator[None]:
    """``owner.name`` replaced by ``wrap(original)`` while the block runs."""
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _aot(state: dict) -> contextlib.AbstractContextManager:
    import types

    import torch

    from edserve.engine import cpu_compile

    runner_cls = cpu_compile.CompiledDecodeRunner

    def compile_both(make):
        def compile_(self, variant, example):
            aot = make(self, variant, example)
            # through dynamo: a code object per variant, so its cache holds that graph alone
            # and the unsafe stance (after the first call, which compiles) cannot pick another
            code = types.FunctionType(runner_cls._forward.__code__.replace(),
                                      runner_cls._forward.__globals__, "_forward")
            options = {"cpp_wrapper": self.cpp_wrapper} if self.compiler == "inductor" \
                else None
            hooked = torch.compile(types.MethodType(code, self), backend=self.compiler,
                                   dynamic=False, options=options)
            called = []

            def call(*args):
                if state["on"]:
                    return aot(*args)
                if not called:
                    called.append(True)
                    return hooked(*args)
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    return hooked(*args)
            return call
        return compile_

    return _patched(runner_cls, "_compile", compile_both)


def _cross_view(state: dict) -> contextlib.AbstractContextManager:
    from edserve.engine import cpu_compile

    return _patched(cpu_compile.CompiledDecodeRunner, "_cross_anchors",
                    lambda anchors: lambda self, batch, g, w:
                    anchors(self, batch, g, w) if state["on"] else None)


def _boxed(state: dict) -> contextlib.AbstractContextManager:
    from edserve.models import quantize

    plain = getattr(quantize._LINEAR_DYNAMIC, "_op", quantize._LINEAR_DYNAMIC)
    return _patched(quantize, "_LINEAR_DYNAMIC_CALL",
                    lambda boxed: lambda x, packed, reduce_range:
                    (boxed if state["on"] else plain)(x, packed, reduce_range))


def _sampling(state: dict) -> contextlib.AbstractContextManager:
    from edserve.engine import cpu_sample

    return _patched(cpu_sample.SamplingKeys, "plan_for",
                    lambda plan_for: lambda self, plan, rows:
                    plan_for(self, plan, rows) if state["on"] else None)


def _both_graphs(state: dict, compiling: Callable[[bool], contextlib.AbstractContextManager]
                 ) -> contextlib.AbstractContextManager:
    """Each variant compiled twice, inside ``compiling(on)`` for on and off; calls run the
    graph of ``state["on"]``."""
    from edserve.engine import cpu_compile

    def compile_both(make):
        def compile_(self, variant, example):
            graphs, index = {}, self.index
            for on in (True, False):
                self.index = index if on else index + 1000  # graph names apart
                with compiling(on):
                    graphs[on] = make(self, variant, example)
            self.index = index
            return lambda *args: graphs[state["on"]](*args)
        return compile_

    return _patched(cpu_compile.CompiledDecodeRunner, "_compile", compile_both)


def _native(state: dict) -> contextlib.AbstractContextManager:
    from edserve.models.opaque_linear import OpaqueLinear
    from edserve.models.quantize import Int8Linear

    tracing = {"on": True}
    stack = contextlib.ExitStack()
    stack.enter_context(_patched(Int8Linear, "compiled", lambda native: lambda self, x:
                                 native(self, x) if tracing["on"]
                                 else OpaqueLinear.compiled(self, x)))
    stack.enter_context(_both_graphs(state, lambda on: _patched_dict(tracing, "on", on)))
    return stack


def _cpp_wrapper(state: dict) -> contextlib.AbstractContextManager:
    from edserve.engine import cpu_compile

    return _both_graphs(state, lambda on: _patched(cpu_compile.CompiledDecodeRunner,
                                                   "cpp_wrapper", lambda _: on))


@contextlib.contextmanager
def _patched_dict(d: dict, key: str, value) -> Iterator[None]:
    saved = d[key]
    d[key] = value
    try:
        yield
    finally:
        d[key] = saved


CHANGES: dict[str, Callable[[dict], contextlib.AbstractContextManager]] = {
    "aot": _aot, "cross-view": _cross_view, "boxed": _boxed, "sampling": _sampling,
    "native": _native, "cpp-wrapper": _cpp_wrapper}


def build(mode: str, beam: int, threads: int, clips: int):
    """``fn(audios) -> texts`` on a compiling engine with ``clips x beam`` rows; its clock."""
    from edserve.runtime import build_engine
    from edserve.whisper.options import TranscribeOptions
    from edserve.whisper.transcribe import transcribe

    dtype, quantization = cs.MODES[mode]
    engine = build_engine(device="cpu", threads=threads, max_running_requests=clips * beam,
                          dtype=dtype, quantization=quantization, cpu_compile="on")
    opts = TranscribeOptions(language="en", temperatures=(0.0,), timestamps=False,
                             beam_size=beam)
    clock = cs.StepClock(engine)
    return (lambda audios: tuple(r.text for r in transcribe(engine, audios, options=opts))), clock


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--change", default="cross-view", choices=sorted(CHANGES))
    ap.add_argument("--mode", default="int8", choices=sorted(cs.MODES))
    ap.add_argument("--beam", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clips", type=int, default=1,
                    help="clips transcribed together (1: jfk; N: the first N of cpu_whisper's)")
    args = ap.parse_args(argv)
    state = {"on": True}
    with CHANGES[args.change](state):
        return _run(args, state)


def _run(args, state: dict) -> int:
    if args.clips == 1:
        audio = [cs._jfk()]
    else:
        from cpu_whisper import clips

        from edserve.audio.decode import load_audio

        audio = [load_audio(p) for p in clips()[:args.clips]]
    fn, clock = build(args.mode, args.beam, args.threads, len(audio))
    for on in (True, False):  # both variants compiled and warm before timing
        state["on"] = on
        fn(audio)
        fn(audio)
    ms: dict[str, list[float]] = {"off": [], "on": []}
    texts: dict[str, set[tuple[str, ...]]] = {"off": set(), "on": set()}
    for _ in range(args.rounds):
        for name in ms:
            state["on"] = name == "on"
            clock.reset()
            texts[name].add(fn(audio))
            ms[name].append(1e3 * clock.mean_decode_s())
    print(f"# {cs.cpu_description()}; {args.change}; {args.mode}, beam {args.beam}, "
          f"{'jfk' if args.clips == 1 else f'{args.clips} clips together'}, "
          f"{args.rounds} rounds")
    for name, v in ms.items():
        print(f"{name}: median {statistics.median(v):.2f} ms/step; "
              + " ".join(f"{x:.2f}" for x in v))
    print("text equal:", texts["off"] == texts["on"] and len(texts["on"]) == 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
