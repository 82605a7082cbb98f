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


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` plus its live descendant processes (audio workers, their
    forkserver; shared pages counted in each)."""
    total, todo = rss_bytes(pid), _children(pid)
    while todo:
        child = todo.pop()
        try:
            total += rss_bytes(child)
        except OSError:
            continue
        todo += _children(child)
    return total


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of ``pid``: ``engine`` (the edserve-engine thread),
    ``api`` (every other thread: event loop, uvicorn, decode threads when the audio pool is
    off) and ``helpers`` (its descendant processes: :func:`helpers_cpu`)."""
    out = {"engine": 0.0, "api": 0.0, "helpers": helpers_cpu(pid)}
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


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(c) for c in task.read_text().split()]
        except OSError:
            continue
    return out


def helpers_cpu(pid: int) -> float:
    """CPU seconds so far of every live descendant process of ``pid`` (the audio workers and
    their forkserver, data-parallel engine workers): work the server moved out of its own
    process."""
    total, todo = 0.0, _children(pid)
    while todo:
        child = todo.pop()
        try:
            fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK
        todo += _children(child)
    return total


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}
