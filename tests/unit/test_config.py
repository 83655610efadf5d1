"""Flags, environment fallbacks, bad values and refused combinations."""
from __future__ import annotations

import argparse
import re

import pytest

from decode_worker.config import ConfigError, ServerConfig, add_config_args, config_from_args, config_from_env
from decode_worker.core.policies import EvictionPolicy, PrefetchMode, Role, StorageBackend, WritePolicy


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
    with pytest.raises(ConfigError, match="^DECODE_WORKER_DISAGGREGATION_DECODE_HICACHE_WRITE_POLICY must be one of "
                                          "write_through, write_through_selective, write_back, not 'write_thru'$"):
        parse([], monkeypatch, {"DECODE_WORKER_DISAGGREGATION_DECODE_HICACHE_WRITE_POLICY": "write_thru"})


@pytest.mark.parametrize("name,value,message", [
    ("PORT", "abc", "DECODE_WORKER_PORT must be an integer, not 'abc'"),
    ("MAX_TOTAL_TOKENS", "1.5", "DECODE_WORKER_MAX_TOTAL_TOKENS must be an integer, not '1.5'"),
    ("KV_LEASE_S", "soon", "DECODE_WORKER_KV_LEASE_S must be a number, not 'soon'"),
    ("DISAGGREGATION_DECODE_ENABLE_RADIX_CACHE", "maybe",
     ("DECODE_WORKER_DISAGGREGATION_DECODE_ENABLE_RADIX_CACHE must be true or false (or 1/0, yes/no, on/off), "
      "not 'maybe'")),
    ("ROLE", "Decode", "DECODE_WORKER_ROLE must be one of colocated, prefill, decode, not 'Decode'"),
])
def test_bad_environment_value_names_the_variable(monkeypatch, name, value, message):
    monkeypatch.setenv("DECODE_WORKER_" + name, value)
    for load in (config_from_env, lambda: parse([])):
        with pytest.raises(ConfigError) as e:
            load()
        assert str(e.value) == message


def test_bad_flag_value_names_the_flag(monkeypatch):
    monkeypatch.setenv("DECODE_WORKER_PORT", "7")
    with pytest.raises(ConfigError) as e:
        parse(["--port", "x1", "--hicache-storage-backend", "s3"])
    assert str(e.value).splitlines() == ["--port must be an integer, not 'x1'",
                                         "--hicache-storage-backend must be one of none, file, redis, not 's3'"]


@pytest.mark.parametrize("value,expected", [(v, True) for v in ("1", "true", "TRUE", "yes", "on")]
                         + [(v, False) for v in ("0", "false", "no", "off")])
def test_boolean_spellings(monkeypatch, value, expected):
    cfg = parse([], monkeypatch, {"DECODE_WORKER_DISAGGREGATION_DECODE_ENABLE_RADIX_CACHE": value})
    assert cfg.disaggregation_decode_enable_radix_cache is expected


def test_empty_variable_counts_as_unset(monkeypatch):
    """compose's `${VAR:-}` sets a variable to the empty string."""
    cfg = parse([], monkeypatch, {"DECODE_WORKER_PORT": "", "DECODE_WORKER_HICACHE_STORAGE_URL": "",
                                  "DECODE_WORKER_DISAGGREGATION_DECODE_ENABLE_RADIX_CACHE": ""})
    assert (cfg.port, cfg.hicache_storage_url, cfg.disaggregation_decode_enable_radix_cache) == (30000, None, False)


def test_policy_fields_are_the_policy_enums(monkeypatch):
    cfg = parse(["--role", "prefill", "--hicache-storage-prefetch-policy", "timeout"], monkeypatch,
                {"DECODE_WORKER_DISAGGREGATION_DECODE_HICACHE_WRITE_POLICY": "write_back"})
    assert cfg.role is Role.PREFILL and cfg.role == "prefill"
    assert cfg.disaggregation_decode_hicache_write_policy is WritePolicy.WRITE_BACK
    assert cfg.hicache_storage_prefetch_policy is PrefetchMode.TIMEOUT
    assert cfg.hicache_storage_backend is StorageBackend.NONE


def test_radix_eviction_policy_defaults_to_slru_and_takes_sglang_s_flag(monkeypatch):
    assert parse([], monkeypatch).radix_eviction_policy is EvictionPolicy.SLRU
    assert parse(["--radix-eviction-policy", "lfu"], monkeypatch).radix_eviction_policy is EvictionPolicy.LFU


def test_help_shows_defaults_variables_and_choices():
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    text = " ".join(parser.format_help().split())
    assert "--port int HTTP port (default: 30000) [env: DECODE_WORKER_PORT]" in text
    assert "--role {colocated,prefill,decode}" in text and "(default: colocated)" in text
    assert "--no-disaggregation-decode-enable-hicache" in text


def test_direct_construction_reads_the_environment(monkeypatch):
    """ServerConfig is a BaseSettings: built in code, it still takes DECODE_WORKER_* for fields not passed."""
    monkeypatch.setenv("DECODE_WORKER_PAGE_SIZE", "32")
    assert ServerConfig(port=1).page_size == 32


def test_redis_backend_needs_a_url():
    with pytest.raises(ConfigError, match="redis://"):
        parse(["--disaggregation-decode-enable-radix-cache", "--disaggregation-decode-enable-hicache",
               "--hicache-storage-backend", "redis"])


def test_server_info_hides_secrets():
    from decode_worker.config import ServerConfig
    from decode_worker.engine.engine import Engine

    info = Engine(ServerConfig(pd_token="tok", hicache_storage_url="redis://user:pw@10.0.0.1:6379")).server_info()
    assert "pd_token" not in info and "pw" not in info["hicache_storage_url"]


def test_api_key_and_limits(monkeypatch):
    cfg = parse([])
    assert (cfg.api_key, cfg.max_request_body_bytes, cfg.max_concurrent_requests) == ("", 32 * 1024 * 1024, 1024)
    cfg = parse(["--max-concurrent-requests", "3"], monkeypatch, {"DECODE_WORKER_API_KEY": "k1",
                                                                  "DECODE_WORKER_MAX_REQUEST_BODY_BYTES": "100"})
    assert (cfg.api_key, cfg.max_request_body_bytes, cfg.max_concurrent_requests) == ("k1", 100, 3)


@pytest.mark.parametrize("argv,fragment", [
    (["--max-request-body-bytes", "0"], "--max-request-body-bytes"),
    (["--max-concurrent-requests", "0"], "--max-concurrent-requests"),
    (["--api-key", "kéy"], "--api-key must be printable ASCII"),
    (["--pd-token", "a b"], "--pd-token must be printable ASCII"),
])
def test_bad_guard_settings_are_refused(argv, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse(argv)


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_cache_flags_mean_the_same_on_every_role(role):
    """Prefill and colocated always have the radix cache: the radix flag is accepted there (it asks for what is
    on), and the hicache flag keeps its rule (radix flag required) and its effect (an L2 tier) on every role."""
    cfg = parse(["--role", role, "--disaggregation-decode-enable-radix-cache", "--disaggregation-decode-enable-hicache"])
    assert cfg.radix_cache and cfg.disaggregation_decode_enable_hicache
    with pytest.raises(ConfigError, match="--disaggregation-decode-enable-hicache requires "
                                          "--disaggregation-decode-enable-radix-cache"):
        parse(["--role", role, "--disaggregation-decode-enable-hicache"])


def test_hicache_flag_builds_the_host_tier_on_the_prefill_role(tmp_path):
    from decode_worker.engine.engine import Engine
    from tests.tiny_model import save_tiny_chat_model

    model = str(save_tiny_chat_model(tmp_path / "tiny"))
    flags = ["--role", "prefill", "--model-path", model, "--max-total-tokens", "256"]
    with_l2 = Engine(parse(flags + ["--disaggregation-decode-enable-radix-cache", "--disaggregation-decode-enable-hicache"]))
    without = Engine(parse(flags))
    for engine in (with_l2, without):
        engine.load_model()
    try:
        assert with_l2.cache.stats().host.total > 0
        assert without.cache.stats().host is None
    finally:
        for engine in (with_l2, without):
            engine.cache.close()


def test_unused_ucx_flags_are_named_not_silently_dropped():
    from decode_worker.engine.wiring import unused_ucx_flags

    assert unused_ucx_flags(parse(["--role", "decode"])) == []
    lines = unused_ucx_flags(parse(["--role", "decode", "--ucx-host", "10.0.0.7", "--ucx-port", "30100"]))
    assert [line.split()[:2] for line in lines] == [["--ucx-host", "10.0.0.7"], ["--ucx-port", "30100"]]
    assert all("not used" in line for line in lines)


def test_prefill_hosts_flag_and_environment(monkeypatch):
    assert parse(["--role", "decode", "--prefill-hosts", "p0:30001,10.0.0.7"]).prefill_hosts == "p0:30001,10.0.0.7"
    assert parse([], monkeypatch, {"DECODE_WORKER_PREFILL_HOSTS": "prefill:30001"}).prefill_hosts == "prefill:30001"


@pytest.mark.parametrize("argv,fragment", [
    (["--prefill-hosts", "p0:port"], "--prefill-hosts: 'p0:port' has no valid port"),
    (["--prefill-hosts", "http://p0"], "--prefill-hosts: 'http://p0' is not host[:port]"),
    (["--role", "decode", "--prefill-hosts", "*", "--pd-token", "t"], "'*' with --pd-token would send it"),
    (["--role", "decode", "--prefill-hosts", "*", "--api-key", "k"], "'*' with --api-key would send it"),
    (["--role", "decode", "--pd-token", "t"], "as host:port (it is unset: loopback, any port)"),
    (["--role", "decode", "--api-key", "k", "--prefill-hosts", "p0:30001,10.0.0.7"], "(10.0.0.7 names no port)"),
])
def test_bad_prefill_hosts_are_refused(argv, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        parse(argv)


@pytest.mark.parametrize("argv", [["--grammar-max-bytes", "0"], ["--grammar-max-nesting", "0"],
                                  ["--grammar-step-budget-ms", "0"]])
def test_grammar_limits_must_allow_something(argv):
    with pytest.raises(ConfigError, match="--grammar-max-bytes and --grammar-max-nesting must be at least 1"):
        parse(argv)


def test_secrets_need_no_prefill_list_where_nothing_sends_them():
    """Only a decode worker sends its PD token and API key onward; without a secret, loopback on any port stays the
    default, for a quick local pair."""
    assert parse(["--role", "prefill", "--pd-token", "t", "--api-key", "k"]).pd_token == "t"
    assert parse(["--role", "decode"]).prefill_hosts == ""
    assert parse(["--role", "decode", "--pd-token", "t", "--prefill-hosts", "127.0.0.1:30001"]).pd_token == "t"


@pytest.mark.parametrize("argv, fragment", [
    (["--role", "prefill"], "--pd-peer-protocol sglang is for the decode role"),
    (["--role", "decode"], "needs --prefill-hosts listing each SGLang prefill's bootstrap server as host:port"),
    (["--role", "decode", "--prefill-hosts", "p0"], "needs --prefill-hosts listing"),
    (["--role", "decode", "--prefill-hosts", "p0:8998", "--pd-token", "t"], "--pd-token is not sent to SGLang"),
])
def test_an_sglang_peer_needs_listed_bootstrap_servers_and_takes_no_pd_token(argv, fragment):
    """A registered SGLang prefill may write into the whole KV pool, and its protocol carries no secret."""
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        parse([*argv, "--pd-peer-protocol", "sglang"])
    assert parse(["--role", "decode", "--pd-peer-protocol", "sglang", "--prefill-hosts", "p0:8998"]).pd_peer_protocol \
        == "sglang"
