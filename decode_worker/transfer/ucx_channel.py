"""The process-wide UCX runtime shared by ``KVReceiver`` and ``KVSender``: every ucxx call goes through here.

ucxx keeps one worker per process, and its completion notifier is tied to the event loop it was created
on, so both roles share one runtime that is started inside the running loop and reset when the last
user closes (that also joins ucxx's threads, which otherwise abort the interpreter at exit).

Progress mode: ``thread`` with Python futures. ucxx awaits a request either through a future set by its
notifier thread, or, in every other configuration (``blocking``, ``polling``, plain ``thread``), by
spinning the event loop with ``asyncio.sleep(0)`` until the request completes. Once a link is up both
sides always have a control receive pending, so the spinning modes burn most of a core while idle, the
core the decode step needs. ``bench/bench_transfer.py --progress-mode M [--busy]``, two processes on this
2-core machine (shared, so ranges over two runs; one transfer at a time, GB/s, idle / busy*):

    mode              idle CPU, link up   1 MB                   16 MB                 64 MB
    thread + futures  0.02 core           0.48-0.85 / 0.69-0.72  2.5-5.0 / 1.9-3.9     4.3-6.6 / 4.9-5.2
    blocking          0.7 core            0.09 / 0.06-0.07       1.6 / 0.8-1.0         1.5-2.1 / 1.2

    * busy: the receiving process runs a torch matmul loop in a second thread, as the decode step will.

Plain ``thread`` (no futures) spun 0.98 core idle in a bare ucxx test; ``thread-polling`` busy-polls a
core by design. Both are unusable here.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import torch  # noqa: E402
import ucxx  # noqa: E402
from ucxx._lib_async import Endpoint, Listener  # noqa: E402  (the types ucxx hands out)
from ucxx.exceptions import UCXMessageTruncatedError, UCXMsgTruncated  # noqa: E402

logger = logging.getLogger(__name__)

PROGRESS_MODE = "thread"
CLOSE_PERIOD_NS = 100_000_000
"""Longest an endpoint close may block the loop; a dead peer would otherwise hold it for ucxx's 10 s."""


@dataclass
class _Runtime:
    loop: asyncio.AbstractEventLoop | None = None
    users: int = 0


_runtime = _Runtime()


def acquire() -> None:
    """Start ucxx on the running loop, or join the runtime already running there."""
    loop = asyncio.get_running_loop()
    if _runtime.loop is not loop:
        if _runtime.users:
            raise RuntimeError("the UCX runtime is in use on another event loop")
        ucxx.init(progress_mode=PROGRESS_MODE, enable_python_future=True)
        _runtime.loop = loop
    _runtime.users += 1


def release() -> None:
    """Drop one user; the last one shuts ucxx down so its threads exit before the interpreter does."""
    _runtime.users -= 1
    if _runtime.users == 0:
        _runtime.loop = None
        ucxx.reset()


def worker_address() -> bytes:
    """This process's UCX worker address: what a peer needs for a bulk endpoint to us."""
    return ucxx.get_worker_address().tobytes()


class _SenderGoneWhileAccepted(logging.Filter):
    """ucxx logs a traceback at ERROR when a peer dies while its connection is being accepted, before our
    handler ever sees the endpoint. For the KV receiver that is an expected failure (a prefill crashed while
    connecting) that costs nothing: the rooms it would have sent fail by their deadline. One warning line."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) == 2 and args[0] == "Unexpected error in listener handler coroutine" \
                and "exchange_peer_info" in args[1] and "ConnectionReset" in args[1]:
            logger.warning("a KV sender was lost while its connection was being accepted: %s",
                           args[1].rsplit("\n", 1)[-1])
            return False
        return True


def listen(handler: Callable[[Endpoint], Awaitable[None]], port: int) -> Listener:
    """Accept control connections; error handling stays on so a dead peer fails its endpoint."""
    ucx_logger = logging.getLogger("ucx")  # ucxx's own
    if not any(isinstance(f, _SenderGoneWhileAccepted) for f in ucx_logger.filters):
        ucx_logger.addFilter(_SenderGoneWhileAccepted())
    return ucxx.create_listener(handler, port=port)


async def connect_control(host: str, port: int) -> Endpoint:
    return await ucxx.create_endpoint(host, port)


async def connect_bulk(worker: bytes) -> Endpoint:
    """Endpoint for payloads. Without error handling UCX may use shared memory / CMA, with it only TCP."""
    address = ucxx.get_ucx_address_from_buffer(worker)
    return await ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=False)


def close_endpoint(ep: Endpoint | None) -> None:
    """Close an endpoint now; ucxx cancels the receives that were posted through it."""
    if ep is not None:
        ep.abort(period=CLOSE_PERIOD_NS)


def _reserve_request_future() -> None:
    """Top up ucxx's pool of completion futures before posting a request.

    Its notifier thread refills the pool only when it wakes, so a burst of posted receives (one per expected
    room: a hundred PD requests arriving at once) would empty it, and ucxx then prints a warning on stdout
    for every further request. A top-up that finds the pool full costs ~0.1 us.
    """
    ucxx.core._get_ctx().worker.populate_python_futures_pool()  # no public accessor; ucxx is pinned for this


async def send(ep: Endpoint, buf, tag: int | None = None) -> None:
    """Post a send on ``ep`` (under exactly ``tag`` when given) and wait for it; every send goes through here."""
    _reserve_request_future()
    await (ep.send(buf) if tag is None else ep.send(buf, tag=tag, force_tag=True))


async def recv(ep: Endpoint, buf, tag: int | None = None) -> None:
    """Post a receive on ``ep`` (matching exactly ``tag`` when given) and wait for it; every receive goes
    through here."""
    _reserve_request_future()
    await (ep.recv(buf) if tag is None else ep.recv(buf, tag=tag, force_tag=True))


def is_truncation(e: Exception) -> bool:
    """Whether a receive failed because the message was longer than its buffer (UCX then dropped the rest)."""
    return isinstance(e, (UCXMessageTruncatedError, UCXMsgTruncated))


async def send_quietly(ep: Endpoint, data: bytes) -> None:
    """Send a control message to a peer that may be gone; its loss is noticed by our receive loop."""
    try:
        await send(ep, data)
    except Exception as e:  # ucxx raises its own error types on a dead endpoint
        logger.debug("KV control message to a lost peer dropped: %r", e)


def as_buffer(t: torch.Tensor, nbytes: int | None = None):
    """The bytes of a contiguous tensor as something ucxx reads or writes in place (no copy).

    ucxx writes a non-contiguous array as if it were contiguous, so refuse those outright.
    """
    if not t.is_contiguous():
        raise ValueError("KV transfer buffers must be contiguous tensors")
    flat = t.reshape(-1).view(torch.uint8)
    if nbytes is not None:
        if nbytes > flat.numel():
            raise ValueError(f"tensor holds {flat.numel()} bytes, {nbytes} expected")
        flat = flat[:nbytes]
    return flat.numpy() if flat.device.type == "cpu" else flat
