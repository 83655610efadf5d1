"""Flags, environment fallbacks and refused combinations."""
from __future__ import annotations

import argparse

import pytest

from decode_worker.config import ConfigError, add_config_args, config_from_args


def parse(argv, monkeypatch=None, env=None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return config_from_args(parser.parse_args(argv))


def test_defaults_and_flags():
    cfg = parse(["--role", "decode", "--disaggregation-decode-enable-radix-cache", "--page-size", "32"])
    assert cfg.role == "decode" and cfg.radix_cache and cfg.page_size == 32
    assert cfg.disaggregation_decode_hicache_ratio == 3.0
    assert not parse(["--role", "decode"]).radix_cache
    assert parse([]).radix_cache  # colocated always reuses prefixes


def test_environment_fallback(monkeypatch):
    cfg = parse([], monkeypatch, {"DECODE_WORKER_PORT": "4321", "DECODE_WORKER_DISAGGREGATION_DECODE_ENABLE_RADIX_CACHE": "true",
                                  "DECODE_WORKER_PD_TOKEN": "t"})
    assert cfg.port == 4321 and cfg.disaggregation_decode_enable_radix_cache and cfg.pd_token == "t"
    assert parse(["--port", "5"], monkeypatch).port == 5  # the flag wins over the environment


def test_hicache_without_radix_is_refused():
    with pytest.raises(ConfigError, match="requires --disaggregation-decode-enable-radix-cache"):
        parse(["--role", "decode", "--disaggregation-decode-enable-hicache"])


def test_bad_choice_from_environment_is_refused(monkeypatch):
    with pytest.raises(ConfigError, match="write-policy must be one of"):
        parse([], monkeypatch, {"DECODE_WORKER_DISAGGREGATION_DECODE_HICACHE_WRITE_POLICY": "write_thru"})


def test_redis_backend_needs_a_url():
    with pytest.raises(ConfigError, match="redis://"):
        parse(["--disaggregation-decode-enable-radix-cache", "--disaggregation-decode-enable-hicache",
               "--hicache-storage-backend", "redis"])


def test_server_info_hides_secrets():
    from decode_worker.config import ServerConfig
    from decode_worker.engine.engine import Engine

    info = Engine(ServerConfig(pd_token="tok", hicache_storage_url="redis://user:pw@10.0.0.1:6379")).server_info()
    assert "pd_token" not in info and "pw" not in info["hicache_storage_url"]
