#!/usr/bin/env python3
"""`make compose-test`: the container deployment end to end, checked as a user would (opt-in; not in `make test`).

1. deploy/docker_env.sh up: Docker engine, compose/buildx plugins, dockerd, base images (pulled, or built locally
   when no registry answers).
2. The project image (deploy/Dockerfile) and the load balancer image (deploy/lb), built with `docker compose build`.
   A torch CPU wheel that this host's pip resolves without the network is put in deploy/wheels/ for the build.
3. docker-compose.yml: `up --wait`; the official openai client (chat, non-stream and stream, a seeded replay),
   /metrics, the target's gRPC health; the draft container killed mid-stream (requests complete with the same greedy
   text); Redis's append-only file (a finished record read back after a Redis restart); a clean SIGTERM stop; down.
4. docker-compose.scale.yml: 2 target replicas behind HAProxy; one replica killed mid-stream, the cut streams resumed
   by request_id through the load balancer, texts and Redis records compared with an uninterrupted run; down.
5. deploy/docker_env.sh down (only what step 1 started).

Prints one line per check and a summary; exits 1 if any check failed.
  --keep-docker   leave dockerd running at the end (faster reruns while editing)
  --only single|scale   run one of the two stacks
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SINGLE = ["docker", "compose", "-f", str(ROOT / "docker-compose.yml")]
SCALE = ["docker", "compose", "-f", str(ROOT / "docker-compose.scale.yml")]
# host ports the stacks publish: 8000 / 50051 / 8404 when free, else free ones (SPECDEC_PUBLISH_*, see pick_ports)
REST = "http://127.0.0.1:8000"
GRPC = "127.0.0.1:50051"
LB_STATS = "http://127.0.0.1:8404/stats;csv"
MODEL = "smollm2-135m"
IMAGES = ["specdec:local", "specdec-lb:local", "python:3.11-slim", "redis:7-bookworm", "debian:bookworm-slim"]

PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a refrigerator works, step by step.",
    "Describe a walk through a busy market in a coastal town.",
    "Write a letter to a friend about learning to play the piano.",
]

T0 = time.monotonic()
RESULTS: list[tuple[str, bool, str]] = []
FIGURES: dict[str, object] = {}


class Failed(Exception):
    pass


def stamp() -> str:
    return f"[{time.monotonic() - T0:6.1f}s]"


def check(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((name, ok, detail))
    print(f"{stamp()} check {name}: {'ok' if ok else 'FAIL'}{'  ' + detail if detail else ''}", flush=True)
    return ok


def note(msg: str) -> None:
    print(f"{stamp()} {msg}", flush=True)


def sh(cmd: list[str], *, check_rc: bool = True, timeout: float | None = 900, env: dict | None = None,
       quiet: bool = True) -> subprocess.CompletedProcess:
    """Run a command; output captured (quiet) or passed through. A failure raises Failed with the output's tail."""
    r = subprocess.run(cmd, cwd=ROOT, text=True, timeout=timeout, env={**os.environ, **(env or {})},
                       stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT if quiet else None)
    if check_rc and r.returncode != 0:
        tail = "\n".join((r.stdout or "").splitlines()[-30:])
        raise Failed(f"{' '.join(cmd)} -> exit {r.returncode}\n{tail}")
    return r


def pick_ports() -> None:
    """The compose files publish ${SPECDEC_PUBLISH_REST:-8000} etc.; a port already taken on this (shared) machine
    is replaced by a free one, and the checks below follow."""
    from run_local import free_port, port_free   # deploy/, this script's directory
    global REST, GRPC, LB_STATS

    def free(port: int) -> int:   # published on every interface
        return port if port_free(port, "0.0.0.0") else free_port(host="0.0.0.0")

    ports = {}
    for var, default in (("SPECDEC_PUBLISH_REST", 8000), ("SPECDEC_PUBLISH_GRPC", 50051),
                         ("SPECDEC_PUBLISH_STATS", 8404)):
        ports[var] = int(os.environ.get(var) or free(default))
        os.environ[var] = str(ports[var])
    REST = f"http://127.0.0.1:{ports['SPECDEC_PUBLISH_REST']}"
    GRPC = f"127.0.0.1:{ports['SPECDEC_PUBLISH_GRPC']}"
    LB_STATS = f"http://127.0.0.1:{ports['SPECDEC_PUBLISH_STATS']}/stats;csv"
    if list(ports.values()) != [8000, 50051, 8404]:
        note(f"published ports (defaults taken here): {ports}")


def crash(cid: str) -> tuple[int, float]:
    """A crash, not a `docker kill` (which Docker counts as a manual stop, so no restart policy applies): SIGKILL to
    the container's init from the host; everything in the container dies with it. Returns (restart count before, when)."""
    before = int(inspect(cid, "{{.RestartCount}}"))
    os.kill(int(inspect(cid, "{{.State.Pid}}")), 9)
    return before, time.monotonic()


def wait_restarted(cid: str, crashed: tuple[int, float], timeout: float = 240) -> tuple[bool, str]:
    """(back and healthy, a line): the restart policy restarted `cid` after crash() and its healthcheck passes."""
    before, t_kill = crashed
    while time.monotonic() - t_kill < timeout:
        rc, running, health = inspect(cid, "{{.RestartCount}} {{.State.Running}} {{.State.Health.Status}}").split()
        if int(rc) > before and running == "true" and health == "healthy":
            return True, f"restarted by its restart policy (RestartCount {rc}), healthy " \
                         f"{time.monotonic() - t_kill:.0f} s after the kill"
        time.sleep(0.5)
    return False, f"not back within {timeout:.0f} s: RestartCount {rc}, running {running}, health {health}"


def timed(cmd: list[str], **kw) -> float:
    t = time.monotonic()
    sh(cmd, **kw)
    return time.monotonic() - t


# --- HTTP helpers (no dependency beyond the venv's openai / grpc) ------------------------------------------------------

def http_get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def wait_ready(base: str, timeout: float = 180) -> float:
    """A published port accepts connections before the app listens (docker-proxy): wait for a real /health answer."""
    t, last = time.monotonic(), ""
    while time.monotonic() - t < timeout:
        try:
            code, body = http_get(base + "/health", timeout=3)
            if code == 200 and json.loads(body).get("status") == "ok":
                return time.monotonic() - t
            last = f"{code} {body[:80]}"
        except Exception as e:        # connection reset / refused / empty reply while the app starts
            last = repr(e)[:120]
        time.sleep(0.5)
    raise Failed(f"{base}/health not ok within {timeout:.0f} s (last: {last})")


def client(timeout: float = 120):
    from openai import OpenAI
    return OpenAI(base_url=REST + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def chat(prompt: str, *, stream: bool, max_tokens: int = 48, progress: list | None = None, **kw) -> tuple[str, str]:
    """One chat completion through the openai client; returns (text, request id). extra fields go in extra_body."""
    temperature = kw.pop("temperature", 0.0)
    seed = kw.pop("seed", None)
    args = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                temperature=temperature, stream=stream, extra_body=kw or None)
    if seed is not None:
        args["seed"] = seed
    c = client()
    if not stream:
        r = c.chat.completions.create(**args)
        return r.choices[0].message.content, r.id
    text, rid = "", ""
    for chunk in c.chat.completions.create(**args):
        rid = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            if progress is not None:
                progress.append(len(text))
    return text, rid


def metric(text: str, name: str) -> float:
    return sum(float(ln.split()[-1]) for ln in text.splitlines()
               if ln.startswith(name + "{") or ln.startswith(name + " "))


def grpc_health(addr: str) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(addr) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="specdec.v1.Target"), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def container_ids(compose: list[str], service: str) -> list[str]:
    return sh(compose + ["ps", "-q", service]).stdout.split()


def inspect(cid: str, fmt: str) -> str:
    return sh(["docker", "inspect", "-f", fmt, cid]).stdout.strip()


# Redis records, read with the image's own redis client from a container on the stack's network (Redis's port is
# not published). Layout: specdec/state/redis_store.py.
RECORDS_PY = r"""
import json, struct, sys, redis
r = redis.Redis(host="redis")
out = {}
for rid in sys.argv[1:]:
    h, o = r.hgetall(f"specdec:req:{rid}"), r.get(f"specdec:req:{rid}:out") or b""
    out[rid] = None if not h else {"status": h[b"status"].decode(), "epoch": int(h[b"epoch"]),
                                  "owner": h[b"owner"].decode(), "plen": int(h[b"plen"]),
                                  "output": list(struct.unpack(f"<{len(o) // 4}i", o))}
print(json.dumps(out))
"""


def records(cid: str, rids: list[str]) -> dict:
    return json.loads(sh(["docker", "exec", cid, "python", "-c", RECORDS_PY, *rids]).stdout)


# --- build ---------------------------------------------------------------------------------------------------------

def torch_spec() -> str | None:
    """TORCH_SPEC for the build: the user's, or `torch==<v>` for a CPU wheel this host's pip resolves from disk (put in
    deploy/wheels/, the build's --find-links), else None (the Dockerfile's default: PyTorch's CPU index)."""
    if os.environ.get("TORCH_SPEC"):
        return os.environ["TORCH_SPEC"]
    wheels = ROOT / "deploy" / "wheels"
    found = sorted(wheels.glob("torch-*+cpu-*.whl"))
    if not found:
        r = sh([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheels),
                "torch==2.13.0"], check_rc=False, timeout=600)
        found = sorted(wheels.glob("torch-*+cpu-*.whl"))
        for w in wheels.glob("torch-*.whl"):
            if w not in found:
                w.unlink()                 # a CUDA wheel: not for this image
        if r.returncode != 0 or not found:
            note("no torch CPU wheel from this host's pip; the build uses the PyTorch CPU index")
            return None
    version = found[-1].name.split("-")[1]
    note(f"torch wheel for the build: deploy/wheels/{found[-1].name} ({found[-1].stat().st_size >> 20} MiB)")
    return f"torch=={version}"


def build() -> None:
    env = {}
    spec = torch_spec()
    if spec:
        env["TORCH_SPEC"] = spec
    t = timed(SINGLE + ["build", "target"], env=env)
    t_lb = timed(SCALE + ["build", "lb"], env=env)
    FIGURES["build_s"] = round(t, 1)
    # the images these builds replaced (untagged, 1.3 GB each after a venv change); the build cache stays
    sh(["docker", "image", "prune", "-f"], check_rc=False)
    check("build", True, f"specdec:local {t:.0f} s, specdec-lb:local {t_lb:.0f} s (TORCH_SPEC={spec or 'default'})")
    sizes = {}
    for img in IMAGES:
        r = sh(["docker", "image", "inspect", "-f", "{{.Size}}", img], check_rc=False)
        if r.returncode == 0:
            sizes[img] = f"{int(r.stdout) / 1e6:.0f} MB"
    FIGURES["image_sizes"] = sizes
    note("image sizes: " + ", ".join(f"{k} {v}" for k, v in sizes.items()))
    probe = sh(["docker", "run", "--rm", "--entrypoint", "sh", "specdec:local", "-c",
                "id -u; for t in gcc cc c++ g++ make nvcc; do command -v $t; done; "
                "ls /opt/venv/lib/python3.11/site-packages | grep -i -E '^(nvidia|triton)' ; "
                "python -c 'import torch; print(torch.__version__, torch.version.cuda)'"], check_rc=False).stdout
    lines = probe.split()
    uid, extra = lines[0], lines[1:-2]
    check("image contents", uid != "0" and not extra and lines[-1] == "None",
          f"uid {uid}; build tools/CUDA found: {extra or 'none'}; torch {lines[-2]} cuda {lines[-1]}")


# --- the single stack ------------------------------------------------------------------------------------------------

def draft_kill_midstream(compose: list[str], baseline: dict[str, str]) -> None:
    """Streams in flight when the draft container is killed complete, with the text they have without the kill."""
    draft = container_ids(compose, "draft")[0]
    before = metric(http_get(REST + "/metrics")[1], "specdec:spec_decode_fallback_steps_total")
    progress = {p: [] for p in baseline}
    with cf.ThreadPoolExecutor(len(baseline)) as pool:
        futs = {p: pool.submit(chat, p, stream=True, max_tokens=96, progress=progress[p]) for p in baseline}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(len(v) >= 3 for v in progress.values()):
            time.sleep(0.05)
        crashed = crash(draft)
        at = [len(v) and v[-1] for v in progress.values()]
        got = {p: f.result(timeout=300)[0] for p, f in futs.items()}
    same = sum(got[p] == baseline[p] for p in baseline)
    after = metric(http_get(REST + "/metrics")[1], "specdec:spec_decode_fallback_steps_total")
    check("draft killed mid-stream", same == len(baseline),
          f"{len(baseline)} streams (killed at {at} chars), {same} identical to the run with the draft up; "
          f"fallback steps +{after - before:.0f}")
    ok, line = wait_restarted(draft, crashed)
    check("draft back", ok, line)


def single_stack() -> None:
    note("--- docker-compose.yml: redis, draft, target ---")
    t = timed(SINGLE + ["up", "-d", "--wait"], timeout=600)
    ready = wait_ready(REST)
    FIGURES["single_up_s"] = round(t, 1)
    check("up --wait", True, f"{t:.0f} s, then /health ok after {ready:.1f} s")
    target = container_ids(SINGLE, "target")[0]
    check("init, non-root", inspect(target, "{{.HostConfig.Init}}") == "true" and
          sh(["docker", "exec", target, "id", "-u"]).stdout.strip() != "0",
          f"init={inspect(target, '{{.HostConfig.Init}}')}, uid {sh(['docker', 'exec', target, 'id', '-u']).stdout.strip()}, "
          f"restart={inspect(target, '{{.HostConfig.RestartPolicy.Name}}')}")

    q = "What is the capital of France? Answer in one sentence."
    a, rid_a = chat(q, stream=False)
    b, _ = chat(q, stream=True)
    check("openai chat (greedy)", bool(a) and a == b, f"non-stream == stream: {a[:60]!r}")
    s1, _ = chat("Write a short poem about the sea.", stream=False, temperature=0.8, seed=7, max_tokens=40)
    s2, _ = chat("Write a short poem about the sea.", stream=True, temperature=0.8, seed=7, max_tokens=40)
    check("seeded replay", bool(s1) and s1 == s2, f"T=0.8 seed=7, second run (streamed) equals the first: {s1[:50]!r}")
    code, text = http_get(REST + "/metrics")
    gen = metric(text, "specdec:generation_tokens_total")
    check("/metrics", code == 200 and gen > 0, f"{len(text.splitlines())} lines, generation_tokens_total {gen:.0f}")
    drafted = metric(text, "specdec:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "specdec:spec_decode_num_accepted_tokens_total")
    check("drafter drafts", drafted > 0, f"the draft container's drafter: {drafted:.0f} draft tokens verified, "
          f"{accepted:.0f} accepted")
    check("target gRPC health", grpc_health(GRPC) == "SERVING", f"{GRPC} specdec.v1.Target SERVING")

    baseline = {p: chat(p, stream=False, max_tokens=96)[0] for p in PROMPTS[:3]}
    draft_kill_midstream(SINGLE, baseline)

    # the named volume's append-only file: a finished record survives a Redis restart (resume answers from it)
    aof = sh(SINGLE + ["exec", "-T", "redis", "redis-cli", "CONFIG", "GET", "appendonly"]).stdout.split()
    sh(SINGLE + ["restart", "redis"])
    sh(SINGLE + ["up", "-d", "--wait", "redis"], timeout=120)
    wait_ready(REST, timeout=60)
    again, _ = chat(q, stream=False, request_id=rid_a, resume=True)
    check("redis AOF volume", aof[-1:] == ["yes"] and again == a,
          f"appendonly={aof[-1:]}; after a Redis restart, resume of {rid_a[:16]}... answers the same text")

    t = time.monotonic()
    sh(SINGLE + ["stop", "target"], timeout=120)
    stop_s = time.monotonic() - t
    code = inspect(target, "{{.State.ExitCode}}")
    # exit 0 means the server ended on the SIGTERM itself (after stop_grace_period Docker would SIGKILL: 137)
    check("SIGTERM stop", code == "0", f"target exited {code} in {stop_s:.1f} s")
    t = timed(SINGLE + ["down", "--volumes"], timeout=180)
    check("down", True, f"{t:.0f} s")


# --- the scale-out stack -----------------------------------------------------------------------------------------------

def lb_servers() -> dict[tuple[str, str], str]:
    """HAProxy's view of both backends: (backend, slot) -> status (UP, DOWN...), for slots that DNS filled (the empty
    ones of server-template are MAINT (resolution))."""
    code, text = http_get(LB_STATS)
    if code != 200:
        return {}
    rows = [ln.split(",") for ln in text.splitlines() if ln and not ln.startswith("#")]
    hdr = text.splitlines()[0].lstrip("# ").split(",")
    i_px, i_sv, i_st = hdr.index("pxname"), hdr.index("svname"), hdr.index("status")
    return {(r[i_px], r[i_sv]): r[i_st] for r in rows if r[i_px] in ("target_rest", "target_grpc")
            and r[i_sv] not in ("FRONTEND", "BACKEND") and not r[i_st].startswith("MAINT")}


def wait_lb_up(n: int, timeout: float = 90) -> float:
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        try:
            up = [b for (b, _), s in lb_servers().items() if s.startswith("UP")]
            if min(up.count("target_rest"), up.count("target_grpc")) >= n:
                return time.monotonic() - t
        except Exception:
            pass
        time.sleep(0.5)
    raise Failed(f"HAProxy does not see {n} replicas UP in both backends within {timeout:.0f} s: {lb_servers()}")


def running_on(cid: str) -> int:
    py = "import json, urllib.request; print(json.load(urllib.request.urlopen('http://127.0.0.1:8000/health'))['running'])"
    r = sh(["docker", "exec", cid, "python", "-c", py], check_rc=False)
    return int(r.stdout) if r.returncode == 0 else -1


def failover(replicas: list[str], draft: str) -> None:
    """K streams through the load balancer; the replica serving most of them is killed; every cut stream is resumed by
    its request_id through the load balancer. Final texts and Redis records are compared with an uninterrupted run."""
    jobs = [dict(prompt=p, temperature=0.0) for p in PROMPTS] + \
           [dict(prompt=PROMPTS[0], temperature=0.8, seed=11), dict(prompt=PROMPTS[1], temperature=0.8, seed=12)]
    tag = uuid.uuid4().hex[:8]
    maxt = 128

    def run(j: dict, rid: str, progress: list | None, resume_after_cut: bool) -> dict:
        kw = {k: v for k, v in j.items() if k != "prompt"}
        out = {"rid": rid, "cut": False, "attempts": 0, "resume_s": None}
        try:
            out["text"], _ = chat(j["prompt"], stream=True, max_tokens=maxt, progress=progress, request_id=rid, **kw)
            return out
        except Exception as e:        # the replica died under the stream
            if not resume_after_cut:
                raise
            out["cut"], out["error"] = True, type(e).__name__
        t = time.monotonic()
        while time.monotonic() - t < 120:
            out["attempts"] += 1
            try:
                out["text"], _ = chat(j["prompt"], stream=True, max_tokens=maxt, request_id=rid, resume=True, **kw)
                out["resume_s"] = time.monotonic() - t
                return out
            except Exception as e:
                out["error"] = f"{type(e).__name__}: {str(e)[:100]}"
                time.sleep(0.5)
        return out

    # uninterrupted run
    t = time.monotonic()
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        base = list(pool.map(lambda ij: run(ij[1], f"base-{tag}-{ij[0]}", None, False), enumerate(jobs)))
    note(f"uninterrupted run: {len(jobs)} streams through the load balancer in {time.monotonic() - t:.0f} s")

    # the same requests, one replica killed mid-stream
    progress = [[] for _ in jobs]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        futs = [pool.submit(run, j, f"fo-{tag}-{i}", progress[i], True) for i, j in enumerate(jobs)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(len(p) >= 8 for p in progress):
            time.sleep(0.05)
        load = {cid: running_on(cid) for cid in replicas}
        victim = max(load, key=load.get)
        crashed = crash(victim)
        t_kill = crashed[1]
        note(f"killed replica {victim[:12]} (running {load[victim]}; others {[v for c, v in load.items() if c != victim]}) "
             f"with streams at {[p[-1] if p else 0 for p in progress]} chars")
        runs = [f.result(timeout=600) for f in futs]
    done_s = time.monotonic() - t_kill

    recs = records(draft, [r["rid"] for r in base] + [r["rid"] for r in runs])
    identical = lost = dup = 0
    bad = []
    for b, r in zip(base, runs):
        rb, rr = recs[b["rid"]], recs[r["rid"]]
        same_text = r.get("text") == b.get("text")
        ob, orr = (rb or {}).get("output", []), (rr or {}).get("output", [])
        common = next((k for k, (x, y) in enumerate(zip(ob, orr)) if x != y), min(len(ob), len(orr)))
        lost += len(ob) - common
        dup += len(orr) - common
        ok = same_text and ob == orr and rr and rr["status"] == "finished" and \
            (rr["epoch"] >= 2 if r["cut"] else rr["epoch"] == 1)
        identical += bool(same_text and ob == orr)
        if not ok:
            bad.append({"rid": r["rid"], "cut": r["cut"], "text_same": same_text, "error": r.get("error"),
                        "rec": {k: v for k, v in (rr or {}).items() if k != "output"}, "n": (len(ob), len(orr))})
    resumed = [r for r in runs if r["cut"]]
    FIGURES["failover"] = dict(requests=len(runs), cut=len(resumed),
                               resumed=sum(r.get("resume_s") is not None for r in resumed), identical=identical,
                               lost=lost, duplicated=dup,
                               resume_attempts=[r["attempts"] for r in resumed],
                               resume_s=[round(r["resume_s"], 1) for r in resumed if r["resume_s"] is not None],
                               all_done_after_kill_s=round(done_s, 1),
                               tokens=sum(len((recs[r['rid']] or {}).get('output', [])) for r in runs))
    f = FIGURES["failover"]
    check("replica killed mid-stream, resumed via LB", not bad and len(resumed) >= 1,
          f"requests={f['requests']} cut={f['cut']} resumed={f['resumed']} identical={f['identical']} "
          f"lost={lost} duplicated={dup} (tokens in Redis {f['tokens']}; resume attempts {f['resume_attempts']}, "
          f"resumed streams complete {f['resume_s']} s after the cut)" + (f" BAD {bad}" if bad else ""))
    if not bad:
        check("Redis records", True, f"{len(runs)} records finished, token-for-token equal to the uninterrupted run's; "
                                     f"epoch 2 (one claim) for the {len(resumed)} resumed, 1 for the rest")
    return victim, crashed


def scale_stack() -> None:
    note("--- docker-compose.scale.yml: redis, draft, 2 target replicas, HAProxy ---")
    t = timed(SCALE + ["up", "-d", "--wait"], timeout=600)
    ready = wait_ready(REST)
    lb = wait_lb_up(2)
    FIGURES["scale_up_s"] = round(t, 1)
    replicas = container_ids(SCALE, "target")
    check("scale up --wait", len(replicas) == 2, f"{t:.0f} s; {len(replicas)} replicas; LB /health ok after "
                                                f"{ready:.1f} s, both UP in HAProxy after {lb:.1f} s")
    draft = container_ids(SCALE, "draft")[0]

    # the same seeded request, several times through the LB (so on both replicas): one text
    outs = {chat("Write a short poem about the sea.", stream=False, temperature=0.8, seed=7, max_tokens=40)[0]
            for _ in range(4)}
    served = [metric(sh(["docker", "exec", c, "python", "-c", "import urllib.request; print(urllib.request.urlopen("
                         "'http://127.0.0.1:8000/metrics').read().decode())"]).stdout, "specdec:request_success_total")
              for c in replicas]
    check("LB routing (REST)", len(outs) == 1 and all(s > 0 for s in served),
          f"4 seeded requests, one text; requests finished per replica {[int(s) for s in served]}")
    check("LB routing (gRPC health)", grpc_health(GRPC) == "SERVING", f"{GRPC} through HAProxy (h2)")

    victim, crashed = failover(replicas, draft)

    # after the kill: the LB keeps serving; the victim comes back by its restart policy and HAProxy takes it again
    a, _ = chat("What is the capital of France? Answer in one sentence.", stream=False)
    ok, line = wait_restarted(victim, crashed)
    back = wait_lb_up(2, timeout=120) if ok else 0.0
    check("replica back in the LB", bool(a) and ok, f"a new request served after the kill; victim {line}; "
          f"both UP in HAProxy {back:.0f} s after that")
    t = timed(SCALE + ["down", "--volumes"], timeout=180)
    check("scale down", True, f"{t:.0f} s")


# --- main ----------------------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep-docker", action="store_true", help="leave dockerd running at the end")
    ap.add_argument("--only", choices=["single", "scale"], help="run one stack")
    args = ap.parse_args()
    env_sh = ["bash", str(ROOT / "deploy" / "docker_env.sh")]
    try:
        t = timed(env_sh + ["up"], quiet=False, timeout=1200)
        check("docker engine + base images", True, f"{t:.0f} s")
        build()
        if args.only in (None, "single"):
            single_stack()
        if args.only in (None, "scale"):
            scale_stack()
    except Failed as e:
        check("run", False, str(e))
    except Exception as e:
        import traceback
        traceback.print_exc()
        check("run", False, f"{type(e).__name__}: {e}")
    finally:
        for compose in (SINGLE, SCALE):
            if sh(["docker", "info"], check_rc=False, timeout=30).returncode == 0:
                sh(compose + ["down", "--volumes", "--timeout", "20"], check_rc=False, timeout=180)
        if not args.keep_docker:
            sh(env_sh + ["down"], quiet=False, check_rc=False, timeout=180)
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(f"{stamp()} compose-test: {len(RESULTS) - len(failed)}/{len(RESULTS)} checks ok"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    print("figures: " + json.dumps(FIGURES), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
