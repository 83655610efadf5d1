"""The cache's KV events over ZMQ as vLLM and SGLang send them (README.md); ``put`` never blocks."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import msgpack
import zmq

from decode_worker.cache.kv_events import AllBlocksCleared, KVEvent, wire

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
MAX_BATCH = 1024  # events per message: bounds one message's size when the cache changes a lot at once
LOST = AllBlocksCleared()  # queued where events were dropped; the sender turns it into a sequence gap + a clear
IDLE_POLL_S = 0.05  # how often an idle sender looks at replay requests and at close


def encode_batch(events: list[KVEvent], ts: float, encoding: str = "array", dp_rank: int = 0) -> bytes:
    """One message's msgpack payload: the batch is an array in both encodings (vLLM's ``array_like`` batch), rank
    included; ``encoding`` is the events' (``wire``)."""
    return msgpack.packb([ts, [wire(e, encoding) for e in events], dp_rank], use_bin_type=True)


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or local address binds, a concrete host connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """A PUB socket (and optional replay ROUTER) fed by one sender thread."""

    def __init__(self, endpoint: str = "tcp://*:5557", *, topic: str = "", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000,
                 event_encoding: str = "array", on_drop: Callable[[], None] | None = None):
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.encoding = event_encoding
        self.dropped = 0  # events lost to a full queue
        self.on_drop = on_drop  # called once per event dropped (the metric)
        self._lost = False  # events were dropped and no LOST marker is queued after them yet (event loop only)
        self.sent = 0  # batches sent
        self._topic = topic.encode()
        self._queue: queue.Queue[KVEvent] = queue.Queue(max_queue_size)  # plus LOST markers
        self._history: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._closing = threading.Event()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            if binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if self._replay is not None:
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"KV events: cannot open {endpoint} / replay {replay_endpoint}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def put(self, event: KVEvent) -> None:
        """Queue one event, never blocking; a full queue drops it (sequence gap + clear)."""
        try:
            if self._lost:  # the first event queued after a drop goes behind a marker of the drop
                self._queue.put_nowait(LOST)
                self._lost = False
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1
            self._lost = True
            if self.on_drop is not None:
                self.on_drop()
            if self.dropped == 1:
                log.warning("KV events: queue full, dropping events; subscribers see a sequence gap and an "
                            "AllBlocksCleared")

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (within ``timeout_s``), then close."""
        self._closing.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("KV events: sender still busy after %.1f s; closing anyway", timeout_s)
            return  # the daemon thread owns the sockets until it stops; the process exit reclaims them
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None:
                self._serve_replays()
            try:
                events = [self._queue.get(timeout=IDLE_POLL_S)]
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            while len(events) < MAX_BATCH:
                try:
                    events.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            batch: list[KVEvent] = []
            for event in events:
                if event is LOST:  # events were dropped here: send what came before, then the gap and the clear
                    seq = self._send(seq, batch) + 1
                    batch = [AllBlocksCleared()]
                else:
                    batch.append(event)
            seq = self._send(seq, batch)

    def _send(self, seq: int, events: list[KVEvent]) -> int:
        """Send ``events`` as batch ``seq``; the next number."""
        if not events:
            return seq
        try:
            payload = encode_batch(events, time.time(), self.encoding)
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], copy=False)
        except Exception:  # a send must not kill the sender; the gap shows in the sequence numbers
            log.exception("KV events: sending batch %d failed", seq)
        else:
            self._history.append((seq, payload))
            self.sent += 1
        return seq + 1

    def _serve_replays(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: malformed replay request (%d frames)", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._history):  # each as it went out on PUB: topic, sequence, payload
                if seq >= start:
                    self._replay.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), payload])
            self._replay.send_multipart([client, b"", b"", END_OF_REPLAY, b""])
