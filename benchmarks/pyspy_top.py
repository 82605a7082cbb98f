"""Where a process's Python CPU goes, from ``py-spy`` (a sampling profiler run from outside).

``record(pid, seconds, path)`` starts ``py-spy record --format raw`` on ``pid`` (its threads,
not its children; idle samples are left out by py-spy); ``top(path)`` prints the frames with
the most samples: by own time, and edserve's frames by inclusive time. Used by
``serve_gpu.py --py-spy`` on the API process of ``edserve serve`` under load.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path


def record(pid: int, seconds: float, path: Path, rate: int = 500) -> subprocess.Popen | None:
    exe = shutil.which("py-spy") or str(Path(sys.prefix) / "bin" / "py-spy")
    if not Path(exe).exists() and shutil.which("py-spy") is None:
        print("# py-spy not installed: no profile", flush=True)
        return None
    return subprocess.Popen([exe, "record", "-p", str(pid), "-d", str(math.ceil(seconds)),
                             "-r", str(rate), "-f", "raw", "-o", str(path), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def top(path: Path, n: int = 25, width: int = 110) -> None:
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, k = stack.split(";"), int(count)
        total += k
        own[frames[-1]] += k
        for f in set(frames):
            if "edserve/" in f:
                incl[f] += k
    print(f"# py-spy: {total} active samples")
    print("| own samples | share | frame |\n|---:|---:|---|")
    for f, k in own.most_common(n):
        print(f"| {k} | {100 * k / max(1, total):.1f} % | `{f[:width]}` |")
    print("| edserve inclusive | share | frame |\n|---:|---:|---|")
    for f, k in incl.most_common(n):
        print(f"| {k} | {100 * k / max(1, total):.1f} % | `{f[:width]}` |")


if __name__ == "__main__":
    top(Path(sys.argv[1]))
