"""Process-group set-up and tear-down for the ranks of one host (NCCL on CUDA, gloo on CPU).

Rank 0 is the caller's process (it hosts the engine); ranks 1..N-1 are follower processes
(``python -m edserve.parallel.follower``) that :func:`spawn_followers` starts with their rank,
the world size, ``MASTER_ADDR=127.0.0.1`` and a free port in the environment. A follower's stdin
is the pipe rank 0 writes its calls to (:mod:`edserve.parallel.wire`).
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

ENV_RANK, ENV_WORLD, ENV_DEVICE = "EDSERVE_TP_RANK", "EDSERVE_TP_WORLD", "EDSERVE_TP_DEVICE"
ENV_TIMEOUT = "EDSERVE_TP_TIMEOUT_S"  # collectives and start-up (default 600 s)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``r`` runs on ``cuda:(i + r)`` when rank 0 runs on ``cuda:i``; on CPU, the CPU."""
    if device.type != "cuda":
        return torch.device("cpu")
    first = device.index if device.index is not None else 0
    if first + rank >= torch.cuda.device_count():
        raise ValueError(f"tensor-parallel rank {rank} needs cuda:{first + rank}, but this host "
                         f"has {torch.cuda.device_count()} GPUs")
    return torch.device("cuda", first + rank)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def spawn_followers(world: int, device: torch.device, port: int) -> list[subprocess.Popen]:
    """Start ranks 1..world-1; each reads its calls from its stdin pipe."""
    procs = []
    for rank in range(1, world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   **{ENV_RANK: str(rank), ENV_WORLD: str(world),
                      ENV_DEVICE: str(rank_device(device, rank))})
        procs.append(subprocess.Popen([sys.executable, "-m", "edserve.parallel.follower"],
                                      stdin=subprocess.PIPE, env=env))
    return procs


def init_group(rank: int, world: int, device: torch.device, port: int) -> None:
    """Join the default process group at ``127.0.0.1:port`` (blocks until every rank has
    joined)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=float(os.environ.get(ENV_TIMEOUT, "600")))
    dist.init_process_group(backend_for(device), rank=rank, world_size=world, timeout=timeout,
                            init_method=f"tcp://127.0.0.1:{port}")


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
