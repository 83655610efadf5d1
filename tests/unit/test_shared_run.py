"""SharedRun: one run at a time, its outcome shared by concurrent callers and reused for a while after."""
from __future__ import annotations

import asyncio

import pytest

from decode_worker.core.tasks import SharedRun


def test_concurrent_callers_share_one_run_and_its_failure():
    runs = []

    async def work():
        runs.append(1)
        await asyncio.sleep(0.05)
        raise RuntimeError(f"run {len(runs)}")

    async def scenario():
        shared = SharedRun(reuse_s=0.2)
        results = await asyncio.gather(*(shared(work) for _ in range(20)), return_exceptions=True)
        assert [str(r) for r in results] == ["run 1"] * 20
        with pytest.raises(RuntimeError, match="run 1"):  # within reuse_s: the same outcome
            await shared(work)
        await asyncio.sleep(0.25)
        with pytest.raises(RuntimeError, match="run 2"):  # past it: a new run
            await shared(work)

    asyncio.run(scenario())
    assert len(runs) == 2


def test_a_caller_that_leaves_does_not_cancel_the_run():
    async def scenario():
        shared = SharedRun(reuse_s=1.0)

        async def work():
            await asyncio.sleep(0.05)
            return "done"

        leaver = asyncio.ensure_future(shared(work))
        await asyncio.sleep(0.01)
        leaver.cancel()
        assert await shared(work) == "done"

    asyncio.run(scenario())


def test_a_caller_just_after_the_run_ends_shares_its_outcome():
    """A caller scheduled between the run's end and its done-callbacks sees a finished run: it must share it, not
    start another (the end time was once set by a callback, so such a caller read the previous run's end)."""
    runs = []

    async def work():
        runs.append(1)

    async def scenario():
        shared = SharedRun(reuse_s=10.0)
        first = asyncio.ensure_future(shared(work))
        await asyncio.sleep(0)  # first creates the run's task, which is now ready to run
        second = asyncio.ensure_future(shared(work))  # ready after that task's only step, before its callbacks
        await asyncio.gather(first, second)

    asyncio.run(scenario())
    assert len(runs) == 1
