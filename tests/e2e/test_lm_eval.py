"""lm-evaluation-harness's ``local-completions`` model against ``decode-worker up`` (smg, prefill, decode,
the embedded SmolLM2) and against a colocated worker: a log-likelihood multiple-choice task and a
``generate_until`` task (``tests/lm_eval/``, local JSON data: no dataset download) score the same on both, four
requests at a time through the router.

lm-eval needs the model's tokenizer to find where each continuation starts; it sends text prompts
(``tokenized_requests=False``), since smg refuses token-id prompts on ``/v1/completions``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from decode_worker.launch import ROUTER_READY_PATH
from tests.servers import free_port, start, start_worker

REPO = Path(__file__).resolve().parents[2]
TASKS = ["dw_multiple_choice", "dw_generate"]
LOGPROB_TOL = 1e-3  # the same prompts in batches of other shapes: float32 differs only in the last bits
FLOAT32 = {"DECODE_WORKER_DTYPE": "float32"}  # bfloat16 logits near 20 step by 0.125: a batch of four moves them


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, smollm2_path) -> Path:
    """The embedded GGUF's tokenizer as a Hugging Face folder, which lm-eval's tokenizer backend loads."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name).save_pretrained(path)
    return path


def evaluate(url: str, tokenizer: Path, concurrent: int = 1) -> dict:
    """``concurrent`` > 1: lm-eval's aiohttp client, which refuses a JSON answer sent as another content type."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": url + "/v1/completions", "model": "default", "tokenizer": str(tokenizer),
                    "tokenizer_backend": "huggingface", "tokenized_requests": False, "max_retries": 1,
                    "num_concurrent": concurrent},
        tasks=TASKS, task_manager=TaskManager(include_path=str(REPO / "tests" / "lm_eval")), log_samples=True)


@pytest.mark.slow  # two deployments of the real model and ~140 requests: about two minutes here
def test_lm_eval_scores_through_up_equal_the_colocated_workers(tmp_path, tokenizer_dir, monkeypatch):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is in the eval extra, which make test-all installs")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for name, value in FLOAT32.items():
        monkeypatch.setenv(name, value)  # every worker `up` starts, and the colocated one
    monkeypatch.chdir(REPO)  # the tasks name their data files from the repository root
    router, prefill, decode = (free_port() for _ in range(3))
    up = start("up", [sys.executable, "-m", "decode_worker.cli", "up", "--port", str(router), "--prefill-port",
                      str(prefill), "--decode-port", str(decode), "--log-dir", str(tmp_path / "logs")],
               f"http://127.0.0.1:{router}", tmp_path, health=ROUTER_READY_PATH, timeout_s=300)
    try:
        pd = evaluate(up.url, tokenizer_dir, concurrent=4)
    finally:
        up.stop()
    colocated = start_worker("colocated", tmp_path, "colocated")
    try:
        alone = evaluate(colocated.url, tokenizer_dir)
    finally:
        colocated.stop()

    for task, metrics in alone["results"].items():
        scores = {k: v for k, v in metrics.items() if k.split(",")[0] in ("acc", "acc_norm", "exact_match")}
        assert scores and scores == {k: pd["results"][task][k] for k in scores}, task
    for task in TASKS:
        assert len(pd["samples"][task]) == len(alone["samples"][task]) > 0
        for a, b in zip(pd["samples"][task], alone["samples"][task]):
            if task == "dw_generate":
                assert a["resps"] == b["resps"]  # greedy: the same text
            else:  # per choice: the continuation's log-likelihood, and whether it was the greedy one
                assert [r[0][1] for r in a["resps"]] == [r[0][1] for r in b["resps"]]
                worst = max(abs(x[0][0] - y[0][0]) for x, y in zip(a["resps"], b["resps"]))
                assert worst < LOGPROB_TOL, (worst, a["doc"])
    assert alone["results"]["dw_multiple_choice"]["acc,none"] > 0.25  # better than chance: the scores mean something
