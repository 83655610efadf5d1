"""`decode-worker up` as a user runs it (router, prefill, decode), open and behind an API key.

With a key, the router must carry it to both workers (requests, batched PD bodies, the router's own calls) and
refuse clients without it; the workers must refuse callers that skip the router without it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from decode_worker.launch import ROUTER_READY_PATH
from tests.servers import free_port, start
from tests.tiny_model import save_tiny_chat_model

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.mark.parametrize("key", [pytest.param("", marks=pytest.mark.slow), "up-key-0123"], ids=["open", "api-key"])
def test_up(tmp_path, tiny_chat_model, key):
    router, prefill, decode = (free_port() for _ in range(3))
    cmd = [sys.executable, "-m", "decode_worker.cli", "up", "--model-path", str(tiny_chat_model),
           "--port", str(router), "--prefill-port", str(prefill), "--decode-port", str(decode),
           "--max-total-tokens", "4096", "--log-dir", str(tmp_path / "logs")]
    proc = start("up", cmd, f"http://127.0.0.1:{router}", tmp_path, env={"DECODE_WORKER_API_KEY": key},
                 health=ROUTER_READY_PATH, timeout_s=300)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        batched = httpx.post(proc.url + "/generate", headers=headers, timeout=120,
                             json={"input_ids": [[5, 6, 7, 8], [9, 10]], "sampling_params": GREEDY})
        assert batched.status_code == 200, batched.text
        assert [len(o["output_ids"]) for o in batched.json()] == [4, 4]

        from openai import OpenAI

        client = OpenAI(base_url=proc.url + "/v1", api_key=key or "none", max_retries=0)
        chat = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=3, temperature=0)
        assert chat.usage.completion_tokens == 3
        # ignore_eos: sampled from a tiny vocabulary, the end-of-sequence token can come first (a full run here did)
        completion = client.completions.create(model="default", prompt="Hello", max_tokens=3,
                                               extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 3

        worker_load = httpx.get(f"http://127.0.0.1:{decode}/get_load", timeout=10)
        if key:
            refused = httpx.post(proc.url + "/generate", json={"text": "Hi"}, timeout=30)
            assert refused.status_code == 401 and "missing API key" not in refused.text  # the router's own 401
            assert worker_load.status_code == 401  # skipping the router does not skip the key
            assert httpx.get(f"http://127.0.0.1:{decode}/get_load", headers=headers, timeout=10).status_code == 200
        else:
            assert worker_load.status_code == 200
    finally:
        proc.stop()


# -- several decode workers: what `up` refuses before starting anything, and the router it would start ------------
# (tests/integration/test_scale_out.py runs `up --decode-replicas 2` end to end.)


@pytest.mark.parametrize("flags,message", [
    (["--decode-replicas", "0"], "--decode-replicas must be at least 1, not 0"),
    (["--decode-replicas", "2", "--decode-port", "30000"], "must all differ"),
    (["--decode-replicas", "3", "--decode-port", "29999"], "must all differ"),  # replicas on --port, --prefill-port
    (["--redis-url", "redis://127.0.0.1:6379", "--no-shared-l3"], "contradict each other"),
    (["--redis-url", "127.0.0.1:6379"], "--redis-url must look like redis://host:port"),
    (["--decode-replicas", "2", "--no-hicache"], "the shared L3 needs hicache"),
    (["--decode-replicas", "2", "--redis-max-gb", "0"], "--redis-max-gb must be positive"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_up_refuses_settings_that_cannot_run(flags, message, monkeypatch, capsys):
    from decode_worker import cli

    def refuse(*_):
        raise AssertionError("started despite a bad setting")

    monkeypatch.setattr(cli, "run_up", refuse)
    assert cli.main(["up", *flags]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and message in err[0], err


def test_router_command_names_every_decode_worker_and_the_policy():
    import argparse

    from smg.router_args import RouterArgs

    from decode_worker.launch import ROUTER_GRACE_S, router_command

    cmd = router_command("127.0.0.1", 30000, 30001, [30002, 30003, 30004], 29001, decode_policy="round_robin",
                         model="SmolLM2")
    assert cmd[1:3] == ["-m", "smg.launch_router"]
    parser = argparse.ArgumentParser(allow_abbrev=False)
    RouterArgs.add_cli_args(parser)
    ra = RouterArgs.from_cli_args(parser.parse_args(cmd[3:]))
    assert ra.pd_disaggregation and ra.decode_policy == "round_robin" and ra.prometheus_port == 29001
    assert ra.model_aliases == {"default": "SmolLM2"} and ra.shutdown_grace_period_secs == ROUTER_GRACE_S
    assert ra.decode_urls == [f"http://127.0.0.1:{p}" for p in (30002, 30003, 30004)]
    assert ra.prefill_urls == [("http://127.0.0.1:30001", 30001)]
