"""Linux /proc readings of a server process for the serving benchmarks: resident memory and
CPU seconds by role (the engine's stepping thread, the rest of an engine process, the API
process, the audio workers)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from edserve.os_names import ENGINE_THREAD

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` plus its live descendant processes (audio workers, their
    forkserver; shared pages counted in each)."""
    total = rss_bytes(pid)
    for child in _descendants(pid):
        try:
            total += rss_bytes(child)
        except OSError:  # it ended
            continue
    return total


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of ``pid`` and its descendant processes, by role:

    ``engine``       the edserve-engine thread (the stepping loop), in ``pid`` itself or in an
                     engine process (``--engine-process``, data-parallel workers)
    ``engine_proc``  the other threads of such an engine process (its I/O, torch's pools)
    ``api``          every other thread of ``pid`` (event loop, uvicorn, decode threads when
                     the audio pool is off)
    ``helpers``      every other descendant process (the audio workers, their forkserver)
    """
    out = {"engine": 0.0, "engine_proc": 0.0, "api": 0.0, "helpers": 0.0}
    for name, seconds in _threads(pid):
        out["engine" if _is_engine(name) else "api"] += seconds
    for child in _descendants(pid):
        threads = _threads(child)
        engine_proc = any(_is_engine(name) for name, _ in threads)
        for name, seconds in threads:
            role = "engine" if _is_engine(name) else "engine_proc" if engine_proc else "helpers"
            out[role] += seconds
    return out


def _is_engine(thread_name: str) -> bool:
    return thread_name.startswith(ENGINE_THREAD[:15])  # the kernel keeps 15 characters


def _threads(pid: int) -> list[tuple[str, float]]:
    """(name, CPU seconds) of each live thread of ``pid`` (none once it has ended)."""
    out = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out.append((name, (int(fields[11]) + int(fields[12])) / TICK))  # utime, stime
    return out


def _descendants(pid: int) -> Iterator[int]:
    """The live processes below ``pid``, depth first (a process that ends meanwhile, and its
    children, are skipped)."""
    todo = _children(pid)
    while todo:
        child = todo.pop()
        yield child
        todo += _children(child)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(c) for c in task.read_text().split()]
        except OSError:
            continue
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def cpu_figures(delta: dict[str, float], requests: int, wall: float) -> dict[str, float]:
    """A :func:`thread_cpu` delta as the serving benchmarks report it: milliseconds of CPU per
    request by role (``<role>_cpu_ms_per_request``) and the stepping thread's busy share of
    the wall. Below 1, the thread idles; near 1 it either works or spin-waits for the device
    (CUDA's default wait burns CPU): a py-spy of it (``serve_gpu.py --py-spy-target engine``)
    tells which, by the share of samples in the step's fetch of the sampled tokens."""
    out = {f"{role}_cpu_ms_per_request": 1000 * s / max(1, requests) for role, s in delta.items()}
    out["engine_thread_busy"] = delta["engine"] / wall if wall > 0 else float("nan")
    return out


def engine_pid(pid: int) -> int:
    """The process whose thread steps the engine: an engine process below ``pid`` (its main
    thread carries the engine thread's name), else ``pid`` itself (the in-process engine)."""
    return next((child for child in _descendants(pid)
                 if any(_is_engine(name) for name, _ in _threads(child))), pid)
