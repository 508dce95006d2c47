"""Security of the service pair, on real processes over loopback (tiny models, real Redis in unique namespaces).

- API keys (target --api-keys): REST needs `Authorization: Bearer <key>` on every route but /health and /metrics
  (401 in OpenAI's shape, before the body is read), gRPC needs metadata `authorization: Bearer <key>`
  (UNAUTHENTICATED); health stays open. Driven with the official openai client and plain grpcio.
- A request can be resumed (read) only with the key that created it: another key gets 403 / PERMISSION_DENIED and
  the Redis record does not change (no epoch bump, no owner change).
- Request ids are 128-bit random; Redis keys live under the configured namespace; keys are stored only as sha256.
- Draft link: loopback bind by default; optional shared token (UNAUTHENTICATED without it, health open) and TLS
  (self-signed cert made here with openssl); target <-> draft over TLS + token speculates; a wrong token or a
  plain-text client degrades to plain decoding (no request fails) and never talks in the clear.
- Logs: neither a prompt nor an API key appears in either server's log.
"""
import hashlib
import ipaddress
import json
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import AuthenticationError, OpenAI, PermissionDeniedError

from specdec.engine.engine import Engine
from specdec.generate import Request, generate
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pbg

from .conftest import free_port
from .stack import Draft, Proc, Target, wait_grpc

pytestmark = pytest.mark.timeout(600)

K1, K2 = f"sk-one-{uuid.uuid4().hex}", f"sk-two-{uuid.uuid4().hex}"
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def target(tmp, draft, redis_url, ns):
    # a 10 ms pause per step keeps a long request running long enough to poke at it while it runs
    t = Target(tmp, draft=draft.addr, redis_url=redis_url, namespace=ns,
               extra=["--api-keys", f"{K1},{K2}", "--fault-step-delay-ms", "10"]).up()
    yield t
    t.kill()


def client(t: Target, key: str) -> OpenAI:
    return OpenAI(base_url=t.url + "/v1", api_key=key, max_retries=0)


def reference(lm, text: str, n: int) -> str:
    out = generate(Engine(lm.model), [Request(lm.tokenizer.encode(text), max_tokens=n,
                                              stop_ids=lm.tokenizer.eos_ids)])[0]
    return lm.tokenizer.decode(out.tokens)


def redis_client(url):
    import redis
    return redis.Redis.from_url(url)


def snapshot(url, ns, rid) -> tuple[dict, bytes | None]:
    r = redis_client(url)
    try:
        return r.hgetall(f"{ns}:req:{rid}"), r.get(f"{ns}:req:{rid}:out")
    finally:
        r.close()


def key_count(url, ns) -> int:
    r = redis_client(url)
    try:
        return len(list(r.scan_iter(f"{ns}:*", count=1000)))
    finally:
        r.close()


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# ---------------------------------------------------------------------------------------------------- API keys

def test_rest_api_keys_with_the_openai_client(target, lm, redis_url, ns):
    before = key_count(redis_url, ns)
    for bad in ("", "wrong", K1 + "x", K1[:-1], K1.upper()):
        with pytest.raises(AuthenticationError) as e:
            client(target, bad or "none").completions.create(model="tiny-llama", prompt="hi", max_tokens=3)
        assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
        with pytest.raises(AuthenticationError):
            client(target, bad or "none").models.list()          # /v1/models needs the key too
    assert key_count(redis_url, ns) == before                       # refused requests wrote nothing
    for key in (K1, K2):
        c = client(target, key)
        got = c.completions.create(model="tiny-llama", prompt="keyed", max_tokens=8, temperature=0)
        assert got.choices[0].text == reference(lm, "keyed", 8)
        chat = c.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=4, temperature=0)
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert [m.id for m in c.models.list().data] == ["tiny-llama"]


def test_rest_auth_is_checked_first_and_probes_stay_open(target):
    u = target.url
    # no header, a wrong scheme, a wrong key: 401 in OpenAI's shape, even when the body is garbage or huge
    for headers in ({}, {"authorization": f"Basic {K1}"}, {"authorization": "Bearer nope"}, {"x-api-key": "nope"}):
        for body in (b'{"prompt": "x"}', b"\xff not json", b"{" * 100_000):
            r = httpx.post(u + "/v1/completions", content=body, timeout=30,
                           headers={"content-type": "application/json", **headers})
            err = openai_error(r, 401)
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
            assert r.headers.get("www-authenticate") == "Bearer"
    for path in ("/v1/models", "/openapi.json", "/docs", "/v1/unknown"):
        openai_error(httpx.get(u + path, timeout=10), 401)
    # probes and scrapes need no key
    assert httpx.get(u + "/health", timeout=10).status_code == 200
    assert httpx.get(u + "/metrics", timeout=10).status_code == 200
    # the scheme name is case-insensitive; the key is not
    ok = httpx.post(u + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0}, timeout=30,
                    headers={"authorization": f"bearer {K2}"})
    assert ok.status_code == 200
    schema = httpx.get(u + "/openapi.json", headers={"authorization": f"Bearer {K1}"}, timeout=10).json()
    assert schema["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert schema["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in schema["paths"]["/health"]["get"]


def test_grpc_api_keys(target, lm):
    req = pb.GenerateRequest(prompt="keyed", max_tokens=8, sampling=pb.SamplingParams(temperature=0))
    with grpc.insecure_channel(target.grpc_addr) as ch:
        stub = pbg.TargetStub(ch)
        for md in (None, [("authorization", "Bearer nope")], [("authorization", K1)], [("x-api-key", "nope")]):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, metadata=md, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, md
            with pytest.raises(grpc.RpcError) as e:
                stub.Verify(pb.VerifyRequest(context=[1, 2], draft_tokens=[3]), metadata=md, timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # unauthenticated garbage is refused as unauthenticated, not parsed
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/specdec.v1.Target/Verify", request_serializer=None, response_deserializer=None)(
                b"\x0a\xff\xff", timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for md in ([("authorization", f"Bearer {K1}")], [("authorization", f"bearer {K2}")], [("x-api-key", K1)]):
            chunks = list(stub.Generate(req, metadata=md, timeout=30))
            assert "".join(c.text for c in chunks) == reference(lm, "keyed", 8)
        st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="specdec.v1.Target"),
                                                  timeout=10)
        assert st.status == SERVING                                   # health needs no key


# ---------------------------------------------------------------------------------------------------- ownership

def test_request_belongs_to_the_key_that_created_it(target, lm, redis_url, ns):
    """k2 cannot resume (read) k1's request, neither while it runs nor after: 403 / PERMISSION_DENIED, and the
    record is untouched (no epoch bump, same owner). k1 can."""
    rid = f"owned-{uuid.uuid4().hex}"
    body = {"prompt": "a long one", "max_tokens": 500, "temperature": 0, "request_id": rid, "stream": True}
    text = ""
    with httpx.stream("POST", target.url + "/v1/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {K1}"}) as r:
        lines = r.iter_lines()
        for line in lines:                                           # a few chunks: the request is running
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
            if len(text) >= 10:
                break
        h0, _ = snapshot(redis_url, ns, rid)
        assert h0[b"status"] == b"running" and h0[b"key_hash"] == hashlib.sha256(K1.encode()).hexdigest().encode()
        with pytest.raises(PermissionDeniedError) as e:
            client(target, K2).completions.create(model="tiny-llama", prompt="x",
                                                  extra_body={"request_id": rid, "resume": True})
        assert e.value.status_code == 403 and e.value.body["type"] == "permission_error"
        with grpc.insecure_channel(target.grpc_addr) as ch:
            with pytest.raises(grpc.RpcError) as g:
                list(pbg.TargetStub(ch).Generate(pb.GenerateRequest(request_id=rid, resume=True),
                                                 metadata=[("authorization", f"Bearer {K2}")], timeout=30))
            assert g.value.code() == grpc.StatusCode.PERMISSION_DENIED
        h1, _ = snapshot(redis_url, ns, rid)
        assert (h1[b"epoch"], h1[b"owner"]) == (h0[b"epoch"], h0[b"owner"])    # not claimed, not fenced
        assert h1[b"status"] == b"running"
        for line in lines:                                           # the owner's stream goes on undisturbed
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    want = reference(lm, "a long one", 500)
    assert text == want
    done = snapshot(redis_url, ns, rid)
    with pytest.raises(PermissionDeniedError):
        client(target, K2).completions.create(model="tiny-llama", prompt="x",
                                              extra_body={"request_id": rid, "resume": True})
    assert snapshot(redis_url, ns, rid) == done                     # byte for byte
    # the owner reads it back; an unknown id is 404 for everyone
    again = client(target, K1).completions.create(model="tiny-llama", prompt="x",
                                                  extra_body={"request_id": rid, "resume": True})
    assert again.choices[0].text == want
    r = httpx.post(target.url + "/v1/completions", json={"request_id": "no-such-" + rid, "resume": True},
                   headers={"authorization": f"Bearer {K2}"}, timeout=30)
    assert openai_error(r, 404)["param"] == "request_id"


# ---------------------------------------------------------------------------------------------------- ids, Redis

ID = re.compile(r"^req-[0-9a-f]{32}$")


def test_request_ids_are_128_bit_random():
    from target_service.service import new_request_id
    ids = {new_request_id() for _ in range(20_000)}
    assert len(ids) == 20_000 and all(ID.match(i) for i in ids)
    # every hex digit is used in every position (no counter, no timestamp prefix)
    for pos in (4, 10, 20, 35):
        assert len({i[pos] for i in ids}) == 16


def test_served_ids_records_namespace_and_hashed_keys(target, redis_url, ns):
    c = client(target, K1)
    ids = [c.completions.create(model="tiny-llama", prompt=f"id {i}", max_tokens=2, temperature=0).id
           for i in range(12)]
    with grpc.insecure_channel(target.grpc_addr) as ch:
        ids.append(next(iter(pbg.TargetStub(ch).Generate(pb.GenerateRequest(prompt="g", max_tokens=2),
                                                         metadata=[("authorization", f"Bearer {K2}")],
                                                         timeout=30))).request_id)
    assert len(set(ids)) == len(ids) and all(ID.match(i) for i in ids)
    r = redis_client(redis_url)
    try:
        for rid, key in zip(ids, [K1] * 12 + [K2]):
            # the request's keys are exactly {ns}:req:{rid} and {ns}:req:{rid}:out, nothing outside the namespace
            found = sorted(k.decode() for k in r.scan_iter(f"*{rid}*", count=1000))
            assert found == [f"{ns}:req:{rid}", f"{ns}:req:{rid}:out"], found
            h = r.hgetall(f"{ns}:req:{rid}")
            assert h[b"key_hash"] == hashlib.sha256(key.encode()).hexdigest().encode()
            blob = b"".join(k + v for k, v in h.items()) + (r.get(f"{ns}:req:{rid}:out") or b"")
            for secret in (K1, K2):
                assert secret.encode() not in blob                   # no key in the record, only its hash
                assert secret.encode().hex().encode() not in blob
    finally:
        r.close()


def test_namespaces_isolate_targets_sharing_a_redis(tmp, target, redis_url, ns):
    rid = f"iso-{uuid.uuid4().hex}"
    done = client(target, K1).completions.create(model="tiny-llama", prompt="mine", max_tokens=3, temperature=0,
                                                 extra_body={"request_id": rid})
    other = Target(tmp, redis_url=redis_url, namespace=f"sec-other-{uuid.uuid4().hex[:8]}",
                   extra=["--api-keys", K1]).up()
    try:
        r = httpx.post(other.url + "/v1/completions", json={"request_id": rid, "resume": True}, timeout=30,
                       headers={"authorization": f"Bearer {K1}"})
        assert openai_error(r, 404)["param"] == "request_id"       # not visible from another namespace
        # the same id can be used there without touching ours
        mine = snapshot(redis_url, ns, rid)
        r = httpx.post(other.url + "/v1/completions", json={"prompt": "theirs", "max_tokens": 3, "request_id": rid},
                       timeout=30, headers={"authorization": f"Bearer {K1}"})
        assert r.status_code == 200
        assert snapshot(redis_url, ns, rid) == mine
    finally:
        other.kill()
    assert done.id == rid


# ---------------------------------------------------------------------------------------------------- draft link

def _listening(port: int) -> set[str]:
    """Local addresses listening on `port` (Linux /proc/net/tcp{,6})."""
    out = set()
    for f, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(f).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            parts = ln.split()
            addr, p = parts[1].split(":")
            if int(p, 16) == port and parts[3] == "0A":             # 0A = LISTEN
                raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, width, 8))  # LE 32-bit words
                ip = ipaddress.ip_address(raw)
                out.add(str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip))
    return out


def test_servers_bind_loopback_by_default(tmp):
    from draft_service.server import parse_args
    from target_service.__main__ import parser
    assert parse_args([]).host == "127.0.0.1"
    assert parser().parse_args([]).host == "127.0.0.1"
    port = free_port()
    d = Proc(["-m", "draft_service", "--drafter", "ngram", "--port", str(port)], tmp / "draft-default.log")
    d.start()
    try:
        wait_grpc(f"127.0.0.1:{port}", d)
        if not Path("/proc/net/tcp").exists():
            pytest.skip("no /proc/net/tcp to read listening sockets from")
        assert _listening(port) == {"127.0.0.1"}, _listening(port)
    finally:
        d.kill()


def make_cert(d: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 / localhost: (cert, key). cryptography if installed, else openssl."""
    cert, key = d / f"{name}.crt", d / f"{name}.key"
    try:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
        k = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
        now = datetime.datetime.now(datetime.UTC)
        c = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(k.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
             .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
             .sign(k, hashes.SHA256()))
        cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
        key.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()))
        return cert, key
    except ImportError:
        pass
    if shutil.which("openssl") is None:
        pytest.skip("neither the cryptography package nor the openssl CLI is available to make a test certificate")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def wait_tls(addr: str, ca: Path, proc: Proc, timeout: float = 90) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    end = time.time() + timeout
    with grpc.secure_channel(addr, creds) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.time() < end:
            if not proc.alive():
                raise RuntimeError(f"process died:\n{proc.tail()}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{addr} not SERVING over TLS:\n{proc.tail()}")


TOKEN = f"draft-token-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def certs(tmp):
    return make_cert(tmp, "draft"), make_cert(tmp, "stranger")


@pytest.fixture(scope="module")
def tls_draft(tmp, certs):
    (cert, key), _ = certs
    d = Draft(tmp, extra=["--tls-cert", str(cert), "--tls-key", str(key)])
    d.env["SPECDEC_DRAFT_TOKEN"] = TOKEN                         # the token from the environment, not argv
    d.start()
    wait_tls(d.addr, cert, d)
    yield d
    d.kill()


def _propose_req():
    return pb.ProposeRequest(items=[pb.ProposeItem(request_id="t", new_tokens=[1, 2, 3], committed_len=3, gamma=2)])


def test_draft_token_and_tls_on_the_wire(tls_draft, certs):
    (cert, _), (stranger, _) = certs
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with grpc.secure_channel(tls_draft.addr, creds) as ch:
        stub = pbg.DrafterStub(ch)
        for md in (None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)]):
            for call, req in ((stub.Propose, _propose_req()), (stub.Release, pb.ReleaseRequest(request_ids=["t"]))):
                with pytest.raises(grpc.RpcError) as e:
                    call(req, metadata=md, timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = stub.Propose(_propose_req(), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=10)
        assert len(ok.proposals[0].tokens) == 2
        st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="specdec.v1.Drafter"),
                                                  timeout=10)
        assert st.status == SERVING                                   # health needs no token
    # plain text to the TLS port: fails closed (no answer, not even health)
    with grpc.insecure_channel(tls_draft.addr) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pbg.DrafterStub(ch).Propose(_propose_req(), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    # TLS trusting another CA: the server is not trusted
    with grpc.secure_channel(tls_draft.addr, grpc.ssl_channel_credentials(stranger.read_bytes())) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pbg.DrafterStub(ch).Propose(_propose_req(), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def _spec_run(t: Target, lm, prompts=("over tls", "second one", "third")):
    """Every request succeeds with exactly the target-only greedy output; returns the summed spec stats."""
    total = {"drafted": 0, "accepted": 0}
    for p in prompts:
        r = httpx.post(t.url + "/v1/completions", json={"prompt": p, "max_tokens": 40, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference(lm, p, 40)
        for k in total:
            total[k] += r.json()["spec"][k]
    return total


def _fallback_steps(t: Target) -> float:
    return sum(float(x.split()[-1]) for x in httpx.get(t.url + "/metrics").text.splitlines()
               if x.startswith("specdec:spec_decode_fallback_steps_total"))


@pytest.mark.parametrize("setup", ["tls+token", "wrong-token", "no-token", "plain-text", "wrong-ca"])
def test_target_to_draft_over_tls(tmp, tls_draft, certs, lm, setup):
    (cert, _), (stranger, _) = certs
    extra = {"tls+token": ["--draft-tls-ca", str(cert)],
             "wrong-token": ["--draft-tls-ca", str(cert), "--draft-token", "not-the-token"],
             "no-token": ["--draft-tls-ca", str(cert)],
             "plain-text": [],
             "wrong-ca": ["--draft-tls-ca", str(stranger)]}[setup]
    t = Target(tmp, draft=tls_draft.addr, extra=extra)
    if setup in ("tls+token", "wrong-ca", "plain-text"):
        t.env["SPECDEC_DRAFT_TOKEN"] = TOKEN                     # the right token, via the environment
    t.up()
    try:
        stats = _spec_run(t, lm)
        if setup == "tls+token":
            assert stats["accepted"] > 0                                # speculation over TLS with the token
        else:
            assert stats["drafted"] == 0 and _fallback_steps(t) > 0     # refused: plain decoding, nothing failed
    finally:
        t.kill()
    assert TOKEN not in t.log.read_text(errors="replace")


# ---------------------------------------------------------------------------------------------------- logs

def test_no_prompts_or_keys_in_logs(tmp, redis_url, lm):
    """Requests that succeed, fail validation, fail auth and fail ownership, over REST and gRPC, with a distinctive
    prompt and key: neither appears in either server's log (default log level)."""
    secret_prompt = f"zebra quartz {uuid.uuid4().hex[:12]}"
    key, bad_key = f"sk-log-{uuid.uuid4().hex}", f"sk-bad-{uuid.uuid4().hex}"
    d = Draft(tmp).up()
    t = Target(tmp, draft=d.addr, redis_url=redis_url, namespace=f"sec-log-{uuid.uuid4().hex[:8]}",
               extra=["--api-keys", key]).up()
    try:
        c = client(t, key)
        end = time.time() + 60   # until one is speculated: a first Propose can miss its deadline on a loaded machine
        while True:
            ok = c.completions.create(model="tiny-llama", prompt=secret_prompt, max_tokens=20, temperature=0)
            assert ok.usage.completion_tokens > 0
            if ok.model_extra["spec"]["drafted"] > 0 or time.time() > end:
                break
        assert ok.model_extra["spec"]["drafted"] > 0, "the draft path never ran"
        c.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": secret_prompt}],
                                  max_tokens=5, temperature=0.8, seed=1)
        list(c.completions.create(model="tiny-llama", prompt=secret_prompt, max_tokens=5, stream=True))
        auth = {"authorization": f"Bearer {key}"}
        for body in ({"prompt": secret_prompt * 40},                       # too long
                     {"prompt": secret_prompt, "stop": [secret_prompt * 30]},
                     {"prompt": secret_prompt, "temperature": -1},
                     {"prompt": secret_prompt, "request_id": secret_prompt + ":out"}):
            assert httpx.post(t.url + "/v1/completions", json=body, headers=auth, timeout=30).status_code == 400
        for k in (bad_key, f"{secret_prompt}"):
            assert httpx.post(t.url + "/v1/completions", json={"prompt": secret_prompt},
                              headers={"authorization": f"Bearer {k}"}, timeout=30).status_code == 401
        with grpc.insecure_channel(t.grpc_addr) as ch:
            stub = pbg.TargetStub(ch)
            list(stub.Generate(pb.GenerateRequest(prompt=secret_prompt, max_tokens=5),
                               metadata=[("authorization", f"Bearer {key}")], timeout=30))
            for md, req in (([("authorization", f"Bearer {bad_key}")], pb.GenerateRequest(prompt=secret_prompt)),
                            ([("authorization", f"Bearer {key}")],
                             pb.GenerateRequest(prompt=secret_prompt, stop=[secret_prompt * 30]))):
                with pytest.raises(grpc.RpcError):
                    list(stub.Generate(req, metadata=md, timeout=30))
        with grpc.insecure_channel(d.addr) as ch:            # the draft server refusing a request
            with pytest.raises(grpc.RpcError):
                pbg.DrafterStub(ch).Propose(pb.ProposeRequest(items=[pb.ProposeItem(
                    request_id=secret_prompt, new_tokens=[1, 999], committed_len=2, gamma=2)]), timeout=10)
    finally:
        t.kill()
        d.kill()
    for proc in (t, d):
        text = proc.log.read_text(errors="replace")
        assert text.strip(), proc.log                            # the logs were written (and read)
        for secret in (secret_prompt, key, bad_key, key[7:], bad_key[7:]):
            assert secret not in text, (proc.log, secret)


# ---------------------------------------------------------------------------------------------------- hostile drafter

def test_a_hostile_draft_server_cannot_fail_or_corrupt_requests(tmp, lm):
    """A draft server answering garbage (ids outside the vocabulary, negative ids, more tokens than asked, NaN
    confidences, missing or malformed distributions, unknown statuses, extra proposals) or plausible lies: every
    request still succeeds with exactly the target-only greedy output; sampled requests succeed too."""
    import itertools
    import math
    from concurrent.futures import ThreadPoolExecutor

    V = 96
    uniform = [1.0 / V] * V

    def ok(it, toks):
        return pb.Proposal(anchor=1, tokens=toks, confidence=[0.5] * len(toks),
                           q=[pb.DraftDistribution(probs=uniform) for _ in toks] if it.sampling.temperature else [])

    bad = [
        lambda it: ok(it, [V + 5] * it.gamma),
        lambda it: ok(it, [-3] * it.gamma),
        lambda it: ok(it, [1] * (it.gamma + 3)),
        lambda it: pb.Proposal(tokens=[1] * it.gamma, confidence=[math.nan] * it.gamma),
        lambda it: pb.Proposal(tokens=[1] * it.gamma, confidence=[0.5] * it.gamma,
                               q=[pb.DraftDistribution(probs=[0.5, 0.5])] * it.gamma),
        lambda it: pb.Proposal(tokens=[1] * it.gamma, confidence=[0.5] * it.gamma,
                               q=[pb.DraftDistribution(ids=[-1, 2], probs=[0.5, 0.5])] * it.gamma),
        lambda it: pb.Proposal(tokens=[1] * it.gamma, confidence=[0.5] * it.gamma,
                               q=[pb.DraftDistribution(probs=[math.nan] * V)] * it.gamma),
        lambda it: pb.Proposal(tokens=[1] * it.gamma, confidence=[0.5] * it.gamma,
                               q=[pb.DraftDistribution(ids=[1], probs=[2.0])] * it.gamma),
        lambda it: pb.Proposal(tokens=[1] * it.gamma, confidence=[0.5] * it.gamma),   # sampled: q missing
        lambda it: pb.Proposal(status=7),
        None,                                                                           # one proposal too many
    ]
    lie = lambda it: ok(it, [(7 * k + 3) % V for k in range(it.gamma)])  # noqa: E731 - well-formed, wrong
    # every other answer is a well-formed lie, so the breaker never opens and every kind of garbage is served
    order = itertools.cycle([x for k in range(len(bad)) for x in (k, -1)])
    served = [0] * len(bad)

    class Hostile(pbg.DrafterServicer):
        def Propose(self, request, context):
            k = next(order)
            if k == -1:
                return pb.ProposeResponse(proposals=[lie(it) for it in request.items])
            served[k] += 1
            if bad[k] is None:
                return pb.ProposeResponse(proposals=[lie(it) for it in request.items] * 2)
            return pb.ProposeResponse(proposals=[bad[k](it) for it in request.items])

        def Release(self, request, context):
            return pb.ReleaseResponse()

    server = grpc.server(ThreadPoolExecutor(4))
    pbg.add_DrafterServicer_to_server(Hostile(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    t = Target(tmp, draft=f"127.0.0.1:{port}").up()
    try:
        for i in range(6):
            p = f"hostile {i}"
            r = httpx.post(t.url + "/v1/completions", json={"prompt": p, "max_tokens": 60, "temperature": 0},
                           timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(lm, p, 60), r.text
            r = httpx.post(t.url + "/v1/completions", json={"prompt": p, "max_tokens": 30, "temperature": 0.8,
                                                             "seed": i}, timeout=60)
            assert r.status_code == 200, r.text
        assert _fallback_steps(t) > 0 and min(served) > 0, served
        assert httpx.get(t.url + "/health").json()["status"] == "ok"
    finally:
        t.kill()
        server.stop(None)
    assert "scheduler step failed" not in t.log.read_text(errors="replace")
