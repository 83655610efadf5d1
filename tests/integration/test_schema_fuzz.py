"""Schemathesis over each role's own OpenAPI schema, against real workers on loopback.

Every operation gets schema-valid and schema-invalid requests; every answer must be a status the operation
declares, never a 500, in the declared content type, headers and schema. The default run is short and
derandomized (a regression check); ``-m slow`` explores with many more examples.

The decode worker's bootstrap fields point anywhere the generator likes: unreachable hosts and closed ports
must give the declared 502/504 within the short deadlines set here, never a 500 or a hang.
"""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.faultkit import wait_idle
from tests.servers import Proc, free_port, start_workers
from tests.tiny_model import save_tiny_chat_model

PD_TOKEN = "fuzz-token"
ROLES = ("colocated", "prefill", "decode")


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> Iterator[dict[str, Proc]]:
    """One worker per role on a tiny model with a 256-token pool: no request can run long."""
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), max_context=256)
    logs = tmp_path_factory.mktemp("fuzz-logs")
    common = ("--model-path", str(model), "--max-total-tokens", "256", "--max-running-requests", "8")
    flags = {
        "colocated": common,
        # A short lease: handshakes for rooms nobody prefilled answer 404 after it.
        "prefill": common + ("--kv-lease-s", "0.2"),
        # A null bootstrap_port goes to a closed port; unreachable prefills fail within a second.
        "decode": common + ("--bootstrap-port", str(free_port()), "--handshake-timeout-s", "1",
                            "--transfer-timeout-s", "1"),
    }
    env = {"DECODE_WORKER_PD_TOKEN": PD_TOKEN}
    procs = start_workers({r: (r, flags[r], env) for r in ROLES}, logs)
    yield procs
    for proc in procs.values():
        proc.stop()


def no_internal_error(ctx, response, case) -> None:
    """Whatever else an answer is, it is never a 500: those mean a bug, not a bad request."""
    if response.status_code == 500:
        raise AssertionError(f"500 from {case.operation.label}: {response.text[:500]}")


CHECKS = [no_internal_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


def strategy(schema, operation) -> st.SearchStrategy:
    """The schema's example bodies (random valid bodies rarely make a prompt the model accepts, so these are what
    reach generation most), valid requests, and invalid ones where there is a body to get wrong."""
    strategies = [*schema.get_strategies_from_examples(operation), operation.as_strategy(GenerationMode.POSITIVE)]
    if operation.body:
        strategies.append(operation.as_strategy(GenerationMode.NEGATIVE))
    return st.one_of(strategies)


CLIENT_TIMEOUT_S = 30.0
"""How long the fuzzing client waits for one answer. A valid request may ask for more than that (4 prompts x n 40
x 200 tokens is 32,000 decode steps on the 256-token pool, where one such sequence runs at a time): the client
then gives up, as a real one would, and the worker must drop that work (``wait_idle``) and go on serving."""


def fuzz(proc: Proc, max_examples: int, derandomize: bool) -> int:
    """Run every operation of ``proc``'s schema; returns how many operations ran."""
    schema = schemathesis.openapi.from_url(proc.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    # The handshake's token header is declared, so generated; here it is the real one, to reach past the check.
    headers = {"X-PD-Token": PD_TOKEN}
    for operation in operations:
        @settings(max_examples=max_examples, deadline=None, database=None, derandomize=derandomize,
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy(schema, operation))
        def run(case) -> None:
            try:
                case.call_and_validate(base_url=proc.url, headers=headers, checks=CHECKS, timeout=CLIENT_TIMEOUT_S)
            except requests.exceptions.ReadTimeout:
                wait_idle(proc, timeout_s=CLIENT_TIMEOUT_S)

        run()
    return len(operations)


def assert_still_serves(proc: Proc) -> None:
    assert httpx.get(proc.url + "/health", timeout=10).status_code == 200, proc.tail()


@pytest.mark.slow  # a fuzz run (~30 s); the inputs it found stay in the default run as test_found_inputs
@pytest.mark.parametrize("role", ROLES)
def test_schema_fuzz(workers, role):
    proc = workers[role]
    assert fuzz(proc, max_examples=24, derandomize=True) >= 13
    assert_still_serves(proc)


@pytest.mark.slow
@pytest.mark.parametrize("role", ROLES)
def test_schema_fuzz_long(workers, role):
    proc = workers[role]
    fuzz(proc, max_examples=300, derandomize=False)
    assert_still_serves(proc)


# Bodies that once gave a 500 (found by fuzzing and by hand); the raw text keeps NaN, which json.dumps would not send.
FOUND = [
    ("/generate", '{"text": "hi", "sampling_params": {"sampling_seed": 1180591620717411303424}}', 400, "sampling_seed"),
    ("/generate", '{"text": "hi", "sampling_params": {"temperature": NaN}}', 400, "finite"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "seed": 99999999999999999999999}', 400, "seed"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', 400,
     "messages.0.content.0.text"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, "image_url"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400, "max_tokens"),
    ("/generate", '{"input_ids": [[1, 2], [3]], "rid": ["a"]}', 400, "rid has 1 entries for 2 prompts"),
    ("/generate", '{"text": "hi", "bootstrap_host": "a/b@c", "bootstrap_room": 1}', 400, "bootstrap_host"),
    ("/generate", '{"text": "hi", "bootstrap_host": "h", "bootstrap_room": -1}', 400, "bootstrap_room"),
    # A temperature past float32's range divided a grammar's masked logits (-inf) into NaN: a seeded draw raised.
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "temperature": 1.3e308, "seed": 1, '
     '"response_format": {"type": "json_object"}}', 400, "temperature"),
    # A temperature this small divided the logits into NaN and failed every request in the batch.
    ("/generate", '{"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 1e-300}}', 200, ""),
]


@pytest.mark.parametrize("path,raw,status,fragment", FOUND)
def test_found_inputs(workers, path, raw, status, fragment):
    resp = httpx.post(workers["colocated"].url + path, content=raw, timeout=30)
    assert resp.status_code == status, resp.text
    if status != 200:
        assert fragment in resp.json()["error"]["message"], resp.text
