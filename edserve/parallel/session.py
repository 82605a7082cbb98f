"""Rank 0's side of a tensor-parallel group: the follower processes, the process group, and
the mirrored calls (:meth:`TPSession.send`).

One session per process (the process group is process-wide), started by the first engine with
``--tensor-parallel-size N > 1`` and kept for later engines of the same size: a new engine
re-builds the followers' model shards (a ``build`` call) instead of restarting processes. Only
the latest engine may step; an older one raises :class:`TensorParallelError`.
"""

from __future__ import annotations

import atexit
import logging
import subprocess
import threading
from typing import Any

import torch
import torch.distributed as dist

from edserve.parallel.distributed import (
    destroy_group,
    free_port,
    init_group,
    rank_device,
    spawn_followers,
)
from edserve.parallel.errors import TensorParallelError
from edserve.parallel.wire import Message, send_tensors, specs_of, write_message

logger = logging.getLogger("edserve")


class TPSession:
    def __init__(self, world: int, device: torch.device) -> None:
        if world < 2:
            raise ValueError(f"a tensor-parallel session needs >= 2 ranks, got {world}")
        self.world = world
        self.device = rank_device(device, 0)
        port = free_port()
        self.procs: list[subprocess.Popen] = spawn_followers(world, self.device, port)
        try:
            self._join(port)
        except BaseException:
            self._stop_procs(timeout=5.0)
            raise
        self.generation = 0  # bumped by every build: the engine that may send calls
        self.calls = 0  # forward calls sent since the last build (followers count them too)

    def _join(self, port: int) -> None:
        """Join the group; a follower that exits while the others wait fails the start at
        once (instead of after the process-group timeout)."""
        done: list[BaseException | None] = []

        def join() -> None:
            try:
                init_group(0, self.world, self.device, port)
                done.append(None)
            except BaseException as exc:  # handed to the caller's thread
                done.append(exc)

        thread = threading.Thread(target=join, name="edserve-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            dead = [(r, p.poll()) for r, p in enumerate(self.procs, 1) if p.poll() is not None]
            if dead and thread.is_alive():
                rank, code = dead[0]
                raise TensorParallelError(f"tensor-parallel rank {rank} exited with code {code} "
                                          "while the group was starting (see its log above)")
        if done and done[0] is not None:
            raise done[0]

    # ---- calls ------------------------------------------------------------------------
    def send(self, kind: str, meta: dict[str, Any] | None = None,
             tensors: list[torch.Tensor] | None = None) -> None:
        """Hand one call to every follower: header over its pipe, tensors by broadcast."""
        tensors = tensors or []
        msg = Message(kind, meta or {}, specs_of(tensors))
        for rank, p in enumerate(self.procs, start=1):
            try:
                write_message(p.stdin, msg)
            except (BrokenPipeError, OSError) as exc:
                raise TensorParallelError(f"tensor-parallel rank {rank} is gone (exit code "
                                          f"{p.poll()}); restart the engine") from exc
        if tensors:
            send_tensors(tensors, self.device)

    def build(self, spec: dict[str, Any]) -> int:
        """Followers (re)build their model shard from ``spec``; returns the new generation."""
        self.generation += 1
        self.calls = 0
        self.send("build", spec)
        return self.generation

    def gather(self, kind: str, meta: dict[str, Any], mine: Any) -> list[Any]:
        """A reporting call (``check``, ``digest``): every rank's answer, in rank order (rank
        0's is ``mine``)."""
        self.send(kind, meta)
        reports: list[Any] = [None] * self.world
        dist.all_gather_object(reports, mine)
        return reports

    def check_followers(self) -> list[str]:
        """Every follower's integrity report (its own checks + its call count vs rank 0's);
        [] when all pass."""
        return [e for r in self.gather("check", {"calls": self.calls}, [])[1:] for e in r]

    # ---- shutdown ---------------------------------------------------------------------
    def _stop_procs(self, timeout: float) -> None:
        for p in self.procs:
            if p.stdin is not None and not p.stdin.closed:
                try:
                    p.stdin.close()  # EOF: the follower leaves the group and exits
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel follower %d did not exit; killing it", p.pid)
                p.kill()
                p.wait()

    def close(self, timeout: float = 30.0) -> None:
        self.generation = -1  # no engine of this session may send calls any more
        self._stop_procs(timeout)
        destroy_group()


_SESSION: TPSession | None = None


def get_session(world: int, device: torch.device) -> TPSession:
    """The process's session, started on first use (ranks 1..world-1 spawned)."""
    global _SESSION
    if _SESSION is not None and (_SESSION.world != world
                                 or _SESSION.device != rank_device(device, 0)):
        raise TensorParallelError(f"this process already runs a tensor-parallel group of "
                                  f"{_SESSION.world} on {_SESSION.device}; one group per "
                                  "process (call edserve.parallel.shutdown() first)")
    if _SESSION is None:
        _SESSION = TPSession(world, device)
        atexit.register(shutdown)
    return _SESSION


def shutdown() -> None:
    """Stop the followers and leave the process group (idempotent)."""
    global _SESSION
    if _SESSION is not None:
        session, _SESSION = _SESSION, None
        session.close()
