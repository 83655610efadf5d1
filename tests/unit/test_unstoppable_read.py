"""A KV read that cannot be stopped must never give its pages back: a page handed to another request would then
receive this prompt's KV whenever the read finally writes."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from decode_worker.cache.handles import NO_PAGES
from decode_worker.core.request import GenerateInput, RequestStream
from decode_worker.core.sampling import SamplingParams
from decode_worker.core.sequence import Sequence
from decode_worker.pd.decode import DeltaKVFetcher
from decode_worker.scheduler.req import Req
from decode_worker.transfer import agent as agent_module
from decode_worker.transfer.agent import KVAgent, TransferError


def nixl_peer(agent: KVAgent, name: str) -> SimpleNamespace:
    """A stand-in peer over ``agent``'s own pool that reads over NIXL (nothing mapped)."""
    return SimpleNamespace(pool=agent.pool, dlist=None, name=name, mapped=None, mapping=None)


def read_failure(agent: KVAgent, room: int, peer, timeout_s: float) -> str:
    """The reason a one-page read from ``peer`` fails with (it must fail)."""
    async def read():
        await agent.read(room, peer, [1], [2], deadline=asyncio.get_running_loop().time() + timeout_s)

    with pytest.raises(TransferError) as failure:
        asyncio.run(read())
    return failure.value.reason


class StuckHandle:
    """A transfer that stays in progress and refuses release, as an uncancellable RDMA read might."""

    def release(self) -> None:
        raise RuntimeError("transfer still active")


def test_a_read_that_cannot_be_stopped_fails_as_unstoppable(monkeypatch):
    monkeypatch.setattr(agent_module, "RETIRE_S", 0.02)
    agent = KVAgent(torch.zeros(4, 1, 2, 16), "decode")  # [page, layer, kv, ...]: 4 pages
    try:
        monkeypatch.setattr(agent.agent, "make_prepped_xfer", lambda *a, **k: StuckHandle())
        monkeypatch.setattr(agent, "_post", lambda handle: "PROC")
        monkeypatch.setattr(agent, "_state", lambda handle: "PROC")
        peer = nixl_peer(agent, "peer")
        monkeypatch.setitem(agent._peers, "peer", peer)
        assert read_failure(agent, 7, peer, 0.01) == "unstoppable"
    finally:
        monkeypatch.undo()
        agent.close()


def test_the_fetcher_keeps_an_unstoppable_reads_pages_out_of_use():
    pages = np.array([5, 6, 9])
    params = SamplingParams()
    req = Req(GenerateInput("r1", [1, 2], params), RequestStream("r1"), Sequence("r1", [1, 2], params),
              handle=SimpleNamespace(delta_pages=pages))
    DeltaKVFetcher._quarantine(req.pending_receive())
    assert req.handle.delta_pages is NO_PAGES  # release() frees the handle's delta pages: none are left to free
