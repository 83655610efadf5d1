"""The event-loop thread never waits for a step: the forward thread forwards, waits for the device and samples.

On a GPU the host waits for a step where the sampler reads tokens back (``.tolist()``). Here a sampler that
sleeps stands in for that wait; a probe on the loop measures its longest stall while requests run.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from decode_worker.core.sampling import SamplingParams
from decode_worker.model import runner as runner_module
from decode_worker.model.sampler import sample
from tests.unit.test_scheduler import make_scheduler, run_all

STEP_S = 0.3  # the device time of one step, as the sampler's wait sees it
PARAMS = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)


def waiting_sample(*args, **kwargs):
    time.sleep(STEP_S)  # the read-back that waits for the device
    return sample(*args, **kwargs)


async def longest_stall(work) -> float:
    """Run ``work`` while a probe ticks every millisecond on the loop; the worst delay of a tick, in seconds."""
    worst, done = 0.0, False

    async def probe() -> None:
        nonlocal worst
        while not done:
            start = time.monotonic()
            await asyncio.sleep(0.001)
            worst = max(worst, time.monotonic() - start - 0.001)

    ticker = asyncio.ensure_future(probe())
    try:
        result = await work
    finally:
        done = True
        await ticker
    return worst, result


def test_loop_never_blocks_on_a_step(tiny_models, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(runner_module, "sample", waiting_sample)
    scheduler = make_scheduler(tiny_models["llama"], 4096)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    started = time.monotonic()
    stall, outputs = asyncio.run(longest_stall(run_all(scheduler, prompts, PARAMS)))
    elapsed = time.monotonic() - started
    print(f"longest loop stall {stall * 1000:.1f} ms over {elapsed:.2f} s of {STEP_S * 1000:.0f} ms steps")
    assert all(len(o) == PARAMS.max_new_tokens for o in outputs)
    assert elapsed >= 4 * STEP_S  # the steps really waited
    assert stall < STEP_S / 2, f"the loop stalled {stall * 1000:.0f} ms: it waited for a step"


def test_forward_sample_hands_back_python_lists(tiny_models):
    """What crosses back to the loop holds no tensor: nothing there can wait for the device."""
    scheduler = make_scheduler(tiny_models["llama"], 4096)
    runner = scheduler.runner
    fb = runner.build_batch([[1, 2, 3], [4, 5]], [0, 0], [[1], [2]])
    result = runner.forward_sample(fb, [PARAMS, PARAMS], [None, None])
    assert all(type(t) is int for t in result.token_ids) and all(type(p) is float for p in result.logprobs)


def test_start_up_objects_are_out_of_the_collectors_reach(tmp_path):
    """A full garbage collection holds the interpreter lock while it walks every tracked object; after start-up
    those are hundreds of thousands (torch, the tokenizer, the app), so the engine freezes them: the objects a
    full collection walks are only those made since."""
    import gc

    from decode_worker.config import ServerConfig
    from decode_worker.engine.engine import Engine
    from tests.tiny_model import save_tiny_chat_model

    gc.unfreeze()
    engine = Engine(ServerConfig(model_path=str(save_tiny_chat_model(tmp_path / "tiny")), max_total_tokens=256))

    async def start_and_stop() -> None:
        await engine.start()
        await engine.shutdown()

    try:
        asyncio.run(start_and_stop())
        assert gc.get_freeze_count() > 10 * len(gc.get_objects(generation=2)), (
            gc.get_freeze_count(), len(gc.get_objects(generation=2)))
    finally:
        gc.unfreeze()


def test_the_offline_engine_freezes_its_start_up_objects_too(tiny_models):
    """``LLM`` runs the same scheduler steps with no event loop: a full collection there stalls a step instead."""
    import gc

    from decode_worker.engine.llm import LLM

    gc.unfreeze()
    try:
        LLM(str(tiny_models["llama"]), max_total_tokens=256, page_size=4, load_tokenizer=False)
        assert gc.get_freeze_count() > 10 * len(gc.get_objects(generation=2)), (
            gc.get_freeze_count(), len(gc.get_objects(generation=2)))
    finally:
        gc.unfreeze()


def test_frozen_objects_thaw_at_exit(tiny_models):
    """The interpreter's last collections free them: bindings such as triton's report objects still frozen at exit
    as leaks, on every run of an offline script."""
    import subprocess
    import sys

    script = ("from decode_worker.engine.llm import LLM; import triton; "
              f"LLM({str(tiny_models['llama'])!r}, max_total_tokens=256, page_size=4, load_tokenizer=False)")
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaked" not in done.stderr, done.stderr[-2000:]
