"""Redis state store.

Layout, per request (both keys carry the TTL, refreshed on every claim and commit):
  {ns}:req:{rid}      hash of the scalar fields; params/stats/stop as JSON, prompt as packed little-endian int32,
                      plen = len(prompt)
  {ns}:req:{rid}:out  string: the committed output tokens, packed little-endian int32, grown with APPEND
So committed_len = plen + STRLEN(out) / 4, both O(1): a commit costs the same at token 10 and token 10,000.

Every write is one Lua script call (atomic on the server). A commit batch, however large, is ONE script call over all
its keys, so one network round trip and one command on the server — the "≤ 2 Redis round trips per step" budget.
Scripts are called by SHA; after a Redis restart (NOSCRIPT) the call is repeated once with EVAL, which also caches it.
"""
from __future__ import annotations

import hashlib
import json
import struct
import time
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from specdec.state.base import (
    Commit,
    RequestExists,
    RequestRecord,
    StateStore,
    StoreUnavailable,
    UnknownRequest,
    check_rid,
)

# KEYS: hash, out. ARGV: ttl_ms, packed output (may be empty), then field/value pairs of the hash.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if #ARGV[2] > 0 then redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[1]) end
return 1
"""

# KEYS: hash, out. ARGV: owner, now, ttl_ms. Returns the new epoch, or -1 when absent.
_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'updated', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return epoch
"""

# KEYS: hash_1, out_1, hash_2, out_2, ... ARGV: now, ttl_ms, then per commit 6 values: epoch, expected_len, packed
# tokens, status, finish_reason, stats. An optional value is '' when not given, else '=' .. value (so a given empty
# string stays distinguishable from "not given"). Returns one 0/1 per commit, applied in order.
_COMMIT = """
local now, ttl = ARGV[1], ARGV[2]
local res = {}
for i = 1, #KEYS / 2 do
  local h, o, a = KEYS[2 * i - 1], KEYS[2 * i], 2 + 6 * (i - 1)
  local m = redis.call('HMGET', h, 'epoch', 'plen')
  local ok = 0
  if m[1] and tonumber(m[1]) == tonumber(ARGV[a + 1])
     and tonumber(m[2]) + redis.call('STRLEN', o) / 4 == tonumber(ARGV[a + 2]) then
    if #ARGV[a + 3] > 0 then redis.call('APPEND', o, ARGV[a + 3]) end
    local f = {'updated', now}
    if #ARGV[a + 4] > 0 then table.insert(f, 'status'); table.insert(f, string.sub(ARGV[a + 4], 2)) end
    if #ARGV[a + 5] > 0 then table.insert(f, 'finish_reason'); table.insert(f, string.sub(ARGV[a + 5], 2)) end
    if #ARGV[a + 6] > 0 then table.insert(f, 'stats'); table.insert(f, string.sub(ARGV[a + 6], 2)) end
    redis.call('HSET', h, unpack(f))
    redis.call('PEXPIRE', h, ttl)
    redis.call('PEXPIRE', o, ttl)
    ok = 1
  end
  res[i] = ok
end
return res
"""


class _Script:
    def __init__(self, text: str):
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


def pack_ids(ids: list[int]) -> bytes:
    try:
        return struct.pack(f"<{len(ids)}i", *ids)
    except struct.error as e:
        raise ValueError(f"token ids must be int32: {e}") from None


def unpack_ids(buf: bytes | None) -> list[int]:
    return list(struct.unpack(f"<{len(buf) // 4}i", buf)) if buf else []


def _opt(value: str | None) -> str:
    return "" if value is None else "=" + value


class RedisStore(StateStore):
    """`round_trips` counts network round trips made (one per command or pipeline), for tests and benchmarks."""

    def __init__(self, url: str, namespace: str = "specdec", ttl_s: float = 86400, *,
                 socket_timeout: float = 5.0, connect_timeout: float = 2.0):
        self.ns, self.ttl_s = namespace, ttl_s
        self.round_trips = 0
        u = urlsplit(url)
        self._where = f"{u.hostname}:{u.port or 6379}"          # for messages; never echo a password
        # No client-side retries: a commit resent after its reply was lost would answer False for tokens that did
        # land. Failures surface at once as StoreUnavailable and the caller re-reads the record to learn the outcome.
        self._r = aioredis.from_url(url, decode_responses=False, socket_timeout=socket_timeout,
                                    socket_connect_timeout=connect_timeout, retry=Retry(NoBackoff(), 0))
        self._create, self._claim, self._commit = _Script(_CREATE), _Script(_CLAIM), _Script(_COMMIT)

    def _keys(self, rid: str) -> tuple[str, str]:
        k = f"{self.ns}:req:{rid}"
        return k, k + ":out"

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    async def _io(self, awaitable):
        """One network round trip: counted, and connection failures turned into StoreUnavailable."""
        self.round_trips += 1
        try:
            return await awaitable
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise StoreUnavailable(f"Redis at {self._where} unavailable: {str(e).rstrip('.')}") from e

    async def _run(self, script: _Script, keys: list[str], args: list) -> object:
        try:
            return await self._io(self._r.evalsha(script.sha, len(keys), *keys, *args))
        except NoScriptError:
            # Script cache empty (Redis restarted or flushed): nothing ran, so running it via EVAL is safe.
            return await self._io(self._r.eval(script.text, len(keys), *keys, *args))

    async def create(self, rec: RequestRecord) -> None:
        check_rid(rec.rid)
        now = time.time()
        fields = {
            "rid": rec.rid, "key_hash": rec.key_hash, "target_model": rec.target_model,
            "draft_model": rec.draft_model, "params": json.dumps(rec.params), "mode": rec.mode,
            "gamma": rec.gamma, "max_tokens": rec.max_tokens, "stop": json.dumps(rec.stop),
            "prompt": pack_ids(rec.prompt), "plen": len(rec.prompt), "status": rec.status, "owner": rec.owner,
            "epoch": 1, "stats": json.dumps(rec.stats),
            "created": repr(rec.created or now), "updated": repr(rec.updated or now),
        }
        if rec.finish_reason is not None:
            fields["finish_reason"] = rec.finish_reason
        flat = [x for kv in fields.items() for x in kv]
        if not await self._run(self._create, list(self._keys(rec.rid)), [self._ttl_ms, pack_ids(rec.output), *flat]):
            raise RequestExists(rec.rid)

    async def get(self, rid: str) -> RequestRecord | None:
        h, o = self._keys(rid)
        pipe = self._r.pipeline(transaction=True)      # MULTI/EXEC: hash and output from the same instant
        pipe.hgetall(h)
        pipe.get(o)
        m, out = await self._io(pipe.execute())
        if not m:
            return None
        s = lambda k: m[k].decode()                     # noqa: E731
        return RequestRecord(
            rid=s(b"rid"), key_hash=s(b"key_hash"), target_model=s(b"target_model"), draft_model=s(b"draft_model"),
            params=json.loads(m[b"params"]), mode=s(b"mode"), gamma=int(m[b"gamma"]),
            max_tokens=int(m[b"max_tokens"]), stop=json.loads(m[b"stop"]), prompt=unpack_ids(m[b"prompt"]),
            output=unpack_ids(out), status=s(b"status"),
            finish_reason=s(b"finish_reason") if b"finish_reason" in m else None, owner=s(b"owner"),
            epoch=int(m[b"epoch"]), stats=json.loads(m[b"stats"]), created=float(m[b"created"]),
            updated=float(m[b"updated"]))

    async def claim(self, rid: str, owner: str) -> int:
        epoch = await self._run(self._claim, list(self._keys(rid)), [owner, repr(time.time()), self._ttl_ms])
        if epoch < 0:
            raise UnknownRequest(rid)
        return int(epoch)

    async def commit(self, commits: list[Commit]) -> list[bool]:
        if not commits:
            return []
        keys, args = [], [repr(time.time()), self._ttl_ms]
        for c in commits:
            keys.extend(self._keys(c.rid))
            args += [c.epoch, c.expected_len, pack_ids(c.tokens), _opt(c.status), _opt(c.finish_reason),
                     "" if c.stats is None else "=" + json.dumps(c.stats)]
        return [bool(r) for r in await self._run(self._commit, keys, args)]

    async def delete(self, rid: str) -> None:
        await self._io(self._r.delete(*self._keys(rid)))

    async def ping(self) -> bool:
        try:
            return bool(await self._io(self._r.ping()))
        except StoreUnavailable:
            return False

    async def close(self) -> None:
        await self._r.aclose()
