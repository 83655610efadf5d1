"""Graceful shutdown: SIGTERM lets a running stream finish, then the worker exits cleanly."""
from __future__ import annotations

import json
import signal

import httpx

from tests.servers import start_worker


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
