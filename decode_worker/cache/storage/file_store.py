"""The default L3 backend: one file per page, ``root/ab/abcd….page``, renamed into place, capped by LRU
(docs/architecture.md). Blocking calls run in threads.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from decode_worker.cache.storage.base import StoreBackend

SUFFIX = ".page"
LOW_WATERMARK = 0.9  # clean-up frees down to this fraction of the cap, so it runs in batches
STALE_TMP_S = 3600.0  # temporary files this old are leftovers of a crashed writer


class FileStore(StoreBackend):
    name = "file"

    def __init__(self, root: str | Path, max_bytes: int):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        self._bytes = 0
        self._scan()

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def path(self, key: str) -> Path:
        return self.root / key[:2] / (key + SUFFIX)

    async def exists(self, keys: list[str]) -> int:
        return await asyncio.to_thread(self._exists, keys)

    async def get(self, keys: list[str]) -> list[bytes | None]:
        return await asyncio.to_thread(self._get, keys)

    async def put(self, keys: list[str], records: list[memoryview]) -> None:
        await asyncio.to_thread(self._put, keys, records)

    async def delete(self, keys: list[str]) -> None:
        await asyncio.to_thread(self._delete, keys)

    # -- blocking halves, run in threads ------------------------------------------------------------------------

    def _exists(self, keys: list[str]) -> int:
        for i, key in enumerate(keys):
            if not self.path(key).is_file():  # the folder, not our index: other workers may share it
                return i
        return len(keys)

    def _get(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            path = self.path(key)
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # never written, or cleaned up by us or a worker sharing the folder
                self._forget(key)
                out.append(None)
                continue
            self._touch(key, len(data), path)
            out.append(data)
        return out

    def _put(self, keys: list[str], records: list[memoryview]) -> None:
        for key, record in zip(keys, records, strict=True):
            path = self.path(key)
            if path.is_file():  # same key, same tokens, same layout: the stored page is as good as ours
                self._touch(key, len(record), path)
                continue
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_name(f".{key}.{os.urandom(6).hex()}.tmp")  # unique across threads, pods and hosts
            try:
                tmp.write_bytes(record)
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            self._touch(key, len(record))
        self._clean_up()

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            self.path(key).unlink(missing_ok=True)
            self._forget(key)

    # -- LRU index ------------------------------------------------------------------------------------------------

    def _touch(self, key: str, size: int, path: Path | None = None) -> None:
        """Mark ``key`` most recent; with ``path`` also its mtime, which outlives a restart."""
        if path is not None:
            try:
                os.utime(path)
            except FileNotFoundError:
                self._forget(key)
                return
        with self._lock:
            self._bytes += size - self._lru.pop(key, 0)
            self._lru[key] = size

    def _forget(self, key: str) -> None:
        with self._lock:
            self._bytes -= self._lru.pop(key, 0)

    def _clean_up(self) -> None:
        """Delete least recent pages down to the low watermark."""
        victims = []
        with self._lock:
            if self._bytes <= self.max_bytes:
                return
            while self._lru and self._bytes > self.max_bytes * LOW_WATERMARK:
                key, size = self._lru.popitem(last=False)
                self._bytes -= size
                victims.append(key)
        for key in victims:
            self.path(key).unlink(missing_ok=True)

    def _scan(self) -> None:
        """Index the pages a previous run left, oldest first; remove stray temporary files."""
        found, now = [], time.time()
        for sub in self.root.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub):
                try:
                    st = entry.stat()
                except FileNotFoundError:  # removed by a worker sharing the folder
                    continue
                if entry.name.endswith(SUFFIX):
                    found.append((st.st_mtime, entry.name[: -len(SUFFIX)], st.st_size))
                elif entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                    Path(entry.path).unlink(missing_ok=True)
        for _, key, size in sorted(found):
            self._lru[key] = size
            self._bytes += size
        self._clean_up()
