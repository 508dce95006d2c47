"""Request state store: one async interface (StateStore), backed by Redis when a URL is configured, else memory."""
from __future__ import annotations

from specdec.state.base import (
    CANCELLED,
    FAILED,
    FINISHED,
    RUNNING,
    STATUSES,
    Commit,
    RequestExists,
    RequestRecord,
    StateStore,
    StoreError,
    StoreUnavailable,
    UnknownRequest,
)
from specdec.state.memory import MemoryStore
from specdec.state.redis_store import RedisStore


def open_store(url: str | None, namespace: str = "specdec", ttl_s: float = 86400) -> StateStore:
    """RedisStore at `url` when set, else a process-local MemoryStore (no sharing, no durability).
    Connecting is lazy: call `ping()` to check the Redis is there."""
    return RedisStore(url, namespace=namespace, ttl_s=ttl_s) if url else MemoryStore(ttl_s=ttl_s)


__all__ = ["open_store", "StateStore", "MemoryStore", "RedisStore", "RequestRecord", "Commit", "StoreError",
           "RequestExists", "UnknownRequest", "StoreUnavailable", "RUNNING", "FINISHED", "CANCELLED", "FAILED",
           "STATUSES"]
