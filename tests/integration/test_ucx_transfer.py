"""KV transfer between two real processes on loopback: this process receives, a spawned one sends.

The sender script reports, per room, whether its send succeeded and the SHA-256 of the bytes it sent, so
the receiver's copy is checked against what actually left the other process.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import uvloop

from decode_worker.transfer import ucx_receiver
from decode_worker.transfer.ucx_receiver import DRAIN_S, KVReceiver
from decode_worker.transfer.wire import Trailer, TransferError

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20

SENDER = r"""
import asyncio, base64, hashlib, json, os, signal, sys
import torch, uvloop
from decode_worker.transfer import ucx_sender
from decode_worker.transfer.ucx_sender import KVSender
from decode_worker.transfer.wire import Trailer, TransferError

def say(**kw):
    print(json.dumps(kw), flush=True)

def payload(nbytes, room, fill):
    if fill == "ones":
        return torch.ones(nbytes, dtype=torch.uint8)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(room))

async def one(sender, address, t, fill):
    data = payload(t["nbytes"], t["room"], fill)
    out = {"room": t["room"], "sha256": hashlib.sha256(data.numpy()).hexdigest()}
    try:
        await sender.send(address, t["room"], data, Trailer(t["room"] % 1000, -0.25, (t["nbytes"],)), 20.0)
        out["ok"] = True
    except TransferError as e:
        out.update(ok=False, reason=e.reason)
    say(**out)

async def main():
    plan = json.loads(sys.stdin.readline())
    post = ucx_sender._send_payload
    if plan["mode"] == "die":  # SIGKILL ourselves while the receiver is pulling the payload
        async def post_then_die(bulk, buf, tag):
            asyncio.ensure_future(post(bulk, buf, tag))
            await asyncio.sleep(0.005)
            say(dying=True)
            os.kill(os.getpid(), signal.SIGKILL)
        ucx_sender._send_payload = post_then_die
    elif plan["mode"] == "late":  # send the payload a second after the offer; report what became of it
        async def post_late(bulk, buf, tag):
            say(offered=True)
            await asyncio.sleep(1.0)
            try:
                await asyncio.wait_for(bulk.send(buf, tag=tag, force_tag=True), 5)
                say(late_payload="taken")
            except Exception as e:
                say(late_payload=repr(e))
        ucx_sender._send_payload = post_late
    elif plan["mode"] == "offer_late":  # the payload goes at once, its OFFER later (half a second by default)
        quiet = ucx_sender.send_quietly
        async def offer_late(ep, data):
            if data[5] == 1:  # Kind.OFFER
                await asyncio.sleep(plan.get("offer_delay", 0.5))
            await quiet(ep, data)
        ucx_sender.send_quietly = offer_late
    sender = await KVSender.start()
    for batch in plan["batches"]:
        await asyncio.gather(*(one(sender, base64.b64decode(t["address"]), t, plan["fill"]) for t in batch))
    if plan["mode"] == "late":
        await asyncio.sleep(1.5)  # the late payload goes out before we close
    await sender.close()

uvloop.run(main())
"""


class Sender:
    """A sender process and its JSON reports."""

    spawned: ClassVar[list[asyncio.subprocess.Process]] = []  # killed after each test, whatever happened

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.spawned.append(proc)

    @classmethod
    async def spawn(cls, rx: KVReceiver, batches: list[list[dict]], mode: str = "normal", fill: str = "random",
                    **options):
        """Each transfer goes to the push address of its room, which must be expected by now."""
        for t in (t for batch in batches for t in batch):
            t.setdefault("address", base64.b64encode(rx.push_address(t["room"])).decode())
        env = dict(os.environ, PYTHONPATH=str(ROOT), UCX_WARN_UNUSED_ENV_VARS="n")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", SENDER, cwd=ROOT, env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        plan = {"batches": batches, "mode": mode, "fill": fill, **options}
        proc.stdin.write(json.dumps(plan).encode() + b"\n")
        await proc.stdin.drain()
        return cls(proc)

    async def line(self, timeout: float = 30.0) -> dict:
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        assert raw, "sender exited early"
        return json.loads(raw)

    async def finish(self, timeout: float = 30.0) -> tuple[list[dict], int]:
        out, _ = await asyncio.wait_for(self.proc.communicate(), timeout)
        return [json.loads(x) for x in out.decode().splitlines()], self.proc.returncode


def run(body: Callable[[KVReceiver], Awaitable[None]]) -> None:
    """Run one test body under uvloop against a fresh receiver, closing it whatever happens."""
    async def main() -> None:
        rx = await KVReceiver.start()
        try:
            await body(rx)
        finally:
            for proc in Sender.spawned:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            Sender.spawned.clear()
            await rx.close()
    uvloop.run(main())


def sha(t: torch.Tensor, nbytes: int) -> str:
    return hashlib.sha256(t.reshape(-1).view(torch.uint8)[:nbytes].numpy()).hexdigest()


def by_room(reports: list[dict]) -> dict[int, dict]:
    return {r["room"]: r for r in reports if "room" in r}


def test_three_rooms_in_flight_at_once():
    sizes = {101: 3 * MB + 7, 102: 8 * MB, 103: 21 * MB + 1}
    into = {
        101: torch.zeros(sizes[101], dtype=torch.uint8),
        102: torch.zeros(1024, 4096, dtype=torch.float16),  # exactly 8 MB, 2-D, not bytes
        103: torch.zeros(6 * MB, dtype=torch.float32),  # larger than the payload: the tail stays untouched
    }

    async def body(rx: KVReceiver) -> None:
        futures = {room: rx.expect(room, n, into[room], deadline_s=30) for room, n in sizes.items()}
        sender = await Sender.spawn(rx, [[{"room": room, "nbytes": n} for room, n in sizes.items()]])
        trailers = dict(zip(futures, await asyncio.gather(*futures.values()), strict=True))
        reports, rc = await sender.finish()
        assert rc == 0
        sent = by_room(reports)
        for room, n in sizes.items():
            assert sent[room]["ok"]
            assert sha(into[room], n) == sent[room]["sha256"]
            assert trailers[room] == Trailer(room % 1000, -0.25, (n,))
        assert not into[103].view(torch.uint8)[sizes[103]:].any()

    run(body)


def test_size_mismatch_fails_only_that_room():
    async def body(rx: KVReceiver) -> None:
        bad = rx.expect(201, 2 * MB, torch.zeros(2 * MB, dtype=torch.uint8), deadline_s=30)
        good_into = torch.zeros(MB, dtype=torch.uint8)
        good = rx.expect(202, MB, good_into, deadline_s=30)
        sender = await Sender.spawn(rx, [[{"room": 201, "nbytes": 3 * MB}], [{"room": 202, "nbytes": MB}]])
        with pytest.raises(TransferError) as err:
            await bad
        assert err.value.reason == "size_mismatch"
        assert (await good).first_token == 202
        reports, rc = await sender.finish()
        sent = by_room(reports)
        assert rc == 0
        assert (sent[201]["ok"], sent[201]["reason"]) == (False, "size_mismatch")
        assert sent[202]["ok"] and sha(good_into, MB) == sent[202]["sha256"]

    run(body)


def test_sender_killed_mid_transfer_then_new_sender_served():
    nbytes, deadline = 256 * MB, 20.0

    async def body(rx: KVReceiver) -> None:
        t0 = time.monotonic()
        doomed = rx.expect(301, nbytes, torch.zeros(nbytes, dtype=torch.uint8), deadline_s=deadline)
        dying = await Sender.spawn(rx, [[{"room": 301, "nbytes": nbytes}]], mode="die", fill="ones")
        with pytest.raises(TransferError) as err:
            await doomed
        assert err.value.reason in ("peer_lost", "timeout")
        assert time.monotonic() - t0 < deadline + DRAIN_S + 2
        reports, rc = await dying.finish()
        assert rc == -signal.SIGKILL and reports == [{"dying": True}]

        into = torch.zeros(4 * MB, dtype=torch.uint8)
        fresh = rx.expect(302, 4 * MB, into, deadline_s=30)
        sender = await Sender.spawn(rx, [[{"room": 302, "nbytes": 4 * MB}]])
        assert (await fresh).first_token == 302
        reports, rc = await sender.finish()
        assert rc == 0 and by_room(reports)[302]["ok"] and sha(into, 4 * MB) == reports[0]["sha256"]

    run(body)


def test_no_sender_times_out_on_deadline():
    async def body(rx: KVReceiver) -> None:
        t0 = time.monotonic()
        with pytest.raises(TransferError) as err:
            await rx.expect(401, MB, torch.zeros(MB, dtype=torch.uint8), deadline_s=1.0)
        elapsed = time.monotonic() - t0
        assert err.value.reason == "timeout"
        assert 1.0 <= elapsed < 2.5

    run(body)


def test_cancel_frees_the_room_and_its_posted_receive():
    async def body(rx: KVReceiver) -> None:
        # Cancelled while waiting for an offer.
        waiting = rx.expect(501, MB, torch.zeros(MB, dtype=torch.uint8), deadline_s=30)
        await asyncio.sleep(0.2)
        rx.cancel(501)
        with pytest.raises(TransferError) as err:
            await waiting
        assert err.value.reason == "cancelled"

        # Cancelled after its OFFER, receive posted: the payload, sent late, must land nowhere, yet not stay stuck.
        old = torch.zeros(MB, dtype=torch.uint8)
        posted = rx.expect(501, MB, old, deadline_s=30)
        late = await Sender.spawn(rx, [[{"room": 501, "nbytes": MB}]], mode="late")
        assert await late.line() == {"offered": True}
        async def offer_taken() -> None:  # white-box: the OFFER claimed the room, its receive is posted
            while rx._rooms[501].offer is None or rx._rooms[501].slot is None:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(offer_taken(), 30)
        t0 = time.monotonic()
        rx.cancel(501)
        with pytest.raises(TransferError) as err:
            await posted
        assert err.value.reason == "cancelled"
        assert time.monotonic() - t0 < DRAIN_S  # the receive was cancelled, not left to drain
        reports, rc = await late.finish()
        assert rc == 0
        assert (by_room(reports)[501]["ok"], by_room(reports)[501]["reason"]) == (False, "cancelled")
        assert {"late_payload": "taken"} in reports  # truncated away by the receiver, sender released

        # The room id is free again and a normal transfer works; the cancelled buffer was never written.
        into = torch.zeros(MB, dtype=torch.uint8)
        again = rx.expect(501, MB, into, deadline_s=30)
        sender = await Sender.spawn(rx, [[{"room": 501, "nbytes": MB}]])
        assert (await again).first_token == 501
        reports, rc = await sender.finish()
        assert rc == 0 and sha(into, MB) == reports[0]["sha256"]
        assert not old.any()

    run(body)


def test_payload_landing_before_its_offer_waits_for_the_offer():
    async def body(rx: KVReceiver) -> None:
        into = torch.zeros(4 * MB, dtype=torch.uint8)
        t0 = time.monotonic()
        result = rx.expect(801, 4 * MB, into, deadline_s=30)
        sender = await Sender.spawn(rx, [[{"room": 801, "nbytes": 4 * MB}]], mode="offer_late")
        async def landed() -> None:  # white-box: all bytes are in, the OFFER is not
            while not rx._rooms[801].landed:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(landed(), 30)
        assert rx._rooms[801].offer is None and not result.done()
        assert (await result) == Trailer(801 % 1000, -0.25, (4 * MB,))
        assert time.monotonic() - t0 >= 0.5
        reports, rc = await sender.finish()
        assert rc == 0 and reports[0]["ok"] and sha(into, 4 * MB) == reports[0]["sha256"]

    run(body)


def test_a_room_failed_by_its_payload_tells_the_late_offer_why():
    async def body(rx: KVReceiver) -> None:
        result = rx.expect(811, 2 * MB, torch.zeros(2 * MB, dtype=torch.uint8), deadline_s=30)
        sender = await Sender.spawn(rx, [[{"room": 811, "nbytes": 3 * MB}]], mode="offer_late")
        with pytest.raises(TransferError) as err:
            await result
        assert err.value.reason == "size_mismatch"
        reports, rc = await sender.finish()
        assert rc == 0 and (reports[0]["ok"], reports[0]["reason"]) == (False, "size_mismatch")
        assert rx._consumed_early == {}  # the OFFER took its answer

    run(body)


def test_a_failed_room_whose_offer_never_comes_is_forgotten(monkeypatch):
    monkeypatch.setattr(ucx_receiver, "LATE_OFFER_S", 0.5)

    async def body(rx: KVReceiver) -> None:
        result = rx.expect(821, 2 * MB, torch.zeros(2 * MB, dtype=torch.uint8), deadline_s=30)
        sender = await Sender.spawn(rx, [[{"room": 821, "nbytes": 3 * MB}]], mode="offer_late", offer_delay=30)
        with pytest.raises(TransferError):
            await result
        assert list(rx._consumed_early.values()) == ["size_mismatch"]
        sender.proc.kill()  # dies before its OFFER
        await asyncio.sleep(1.0)
        assert rx._consumed_early == {}

    run(body)


def test_stale_push_address_never_lands_in_a_reexpected_room():
    """A room expected again gets a new tag: a push to the old address is refused, the new buffer untouched."""
    async def body(rx: KVReceiver) -> None:
        first = rx.expect(901, MB, torch.zeros(MB, dtype=torch.uint8), deadline_s=30)
        stale = base64.b64encode(rx.push_address(901)).decode()
        rx.cancel(901)
        with pytest.raises(TransferError):
            await first
        into = torch.zeros(MB, dtype=torch.uint8)
        again = rx.expect(901, MB, into, deadline_s=30)
        old = await Sender.spawn(rx, [[{"room": 901, "nbytes": MB, "address": stale}]])
        reports, rc = await old.finish()
        assert rc == 0 and (reports[0]["ok"], reports[0]["reason"]) == (False, "unknown_room")
        assert not into.any() and not again.done()
        sender = await Sender.spawn(rx, [[{"room": 901, "nbytes": MB}]])
        assert (await again).first_token == 901
        reports, rc = await sender.finish()
        assert rc == 0 and sha(into, MB) == reports[0]["sha256"]

    run(body)


def test_burst_of_rooms_lands_without_ucxx_warnings(capfd):
    """A hundred and fifty rooms at once: each posts a receive, each send posts two requests. ucxx would
    print "No Futures available" on stdout (breaking the sender's JSON lines too) unless its pool is kept full."""
    rooms = range(1000, 1150)

    async def body(rx: KVReceiver) -> None:
        into = {room: torch.zeros(64 << 10, dtype=torch.uint8) for room in rooms}
        futures = [rx.expect(room, 64 << 10, into[room], deadline_s=60) for room in rooms]
        sender = await Sender.spawn(rx, [[{"room": room, "nbytes": 64 << 10} for room in rooms]])
        trailers = await asyncio.gather(*futures)
        assert [t.first_token for t in trailers] == [room % 1000 for room in rooms]
        reports, rc = await sender.finish()  # every line must parse as JSON
        assert rc == 0 and all(by_room(reports)[room]["ok"] for room in rooms)
        assert all(sha(into[r], 64 << 10) == by_room(reports)[r]["sha256"] for r in rooms)

    run(body)
    assert "UCXX WARN" not in capfd.readouterr().out


def test_non_contiguous_buffer_is_refused():
    async def body(rx: KVReceiver) -> None:
        with pytest.raises(ValueError, match="contiguous"):
            rx.expect(601, 64, torch.zeros(16, 16, dtype=torch.uint8).t(), deadline_s=1)

    run(body)
