"""Bad input against the real servers (tiny models, loopback, real Redis in a unique namespace).

1. schemathesis generates bodies from the target's own /openapi.json (positive: what the schema allows; negative:
   what it forbids) for every operation: no response may be >= 500, every 4xx must be OpenAI's error shape, negative
   data must be refused, responses must match the schema. The numbers tried are printed (pytest -s) and reported.
2. Hand-written bad input over REST and gRPC, target and draft: wrong types, NaN/Infinity (raw JSON bytes), invalid
   UTF-8 (REST body, protobuf string fields), ids outside the vocabulary, empty prompts, gamma 0 and huge, huge
   max_tokens, long prompts, thousands of stop strings, 1 MB strings, messages over the gRPC limit. Each gets a clear
   400 / INVALID_ARGUMENT (or RESOURCE_EXHAUSTED) naming the field, nothing is written to Redis, and the servers stay
   healthy and keep decoding correctly.
"""
import json
import os
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.engine.engine import Engine
from specdec.generate import Request, generate
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pbg

from .stack import Target

try:   # at collection, on a shallow stack: schemathesis imports its OpenAPI modules lazily, and Python 3.11.7's parser
    # (pytest rewrites them) failed there deep in a full run ("AST constructor recursion depth mismatch", gh-106905)
    import schemathesis.specs.openapi.schemas  # noqa: F401
except ImportError:
    pass

pytestmark = pytest.mark.timeout(600)

V, CONTEXT = 96, 512           # tiny-llama
EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "100"))     # per operation and generation mode
ERROR_KEYS = {"message", "type", "param", "code"}


def redis_keys(redis_url, ns) -> int:
    import redis
    r = redis.Redis.from_url(redis_url)
    try:
        return len(list(r.scan_iter(f"{ns}:*", count=1000)))
    finally:
        r.close()


def assert_openai_error(r: httpx.Response, status: int | None = None, param: str | None = "-") -> dict:
    """The body is {"error": {"message", "type", "param", "code"}}; returns the inner object."""
    assert status is None or r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    if param != "-":
        assert err["param"] == param, (err, param)
    return err


def greedy_ok(t: Target, lm, prompt="still healthy") -> None:
    """The server answers and decodes exactly like in-process target-only decoding."""
    assert httpx.get(t.url + "/health", timeout=10).json()["status"] == "ok"
    want = generate(Engine(lm.model), [Request(lm.tokenizer.encode(prompt), max_tokens=12,
                                               stop_ids=lm.tokenizer.eos_ids)])[0]
    r = httpx.post(t.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == lm.tokenizer.decode(want.tokens), r.text


# ---------------------------------------------------------------------------------------------------- schemathesis

def fuzz(target, lm, redis_url, ns, examples: int, derandomize: bool) -> dict:
    """Run schemathesis over every operation; returns the counts per operation and mode."""
    schemathesis = pytest.importorskip("schemathesis")      # the test extra has it; the hand-made tests need none
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import (
        content_type_conformance,
        negative_data_rejection,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(target.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in ops} >= {"POST /v1/completions", "POST /v1/chat/completions",
                                                                 "GET /v1/models", "GET /health", "GET /metrics"}
    tried: dict[str, dict] = {}
    failures: list[str] = []
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              negative_data_rejection]

    def record(label, mode, resp):
        s = tried.setdefault(f"{label} {mode}", {"n": 0, "2xx": 0, "4xx": 0, "5xx": 0})
        s["n"] += 1
        s[f"{resp.status_code // 100}xx"] = s.get(f"{resp.status_code // 100}xx", 0) + 1

    def fuzz_one(op, mode, n: int) -> None:
        @settings(max_examples=n, deadline=None, database=None, derandomize=derandomize,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
                  report_multiple_bugs=True)
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            resp = case.call(base_url=target.url, timeout=120)
            record(op.label, mode.value, resp)
            problems = []
            if resp.status_code >= 500:
                problems.append(f"server error {resp.status_code}")
            if 400 <= resp.status_code < 500:
                try:
                    assert_openai_error(httpx.Response(resp.status_code, content=resp.content))
                except (AssertionError, ValueError) as e:
                    problems.append(f"not an OpenAI error: {e!r}")
            try:
                case.validate_response(resp, checks=checks)
            except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 - collected, reported together below
                lines = str(e).splitlines()
                problems.append("; ".join(x.strip() for x in lines if x.startswith(("- ", "    "))
                                          and len(x) < 300)[:1500] or type(e).__name__)
            if problems:
                failures.append(f"{op.label} [{mode.value}] {problems}: {case.as_curl_command()[:600]}")

        run()

    for op in ops:
        if op.method.upper() == "POST":
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                fuzz_one(op, mode, examples)
        else:
            fuzz_one(op, GenerationMode.POSITIVE, 3)

    total = sum(s["n"] for s in tried.values())
    server_errors = sum(s.get("5xx", 0) for s in tried.values())
    print(f"\nschemathesis: {total} requests, {server_errors} server errors")
    for k, s in sorted(tried.items()):
        print(f"  {k}: {s}")
    assert not failures, "\n".join(failures[:20])
    assert server_errors == 0
    assert total >= 4 * examples * 0.9           # hypothesis may stop early only on exhausted small spaces
    completions = tried["POST /v1/completions positive"]
    assert completions["2xx"] > 0 and completions["4xx"] > 0       # the fuzz reached generation and validation
    # every request the fuzzer got admitted has finished (none left running), and the server decodes correctly
    import asyncio

    from specdec.state import open_store

    async def statuses():
        import redis.asyncio as aioredis
        r = aioredis.Redis.from_url(redis_url)
        store = open_store(redis_url, namespace=ns)
        try:
            ids = [k.decode()[len(ns) + 5:] async for k in r.scan_iter(f"{ns}:req:*", count=1000)
                   if not k.endswith(b":out")]
            return [r for r in [await store.get(i) for i in ids] if r]
        finally:
            await r.aclose()
            await store.close()
    deadline = time.monotonic() + 10      # a timed-out or cancelled request is recorded just after its answer
    while (left := [r for r in asyncio.run(statuses()) if r.status == "running"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    # known, reported (test_stop_string_finish_is_recorded): a request ended by a stop *string* stays "running"
    stopped = [r for r in left if any(x in lm.tokenizer.decode(r.output) for x in r.stop)]
    if stopped:
        print(f"  {len(stopped)} records ended by a stop string still say 'running' (known scheduler issue)")
    left = [(r.rid, len(r.output), r.max_tokens, r.stop) for r in left if r not in stopped]
    assert not left, left
    greedy_ok(target, lm)
    return tried


def test_schemathesis_fuzz_rest(target, lm, redis_url, ns):
    """Bounded and reproducible (derandomized): the same inputs on every run."""
    fuzz(target, lm, redis_url, ns, EXAMPLES, derandomize=True)


@pytest.mark.slow
def test_schemathesis_fuzz_rest_long(target, lm, redis_url, ns):
    """Longer (SPECDEC_FUZZ_LONG_EXAMPLES per operation and mode). Reproducible by default, so CI cannot fail on a
    draw it never made before; SPECDEC_FUZZ_RANDOM=1 draws new inputs on every run, for exploring."""
    fuzz(target, lm, redis_url, ns, int(os.environ.get("SPECDEC_FUZZ_LONG_EXAMPLES", "150")),
         derandomize=os.environ.get("SPECDEC_FUZZ_RANDOM", "") in ("", "0"))


# ---------------------------------------------------------------------------------------------------- REST by hand

def _post(t, path, content: bytes, ctype="application/json", **kw):
    headers = {"content-type": ctype} if ctype else {}
    return httpx.post(t.url + path, content=content, headers=headers, timeout=60, **kw)


J = json.dumps
BIG = 1 << 20

# (raw body, expected param or "-" for "don't care", a word the message must contain)
BAD_RAW = [
    # NaN / Infinity: Python's json accepts them, the API refuses them
    (b'{"prompt": "x", "temperature": NaN}', "temperature", "finite"),
    (b'{"prompt": "x", "temperature": Infinity}', "temperature", "finite"),
    (b'{"prompt": "x", "top_p": -Infinity}', "top_p", "finite"),
    (b'{"prompt": "x", "min_p": NaN}', "min_p", "finite"),
    (b'{"prompt": "x", "temperature": 1e999}', "temperature", "finite"),
    (b'{"prompt": "x", "timeout_s": NaN}', "timeout_s", "finite"),
    # negative and out-of-range floats
    (b'{"prompt": "x", "temperature": -0.5}', "temperature", "temperature"),
    (b'{"prompt": "x", "temperature": 5e-324}', "temperature", "temperature"),   # denormal: NaN probs (was a 500)
    (b'{"prompt": "x", "top_p": 0}', "top_p", "top_p"),
    (b'{"prompt": "x", "min_p": -1}', "min_p", "min_p"),
    # invalid UTF-8 in the body, lone surrogates in JSON strings
    (b'{"prompt": "\xff\xfe\xfd"}', None, "UTF-8"),
    (b'{"prompt": "\xc3\x28"}', None, "UTF-8"),
    (b'{"prompt": "\\ud800"}', "prompt", "Unicode"),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content", "Unicode"),
    (b'{"prompt": "x", "stop": ["\\ud800"]}', "stop[0]", "Unicode"),
    (b'{"prompt": "x", "request_id": "a\\udc80"}', "request_id", "Unicode"),
    # wrong types
    (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens", "integer"),
    (b'{"prompt": "x", "max_tokens": 5.5}', "max_tokens", "integer"),
    (b'{"prompt": "x", "max_tokens": true}', "max_tokens", "integer"),
    (b'{"prompt": "x", "temperature": "0.5"}', "temperature", "number"),
    (b'{"prompt": "x", "stream": "yes"}', "stream", "boolean"),
    (b'{"prompt": "x", "seed": 1.5}', "seed", "integer"),
    (b'{"prompt": {"text": "x"}}', "prompt", "string"),
    (b'{"prompt": [1, "a"]}', "prompt", "string"),
    (b'{"prompt": [[1, 2]]}', "prompt", "string"),
    (b'{"prompt": "x", "stop": 7}', "stop", "string"),
    (b'{"prompt": "x", "stop": [["a"]]}', "stop", "string"),
    (b'{"prompt": "x", "speculative": "on"}', "speculative", "dictionary"),
    (b'{"prompt": "x", "speculative": {"gamma": "4"}}', "speculative.gamma", "integer"),
    (b'{"prompt": "x", "speculative": {"gama": 4}}', "speculative.gama", "unknown"),
    (b'{"prompt": "x", "model": ["tiny"]}', "model", "string"),
    # token ids outside the vocabulary, empty prompts
    (J({"prompt": [1, 2, V]}).encode(), "prompt", "vocabulary"),
    (J({"prompt": [-1]}).encode(), "prompt", "vocabulary"),
    (J({"prompt": [2**70]}).encode(), "prompt", "vocabulary"),
    (J({"prompt": ""}).encode(), "prompt", "empty"),
    (J({"prompt": []}).encode(), "prompt", "empty"),
    (J({"prompt": ["a", "b"]}).encode(), "prompt", "several"),
    # gamma 0 and huge, huge ints
    (J({"prompt": "x", "speculative": {"gamma": 0}}).encode(), "gamma", "gamma"),
    (J({"prompt": "x", "speculative": {"gamma": 10**30}}).encode(), "gamma", "gamma"),
    (J({"prompt": "x", "speculative": {"gamma": -3}}).encode(), "gamma", "gamma"),
    (J({"prompt": "x", "max_tokens": 10**30}).encode(), "max_tokens", "context"),
    (J({"prompt": "x", "max_tokens": CONTEXT}).encode(), "max_tokens", "context"),
    (J({"prompt": "x", "max_tokens": 0}).encode(), "max_tokens", "max_tokens"),
    (J({"prompt": "x", "max_tokens": -1}).encode(), "max_tokens", "max_tokens"),
    (J({"prompt": "x", "top_k": 2**31}).encode(), "top_k", "top_k"),
    (J({"prompt": "x", "top_k": -1}).encode(), "top_k", "top_k"),
    (J({"prompt": "x", "seed": 2**63}).encode(), "seed", "seed"),
    (J({"prompt": "x", "n": 10**20}).encode(), "n", "n="),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None, "number"),   # beyond Python's int parsing
    # long prompts, enormous stop lists, 1 MB strings
    (J({"prompt": "x" * CONTEXT}).encode(), "prompt", "context"),
    (J({"prompt": "x" * BIG}).encode(), "prompt", "context"),
    (J({"prompt": list(range(1, V)) * 10}).encode(), "prompt", "context"),
    (J({"messages": [{"role": "user", "content": "y" * BIG}]}).encode(), "prompt", "context"),
    (J({"prompt": "x", "stop": [f"s{i}" for i in range(5000)]}).encode(), "stop", "at most"),
    (J({"prompt": "x", "stop": ["z" * BIG]}).encode(), "stop[0]", "256"),
    (J({"prompt": "x", "stop": "z" * BIG}).encode(), "stop", "256"),
    (J({"prompt": "x", "request_id": "r" * BIG}).encode(), "request_id", "128"),
    (J({"prompt": "x", "model": "m" * BIG, "max_tokens": 0}).encode(), "max_tokens", "max_tokens"),
    # bodies that are not a JSON object, nesting, unsupported options
    (b"", None, "JSON object"),
    (b"[]", None, "JSON object"),
    (b"null", None, "JSON object"),
    (b'"prompt"', None, "JSON object"),
    (b'{"prompt": "x"', None, "JSON"),
    (b"[" * 100_000 + b"]" * 100_000, None, "nests"),
    (b'{"prompt": "x", "logprobs": ' + b"[" * 500 + b"]" * 500 + b"}", "logprobs", "integer"),
    (J({"prompt": "x", "echo": True}).encode(), "echo", "echo"),
    (J({"prompt": "x", "logprobs": 5}).encode(), "logprobs", "logprobs"),
    (J({"prompt": "x", "request_id": "abc:out"}).encode(), "request_id", "out"),
    (J({"request_id": "nope", "resume": True, "prompt": "x"}).encode(), "request_id", "no request"),
    (J({"resume": True, "prompt": "x"}).encode(), "request_id", "request_id"),
]


@pytest.mark.parametrize("body,param,word", BAD_RAW, ids=[f"{i}:{b[:40]!r}" for i, (b, _, _) in enumerate(BAD_RAW)])
def test_rest_bad_input_is_a_clear_400(target, body, param, word):
    path = "/v1/chat/completions" if body.startswith(b'{"messages"') else "/v1/completions"
    r = _post(target, path, body)
    status = 404 if b"nope" in body else 400
    err = assert_openai_error(r, status, param)
    assert word.lower() in err["message"].lower(), err
    if param:
        assert param.split(".")[-1].split("[")[0] in err["message"], err    # the message names the field


def test_rest_transport_level_bad_input(target, lm, redis_url, ns):
    before = redis_keys(redis_url, ns)
    # not JSON at all
    assert "application/json" in assert_openai_error(_post(target, "/v1/completions", b"prompt=x",
                                                           "application/x-www-form-urlencoded"), 400)["message"]
    assert_openai_error(_post(target, "/v1/completions", b'{"prompt": "x"}', None), 400)
    # over the body limit (16 MB by default): 413 before parsing, with and without Content-Length
    big = J({"prompt": "a" * (17 << 20)}).encode()
    assert assert_openai_error(_post(target, "/v1/completions", big), 413)["code"] == "request_too_large"

    def chunks():
        for _ in range(17):
            yield b"a" * (1 << 20)
    assert_openai_error(httpx.post(target.url + "/v1/completions", content=chunks(),
                                   headers={"content-type": "application/json"}, timeout=60), 413)
    # unknown routes and methods are OpenAI-shaped too
    assert_openai_error(httpx.get(target.url + "/v1/nope"), 404)
    assert_openai_error(httpx.get(target.url + "/v1/completions"), 405)
    # every bad body so far and in the table wrote nothing
    for body, _, _ in BAD_RAW[:20]:
        _post(target, "/v1/completions", body)
    assert redis_keys(redis_url, ns) == before
    greedy_ok(target, lm)


def test_rest_bad_input_writes_nothing_to_redis(target, lm, redis_url, ns):
    before = redis_keys(redis_url, ns)
    for body, _, _ in BAD_RAW:
        path = "/v1/chat/completions" if body.startswith(b'{"messages"') else "/v1/completions"
        assert 400 <= _post(target, path, body).status_code < 500
    assert redis_keys(redis_url, ns) == before
    greedy_ok(target, lm)


# ---------------------------------------------------------------------------------------------------- gRPC by hand

def _raw_call(addr, method: str, payload: bytes, streaming: bool, metadata=None):
    """Send hand-made bytes (what protobuf would never serialize) to a method."""
    with grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 256 << 20)]) as ch:
        if streaming:
            return list(ch.unary_stream(method, request_serializer=None, response_deserializer=None)(
                payload, timeout=30, metadata=metadata))
        return ch.unary_unary(method, request_serializer=None, response_deserializer=None)(
            payload, timeout=30, metadata=metadata)


def _healthy(addr, service):
    with grpc.insecure_channel(addr) as ch:
        st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
    assert st == health_pb2.HealthCheckResponse.SERVING


def _gen(prompt="x", **kw):
    return pb.GenerateRequest(prompt=prompt, max_tokens=kw.pop("max_tokens", 4), **kw)


NAN, INF = float("nan"), float("inf")
BAD_GENERATE = [
    (_gen(sampling=pb.SamplingParams(temperature=NAN)), "temperature"),
    (_gen(sampling=pb.SamplingParams(temperature=INF)), "temperature"),
    (_gen(sampling=pb.SamplingParams(temperature=-1)), "temperature"),
    (_gen(sampling=pb.SamplingParams(temperature=5e-324)), "temperature"),
    (_gen(sampling=pb.SamplingParams(temperature=0.5, top_p=NAN)), "top_p"),
    (_gen(sampling=pb.SamplingParams(temperature=0.5, top_p=-INF)), "top_p"),
    (_gen(sampling=pb.SamplingParams(temperature=0.5, min_p=INF)), "min_p"),
    (_gen(sampling=pb.SamplingParams(temperature=0.5, top_k=-5)), "top_k"),
    (_gen(sampling=pb.SamplingParams(temperature=0.5, seed=2**64 - 1)), "seed"),
    (pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=[1, V]), max_tokens=4), "prompt"),
    (pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=[-7]), max_tokens=4), "prompt"),
    (pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=[]), max_tokens=4), "prompt"),
    (_gen(prompt=""), "prompt"),
    (pb.GenerateRequest(max_tokens=4), "prompt"),
    (_gen(prompt="x" * CONTEXT), "prompt"),
    (_gen(prompt="x" * BIG), "prompt"),
    (_gen(max_tokens=2**32 - 1), "max_tokens"),
    (_gen(speculative=pb.SpeculativeOptions(gamma=2**32 - 1)), "gamma"),
    (_gen(speculative=pb.SpeculativeOptions(gamma=17)), "gamma"),
    (_gen(speculative=pb.SpeculativeOptions(mode=99)), "mode"),
    (_gen(stop=[f"s{i}" for i in range(5000)]), "stop"),
    (_gen(stop=["z" * BIG]), "stop"),
    (_gen(stop=[""]), "stop"),
    (_gen(request_id="r" * 1000), "request_id"),
    (_gen(request_id="x:out"), "request_id"),
    (pb.GenerateRequest(resume=True), "request_id"),
]

BAD_VERIFY = [
    (pb.VerifyRequest(context=[], draft_tokens=[1]), "context"),
    (pb.VerifyRequest(context=[1, V], draft_tokens=[1]), "prompt"),
    (pb.VerifyRequest(context=[1, 2], draft_tokens=[V]), "draft_tokens"),
    (pb.VerifyRequest(context=[1, 2], draft_tokens=[-1]), "draft_tokens"),
    (pb.VerifyRequest(context=[1, 2], draft_tokens=[1] * 1000), "draft_tokens"),
    (pb.VerifyRequest(context=[1] * CONTEXT, draft_tokens=[1]), "prompt"),
    (pb.VerifyRequest(context=[1, 2], draft_tokens=[3], sampling=pb.SamplingParams(temperature=NAN)), "temperature"),
    (pb.VerifyRequest(context=[1, 2], draft_tokens=[3], sampling=pb.SamplingParams(temperature=1e-320)),
     "temperature"),
    # rejection mode: q must be one distribution per draft token, well-formed
    (pb.VerifyRequest(context=[1, 2], draft_tokens=[3], sampling=pb.SamplingParams(temperature=1, seed=1),
                      mode=pb.REJECTION), "q"),
    (pb.VerifyRequest(context=[1, 2], draft_tokens=[3], q=[pb.DraftDistribution()] * 100_000,
                      sampling=pb.SamplingParams(temperature=1, seed=1), mode=pb.REJECTION), "q"),  # memory bomb
    (pb.VerifyRequest(context=[1, 2], draft_tokens=[3], q=[pb.DraftDistribution(ids=[3, V], probs=[0.5, 0.5])],
                      sampling=pb.SamplingParams(temperature=1, seed=1), mode=pb.REJECTION), "q[0].ids"),
    (pb.VerifyRequest(context=[1, 2], draft_tokens=[3], q=[pb.DraftDistribution(ids=[3, -1], probs=[0.5, 0.5])],
                      sampling=pb.SamplingParams(temperature=1, seed=1), mode=pb.REJECTION), "q[0].ids"),
    (pb.VerifyRequest(context=[1, 2], draft_tokens=[3], q=[pb.DraftDistribution(ids=[3], probs=[0.5, 0.5])],
                      sampling=pb.SamplingParams(temperature=1, seed=1), mode=pb.REJECTION), "q[0]"),
    (pb.VerifyRequest(context=[1, 2], draft_tokens=[3], q=[pb.DraftDistribution(probs=[1.0] * 5)],
                      sampling=pb.SamplingParams(temperature=1, seed=1), mode=pb.REJECTION), "q[0].probs"),
    (pb.VerifyRequest(context=[1, 2], draft_tokens=[3], q=[pb.DraftDistribution(ids=[3], probs=[NAN])],
                      sampling=pb.SamplingParams(temperature=1, seed=1), mode=pb.REJECTION), "q[0].probs"),
    (pb.VerifyRequest(context=[1, 2], draft_tokens=[3], q=[pb.DraftDistribution(ids=[3, 4], probs=[2.0, -1.0])],
                      sampling=pb.SamplingParams(temperature=1, seed=1), mode=pb.REJECTION), "q[0].probs"),
    (pb.VerifyRequest(context=[1, 2], draft_tokens=[3], mode=42), "mode"),
]


def _bad_utf8_generate() -> bytes:
    # GenerateRequest.prompt (field 2, length-delimited) holding bytes that are not UTF-8
    return b"\x12\x03\xff\xfe\xfd" + b"\x20\x04"                     # + max_tokens = 4


def test_grpc_bad_input_is_invalid_argument_and_writes_nothing(target, lm, redis_url, ns):
    before = redis_keys(redis_url, ns)
    with grpc.insecure_channel(target.grpc_addr) as ch:
        stub = pbg.TargetStub(ch)
        for req, field in BAD_GENERATE:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (req, e.value)
            assert field in e.value.details(), (field, e.value.details())
        for req, field in BAD_VERIFY:
            with pytest.raises(grpc.RpcError) as e:
                stub.Verify(req, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e.value)
            assert field in e.value.details(), (field, e.value.details())
    # invalid UTF-8 in a string field: protobuf refuses to parse it; the server answers INVALID_ARGUMENT
    for method, payload, streaming in [
        ("/specdec.v1.Target/Generate", _bad_utf8_generate(), True),
        ("/specdec.v1.Target/Generate", b"\x12\xff\xff\xff\xff\x0f", True),          # truncated length
        ("/specdec.v1.Target/Verify", b"\x0a\x05\x01\x02", False),                 # packed ints cut short
    ]:
        with pytest.raises(grpc.RpcError) as e:
            _raw_call(target.grpc_addr, method, payload, streaming)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert "UTF-8" in e.value.details() or "not a valid" in e.value.details()
    # over the 64 MB receive limit: refused by grpc, the server stays up
    with grpc.insecure_channel(target.grpc_addr, options=[("grpc.max_send_message_length", 256 << 20)]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(pbg.TargetStub(ch).Generate(_gen(prompt="p" * (65 << 20)), timeout=60))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert redis_keys(redis_url, ns) == before
    _healthy(target.grpc_addr, "specdec.v1.Target")
    greedy_ok(target, lm)
    # and gRPC still generates
    with grpc.insecure_channel(target.grpc_addr) as ch:
        chunks = list(pbg.TargetStub(ch).Generate(_gen(prompt="fine", max_tokens=6,
                                                       sampling=pb.SamplingParams(temperature=0)), timeout=60))
    want = generate(Engine(lm.model), [Request(lm.tokenizer.encode("fine"), max_tokens=6,
                                               stop_ids=lm.tokenizer.eos_ids)])[0]
    assert [t for c in chunks for t in c.tokens] == want.tokens and chunks[-1].finish_reason == want.finish_reason


def test_draft_server_bad_bytes_and_size(draft):
    item = pb.ProposeItem(request_id="r", new_tokens=[1, 2], committed_len=2, gamma=2)
    ok = pb.ProposeRequest(items=[item]).SerializeToString()
    with grpc.insecure_channel(draft.addr, options=[("grpc.max_send_message_length", 256 << 20)]) as ch:
        stub = pbg.DrafterStub(ch)
        # ProposeItem.request_id (items: field 1; request_id: field 1) with invalid UTF-8
        bad_item = b"\x0a\x03\xff\xfe\xfd" + item.SerializeToString()[len(b"\x0a\x01r"):]
        payload = b"\x0a" + bytes([len(bad_item)]) + bad_item
        for raw in (payload, b"\x0a\xff\xff\xff\xff\x0f"):
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary("/specdec.v1.Drafter/Propose", request_serializer=None,
                               response_deserializer=None)(raw, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        for req, field in [
            (pb.ProposeRequest(items=[pb.ProposeItem(request_id="r", new_tokens=[1, V], committed_len=2, gamma=2)]),
             "new_tokens"),
            (pb.ProposeRequest(items=[pb.ProposeItem(request_id="r", new_tokens=[1], committed_len=1, gamma=0)]),
             "gamma"),
            (pb.ProposeRequest(items=[pb.ProposeItem(request_id="r", new_tokens=[1], committed_len=1,
                                                     gamma=2**32 - 1)]), "gamma"),
            (pb.ProposeRequest(items=[pb.ProposeItem(request_id="r", new_tokens=[1], committed_len=1, gamma=2,
                                                     sampling=pb.SamplingParams(temperature=NAN))]), "temperature"),
            (pb.ProposeRequest(items=[pb.ProposeItem(request_id="x" * 300, new_tokens=[1], committed_len=1,
                                                     gamma=2)]), "request_id"),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                stub.Propose(req, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value
        with pytest.raises(grpc.RpcError) as e:
            stub.Propose(pb.ProposeRequest(items=[pb.ProposeItem(request_id="r" * (65 << 20))]), timeout=60)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # still serving, and still drafting
        assert len(pb.ProposeResponse.FromString(ch.unary_unary(
            "/specdec.v1.Drafter/Propose", request_serializer=None, response_deserializer=None)(ok, timeout=30))
            .proposals[0].tokens) == 2
    _healthy(draft.addr, "specdec.v1.Drafter")


def test_stop_string_finish_is_recorded(target, lm, redis_url, ns):
    import asyncio

    from specdec.state import open_store
    body = {"prompt": "stop here", "max_tokens": 30, "temperature": 0}
    text = httpx.post(target.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    r = httpx.post(target.url + "/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "stop" and stop not in r["choices"][0]["text"]

    async def get():
        store = open_store(redis_url, namespace=ns)
        try:
            return await store.get(r["id"])
        finally:
            await store.close()
    time.sleep(0.5)
    rec = asyncio.run(get())
    assert (rec.status, rec.finish_reason) == ("finished", "stop")
