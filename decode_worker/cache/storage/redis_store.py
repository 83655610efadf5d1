"""Redis / Valkey backend: one string per page, ``dwkv:<page key>``; no retries (the tier's circuit decides)."""
from __future__ import annotations

from redis import exceptions as rexc
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from decode_worker.cache.storage.base import StoreBackend

NAMESPACE = "dwkv:"


class RedisStore(StoreBackend):
    name = "redis"

    def __init__(self, url: str, timeout_s: float = 2.0):
        self.url = url
        self.client = Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )

    @staticmethod
    def _names(keys: list[str]) -> list[str]:
        return [NAMESPACE + k for k in keys]

    async def exists(self, keys: list[str]) -> int:
        if not keys:
            return 0
        async with self.client.pipeline(transaction=False) as pipe:
            for name in self._names(keys):
                pipe.exists(name)
            found = await pipe.execute()
        return next((i for i, n in enumerate(found) if not n), len(keys))

    async def get(self, keys: list[str]) -> list[bytes | None]:
        return await self.client.mget(self._names(keys)) if keys else []

    async def put(self, keys: list[str], records: list[memoryview]) -> None:
        if not keys:
            return
        async with self.client.pipeline(transaction=False) as pipe:
            for name, record in zip(self._names(keys), records, strict=True):
                pipe.set(name, record, nx=True)
            await pipe.execute()

    async def delete(self, keys: list[str]) -> None:
        if keys:
            await self.client.delete(*self._names(keys))

    def failure_reason(self, exc: Exception) -> str:
        if isinstance(exc, rexc.TimeoutError):
            return "timeout"
        if isinstance(exc, rexc.ConnectionError):  # refused, reset, still loading, auth
            return "down"
        if isinstance(exc, rexc.OutOfMemoryError):
            return "full"
        return super().failure_reason(exc)

    async def close(self) -> None:
        await self.client.aclose()
