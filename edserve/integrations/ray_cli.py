"""``edserve serve-ray [server and engine flags] --replicas N [--max-replicas M]
[--address ray://... | auto]``."""

from __future__ import annotations

import argparse

from edserve.config import EngineConfig
from edserve.config_args import add_config_args, config_from_args


def add_serve_ray(sub: argparse._SubParsersAction) -> None:
    from edserve.server.config import ServerConfig

    p = sub.add_parser("serve-ray", help="The OpenAI-compatible server on Ray Serve, one "
                       "engine per replica (pip install 'edserve[ray]').")
    add_config_args(p, ServerConfig, skip=("data_parallel_size", "engine_process"))
    add_config_args(p, EngineConfig)
    p.add_argument("--replicas", type=int, default=1,
                   help="Replicas (engines); the minimum when --max-replicas is larger.")
    p.add_argument("--max-replicas", type=int, default=None,
                   help="Autoscale up to this many replicas (default: --replicas, fixed).")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join ('auto': the one `ray start --head` started on "
                   "this machine; ray://host:10001); default: start a local Ray.")
    p.add_argument("--num-gpus", type=float, default=None,
                   help="GPUs per replica (default: 1 when the cluster has GPUs, else 0).")

    def check(args: argparse.Namespace) -> None:
        from edserve.server.config import server_flags_error

        if message := server_flags_error(args):
            p.error(message)

    p.set_defaults(func=_run, check=check)


def _run(args: argparse.Namespace) -> int:
    from edserve.integrations.ray_serve import run
    from edserve.server.config import ServerConfig

    run(config_from_args(args, EngineConfig), config_from_args(args, ServerConfig),
        args.replicas, args.max_replicas, args.address, args.num_gpus)
    return 0
