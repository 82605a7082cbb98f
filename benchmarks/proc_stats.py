"""Linux /proc readings of a server process for the serving benchmarks: resident memory and
CPU seconds by thread (the engine thread vs everything else: the API's share)."""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
ENGINE_THREAD = "edserve-engine"


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of ``pid``: ``engine`` (the edserve-engine thread)
    and ``api`` (every other thread: event loop, decode/feature workers, uvicorn)."""
    out = {"engine": 0.0, "api": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended
            continue
        fields = stat.rsplit(")", 1)[1].split()
        seconds = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
        out["engine" if name.startswith(ENGINE_THREAD[:15]) else "api"] += seconds
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}
