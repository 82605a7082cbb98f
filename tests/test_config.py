"""The frozen engine config: validation at construction, field docs as --help."""

import argparse

import pytest

from edserve.config_args import add_config_args, config_from_args


def test_help_comes_from_field_docs():
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    text = parser.format_help()
    assert "--encoder-kv" in text and "token-slot indexing" in text
    assert "--page-size" in text and "backend's default" in text


def test_flags_round_trip_into_frozen_config():
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    cfg = config_from_args(parser.parse_args(["--page-size", "128", "--encoder-kv", "aligned",
                                              "--max-running-requests", "3"]))
    assert (cfg.page_size, cfg.encoder_kv, cfg.max_running_requests) == ("128", "aligned", 3)
    with pytest.raises(AttributeError):
        cfg.page_size = "1"
