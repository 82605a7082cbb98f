"""Start the server: ``serve`` (blocking, for ``edserve serve``) and :class:`ServerThread`
(uvicorn in a background thread on an already-bound socket, for tests and embedding)."""

from __future__ import annotations

import dataclasses
import signal
import socket
import threading
import time
from typing import Any

import uvicorn

from edserve.config import EngineConfig
from edserve.engine.async_engine import AsyncEngine
from edserve.models.weights import model_type_of
from edserve.runtime import build_engine
from edserve.runtime.settings import resolve_device
from edserve.server.app import create_app
from edserve.server.config import DEFAULT_MODEL_NAME, ServerConfig
from edserve.server.connections import connection_cap, guarded_protocol, install_log_limits


def build(engine_config: EngineConfig, server_config: ServerConfig) -> tuple[Any, Any]:
    """Load the engine, start its loop, and build the app around it; returns (the engine or
    client, with ``shutdown(timeout)``, the app). With ``data_parallel_size`` > 1 or an
    engine process (:func:`engine_process`): a started
    :class:`~edserve.dp.client.DataParallelClient` over that many worker processes. The audio
    workers (``--audio-workers``) are started here too."""
    server_config = with_model_name(engine_config, server_config)
    if server_config.data_parallel_size > 1 or engine_process(engine_config, server_config):
        from edserve.dp.launch import build_dp

        engine, app = build_dp(engine_config, server_config)
    else:
        engine = AsyncEngine(build_engine(engine_config)).start()
        app = create_app(engine, server_config)
    if app.state.engine.n_mels is not None:  # a Whisper model: uploads to come
        app.state.audio.start()  # warm audio workers before the first upload
    return engine, app


def with_model_name(engine_config: EngineConfig, server_config: ServerConfig) -> ServerConfig:
    """``server_config`` with ``--served-model-name`` resolved: as given, else ``whisper-1``
    for a Whisper model (what OpenAI's audio clients send) and the ``--model`` value for any
    other (a Llama-3.2-Vision folder reports its path, as vLLM does)."""
    if server_config.served_model_name is not None:
        return server_config
    whisper = engine_config.model is None or model_type_of(engine_config.model) == "whisper"
    name = DEFAULT_MODEL_NAME if whisper else str(engine_config.model)
    return dataclasses.replace(server_config, served_model_name=name)


def engine_process(engine_config: EngineConfig, server_config: ServerConfig) -> bool:
    """``--engine-process`` resolved: as given, or (unset) on for a Whisper model on one CUDA
    device, where the engine loop's host work and the HTTP handlers' would share one GIL
    (measured on an H200 at 32 clients: 93.7 requests/s in a worker process, 61.8 on a
    thread); off on CPU, for several GPUs (tensor parallel) and for other models."""
    if server_config.engine_process is not None:
        return server_config.engine_process
    return resolve_device(engine_config.device).type == "cuda" \
        and engine_config.tensor_parallel_size == 1 \
        and model_type_of(engine_config.model) == "whisper"


def uvicorn_options(cfg: ServerConfig) -> dict[str, Any]:
    """Timeouts and connection limits for ``uvicorn.Config`` (see :mod:`.connections`)."""
    cap = connection_cap(cfg.max_connections)
    install_log_limits()
    return {"http": guarded_protocol(cfg.header_timeout, cap, cfg.http), "limit_concurrency": cap,
            "timeout_keep_alive": cfg.timeout_keep_alive, "ws": "none",
            "timeout_graceful_shutdown": cfg.drain_timeout}


def serve(engine_config: EngineConfig, server_config: ServerConfig,
          log_level: str = "info") -> None:
    """:func:`build`, then :func:`run_built`."""
    run_built(*build(engine_config, server_config), server_config, log_level)


def run_built(aengine: Any, app: Any, server_config: ServerConfig,
              log_level: str = "info") -> None:
    """Run until SIGINT/SIGTERM: uvicorn stops accepting and waits for in-flight requests
    (at most ``drain_timeout`` s), then the engine (or every data-parallel worker) stops."""
    # uvicorn re-raises the signal it handled once it has shut down; without these handlers
    # that would kill the process before the engine and its workers are stopped.
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.run(app, host=server_config.host, port=server_config.port,
                    log_level=log_level.lower(), **uvicorn_options(server_config))
    finally:
        aengine.shutdown(server_config.drain_timeout)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class ServerThread:
    """Run ``app`` with uvicorn on ``host`` in a daemon thread; ``port`` 0 picks a free one.
    Timeouts and limits come from ``app.state.config``."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level,
                                **uvicorn_options(app.state.config))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="edserve-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
