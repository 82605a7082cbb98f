"""Build the data-parallel server: workers started, the app around their client."""

from __future__ import annotations

import logging
from typing import Any

from edserve.config import EngineConfig
from edserve.dp.app import create_dp_app
from edserve.dp.client import DataParallelClient
from edserve.server.config import ServerConfig


def build_dp(engine_config: EngineConfig, server_config: ServerConfig
             ) -> tuple[DataParallelClient, Any]:
    """Start ``server_config.data_parallel_size`` workers of ``engine_config`` (the caller
    shuts the client down) and build the app."""
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    client = DataParallelClient(engine_config, server_config.data_parallel_size,
                                server_config.served_model_name, log_level=level,
                                held_mel_bytes=server_config.held_log_mel_mb << 20).start()
    return client, create_dp_app(client, server_config)
