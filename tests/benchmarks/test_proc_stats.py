"""The serving benchmarks' readings: CPU by role from /proc (an engine process found by its
stepping thread's OS name, audio workers as the other children) and the short-clip floor."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

BURN = """
import sys, time
from edserve.os_names import ENGINE_THREAD, name_os_thread
if sys.argv[1] == "engine":
    name_os_thread(ENGINE_THREAD)
t = time.process_time()
while time.process_time() - t < 0.4:
    pass
print("done", flush=True)
sys.stdin.read()  # stay alive (and readable in /proc) until the test closes stdin
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc")
def test_cpu_by_role_finds_the_engine_process():
    from proc_stats import cpu_delta, cpu_figures, engine_pid, thread_cpu

    before = thread_cpu(os.getpid())
    procs = [subprocess.Popen([sys.executable, "-c", BURN, role], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for role in ("engine", "audio")]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "done"
        assert engine_pid(os.getpid()) == procs[0].pid
        assert engine_pid(procs[1].pid) == procs[1].pid  # no engine below: the process itself
        cpu = cpu_delta(before, thread_cpu(os.getpid()))
    finally:
        for p in procs:
            p.communicate("", timeout=30)
    assert cpu["engine"] >= 0.3 and cpu["helpers"] >= 0.3  # each child burnt 0.4 s
    assert cpu["engine"] < 1.0 and cpu["helpers"] < 1.0  # and not counted twice
    figures = cpu_figures(cpu, requests=4, wall=2.0)
    assert figures["engine_cpu_ms_per_request"] == pytest.approx(250 * cpu["engine"])
    assert figures["engine_thread_busy"] == pytest.approx(cpu["engine"] / 2.0)
    assert set(figures) >= {"api_cpu_ms_per_request", "helpers_cpu_ms_per_request",
                            "engine_proc_cpu_ms_per_request"}


def test_short_clip_floor():
    import whisper_gpu as wg

    bw, flops = 4.27e12, 714e12  # an H200's measured copy and matmul rates
    plain = 32 / wg.floor_seconds("large-v3", 32, 17, bw, flops)
    full = 32 / wg.floor_seconds("large-v3", 32, 17, bw, flops, cross_kv=True)
    assert 220 < plain < 232  # 2.274 TFLOP per window + 17 steps' reads at 32 rows
    # the cross-K/V projection: 64 GEMMs of 1500 x 1280 x 1280 per request (~0.44 ms)
    assert 1000 * (32 / full - 32 / plain) / 32 == pytest.approx(
        1000 * 2 * 64 * 1500 * 1280**2 / flops, rel=1e-6)
    assert "226.5 req/s" in wg.short_floor("large-v3", 32, 17, bw, flops)
