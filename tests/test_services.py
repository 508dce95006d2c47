"""The service pair as real processes: draft server + target server + real Redis, over loopback, driven by the
official openai client and plain grpcio. Tiny float64 models, so outputs are compared exactly with in-process
target-only decoding."""
import asyncio
import json
import time
import uuid

import grpc
import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, OpenAI

from specdec.engine.engine import Engine
from specdec.generate import Request, generate
from specdec.speculative.sampling import SamplingParams
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pbg

from .stack import Draft, Target, redis_record

pytestmark = pytest.mark.timeout(300)


def reference(lm, prompt_ids, max_tokens, params=SamplingParams()):
    """In-process target-only decoding: what every served output must equal."""
    out = generate(Engine(lm.model), [Request(prompt_ids, params, max_tokens, lm.tokenizer.eos_ids)])[0]
    return lm.tokenizer.decode(out.tokens), out


def client(t: Target) -> OpenAI:
    return OpenAI(base_url=t.url + "/v1", api_key="unused", max_retries=0)


def redis_keys(redis_url, ns) -> int:
    import redis
    r = redis.Redis.from_url(redis_url)
    try:
        return len(list(r.scan_iter(f"{ns}:*")))
    finally:
        r.close()


PROMPTS = ["hello world", "speculative decoding is", "the quick brown fox"]


def test_openai_completions_greedy_equals_target_only(target, lm):
    c = client(target)
    for text in PROMPTS:
        want, _ = reference(lm, lm.tokenizer.encode(text), 40)
        got = c.completions.create(model="tiny-llama", prompt=text, max_tokens=40, temperature=0)
        assert got.choices[0].text == want
        assert got.usage.completion_tokens == 40 or got.choices[0].finish_reason == "stop"
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model="tiny-llama", prompt=text, max_tokens=40, temperature=0, stream=True) if ch.choices)
        assert streamed == want


def test_openai_chat_greedy_equals_target_only(target, lm):
    c = client(target)
    msgs = [{"role": "user", "content": "tell me a story"}]
    want, _ = reference(lm, lm.tokenizer.chat(msgs), 32)
    got = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=32, temperature=0)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=32, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == 32 and chunks[-1].usage.prompt_tokens == len(lm.tokenizer.chat(msgs))
    # the extension field reports what speculation did
    spec = got.model_extra["spec"]
    assert spec["drafted"] > 0 and spec["accepted"] > 0 and spec["acceptance"] == "greedy"


def test_default_cost_planner_keeps_outputs_exact(tmp, draft, lm):
    """The service's default planner (--planner cost) decides per step what to draft and verify, from measured costs
    (on a tiny model it may stop drafting: a gRPC round trip costs more than a target step). Whatever it decides,
    concurrent greedy and seeded (coupled) requests equal target-only decoding."""
    import concurrent.futures as cf
    t = Target(tmp, draft=draft.addr, extra=["--planner", "cost"]).up()
    try:
        c = client(t)
        jobs = [("tell me a story", 0.0, None), ("one two three one two three one", 0.0, None),
                ("once upon a time", 0.8, 11), ("abc abc abc", 1.0, 12)] * 2
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda j: c.completions.create(model="tiny-llama", prompt=j[0], max_tokens=40,
                                                               temperature=j[1], seed=j[2]), jobs))
        for (prompt, temp, seed), r in zip(jobs, got):
            params = SamplingParams() if temp == 0 else SamplingParams(temperature=temp, seed=seed)
            assert r.choices[0].text == reference(lm, lm.tokenizer.encode(prompt), 40, params)[0], (prompt, temp)
    finally:
        t.kill()


def test_raw_sse_ends_with_done(target):
    with httpx.stream("POST", target.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 5,
                                                                    "temperature": 0, "stream": True}) as r:
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)


def test_seeded_reproducible_and_recorded(target, lm, redis_url, ns):
    c = client(target)
    kw = dict(model="tiny-llama", prompt="once upon", max_tokens=30, temperature=0.9, top_p=0.95, seed=4242)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.model_extra["seed"] == 4242
    other = c.completions.create(**{**kw, "seed": 4243})
    assert other.choices[0].text != a.choices[0].text
    rec = redis_record(redis_url, ns, a.id)
    assert rec.params["seed"] == 4242 and rec.status == "finished"
    assert rec.committed_len == a.usage.prompt_tokens + a.usage.completion_tokens
    assert lm.tokenizer.decode(rec.output) == a.choices[0].text
    # unseeded non-greedy: the server picks a seed, reports it, and the run replays with it
    u = c.completions.create(**{**kw, "seed": None})
    assert isinstance(u.model_extra["seed"], int)
    assert c.completions.create(**{**kw, "seed": u.model_extra["seed"]}).choices[0].text == u.choices[0].text


def test_eight_concurrent_requests_batch(target, lm):
    before = {k: counter(target, k) for k in ("specdec:store_round_trips", "specdec:scheduler_steps_total")}

    async def run():
        ac = AsyncOpenAI(base_url=target.url + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*[ac.completions.create(model="tiny-llama", prompt=f"request {i} says",
                                                            max_tokens=48, temperature=0) for i in range(8)])
    outs = asyncio.run(run())
    for i, o in enumerate(outs):
        assert o.choices[0].text == reference(lm, lm.tokenizer.encode(f"request {i} says"), 48)[0]
    ids = {o.id for o in outs}
    steps: dict[int, set] = {}
    for line in target.trace.read_text().splitlines():
        r = json.loads(line)
        if r["request"] in ids:
            steps.setdefault(r["step"], set()).add(r["request"])
    assert max(len(s) for s in steps.values()) >= 4   # one verify forward carried rows of several requests
    trips = counter(target, "specdec:store_round_trips") - before["specdec:store_round_trips"]
    n_steps = counter(target, "specdec:scheduler_steps_total") - before["specdec:scheduler_steps_total"]
    # one commit round trip per step for the whole batch (+ one create per request at admission)
    assert trips <= n_steps + 8 and n_steps > 0


def test_grpc_generate_verify_and_health(target, draft, lm):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    for addr, svc in ((target.grpc_addr, "specdec.v1.Target"), (draft.addr, "specdec.v1.Drafter")):
        with grpc.insecure_channel(addr) as ch:
            st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=svc), timeout=5).status
            assert st == health_pb2.HealthCheckResponse.SERVING
    prompt = lm.tokenizer.encode("grpc says")
    want_text, want = reference(lm, prompt, 20)
    with grpc.insecure_channel(target.grpc_addr) as ch:
        stub = pbg.TargetStub(ch)
        chunks = list(stub.Generate(pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=prompt), max_tokens=20,
                                                       sampling=pb.SamplingParams(temperature=0)), timeout=60))
        assert [t for c in chunks for t in c.tokens] == want.tokens
        assert "".join(c.text for c in chunks) == want_text and chunks[-1].finish_reason == want.finish_reason
        assert chunks[-1].spec.steps > 0
        # Verify: the true continuation is accepted in full, plus the next target token
        r = stub.Verify(pb.VerifyRequest(context=prompt, draft_tokens=want.tokens[:3],
                                         sampling=pb.SamplingParams(temperature=0)), timeout=30)
        assert (r.num_accepted, list(r.tokens)) == (3, want.tokens[:4])
        wrong = [(want.tokens[0] + 1) % 96, want.tokens[1]]
        r = stub.Verify(pb.VerifyRequest(context=prompt, draft_tokens=wrong,
                                         sampling=pb.SamplingParams(temperature=0)), timeout=30)
        assert (r.num_accepted, list(r.tokens), r.num_drafted) == (0, want.tokens[:1], 2)


BAD_REST = [
    ({"prompt": "x", "max_tokens": 5, "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2, 99999], "max_tokens": 5}, "prompt"),
    ({"prompt": "x", "max_tokens": 5, "top_p": 7}, "top_p"),
    ({"prompt": "x", "max_tokens": 5, "speculative": {"gamma": 0}}, "gamma"),
    ({"prompt": "x", "max_tokens": 5, "speculative": {"gamma": 0, "enabled": False}}, "gamma"),
    ({"prompt": "x", "max_tokens": 5, "speculative": {"acceptance": "typical"}}, "speculative.acceptance"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x" * 600, "max_tokens": 5}, "prompt"),
    ({"prompt": "x", "max_tokens": 5, "n": 3}, "n"),
    ({"prompt": "", "max_tokens": 5}, "prompt"),
]


def test_bad_input_rest_and_grpc_write_nothing(target, redis_url, ns):
    before = redis_keys(redis_url, ns)
    for body, field in BAD_REST:
        r = httpx.post(target.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == field and field.split(".")[-1] in \
            err["message"], (body, err)
    with pytest.raises(BadRequestError, match="temperature"):
        client(target).completions.create(model="tiny-llama", prompt="x", max_tokens=3, temperature=-2)
    with grpc.insecure_channel(target.grpc_addr) as ch:
        stub = pbg.TargetStub(ch)
        for req, field in [
            (pb.GenerateRequest(prompt="x", max_tokens=5, sampling=pb.SamplingParams(temperature=-1)), "temperature"),
            (pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=[1, 500]), max_tokens=5), "prompt"),
            (pb.GenerateRequest(max_tokens=5), "prompt"),
            (pb.GenerateRequest(prompt="x", max_tokens=5, speculative=pb.SpeculativeOptions(gamma=99)), "gamma"),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Verify(pb.VerifyRequest(context=[1, 2], draft_tokens=[777]), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "draft_tokens" in e.value.details()
    assert redis_keys(redis_url, ns) == before                    # nothing written
    assert httpx.get(target.url + "/health").json()["status"] == "ok"


def test_metrics_exposed(target):
    text = httpx.get(target.url + "/metrics").text
    for name in ("specdec:spec_decode_num_drafts_total", "specdec:spec_decode_num_draft_tokens_total",
                 "specdec:spec_decode_num_accepted_tokens_total", "specdec:spec_decode_num_accepted_tokens_per_pos_total",
                 "specdec:time_to_first_token_seconds_bucket", "specdec:inter_token_latency_seconds_bucket",
                 "specdec:num_requests_running", "specdec:num_requests_waiting", "specdec:prefix_cache_queries_total",
                 "specdec:prefix_cache_hits_total", "specdec:draft_catch_ups_withheld"):
        assert name in text, name
    drafts = [float(x.split()[-1]) for x in text.splitlines() if x.startswith("specdec:spec_decode_num_drafts_total")]
    assert drafts and drafts[0] > 0


def counter(t: Target, name: str) -> float:
    return sum(float(x.split()[-1]) for x in httpx.get(t.url + "/metrics").text.splitlines()
               if x.startswith(name + "{") or x.startswith(name + " "))


def test_a_chats_next_turn_reuses_the_last_answer(target, lm):
    """The target's prefix cache keeps a finished request's pages: a chat's next turn (the first turn's prompt, its
    answer, a new user message; token ids, as this tiny model's tokenizer does not give an answer's ids back from its
    text) takes the first turn's prompt and its answer's full pages from the cache, and its output is still
    target-only decoding's. The metrics count the prompt tokens prefilled and those found."""
    c = client(target)
    first = lm.tokenizer.chat([{"role": "user", "content": "tell me a long story about a fox and a crow"}])
    text, ref = reference(lm, first, 48)
    assert c.completions.create(model="tiny-llama", prompt=first, max_tokens=48, temperature=0).choices[0].text == text
    answer = ref.tokens
    assert len(answer) >= 32
    second = first + answer + lm.tokenizer.encode("and then?")
    q0, h0 = counter(target, "specdec:prefix_cache_queries_total"), counter(target, "specdec:prefix_cache_hits_total")
    want, _ = reference(lm, second, 8)
    assert c.completions.create(model="tiny-llama", prompt=second, max_tokens=8, temperature=0).choices[0].text == want
    deadline = time.time() + 10                               # the counters follow the scheduler's loop
    while counter(target, "specdec:prefix_cache_queries_total") == q0 and time.time() < deadline:
        time.sleep(0.05)
    assert counter(target, "specdec:prefix_cache_queries_total") - q0 == len(second) - 1    # all but the anchor
    # the first turn wrote the K/V of its prompt and all but its last answer token: its full pages are found
    assert counter(target, "specdec:prefix_cache_hits_total") - h0 >= (len(first) + len(answer) - 1) // 16 * 16


def test_draft_killed_mid_stream_then_restarted(tmp, lm, redis_url):
    """Every request completes with unchanged greedy output while the draft server is down; speculation resumes
    once it is back (the breaker probes it)."""
    d = Draft(tmp).up()
    t = Target(tmp, draft=d.addr, redis_url=redis_url, namespace=f"test-{uuid.uuid4().hex[:8]}",
               extra=["--fault-step-delay-ms", "15"]).up()
    try:
        prompts = [f"draft fault {i}" for i in range(8)]

        async def run_all():
            ac = AsyncOpenAI(base_url=t.url + "/v1", api_key="unused", max_retries=0)
            return await asyncio.gather(*[ac.completions.create(model="tiny-llama", prompt=p, max_tokens=120,
                                                                temperature=0) for p in prompts])

        async def kill_midway():
            task = asyncio.create_task(run_all())
            await asyncio.sleep(1.0)
            d.kill()
            return await task

        outs = asyncio.run(kill_midway())
        for p, o in zip(prompts, outs):
            assert o.choices[0].text == reference(lm, lm.tokenizer.encode(p), 120)[0]
        assert counter(t, "specdec:spec_decode_fallback_steps_total") > 0
        accepted_before = counter(t, "specdec:spec_decode_num_accepted_tokens_total")
        d = Draft(tmp, port=d.port).up()                       # back on the same address
        # The breaker probes after its cooldown; on a loaded machine the first Proposes after that can still miss their
        # deadline, so requests are sent until one is speculated (each must still match plain decoding), up to 60 s.
        want = reference(lm, lm.tokenizer.encode("after restart"), 60)[0]
        t0 = time.monotonic()
        while counter(t, "specdec:spec_decode_num_accepted_tokens_total") <= accepted_before:
            assert time.monotonic() - t0 < 60, "speculation did not resume within 60 s of the draft server's restart"
            time.sleep(1.0)
            again = client(t).completions.create(model="tiny-llama", prompt="after restart", max_tokens=60,
                                                 temperature=0)
            assert again.choices[0].text == want
    finally:
        t.kill()
        d.kill()


# seed 75: its seeded output (plain seeded decoding, what the default coupled acceptance gives) runs all 150 tokens,
# so the kill lands mid-request
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=75)], ids=["greedy", "seeded"])
def test_target_killed_then_resumed_by_id(tmp, draft, lm, redis_url, sampling):
    ns = f"test-{uuid.uuid4().hex[:8]}"
    body = dict(prompt="resume me please", max_tokens=150, **sampling)
    t = Target(tmp, draft=draft.addr, redis_url=redis_url, namespace=ns).up()
    try:
        whole = httpx.post(t.url + "/v1/completions", json={**body, "request_id": "ref-" + ns}, timeout=60).json()
    finally:
        t.kill()
    t = Target(tmp, draft=draft.addr, redis_url=redis_url, namespace=ns, extra=["--fault-step-delay-ms", "20"]).up()
    rid = "victim-" + ns
    got = ""
    with httpx.stream("POST", t.url + "/v1/completions", json={**body, "request_id": rid, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += json.loads(line[6:])["choices"][0]["text"]
            if len(got) >= 20:
                t.kill()                                       # SIGKILL mid-request
                break
    rec = redis_record(redis_url, ns, rid)
    assert rec.status == "running" and 0 < len(rec.output) < 150
    t2 = Target(tmp, draft=draft.addr, redis_url=redis_url, namespace=ns).up()
    try:
        resumed = httpx.post(t2.url + "/v1/completions", json={"request_id": rid, "resume": True}, timeout=60).json()
        assert resumed["choices"][0]["text"] == whole["choices"][0]["text"]
        assert resumed["spec"]["resumed_tokens"] == len(rec.output)
        assert resumed["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
        assert redis_record(redis_url, ns, rid).output == redis_record(redis_url, ns, "ref-" + ns).output
    finally:
        t2.kill()
