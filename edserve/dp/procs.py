"""Starting and stopping worker processes (``python -m edserve.dp.worker``).

Each worker starts in its own session (a terminal's Ctrl-C reaches only the API process, which
drains and then stops the workers), with the environment of its :class:`Placement`
(``CUDA_VISIBLE_DEVICES``), and dies with its parent (see :mod:`edserve.dp.worker`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from edserve.dp.placement import Placement


def spawn(index: int, placement: Placement, up: str, down: str,
          log_level: str = "WARNING") -> subprocess.Popen:
    """Start worker ``index`` connected to the ``up``/``down`` endpoints."""
    config = json.dumps(dataclasses.asdict(placement.config))
    cmd = [sys.executable, "-m", "edserve.dp.worker", "--index", str(index), "--up", up,
           "--down", down, "--config", config, "--parent-pid", str(os.getpid()),
           "--log-level", log_level]
    env = {**os.environ, **placement.env}
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)


def stop(proc: subprocess.Popen, timeout: float) -> int | None:
    """Wait up to ``timeout`` s for ``proc`` to exit, then SIGKILL it; its exit code."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            return proc.wait(5.0)
        except subprocess.TimeoutExpired:
            return None
