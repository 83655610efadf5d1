"""Graceful shutdown: SIGTERM lets a running stream finish, then the worker exits cleanly."""
from __future__ import annotations

import json
import signal

import httpx

from tests.servers import pd_generate, start_worker


def test_sigterm_drains_a_running_stream(tmp_path, smollm2_path):
    proc = start_worker("drain", tmp_path, "colocated")
    body = {"text": "Tell me a long story.", "stream": True,
            "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
    chunks = []
    try:
        with httpx.stream("POST", proc.url + "/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunks.append(line[6:])
                if len(chunks) == 3:
                    proc.popen.send_signal(signal.SIGTERM)  # mid-stream
        assert chunks[-1] == "[DONE]"
        assert len(json.loads(chunks[-2])["output_ids"]) == 48
        # uvicorn re-raises the signal once its graceful shutdown is done, so a clean exit reads as -SIGTERM.
        assert proc.popen.wait(timeout=40) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in proc.tail(20)
    finally:
        proc.stop()


def test_sigterm_stops_a_pd_pair_cleanly(tmp_path, smollm2_path):
    """Both halves of PD stop on SIGTERM after a hand-off: prefill got the release (nothing left to wait for) and
    each closes its NIXL agent without hanging."""
    prefill = start_worker("drain-prefill", tmp_path, "prefill")
    decode = start_worker("drain-decode", tmp_path, "decode")
    try:
        body = {"text": "Tell me a story.", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        assert pd_generate(prefill, decode, body, room=4242).status_code == 200
        for proc in (decode, prefill):
            proc.popen.send_signal(signal.SIGTERM)
        for proc in (decode, prefill):
            assert proc.popen.wait(timeout=20) in (0, -signal.SIGTERM)
            assert "Application shutdown complete" in proc.tail(20), proc.tail(20)
    finally:
        decode.stop()
        prefill.stop()
