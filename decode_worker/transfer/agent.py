"""This worker's NIXL agent over its KV pool: peers, page reads, notifications; no progress thread (it spins a core)."""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL's own handler prints INFO lines on stdout
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

from nixl_cu12 import nixl_agent, nixl_agent_config, nixl_thread_sync_t  # noqa: E402

from decode_worker.core.shared_memory import MappedRegion, SharedFile, boot_id  # noqa: E402
from decode_worker.core.threads import started_pool  # noqa: E402

from .deadline import DeadlineJob, T, run_to_the_end  # noqa: E402
from .descriptors import PoolDescriptor  # noqa: E402
from .pool_share import ask_for_pool, serve_pool, settled  # noqa: E402

logger = logging.getLogger(__name__)
_nixl_logger = logging.getLogger("nixl")  # through our handlers (stderr), never stdout
_nixl_logger.handlers.clear()
_nixl_logger.propagate = True

REASONS = ("timeout", "peer_lost", "size_mismatch", "unknown_room", "cancelled", "unstoppable")
"""Why a transfer failed; also the ``reason`` label of ``transfer_failures_total``."""
INLINE_BYTES = 2 << 20
"""Reads below this are posted on the event loop: the hop to the copy thread costs more than the copy."""
POLL_S = 0.0005
"""Polling period of a read the post did not finish (a transport that completes asynchronously)."""
RETIRE_S = 5.0
"""How long a read that could not be cancelled may take to end before the read fails as ``unstoppable``."""
MAP_RETRY_S = (1.0, 60.0)
"""First and longest wait before a same-host peer whose pool could not be had (its socket busy, say) is asked
again; the wait doubles in between. Its pages are read over NIXL meanwhile."""
SHARED_MEMORY_ENV = "DECODE_WORKER_PD_SHARED_MEMORY"
"""``off`` (or false, 0, no): neither map a peer's pool nor share ours; every read goes over NIXL. Default ``on``."""


def shared_memory_enabled() -> bool:
    value = os.environ.get(SHARED_MEMORY_ENV, "").strip().lower() or "on"
    if value not in ("on", "1", "true", "yes", "off", "0", "false", "no"):
        raise ValueError(f"{SHARED_MEMORY_ENV} must be on or off (or true/false, 1/0, yes/no), not {value!r}")
    return value in ("on", "1", "true", "yes")


class TransferError(Exception):
    """One room's failed transfer; other rooms go on."""

    def __init__(self, room: int, reason: str, detail: str = ""):
        if reason not in REASONS:
            raise ValueError(f"unknown transfer failure reason {reason!r}")
        self.room = room
        self.reason = reason
        self.detail = detail
        super().__init__(f"KV transfer of room {room} failed: {reason}" + (f" ({detail})" if detail else ""))


@dataclass(eq=False)
class Peer:
    """A loaded remote agent and its pool's prepared descriptors."""

    name: str
    pool: PoolDescriptor
    dlist: object  # nixl_prepped_dlist_handle
    mapped: MappedRegion | None = None  # its pool, mapped read-only here: pages are copied without NIXL
    mapping: asyncio.Task | None = None  # the first ask for its pool (``add_peer`` under a loop): reads wait for it
    map_asks: int = 0  # asks for its pool so far
    next_ask: asyncio.TimerHandle | None = None  # the next, after one failed
    connected: bool = False  # a NIXL read reached it, so notifications to it go out at once


class KVAgent:
    """Our NIXL agent over the KV pool ``buffer`` (host or device memory)."""

    def __init__(self, buffer: torch.Tensor, role: str, shared: SharedFile | None = None):
        """``shared``: the memory file behind ``buffer``, served to same-host peers."""
        self.name = f"{role}-{uuid.uuid4().hex[:12]}"
        self._map_peers = shared_memory_enabled()  # a bad value stops the worker at start, naming the variable
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                   sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)  # the copy thread posts too
        self.agent = nixl_agent(self.name, config)
        self._pool_server = serve_pool(shared) if shared is not None and self._map_peers else None
        self.pool = PoolDescriptor.of(self.name, buffer, self._pool_server and self._pool_server.region)
        self._buffer = buffer  # registered memory must outlive its registration
        self._registered = self.agent.register_memory([buffer])
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.pool.table(), self.pool.mem)
        self._peers: dict[str, Peer] = {}
        self._scratch: tuple | None = None  # a registered page for ``_connect``'s test reads, made on first use
        self._extra: list[tuple[torch.Tensor, object]] = []  # other registered buffers, with their handles
        self._copier = started_pool(1, "kv-read")
        self._loader = started_pool(1, "kv-peer")  # loads one peer at a time
        self._loading: dict[str, asyncio.Task[Peer]] = {}  # by agent name: a load a second handshake waits for too

    def register_extra(self, buffer: torch.Tensor) -> None:
        """Register another host buffer (SGLang's aux slots) for peers to write; kept until ``close``."""
        self._extra.append((buffer, self.agent.register_memory([buffer])))

    def metadata(self) -> bytes:
        """What peers load to read our pool and notify us."""
        return self.agent.get_agent_metadata()

    def peer(self, name: str) -> Peer | None:
        return self._peers.get(name)

    def add_peer(self, metadata: bytes, pool: PoolDescriptor) -> Peer:
        """Load a peer and prepare its descriptors (blocking); kept until ``drop_peer``."""
        return self._register(pool, *self._prepare(metadata, pool))

    async def load_peer(self, metadata: bytes, pool: PoolDescriptor, timeout_s: float) -> Peer:
        """``add_peer`` off the loop, awaited at most ``timeout_s``; a late load still keeps the peer."""
        if (peer := self._peers.get(pool.agent)) is not None:
            return peer
        if (task := self._loading.get(pool.agent)) is None:
            task = self._loading[pool.agent] = asyncio.get_running_loop().create_task(self._load(metadata, pool))
            task.add_done_callback(lambda t: self._loaded(pool.agent, t))
        return await asyncio.wait_for(asyncio.shield(task), timeout_s)

    async def _load(self, metadata: bytes, pool: PoolDescriptor) -> Peer:
        prepared = await asyncio.get_running_loop().run_in_executor(self._loader, self._prepare, metadata, pool)
        return self._register(pool, *prepared)

    def _loaded(self, name: str, task: asyncio.Task[Peer]) -> None:
        self._loading.pop(name, None)
        if not task.cancelled() and (e := task.exception()) is not None:  # its waiters were told; if none is left
            logger.debug("loading peer %s failed: %r", name, e)

    def _prepare(self, metadata: bytes, pool: PoolDescriptor) -> tuple[str, object]:
        """The blocking part of ``add_peer``."""
        name = self.agent.add_remote_agent(metadata)
        if isinstance(name, bytes):
            name = name.decode()
        if name != pool.agent:
            self.agent.remove_remote_agent(name)
            raise ValueError(f"peer metadata names agent {name!r}, its pool names {pool.agent!r}")
        return name, self.agent.prep_xfer_dlist(name, pool.table(), pool.mem)

    def _register(self, pool: PoolDescriptor, name: str, dlist: object) -> Peer:
        self._peers[name] = peer = Peer(name, pool, dlist)
        self._map(peer)
        return peer

    def drop_peer(self, name: str) -> None:
        """Forget a replaced peer (a restarted prefill's old agent)."""
        peer = self._peers.pop(name, None)
        if peer is not None:
            if peer.next_ask is not None:
                peer.next_ask.cancel()
            self._unmap(peer)
            peer.dlist.release()
            self.agent.remove_remote_agent(name)

    def _map(self, peer: Peer) -> None:
        """Ask for a same-host peer's pool off the loop; NIXL reads it meanwhile."""
        region = peer.pool.shared
        if region is None or "VRAM" in (peer.pool.mem, self.pool.mem) or not self._map_peers:
            return
        if region.host != boot_id():
            logger.info("peer %s shares its KV pool on another host: it is read over NIXL", peer.name)
            return
        if self._peers.get(peer.name) is not peer:  # dropped while it waited to ask again
            return
        peer.next_ask = None
        asking = ask_for_pool(region, peer.pool.num_pages, peer.pool.page_bytes,
                              lambda mapped, why: self._attach(peer, mapped, why))
        if peer.map_asks == 0:
            peer.mapping = asking
        peer.map_asks += 1

    def _attach(self, peer: Peer, mapped: MappedRegion | None, why: str) -> None:
        """Give the peer its mapping (dropped when it exits), or log why not and ask again later."""
        if self._peers.get(peer.name) is not peer:  # dropped while its pool was asked for
            if mapped is not None:
                mapped.close()
        elif mapped is None:
            self._ask_again(peer, why)
        else:
            peer.mapped = mapped
            after = f" (ask {peer.map_asks})" if peer.map_asks > 1 else ""
            logger.info("peer %s is on this host: its KV pages are copied from its shared pool%s", peer.name, after)
            try:
                asyncio.get_running_loop().add_reader(mapped.pidfd, self._unmap, peer)
            except RuntimeError:  # no loop here: reads check for the peer's exit themselves
                pass

    def _ask_again(self, peer: Peer, why: str) -> None:
        """A failed ask (a flood of local connections on its socket, say) is retried with backoff under a loop."""
        wait = min(MAP_RETRY_S[0] * 2 ** (peer.map_asks - 1), MAP_RETRY_S[1])
        logger.log(logging.WARNING if peer.map_asks == 1 else logging.DEBUG,
                   "peer %s shares its KV pool on this host, but it is read over NIXL: %s; asking again in %.1f s",
                   peer.name, why, wait)
        try:
            peer.next_ask = asyncio.get_running_loop().call_later(wait, self._map, peer)
        except RuntimeError:  # no loop (a blocking ``add_peer``): NIXL it stays
            pass

    async def _connect(self, room: int, peer: Peer, deadline: float) -> bool:
        """Before mapped copies, one NIXL read of page 0: UCX connects lazily, and release notifications need it."""
        if self._scratch is None:
            page = torch.empty(self.pool.page_bytes, dtype=torch.uint8)
            self._scratch = (page, self.agent.register_memory([page]),
                             self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(page.data_ptr(), page.numel(), 0)], "DRAM"))
        try:
            handle = self.agent.make_prepped_xfer("READ", self._scratch[2], [0], peer.dlist, [0])
        except Exception as e:  # nixl raises its own error types for an unknown or lost peer
            logger.debug("test read of %s: %r", peer.name, e)
            return False
        state = self._post(handle)
        while state == "PROC" and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
            state = self._state(handle)
        await self._retire(room, handle, state)  # one that cannot be stopped writes only our scratch page
        return state == "DONE"

    def _unmap(self, peer: Peer) -> None:
        if peer.mapped is None:
            return
        try:
            asyncio.get_running_loop().remove_reader(peer.mapped.pidfd)
        except RuntimeError:
            pass
        peer.mapped.close()
        peer.mapped = None

    async def read(self, room: int, peer: Peer, into: list[int], source: list[int], deadline: float) -> None:
        """Copy ``peer``'s pages ``source`` into our ``into`` before ``deadline`` (``time.monotonic()``) or raise
        ``TransferError``; ``ValueError`` for a page outside a pool.

        Ends only once nothing writes into ``into``, even if cancelled.
        """
        if len(into) != len(source) or peer.pool.page_bytes != self.pool.page_bytes:
            raise TransferError(room, "size_mismatch", f"{len(source)} pages of {peer.pool.page_bytes} bytes into "
                                                       f"{len(into)} of {self.pool.page_bytes}")
        if self._peers.get(peer.name) is not peer:  # dropped (replaced by a restarted prefill): its handles are gone
            raise TransferError(room, "peer_lost", f"agent {peer.name} was replaced")
        ours, theirs = self.pool.indices(into), peer.pool.indices(source)  # ValueError for a page outside a pool
        await settled(peer.mapping, deadline)
        if peer.mapped is not None and peer.mapped.owner_exited():
            self._unmap(peer)  # it died: fail as a NIXL read of a dead peer does, without its memory
        if peer.mapped is not None and not peer.connected:
            peer.connected = await self._connect(room, peer, deadline)
            if not peer.connected:
                self._unmap(peer)
                logger.info("peer %s: a test read of one page failed, so its pages are read over NIXL", peer.name)
        inline = len(into) * self.pool.page_bytes < INLINE_BYTES
        if peer.mapped is not None:
            pages = peer.mapped.pages  # held by the copy, so the mapping outlives it even if the peer exits now
            await self._in_time(room, deadline, inline, self._copy_mapped, pages, ours, theirs)
            return
        try:
            handle = self.agent.make_prepped_xfer("READ", self._local, ours, peer.dlist, theirs)
        except Exception as e:  # nixl raises its own error types for an unknown or lost peer
            raise TransferError(room, "peer_lost", f"cannot prepare the read: {e!r}") from e
        state = "PROC"
        try:
            state = await self._in_time(room, deadline, inline, self._post, handle)
            while state == "PROC":
                if time.monotonic() >= deadline:
                    raise TransferError(room, "timeout", "reading the peer's pages")
                await asyncio.sleep(POLL_S)
                state = self._state(handle)
                if state == "DONE" and time.monotonic() > deadline:  # it ended no earlier than we saw it end
                    raise TransferError(room, "timeout", "the read ended after its deadline: its bytes are not used")
            if state != "DONE":
                raise TransferError(room, "peer_lost", "the peer's pages could not be read")
        finally:
            if not await self._retire(room, handle, state):
                raise TransferError(room, "unstoppable", "the read could not be stopped: its pages may still be "
                                                         "written and must never be reused")

    async def _in_time(self, room: int, deadline: float, inline: bool, work: Callable[..., T], *args) -> T:
        """``work(*args)`` inline or on the copy thread; its result only if it ran wholly before ``deadline``."""
        job = DeadlineJob(deadline)
        if inline:
            return self._checked(room, job, job.run(work, *args))
        future = asyncio.get_running_loop().run_in_executor(self._copier, job.run, work, *args)
        cancelled = False
        try:
            await asyncio.wait_for(asyncio.shield(future), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            if job.drop():
                raise TransferError(room, "timeout", "the copy thread did not reach the read before its deadline") from None
        except asyncio.CancelledError:
            if job.drop():
                raise
            cancelled = True  # it writes into our pages: wait for its end first
        try:
            result = await run_to_the_end(future, RETIRE_S)
        except TimeoutError:
            raise TransferError(room, "unstoppable", "the copy thread did not end the read") from None
        if cancelled:
            raise asyncio.CancelledError
        return self._checked(room, job, result)

    @staticmethod
    def _checked(room: int, job: DeadlineJob, result: T) -> T:
        if why := job.missed():
            raise TransferError(room, "timeout", why)
        return result

    def notify(self, peer: str, message: bytes) -> bool:
        """Notify outside any read (an attached one slows the read); False when the peer is gone."""
        try:
            self.agent.send_notif(peer, message)
            return True
        except Exception as e:  # nixl raises its own error types for a lost peer
            logger.debug("notification to %s dropped: %r", peer, e)
            return False

    def notifications(self) -> list[bytes]:
        """Notifications received since the last call, from any peer."""
        return [m for messages in self.agent.get_new_notifs().values() for m in messages]

    def close(self) -> None:
        if self._pool_server is not None:
            self._pool_server.close()
        self._copier.shutdown(wait=True)
        self._loader.shutdown(wait=True)
        for name in list(self._peers):
            self.drop_peer(name)
        self._local.release()
        self.agent.deregister_memory(self._registered)
        for _, registered in self._extra:
            self.agent.deregister_memory(registered)
        if self._scratch is not None:
            self._scratch[2].release()
            self.agent.deregister_memory(self._scratch[1])

    def _copy_mapped(self, theirs: torch.Tensor, into: list[int], source: list[int]) -> None:
        """Copy from a peer's mapping (indices checked by ``read``), one memmove per consecutive run."""
        size, ours, base = self.pool.page_bytes, self._buffer.data_ptr(), theirs.data_ptr()
        start, n = 0, len(into)
        while start < n:
            end = start + 1
            while end < n and into[end] == into[start] + end - start and source[end] == source[start] + end - start:
                end += 1
            ctypes.memmove(ours + into[start] * size, base + source[start] * size, (end - start) * size)
            start = end

    def _post(self, handle) -> str:
        try:
            return self.agent.transfer(handle)
        except Exception as e:  # a peer that died is an error status or an exception, depending on the transport
            logger.debug("posting a KV read failed: %r", e)
            return "ERR"

    def _state(self, handle) -> str:
        try:
            return self.agent.check_xfer_state(handle)
        except Exception as e:
            logger.debug("KV read failed: %r", e)
            return "ERR"

    async def _retire(self, room: int, handle, state: str) -> bool:
        """Release the transfer, waiting up to ``RETIRE_S`` for its end; False if unstoppable: never reuse its pages."""
        for _ in range(int(RETIRE_S / POLL_S)):
            try:
                handle.release()
                return True
            except Exception:  # still active and not cancellable: wait for it to end
                await asyncio.sleep(POLL_S)
                state = self._state(handle)
        logger.error("KV read of room %d could not be stopped (%s)", room, state)
        return False
