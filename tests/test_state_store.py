"""State store contract, run against MemoryStore and RedisStore alike; then Redis-only checks (one round trip per
commit batch, key namespacing, typed unavailability) and a model test: Redis must agree with memory on random
sequences of creates, claims, commits and deletes."""
import asyncio
from uuid import uuid4

import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio.connection import AbstractConnection

from specdec.errors import InvalidRequest
from specdec.state import (
    Commit,
    MemoryStore,
    RedisStore,
    RequestExists,
    RequestRecord,
    StoreUnavailable,
    UnknownRequest,
    open_store,
)
from tests.conftest import free_port

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def purge(raw, ns: str) -> None:
    keys = [k async for k in raw.scan_iter(match=f"{ns}:*", count=1000)]
    if keys:
        await raw.delete(*keys)


@pytest.fixture
async def raw(redis_url):
    r = aioredis.from_url(redis_url)
    yield r
    await r.aclose()


@pytest.fixture(params=["memory", "redis"])
async def make_store(request, redis_url, raw):
    """Factory of stores of the parametrised kind; Redis ones get a unique namespace, purged afterwards."""
    made = []

    def make(ttl_s: float = 86400):
        if request.param == "memory":
            s = MemoryStore(ttl_s=ttl_s)
        else:
            s = RedisStore(redis_url, namespace=f"test-{uuid4().hex}", ttl_s=ttl_s)
        made.append(s)
        return s

    yield make
    for s in made:
        if isinstance(s, RedisStore):
            await purge(raw, s.ns)
        await s.close()


@pytest.fixture
async def store(make_store):
    return make_store()


@pytest.fixture
async def rstore(redis_url, raw):
    s = RedisStore(redis_url, namespace=f"test-{uuid4().hex}")
    yield s
    await purge(raw, s.ns)
    await s.close()


def record(rid: str = "r1", prompt_len: int = 3, **kw) -> RequestRecord:
    return RequestRecord(rid=rid, prompt=list(range(100, 100 + prompt_len)), params={"temperature": 0.0}, **kw)


# ---------------------------------------------------------------------------------------------------- contract

async def test_create_get_roundtrip_every_field(store):
    rec = RequestRecord(
        rid="req-ü1", key_hash="ab12", target_model="qwen2.5-coder-1.5b", draft_model="qwen2.5-coder-0.5b",
        params={"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.05, "seed": 2**63 - 1},
        mode="coupled", gamma=4, max_tokens=256, stop=["\n\n", "“end”"], prompt=[0, 1, 151935, 2**31 - 1],
        output=[5, 6], status="running", finish_reason=None, owner="target-a", epoch=7,
        stats={"accepted": 3, "alpha": 0.5, "per_step": [1, 2]}, created=1700000000.125, updated=1700000001.5)
    await store.create(rec)
    got = await store.get(rec.rid)
    expected = rec.copy()
    expected.epoch = 1                              # epoch always starts at 1
    assert got == expected
    assert got.committed_len == 6

    got.output.append(99)                           # callers get copies, not the stored state
    got.params["seed"] = 0
    assert await store.get(rec.rid) == expected
    assert await store.get("absent") is None


async def test_create_defaults_timestamps_and_finish_reason(store):
    await store.create(record(finish_reason=""))
    got = await store.get("r1")
    assert got.created > 1e9 and got.updated >= got.created
    assert got.finish_reason == "" and got.output == [] and got.epoch == 1


async def test_create_twice_raises_and_keeps_first(store):
    await store.create(record(owner="a"))
    with pytest.raises(RequestExists):
        await store.create(record(owner="b", prompt_len=9))
    got = await store.get("r1")
    assert got.owner == "a" and got.committed_len == 3


async def test_invalid_rid_refused(store):
    for rid in ("", "x:out"):
        with pytest.raises(InvalidRequest):
            await store.create(record(rid=rid))


async def test_commit_appends_and_advances(store):
    await store.create(record())
    assert await store.commit([Commit("r1", 1, 3, [7, 8])]) == [True]
    assert await store.commit([Commit("r1", 1, 5, [9])]) == [True]
    assert await store.commit([Commit("r1", 1, 6, [])]) == [True]        # empty commit: allowed, no change
    got = await store.get("r1")
    assert got.output == [7, 8, 9] and got.committed_len == 6 and got.status == "running"


async def test_wrong_expected_len_changes_nothing(store):
    await store.create(record())
    await store.commit([Commit("r1", 1, 3, [7])])
    before = await store.get("r1")
    assert await store.commit([Commit("r1", 1, 3, [8], status="finished"), Commit("r1", 1, 5, [8])]) == [False, False]
    assert await store.get("r1") == before

    # a token is committed once: the same commit replayed is refused
    c = Commit("r1", 1, 4, [8, 9], status="finished", finish_reason="stop")
    assert await store.commit([c]) == [True]
    assert await store.commit([c]) == [False]
    got = await store.get("r1")
    assert got.output == [7, 8, 9] and got.status == "finished"


async def test_claim_fences_stale_owner(store):
    await store.create(record(owner="a"))
    assert await store.commit([Commit("r1", 1, 3, [7])]) == [True]
    assert await store.claim("r1", "b") == 2
    assert await store.commit([Commit("r1", 1, 4, [8])]) == [False]    # old owner, right length, stale epoch
    assert await store.commit([Commit("r1", 3, 4, [8])]) == [False]    # a future epoch is no better
    assert await store.commit([Commit("r1", 2, 4, [8])]) == [True]
    got = await store.get("r1")
    assert (got.owner, got.epoch, got.output) == ("b", 2, [7, 8])
    assert await store.claim("r1", "c") == 3
    with pytest.raises(UnknownRequest):
        await store.claim("absent", "c")


async def test_batch_mixed_results_in_order(store):
    for i in range(4):
        await store.create(record(rid=f"r{i}", prompt_len=i + 1))
    await store.claim("r2", "other")
    res = await store.commit([
        Commit("r0", 1, 1, [10]),           # ok
        Commit("r1", 1, 5, [11]),           # wrong length
        Commit("r2", 1, 3, [12]),           # stale epoch
        Commit("r3", 1, 4, [13, 14]),       # ok
        Commit("nope", 1, 0, [15]),         # absent
        Commit("r0", 1, 2, [16]),           # ok: sees the first commit of this same batch
        Commit("r0", 1, 2, [17]),           # replay within the batch
    ])
    assert res == [True, False, False, True, False, True, False]
    assert (await store.get("r0")).output == [10, 16]
    assert (await store.get("r1")).output == []
    assert (await store.get("r2")).output == []
    assert (await store.get("r3")).output == [13, 14]
    assert await store.get("nope") is None          # a commit never creates a record


async def test_status_finish_reason_stats(store):
    await store.create(record(stats={"steps": 0}))
    assert await store.commit([Commit("r1", 1, 3, [1], stats={"steps": 1, "accepted": [1]})]) == [True]
    got = await store.get("r1")
    assert got.status == "running" and got.finish_reason is None and got.stats == {"steps": 1, "accepted": [1]}
    before = got.updated
    await asyncio.sleep(0.01)
    # zero tokens + a status: how a request is cancelled
    assert await store.commit([Commit("r1", 1, 4, [], status="cancelled", finish_reason="abort")]) == [True]
    got = await store.get("r1")
    assert (got.status, got.finish_reason, got.output) == ("cancelled", "abort", [1])
    assert got.stats == {"steps": 1, "accepted": [1]}      # stats=None leaves stats alone
    assert got.updated > before


async def test_ttl_expiry_and_refresh(make_store):
    store = make_store(ttl_s=1)
    await store.create(record("a"))
    await store.create(record("b"))
    await asyncio.sleep(0.5)
    assert await store.commit([Commit("a", 1, 3, [1])]) == [True]      # refreshes a's TTL, not b's
    await asyncio.sleep(0.75)
    assert await store.get("b") is None
    assert (await store.get("a")).output == [1]
    await asyncio.sleep(0.5)
    assert await store.get("a") is None
    assert await store.commit([Commit("a", 1, 4, [2])]) == [False]
    with pytest.raises(UnknownRequest):
        await store.claim("a", "x")
    await store.create(record("a"))                 # the id is free again, and starts clean
    assert (await store.get("a")).output == []


async def test_delete(store):
    await store.create(record())
    await store.commit([Commit("r1", 1, 3, [1, 2])])
    await store.delete("r1")
    await store.delete("r1")                        # idempotent
    assert await store.get("r1") is None
    assert await store.commit([Commit("r1", 1, 5, [3])]) == [False]
    await store.create(record())
    assert (await store.get("r1")).output == []     # no leftover output from the deleted record


async def test_ping_and_empty_batch(store):
    assert await store.ping()
    assert await store.commit([]) == []


async def test_open_store():
    assert isinstance(open_store(None), MemoryStore)
    s = open_store("redis://127.0.0.1:6379/0", namespace="x", ttl_s=5)
    assert isinstance(s, RedisStore) and s.ns == "x" and s.ttl_s == 5
    await s.close()


# ---------------------------------------------------------------------------------------------------- Redis only

async def _evalsha_calls(raw) -> int:
    stats = await raw.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def test_commit_batch_is_one_round_trip(rstore, raw, monkeypatch):
    n = 64
    for i in range(n):
        await rstore.create(record(f"r{i}"))
    assert await rstore.commit([Commit("r0", 1, 3, [0])]) == [True]     # script cached, connection open

    # Independent client-side view: every write to and read from the socket, below the store's own counter.
    io = []
    send, read = AbstractConnection.send_packed_command, AbstractConnection.read_response

    async def counting_send(self, *a, **kw):
        io.append("send")
        return await send(self, *a, **kw)

    async def counting_read(self, *a, **kw):
        io.append("read")
        return await read(self, *a, **kw)

    lens = {f"r{i}": 4 if i == 0 else 3 for i in range(n)}
    for attempt in range(3):       # the server counter is global: retry if another client ran a script meanwhile
        batch = [Commit(rid, 1, length, [7, 8]) for rid, length in lens.items()]
        calls0, rt0 = await _evalsha_calls(raw), rstore.round_trips
        io.clear()
        with monkeypatch.context() as m:
            m.setattr(AbstractConnection, "send_packed_command", counting_send)
            m.setattr(AbstractConnection, "read_response", counting_read)
            res = await rstore.commit(batch)
        server = await _evalsha_calls(raw) - calls0
        assert res == [True] * n
        lens = {rid: length + 2 for rid, length in lens.items()}
        assert rstore.round_trips - rt0 == 1        # the store's counter
        assert io == ["send", "read"]               # one write, one reply: one network round trip
        if server == 1:                             # one command on the server for the whole batch
            break
    else:
        pytest.fail(f"expected 1 EVALSHA on the server per batch, saw {server}")
    got = await rstore.get("r5")
    assert got.committed_len == lens["r5"] and got.output[-2:] == [7, 8]

    # the other per-request operations are one round trip each as well
    for op in (rstore.get("r1"), rstore.claim("r1", "x"), rstore.delete("r1")):
        rt0 = rstore.round_trips
        await op
        assert rstore.round_trips - rt0 == 1


async def test_layout_and_namespacing(rstore, raw):
    rid = f"id-{uuid4().hex}"
    await rstore.create(record(rid, prompt_len=2))
    await rstore.commit([Commit(rid, 1, 2, [1, 2**31 - 1, 7])])
    ours = sorted([k.decode() async for k in raw.scan_iter(match=f"{rstore.ns}:*")])
    assert ours == [f"{rstore.ns}:req:{rid}", f"{rstore.ns}:req:{rid}:out"]
    everywhere = [k.decode() async for k in raw.scan_iter(match=f"*{rid}*", count=1000)]
    assert sorted(everywhere) == ours
    # output: packed little-endian int32, appended in place; both keys carry the TTL
    assert await raw.get(f"{rstore.ns}:req:{rid}:out") == b"\x01\0\0\0\xff\xff\xff\x7f\x07\0\0\0"
    assert await raw.hget(f"{rstore.ns}:req:{rid}", "plen") == b"2"
    for k in ours:
        assert 0 < await raw.ttl(k) <= 86400


async def test_survives_script_cache_flush(rstore, raw):
    await rstore.create(record())
    await raw.script_flush()                        # as after a Redis restart: NOSCRIPT, then EVAL once
    assert await rstore.commit([Commit("r1", 1, 3, [4])]) == [True]
    assert await rstore.claim("r1", "b") == 2
    assert (await rstore.get("r1")).output == [4]


async def test_unavailable_is_typed():
    s = RedisStore(f"redis://:secret@127.0.0.1:{free_port()}/0", namespace="down", connect_timeout=0.5)
    try:
        assert await s.ping() is False
        for op in (lambda: s.create(record()), lambda: s.get("r1"), lambda: s.claim("r1", "a"),
                   lambda: s.commit([Commit("r1", 1, 3, [1])]), lambda: s.delete("r1")):
            with pytest.raises(StoreUnavailable) as e:
                await op()
            assert "secret" not in str(e.value) and "Redis" in str(e.value)
    finally:
        await s.close()


# ---------------------------------------------------------------------------------------------------- model test

RIDS = ["m0", "m1", "m2"]
commit_item = st.tuples(
    st.integers(0, len(RIDS) - 1),
    st.sampled_from([0, 0, 0, -1, 1]),                  # epoch offset from the current one
    st.sampled_from([0, 0, 0, -1, 1, 2]),               # length offset from the current one
    st.lists(st.integers(0, 2**31 - 1), max_size=4),
    st.sampled_from([None, None, "finished", "cancelled", "failed", "running"]),
    st.sampled_from([None, None, "stop", "length", ""]),
    st.one_of(st.none(), st.fixed_dictionaries({"steps": st.integers(0, 9)})))
operation = st.one_of(
    st.tuples(st.just("create"), st.integers(0, len(RIDS) - 1), st.integers(0, 3)),
    st.tuples(st.just("claim"), st.integers(0, len(RIDS) - 1), st.sampled_from(["a", "b"])),
    st.tuples(st.just("delete"), st.integers(0, len(RIDS) - 1)),
    st.tuples(st.just("commit"), st.lists(commit_item, max_size=5)))


async def _outcome(coro):
    try:
        return await coro
    except (RequestExists, UnknownRequest) as e:
        return type(e).__name__


def _comparable(rec):
    if rec is not None:
        rec.updated = 0.0
    return rec


async def _model_check(prompt_lens, ops, redis_url):
    mem = MemoryStore()
    red = RedisStore(redis_url, namespace=f"test-{uuid4().hex}")
    try:
        for rid, n in zip(RIDS, prompt_lens):      # start with live records, so most operations hit one
            await mem.create(record(rid, prompt_len=n, created=1.0))
            await red.create(record(rid, prompt_len=n, created=1.0))
        for op in ops:
            if op[0] == "commit":
                # resolve offsets against the reference state, so that many commits are meant to succeed
                batch = []
                for i, de, dl, toks, status, reason, stats in op[1]:
                    cur = await mem.get(RIDS[i])
                    epoch, length = (cur.epoch, cur.committed_len) if cur else (1, 0)
                    batch.append(Commit(RIDS[i], epoch + de, length + dl, toks, status, reason, stats))
                calls = (mem.commit(batch), red.commit(batch))
            elif op[0] == "create":
                rec = record(RIDS[op[1]], prompt_len=op[2], created=1.0)
                calls = (mem.create(rec), red.create(rec))
            elif op[0] == "claim":
                calls = (mem.claim(RIDS[op[1]], op[2]), red.claim(RIDS[op[1]], op[2]))
            else:
                calls = (mem.delete(RIDS[op[1]]), red.delete(RIDS[op[1]]))
            expected, got = await _outcome(calls[0]), await _outcome(calls[1])
            assert got == expected, op
        for rid in RIDS:
            assert _comparable(await red.get(rid)) == _comparable(await mem.get(rid))
    finally:
        raw = aioredis.from_url(redis_url)
        await purge(raw, red.ns)
        await raw.aclose()
        await red.close()


@settings(max_examples=150, deadline=None)
@given(prompt_lens=st.lists(st.integers(0, 3), min_size=len(RIDS), max_size=len(RIDS)),
       ops=st.lists(operation, max_size=25))
def test_redis_matches_memory_model(prompt_lens, ops, redis_url):
    asyncio.run(_model_check(prompt_lens, ops, redis_url))
