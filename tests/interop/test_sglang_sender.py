"""SGLang 0.5.18's own prefill-side sender (``sglang_prefill.py``, a process of its own) pushes a prompt's KV and
aux slot over NIXL into a host pool laid out as ours (``[page, layer, K|V, token, head, dim]``), which this process
registers and asks for in our wire frames (``decode_worker/pd/sglang_wire.py``): every byte lands where our pool
reads it, a delta after ``decode_prefix_len`` carries only the missing pages, a full hit only the aux slot."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
import zmq
from nixl._api import nixl_agent, nixl_agent_config

from decode_worker.pd.sglang_wire import (
    AuxLayout,
    Endpoint,
    PrefillServerInfo,
    RankInfo,
    Registration,
    RoomProgress,
    TransferRequest,
    parse_notification,
)
from tests.interop.sglang_prefill import DEADLINE_S, DIM, DTYPE, HEADS, HIDDEN, LAYERS, PAGE, kv_buffers

HERE = Path(__file__).parent
OUR_PAGES, AUX_SLOTS = 64, 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def route(boot_port: int, rank: int) -> dict:
    """The bootstrap server's answer: its layout (``rank`` -1) or that rank's ZMQ endpoint."""
    ranks = [rank] * 4 if rank < 0 else [0, 0, rank, 0]
    query = "&".join(f"{name}={r}" for name, r in zip(
        ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"), ranks))
    answer = requests.get(f"http://127.0.0.1:{boot_port}/route?{query}", timeout=5)
    assert answer.status_code == 200, answer.text
    return answer.json()


class Decode:
    """Our side: a pool in our layout and the aux buffers, registered with NIXL and announced in our frames."""

    def __init__(self, boot_port: int):
        self.agent = nixl_agent(f"decode-interop-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        self.pool = torch.zeros((OUR_PAGES, LAYERS, 2, PAGE, HEADS, DIM), dtype=DTYPE)
        self.layout = AuxLayout(HIDDEN * DTYPE.itemsize)
        self.aux = [torch.zeros(AUX_SLOTS * n, dtype=torch.uint8) for n in self.layout.item_lens]
        self.registered = [self.agent.register_memory([t]) for t in (self.pool, *self.aux)]
        info = PrefillServerInfo.parse(route(boot_port, -1))
        assert (info.attn_tp_size, info.pp_size, info.page_size) == (1, 1, PAGE)
        rank = RankInfo.parse(route(boot_port, 0))
        self.socket = zmq.Context.instance().socket(zmq.PUSH)
        self.socket.connect(f"tcp://{rank.ip}:{rank.port}")
        self.me = Endpoint("127.0.0.1", free_port(), self.agent.name)
        region = self.pool[0, 0, 0].nbytes  # one layer's K (or V) of a page
        self.socket.send_multipart(Registration(
            self.me, self.agent.get_agent_metadata(),
            kv_ptrs=[self.pool.data_ptr() + r * region for r in range(2 * LAYERS)],
            kv_strides=[self.pool[0].nbytes] * 2 * LAYERS, num_pages=OUR_PAGES,
            aux_ptrs=[t.data_ptr() for t in self.aux], layer_ids=[r // 2 for r in range(2 * LAYERS)]).frames())

    def wait(self, progress: RoomProgress) -> None:
        give_up = time.monotonic() + DEADLINE_S
        while not progress.done and time.monotonic() < give_up:
            for messages in self.agent.get_new_notifs().values():
                for message in messages:
                    progress.note(parse_notification(message))
            time.sleep(0.002)

    def page_bytes(self, page: int) -> list[bytes]:
        return [self.pool[page, layer, kv].contiguous().view(torch.uint8).numpy().tobytes()
                for layer in range(LAYERS) for kv in (0, 1)]

    def slot(self, slot: int) -> list[bytes]:
        return [t[slot * n: (slot + 1) * n].numpy().tobytes() for t, n in zip(self.aux, self.layout.item_lens)]


def prefill_page_bytes(page: int) -> list[bytes]:
    """A sender page's bytes per layer, K then V (its buffers are made from the same seed)."""
    k, v = kv_buffers()
    rows = slice(page * PAGE, (page + 1) * PAGE)
    return [t[rows].contiguous().view(torch.uint8).numpy().tobytes() for layer in range(LAYERS)
            for t in (k[layer], v[layer])]


@pytest.fixture(scope="module")
def sender():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(HERE / "sglang_prefill.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:  # its threads never end (and poll a core): it is killed however the test goes
        hello = proc.stdout.readline()
        assert hello, "SGLang's sender did not start"
        yield proc, json.loads(hello)["boot_port"]
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def decode(sender):
    ours = Decode(sender[1])
    time.sleep(0.2)  # the registration reaches the sender's bootstrap thread before any request
    return ours


@pytest.mark.parametrize("held", [0, 2, 5], ids=["full prompt", "prefix delta", "full hit"])
def test_sglangs_sender_fills_our_pool_byte_for_byte(sender, decode, held):
    """A 5-page prompt on sender pages 7, 3, 20, 8, 1; decode already holds ``held`` of them and asks for the rest
    into its pages 50, 2, 33, ...: those hold exactly the sender's bytes, no other page changed, the aux slot
    carries the first token and the room, and the sender sent only the missing pages."""
    proc, _ = sender
    prompt_pages, ours = [7, 3, 20, 8, 1], [50, 2, 33, 9, 41]
    room, slot = 2**62 + held, 3
    before = decode.pool.clone()
    request = TransferRequest(room, decode.me, ours[held:], slot, prefix_tokens=held * PAGE)
    decode.socket.send_multipart(request.frames())
    proc.stdin.write(json.dumps({"room": room, "pages": prompt_pages, "aux_slot": 5, "first_token": 4242}) + "\n")
    proc.stdin.flush()
    answer = json.loads(proc.stdout.readline())
    assert answer == {"sent": prompt_pages[held:]}, answer
    progress = RoomProgress()
    decode.wait(progress)
    assert progress.done, progress
    for theirs, mine in zip(prompt_pages[held:], ours[held:]):
        assert decode.page_bytes(mine) == prefill_page_bytes(theirs)
    others = [p for p in range(OUR_PAGES) if p not in ours[held:]]
    assert torch.equal(decode.pool[others].view(torch.uint8), before[others].view(torch.uint8))
    record = decode.layout.read(decode.slot(slot))
    assert (record.first_token, record.room) == (4242, room)
