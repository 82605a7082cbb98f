"""edserve on Ray Serve: one engine per replica behind the same OpenAI routes.

:func:`build_app` returns a Serve application whose ingress deployment builds
``create_app(engine)`` in every replica (FastAPI ingress, built after the replica's engine has
loaded: Serve's ``__serve_build_asgi_app__``), so every route, limit and error shape is the
single-engine server's. Replicas ask Ray for ``num_gpus=1`` when the cluster has GPUs, else
``num_cpus`` = the engine's ``--threads`` (default 1). Serve's router sends a replica at most
``--max-running-requests`` requests at once (``max_ongoing_requests``; more wait in Serve's
queue); with ``min_replicas`` < ``max_replicas`` Serve autoscales between them, targeting
that many ongoing requests per replica. ``/metrics`` and ``/health`` answer per replica.

Every node needs edserve (and the model) installed; ``edserve serve-ray`` starts or joins Ray
(``--address``), deploys, and blocks until interrupted.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import ray
from ray import serve

from edserve.config import CPU_RUNNING_DEFAULT, GRAPH_MAX_BS_DEFAULT, EngineConfig
from edserve.server.config import ServerConfig

APP_NAME = "edserve"


@serve.ingress()
class EdserveReplica:
    """One engine and its app; Serve calls ``__serve_build_asgi_app__`` after ``__init__``."""

    def __init__(self, engine_config: dict[str, Any], server_config: dict[str, Any]) -> None:
        from edserve.engine.async_engine import AsyncEngine
        from edserve.runtime import build_engine

        self.server_config = ServerConfig(**server_config)
        self.aengine = AsyncEngine(build_engine(EngineConfig(**engine_config))).start()

    def __serve_build_asgi_app__(self) -> Any:
        from edserve.server.app import create_app

        return create_app(self.aengine, self.server_config)

    def __del__(self) -> None:
        aengine = getattr(self, "aengine", None)
        if aengine is not None:
            aengine.shutdown()


def replica_resources(engine_config: EngineConfig, num_gpus: float | None = None
                      ) -> dict[str, float]:
    """``ray_actor_options`` of one replica: ``num_gpus`` (default: 1 when the cluster has a
    GPU, else 0) and, on CPU, ``num_cpus`` = ``--threads`` (default 1)."""
    if num_gpus is None:
        num_gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    if num_gpus > 0:
        return {"num_gpus": num_gpus, "num_cpus": 1}
    return {"num_gpus": 0, "num_cpus": float(engine_config.threads or 1)}


def build_app(engine_config: EngineConfig, server_config: ServerConfig | None = None,
              replicas: int = 1, max_replicas: int | None = None,
              num_gpus: float | None = None) -> Any:
    """The Serve application (call after ``ray.init``): ``replicas`` fixed replicas, or
    autoscaling between ``replicas`` and ``max_replicas`` when that is larger."""
    server_config = server_config or ServerConfig()
    resources = replica_resources(engine_config, num_gpus)
    if resources["num_gpus"] == 0 and engine_config.threads is None:
        engine_config = engine_config.replace(threads=1, device="cpu")
    ongoing = engine_config.max_running_requests or (
        GRAPH_MAX_BS_DEFAULT if resources["num_gpus"] > 0 else CPU_RUNNING_DEFAULT)
    options: dict[str, Any] = {"ray_actor_options": resources, "max_ongoing_requests": ongoing}
    if max_replicas is not None and max_replicas > replicas:
        options["autoscaling_config"] = {
            "min_replicas": replicas, "max_replicas": max_replicas,
            "target_ongoing_requests": ongoing}
    else:
        options["num_replicas"] = replicas
    deployment = serve.deployment(EdserveReplica, name="edserve", **options)
    return deployment.bind(dataclasses.asdict(engine_config), dataclasses.asdict(server_config))


def run(engine_config: EngineConfig, server_config: ServerConfig, replicas: int = 1,
        max_replicas: int | None = None, address: str | None = None,
        num_gpus: float | None = None, blocking: bool = True) -> None:
    """Connect to (``address``) or start Ray, start Serve's HTTP proxy on the server config's
    host/port, deploy; with ``blocking`` wait until Ctrl-C, then delete the app."""
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False)
    serve.start(http_options={"host": server_config.host, "port": server_config.port})
    app = build_app(engine_config, server_config, replicas, max_replicas, num_gpus)
    serve.run(app, name=APP_NAME, route_prefix="/")
    if not blocking:
        return
    print(f"edserve: serving on http://{server_config.host}:{server_config.port} "
          f"({replicas} replica(s)); Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()
