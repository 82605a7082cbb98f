"""Where an upload's log-mel is computed (edserve.server.feature_policy): the long-upload
threshold, every upload while the server is nearly idle, and the settings' resolution."""

from __future__ import annotations

import pytest

from edserve.server.config import ServerConfig
from edserve.server.feature_policy import FeaturePolicy


def test_idle_servers_send_every_upload_to_the_device_busy_ones_only_long_ones():
    policy = FeaturePolicy(30.0, 2)
    with policy.track():
        assert policy.defer_above_s() == 0.0  # 1 in flight
        with policy.track():
            assert policy.defer_above_s() == 0.0  # 2
            with policy.track():
                assert policy.defer_above_s() == 30.0  # 3: busy
    assert policy.in_flight == 0


def test_the_count_drops_when_a_request_fails():
    policy = FeaturePolicy(30.0, 0)
    with pytest.raises(RuntimeError), policy.track():
        assert policy.defer_above_s() == 30.0  # idle 0: only long uploads
        raise RuntimeError("engine error")
    assert policy.in_flight == 0


def test_no_device_log_mels_means_none_at_all():
    policy = FeaturePolicy(None, 5)
    with policy.track():
        assert policy.defer_above_s() is None
    with pytest.raises(ValueError, match=">= 0"):
        FeaturePolicy(30.0, -1)


def test_settings_resolve_per_device():
    assert ServerConfig().device_features_idle_max("cuda") == 2
    assert ServerConfig().device_features_idle_max("cpu") == 0
    assert ServerConfig(device_features_idle=0).device_features_idle_max("cuda") == 0
    assert ServerConfig(device_features_idle=4).device_features_idle_max("cpu") == 4
    with pytest.raises(ValueError, match="--device-features-idle"):
        ServerConfig(device_features_idle=-1)
