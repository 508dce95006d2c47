"""Fault isolation: one request's bad proposal or failing step never fails its neighbours.

1. Through the real stack (n-gram draft server, target server, Redis): concurrent seeded requests in rejection mode,
   where some requests' n-gram proposals are empty (their q comes off the wire as None) while others carry drafts --
   the case that used to fail the whole batch with a TypeError and a 500 for everyone.
2. In process, with an engine wrapper that raises on demand: a step that raises once is rerun as plain decoding
   (outputs unchanged, counted in specdec:step_retries_total); a request whose forwards always raise ends alone with
   a retryable error (REST 503, gRPC UNAVAILABLE) and its committed tokens kept, and a resume by id completes it
   exactly, while its neighbours finish with their exact outputs.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import httpx
import pytest
from openai import AsyncOpenAI

from specdec.draft.model import ModelDrafter
from specdec.draft.ngram import NgramDrafter
from specdec.engine.engine import Engine
from specdec.engine.registry import load
from specdec.generate import Request, generate
from specdec.speculative.generator import GenRequest, SpeculativeGenerator
from specdec.speculative.propose import Drafter, Proposal
from specdec.speculative.sampling import SamplingParams
from specdec.state import MemoryStore
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pbg

from .stack import Draft, Target

pytestmark = pytest.mark.timeout(400)

# greedy tiny-llama outputs of these run >= 250 tokens before EOS (tests/test_faults.py): still going when a fault hits
LONG = ["long run 146", "long run 50", "long run 16", "long run 120", "long run 240"]


def plain(lm, prompt_ids: list[int], params: SamplingParams, max_tokens: int) -> list[int]:
    """In-process target-only decoding: the definition of the output."""
    return generate(Engine(lm.model), [Request(prompt_ids, params, max_tokens, lm.tokenizer.eos_ids)])[0].tokens


def metric(text: str, name: str) -> float:
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name + "{") or x.startswith(name + " "))


# -- 1. the real stack: empty n-gram proposals in a rejection batch ---------------------------------------------------
class OffTheWire(Drafter):
    """An n-gram drafter whose empty blocks lose their q, as the draft server's answers do on the wire."""

    def __init__(self):
        self.inner = NgramDrafter()

    def propose(self, items):
        return [p if p is None or p.tokens else Proposal(p.anchor, [], []) for p in self.inner.propose(items)]

    def release(self, sid):
        self.inner.release(sid)


def test_concurrent_seeded_rejection_with_empty_ngram_proposals(tmp, lm, redis_url, ns):
    """8 concurrent seeded chat requests (T=0.8, top_p=0.95) in rejection mode through the openai client, n-gram
    drafts from the draft server: all succeed, some steps mix empty and non-empty proposals, and each output is the
    in-process rejection run of that request alone (rejection text depends on the proposals, which depend on the
    request's own context only). Speculation off, or coupled, gives plain seeded decoding on the same server."""
    d = Draft(tmp, drafter="ngram").up()
    # a generous draft deadline: a late draft would change rejection-mode text (that is what rejection gives up)
    t = Target(tmp, draft=d.addr, redis_url=redis_url, namespace=ns,
               extra=["--acceptance", "rejection", "--draft-deadline-ms", "30000"]).up()
    try:
        msgs = [[{"role": "user", "content": f"q{i}: tell me about {w}"}] for i, w in
                enumerate(["owls", "rivers", "glass", "maps", "salt", "bells", "moss", "kites"])]
        kw = dict(model="tiny-llama", max_tokens=40, temperature=0.8, top_p=0.95)

        async def run():
            ac = AsyncOpenAI(base_url=t.url + "/v1", api_key="unused", max_retries=0)
            return await asyncio.gather(*[ac.chat.completions.create(messages=m, seed=1000 + i, **kw)
                                          for i, m in enumerate(msgs)])
        outs = asyncio.run(run())
        ids = {o.id: i for i, o in enumerate(outs)}
        for i, (m, o) in enumerate(zip(msgs, outs)):
            assert o.model_extra["spec"]["acceptance"] == "rejection"
            params = SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i)
            gen = SpeculativeGenerator(Engine(lm.model), OffTheWire(), gamma=4, mode="rejection")
            want = gen.generate([GenRequest(lm.tokenizer.chat(m), params, 40, lm.tokenizer.eos_ids)])[0]
            assert o.choices[0].message.content == lm.tokenizer.decode(want.tokens), i
        steps: dict[int, list[int]] = {}
        for line in t.trace.read_text().splitlines():
            r = json.loads(line)
            if r["request"] in ids:
                steps.setdefault(r["step"], []).append(r["verify_len"])
        assert any(1 in v and max(v) > 1 for v in steps.values()), "no step mixed empty and non-empty proposals"
        text = httpx.get(t.url + "/metrics").text
        assert metric(text, "specdec:spec_decode_num_accepted_tokens_total") > 0
        assert metric(text, "specdec:step_retries_total") == 0    # fixed at the root: no step even raised

        # speculation off, or coupled, on this rejection-default server: plain seeded decoding, token for token
        prompt = lm.tokenizer.chat(msgs[0])
        want = lm.tokenizer.decode(plain(lm, prompt, SamplingParams(temperature=0.8, top_p=0.95, seed=5), 40))
        for spec in ({"enabled": False}, {"acceptance": "coupled"}):
            r = httpx.post(t.url + "/v1/chat/completions", json={**kw, "messages": msgs[0], "seed": 5,
                                                                  "speculative": spec}, timeout=120).json()
            assert r["choices"][0]["message"]["content"] == want, spec
    finally:
        t.kill()
        d.kill()


# -- 2. in process: a step that raises ---------------------------------------------------------------------------------
class FaultyEngine:
    """The real engine, except that `forward` (what verify calls; prefill goes through the real engine's own forward)
    raises while `fail(inputs)` says so, and waits for `unstall` (at most 20 s: a collective a dead rank left hanging)
    when `stall(inputs)` says so."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.fail = self.stall = lambda inputs: False
        self.raised = 0
        self.stalled, self.unstall = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def forward(self, inputs, *args, **kwargs):
        if self.fail(inputs):
            self.raised += 1
            raise RuntimeError("injected engine fault")
        if self.stall(inputs):
            self.stalled.set()
            self.unstall.wait(20)
        return self._engine.forward(inputs, *args, **kwargs)


class Stack:
    """Scheduler + service + REST app (ASGI, in process) + gRPC server on a loopback port, on a FaultyEngine."""

    def __init__(self, lm, cfg=None):
        from target_service.metrics import Metrics
        from target_service.scheduler import Scheduler, SchedulerConfig
        from target_service.service import TargetService
        self.lm, self.store, self.metrics = lm, MemoryStore(), Metrics(lm.name)
        self.engine = FaultyEngine(Engine(lm.model, kv_tokens=8192))
        drafter = ModelDrafter(load("tiny-llama-draft").model)
        self.sched = Scheduler(self.engine, drafter, self.store, lm.tokenizer, cfg or SchedulerConfig(), self.metrics)
        self.svc = TargetService(self.engine, self.sched, self.store, lm.tokenizer, model_name=lm.name,
                                 draft_name="tiny-llama-draft", metrics=self.metrics)

    async def __aenter__(self):
        from target_service.grpc_server import build_grpc_server
        from target_service.rest import create_app
        self.sched.start()
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(self.svc, self.metrics)),
                                      base_url="http://test", timeout=120)
        self.grpc_server, port, _ = build_grpc_server(self.svc, "127.0.0.1", 0)
        await self.grpc_server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pbg.TargetStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        await self.grpc_server.stop(None)
        await self.http.aclose()
        await self.sched.stop()

    def counter(self, name: str) -> float:
        from prometheus_client import generate_latest
        return metric(generate_latest(self.metrics.registry).decode(), name)


def test_step_that_raises_is_rerun_as_plain_decoding(lm):
    """Verify forwards carrying drafts raise 3 times: each such step is undone and rerun as plain decoding, and every
    output (greedy and seeded, coupled by default) is still exactly plain decoding's."""
    cases = [(LONG[0], SamplingParams()), (LONG[1], SamplingParams(temperature=0.9, seed=7)),
             ("hello there", SamplingParams(temperature=1.1, top_k=20, seed=8))]

    async def run():
        async with Stack(lm) as s:
            budget = [3]

            def fail(inputs):
                if budget[0] > 0 and any(len(i.tokens) > 1 for i in inputs):
                    budget[0] -= 1
                    return True
                return False
            s.engine.fail = fail
            bodies = [{"prompt": p, "max_tokens": 30, "temperature": sp.temperature, "top_k": sp.top_k,
                       "seed": sp.seed} for p, sp in cases]
            rs = await asyncio.gather(*[s.http.post("/v1/completions", json=b) for b in bodies])
            return [r.json() for r in rs], s.engine.raised, s.counter("specdec:step_retries_total"), \
                s.counter("specdec:step_failed_requests_total"), s.counter("specdec:spec_decode_fallback_steps_total")

    outs, raised, retries, failed, fallbacks = asyncio.run(run())
    assert raised == 3 and retries == 3 and failed == 0 and fallbacks >= 3
    for (p, sp), o in zip(cases, outs):
        assert o["choices"][0]["text"] == lm.tokenizer.decode(plain(lm, lm.tokenizer.encode(p), sp, 30)), o
        assert o["spec"]["acceptance"] == ("greedy" if sp.greedy else "coupled")


def test_request_that_cannot_step_ends_alone_and_resumes(lm):
    """Every forward touching a victim's KV raises (once it has 4+ tokens). The victims -- one over REST, one over
    gRPC -- end with a retryable error (503 / UNAVAILABLE) with their committed tokens kept in the store; the three
    neighbours in the same batches finish with exactly plain decoding's output; once the fault is gone a resume by id
    completes each victim with exactly its uninterrupted output."""
    n = 40
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=21)

    async def run():
        async with Stack(lm) as s:
            poisoned = [True]

            def fail(inputs):
                if not poisoned[0]:
                    return False
                bad = {j.req.seq for j in s.sched.running if j.rid.startswith("victim") and len(j.req.output) >= 4}
                return any(i.seq in bad for i in inputs)
            s.engine.fail = fail

            async def grpc_victim():
                toks, err = [], None
                try:
                    async for c in s.stub.Generate(pb.GenerateRequest(
                            request_id="victim-grpc", prompt_ids=pb.TokenIds(ids=lm.tokenizer.encode(LONG[1])),
                            max_tokens=n, sampling=pb.SamplingParams(temperature=0)), timeout=120):
                        toks += c.tokens
                except grpc.aio.AioRpcError as e:
                    err = e
                return toks, err

            neighbours = [{"prompt": LONG[2], "max_tokens": n, "temperature": 0},
                          {"prompt": LONG[3], "max_tokens": n, "temperature": 0.9, "top_p": 0.95, "seed": 21},
                          {"prompt": LONG[4], "max_tokens": n, "temperature": 0}]
            victim = s.http.post("/v1/completions", json={"prompt": LONG[0], "max_tokens": n, "temperature": 0.9,
                                                          "top_p": 0.95, "seed": 21, "request_id": "victim-rest"})
            res = await asyncio.gather(victim, grpc_victim(), *[s.http.post("/v1/completions", json=b)
                                                                for b in neighbours])
            rest_victim, (grpc_toks, grpc_err), *others = res
            recs = {rid: await s.store.get(rid) for rid in ("victim-rest", "victim-grpc")}
            failed = s.counter("specdec:step_failed_requests_total")
            poisoned[0] = False
            resumed_rest = (await s.http.post("/v1/completions", json={"request_id": "victim-rest",
                                                                       "resume": True})).json()
            resumed_grpc = [t async for c in s.stub.Generate(pb.GenerateRequest(request_id="victim-grpc",
                                                                               resume=True), timeout=120)
                            for t in c.tokens]
            return rest_victim, grpc_toks, grpc_err, others, recs, failed, resumed_rest, resumed_grpc

    rest_victim, grpc_toks, grpc_err, others, recs, failed, resumed_rest, resumed_grpc = asyncio.run(run())
    want_rest = plain(lm, lm.tokenizer.encode(LONG[0]), seeded, n)
    want_grpc = plain(lm, lm.tokenizer.encode(LONG[1]), SamplingParams(), n)
    # the victims: retryable errors, committed tokens kept
    assert rest_victim.status_code == 503 and rest_victim.headers.get("retry-after")
    err = rest_victim.json()["error"]
    assert err["type"] == "service_unavailable" and "resume" in err["message"], err
    assert grpc_err is not None and grpc_err.code() == grpc.StatusCode.UNAVAILABLE
    assert failed == 2
    for rid, want in (("victim-rest", want_rest), ("victim-grpc", want_grpc)):
        rec = recs[rid]
        assert rec.status == "running" and 4 <= len(rec.output) < n and rec.output == want[:len(rec.output)], rid
    assert grpc_toks == want_grpc[:len(grpc_toks)]
    # the neighbours: exact
    for o, (p, sp) in zip(others, [(LONG[2], SamplingParams()), (LONG[3], seeded), (LONG[4], SamplingParams())]):
        assert o.status_code == 200, o.text
        assert o.json()["choices"][0]["text"] == lm.tokenizer.decode(plain(lm, lm.tokenizer.encode(p), sp, n))
    # resumed: exactly the uninterrupted output
    assert resumed_rest["choices"][0]["text"] == lm.tokenizer.decode(want_rest)
    assert resumed_grpc == want_grpc


def test_a_forward_left_hanging_by_a_dead_backend_does_not_hold_the_requests(lm):
    """A tensor-parallel rank dies while rank 0 sits in a collective that does not return (here: a forward waiting
    for an event). The backend's watch thread calls Scheduler.backend_lost; every request -- a REST stream, a gRPC
    stream, one queued behind the hung step -- ends with the retryable error while the forward still hangs, its
    committed tokens kept; the server is told to go (on_backend_dead) then too. When the abandoned forward does
    return, nothing of it is committed."""
    from specdec import compute
    n = 40

    async def run():
        async with Stack(lm) as s:
            once = [True]

            def stall(inputs):
                hang = {j.req.seq for j in s.sched.running if j.rid == "hang-rest" and len(j.req.output) >= 6}
                if once[0] and any(i.seq in hang for i in inputs):
                    once[0] = False
                    return True
                return False
            s.engine.stall = stall
            down = []
            s.sched.on_backend_dead = lambda reason: down.append((reason, s.engine.unstall.is_set()))

            async def rank_dies():      # what TPEngine's watch does when it sees rank 1 gone
                assert await asyncio.to_thread(s.engine.stalled.wait, 60)
                queued.append(asyncio.create_task(grpc_stream("hang-queued", LONG[2])))
                while not s.sched.waiting:          # it waits behind the hung step
                    await asyncio.sleep(0.01)
                s.engine.healthy = lambda: False
                threading.Thread(target=s.sched.backend_lost, args=("rank 1 (pid 0) exited with code -9",)).start()
                return time.perf_counter()

            async def rest_stream():
                r = await s.http.post("/v1/completions", json={"prompt": LONG[0], "max_tokens": n, "temperature": 0,
                                                               "request_id": "hang-rest", "stream": True})
                events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
                return events, time.perf_counter(), s.engine.unstall.is_set()

            async def grpc_stream(rid, prompt):
                toks, err = [], None
                try:
                    async for c in s.stub.Generate(pb.GenerateRequest(
                            request_id=rid, prompt_ids=pb.TokenIds(ids=lm.tokenizer.encode(prompt)), max_tokens=n,
                            sampling=pb.SamplingParams(temperature=0.9, seed=4)), timeout=120):
                        toks += c.tokens
                except grpc.aio.AioRpcError as e:
                    err = e
                return toks, err, s.engine.unstall.is_set()

            queued = []
            t_dead, (events, t_end, released), g = await asyncio.gather(
                rank_dies(), rest_stream(), grpc_stream("hang-grpc", LONG[1]))
            queued = await queued[0]
            recs = {rid: await s.store.get(rid) for rid in ("hang-rest", "hang-grpc")}
            s.engine.unstall.set()                  # the collective returns after all
            await compute.run(lambda: None)         # ... and the abandoned step with it
            await asyncio.sleep(0.2)
            after = {rid: await s.store.get(rid) for rid in recs}
            return t_end - t_dead, events, released, g, queued, recs, after, down, s.sched.running

    ended_s, events, released, (g_toks, g_err, g_released), (q_toks, q_err, _), recs, after, down, running = \
        asyncio.run(run())
    print(f"\n[backend lost mid-forward] the REST stream ended {ended_s:.2f} s after backend_lost")
    assert not released and not g_released         # ended while the forward still hung
    assert ended_s < 5
    err = events[-1]["error"]
    assert err["type"] == "service_unavailable" and "hang-rest" in err["message"] and "resume" in err["message"]
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    want = plain(lm, lm.tokenizer.encode(LONG[0]), SamplingParams(), n)
    assert g_err is not None and g_err.code() == grpc.StatusCode.UNAVAILABLE and "hang-grpc" in g_err.details()
    assert q_err is not None and q_err.code() == grpc.StatusCode.UNAVAILABLE and q_toks == []
    assert "hang-queued" in q_err.details()        # ended from the queue (a refusal at the door names no id)
    assert down == [("rank 1 (pid 0) exited with code -9", False)] and running == []    # told to go before it returned
    rec = recs["hang-rest"]
    assert rec.status == "running" and 6 <= len(rec.output) < n and rec.output == want[:len(rec.output)]
    assert text == lm.tokenizer.decode(rec.output)
    g_want = plain(lm, lm.tokenizer.encode(LONG[1]), SamplingParams(temperature=0.9, seed=4), n)
    assert recs["hang-grpc"].output == g_want[:len(recs["hang-grpc"].output)] and g_toks == recs["hang-grpc"].output
    assert {rid: r.output for rid, r in after.items()} == {rid: r.output for rid, r in recs.items()}


def test_a_request_admitted_mid_flight_is_prefilled_in_the_step_forward(lm):
    """A request admitted while another runs gets its context prefilled inside the next step's forward, packed with
    the running request's verify rows (no forward of its own), and both outputs are still plain decoding's: a row's
    bits do not depend on what it is packed with. Its neighbour's steps go on meanwhile."""
    first = (LONG[2], SamplingParams())
    second = ("tell me about the sea and the long winter nights", SamplingParams(temperature=0.9, seed=3))

    async def run():
        async with Stack(lm) as s:
            mixed, prefills = [], []
            real_prefill = s.engine._engine.prefill
            s.engine.prefill = lambda *a, **k: (prefills.append(len(a[0])), real_prefill(*a, **k))[1]

            def watch(inputs):
                kinds = {i.logits for i in inputs}
                if "none" in kinds and kinds - {"none"}:
                    mixed.append(sum(len(i.tokens) for i in inputs if i.logits == "none"))
                return False
            s.engine.fail = watch
            one = asyncio.create_task(s.http.post("/v1/completions", json={"prompt": first[0], "max_tokens": 60,
                                                                           "temperature": 0}))
            while s.sched.steps < 3:
                await asyncio.sleep(0.005)
            two = await s.http.post("/v1/completions", json={"prompt": second[0], "max_tokens": 30,
                                                              "temperature": 0.9, "seed": 3})
            return [(await one).json(), two.json()], mixed, prefills

    outs, mixed, prefills = asyncio.run(run())
    assert prefills == [1] and mixed == [len(lm.tokenizer.encode(second[0])) - 1]
    for (p, sp, n), o in zip([(*first, 60), (*second, 30)], outs):
        assert o["choices"][0]["text"] == lm.tokenizer.decode(plain(lm, lm.tokenizer.encode(p), sp, n)), o


def test_the_planner_is_told_whether_requests_wait_for_admission(lm):
    """A planner with a `closed` attribute is told before each step whether any request waits for admission
    (CostPlanner.burst_worth values tokens by the batch's end only where none does): with one request running at a
    time, the first one's steps run with the second waiting, the second's with nothing waiting."""
    from specdec.speculative.step import plan_full
    from target_service.scheduler import SchedulerConfig

    class Recorder:
        closed = None

        def __init__(self):
            self.seen = []

        def __call__(self, reqs, props):
            self.seen.append(([r.rid for r in reqs], self.closed))
            return plan_full(reqs, props)

    async def run():
        async with Stack(lm, SchedulerConfig(max_running=1)) as s:
            s.sched.planner = rec = Recorder()
            body = {"prompt": LONG[1], "max_tokens": 12, "temperature": 0}
            outs = await asyncio.gather(s.http.post("/v1/completions", json=body),
                                        s.http.post("/v1/completions", json=body))
            return rec.seen, outs

    seen, outs = asyncio.run(run())
    assert all(o.status_code == 200 for o in outs)
    first, second = seen[0][0], seen[-1][0]
    assert len(first) == len(second) == 1 and first != second
    assert seen[-1][1] is True and all(closed is True for rids, closed in seen if rids == second)
    assert [closed for rids, closed in seen if rids == first][-1] is False
