"""In-process state store: the same contract as RedisStore for single-process deployments and tests.

Every method runs without an `await` in its body, so on one asyncio loop each call (a whole commit batch included)
is atomic. TTL is honoured lazily: an expired record reads as absent, and expired entries are swept now and then.
"""
from __future__ import annotations

import copy
import time

from specdec.state.base import (
    Commit,
    RequestExists,
    RequestRecord,
    StateStore,
    UnknownRequest,
    check_rid,
)


class MemoryStore(StateStore):
    def __init__(self, ttl_s: float = 86400):
        self.ttl_s = ttl_s
        self._recs: dict[str, tuple[RequestRecord, float]] = {}   # rid -> (record, monotonic expiry)
        self._next_sweep = time.monotonic() + min(ttl_s, 60.0)

    def _live(self, rid: str) -> RequestRecord | None:
        entry = self._recs.get(rid)
        if entry is None:
            return None
        if time.monotonic() >= entry[1]:
            del self._recs[rid]
            return None
        return entry[0]

    def _touch(self, rec: RequestRecord) -> None:
        self._recs[rec.rid] = (rec, time.monotonic() + self.ttl_s)

    def _sweep(self) -> None:
        # Bounded memory for records nobody reads again; amortised O(1) per create.
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(self.ttl_s, 60.0)
        for rid in [rid for rid, (_, exp) in self._recs.items() if now >= exp]:
            del self._recs[rid]

    async def create(self, rec: RequestRecord) -> None:
        check_rid(rec.rid)
        self._sweep()
        if self._live(rec.rid) is not None:
            raise RequestExists(rec.rid)
        now = time.time()
        stored = rec.copy()
        stored.epoch = 1
        stored.created = rec.created or now
        stored.updated = rec.updated or now
        self._touch(stored)

    async def get(self, rid: str) -> RequestRecord | None:
        rec = self._live(rid)
        return None if rec is None else rec.copy()

    async def claim(self, rid: str, owner: str) -> int:
        rec = self._live(rid)
        if rec is None:
            raise UnknownRequest(rid)
        rec.epoch += 1
        rec.owner = owner
        rec.updated = time.time()
        self._touch(rec)
        return rec.epoch

    async def commit(self, commits: list[Commit]) -> list[bool]:
        now = time.time()
        results = []
        for c in commits:
            rec = self._live(c.rid)
            ok = rec is not None and rec.epoch == c.epoch and rec.committed_len == c.expected_len
            if ok:
                rec.output.extend(c.tokens)
                if c.status is not None:
                    rec.status = c.status
                if c.finish_reason is not None:
                    rec.finish_reason = c.finish_reason
                if c.stats is not None:
                    rec.stats = copy.deepcopy(c.stats)
                rec.updated = now
                self._touch(rec)
            results.append(ok)
        return results

    async def delete(self, rid: str) -> None:
        self._recs.pop(rid, None)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        pass
