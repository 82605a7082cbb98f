"""What a CPU engine's start-up imports: Triton (~0.2 s of a short CLI run's start-up) only
where a kernel is used, never for the embedded default on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_cpu_engine_does_not_import_triton(random_whisper):
    code = ("import sys\nfrom edserve.runtime import build_engine\n"
            f"e = build_engine(model={str(random_whisper)!r}, device='cpu', beam_on_device=True)\n"
            "assert e.scheduler.beams.state.choice == 'ops'\n"
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
