"""Bounded load generator for the target's REST API: N concurrent streaming clients for a fixed time, loopback only.

    # start a tiny stack (draft + target on free loopback ports) and load it: 64 streams for 60 s
    .venv/bin/python benchmarks/load.py --concurrency 64 --duration 60
    # against a running target (give its pid to sample its memory)
    .venv/bin/python benchmarks/load.py --url http://127.0.0.1:8000 --pid 12345 --concurrency 32 --duration 30
    # soak: longer (default 30 min), with a progress line every --report-every seconds
    .venv/bin/python benchmarks/load.py --soak

Each client loops: POST /v1/completions (stream, include_usage) with a prompt and max_tokens drawn from a seeded RNG,
reads the SSE stream to [DONE], records TTFT (first data chunk) and end-to-end latency; a 429 is counted and honoured
(sleeps its Retry-After, capped, with jitter) before the next try. Everything is bounded: --duration of new requests
(plus --grace for the ones in flight), at most --max-requests requests. Reports requests done, errors by status, 429s,
TTFT and latency p50/p90/p99, tokens/s, and the target's RSS (/proc/<pid>/status VmRSS) after warm-up, at the end and
its maximum, sampled every --rss-every seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the quick brown fox jumps over lazy dogs while speculative decoding drafts tokens that a larger model "
         "verifies in one packed forward pass and streams to every client").split()


# -- the stack (when no --url) -----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """A draft server and a target server (tiny models by default) on free loopback ports, killed on exit."""

    def __init__(self, logdir: Path, *, model="tiny-llama", drafter="tiny-llama-draft", target_args=(),
                 redis_url=""):
        self.logdir, self.model, self.drafter = logdir, model, drafter
        self.target_args, self.redis_url = list(target_args), redis_url
        self.procs: list[subprocess.Popen] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.target: subprocess.Popen | None = None

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        p = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                             stdout=open(self.logdir / log, "ab"), stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def _wait(self, check, proc: subprocess.Popen, what: str, timeout=120) -> None:
        end = time.time() + timeout
        while time.time() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited ({proc.returncode}); see {self.logdir}")
            try:
                if check():
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{what} not up after {timeout}s; see {self.logdir}")

    def up(self) -> "Stack":
        self.logdir.mkdir(parents=True, exist_ok=True)
        draft = ""
        if self.drafter:
            dport = free_port()
            d = self._spawn(["-m", "draft_service", "--drafter", self.drafter, "--port", str(dport)], "draft.log")
            draft = f"127.0.0.1:{dport}"

            def grpc_ok():
                import grpc
                from grpc_health.v1 import health_pb2, health_pb2_grpc
                with grpc.insecure_channel(draft) as ch:
                    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status \
                        == health_pb2.HealthCheckResponse.SERVING
            self._wait(grpc_ok, d, "draft server")
        args = ["-m", "target_service", "--model", self.model, "--port", str(self.port), "--grpc-port", "0",
                "--draft", draft, "--log-level", "warning", *self.target_args]
        if self.redis_url:
            args += ["--redis-url", self.redis_url]
        self.target = self._spawn(args, "target.log")
        self._wait(lambda: httpx.get(self.url + "/health", timeout=1).status_code == 200, self.target, "target")
        return self

    def down(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)

    def __enter__(self):
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc):
        self.down()


# -- measurement -------------------------------------------------------------------------------------------------------
def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


@dataclass
class Stats:
    done: int = 0
    tokens: int = 0
    too_many: int = 0
    too_many_without_retry_after: int = 0
    errors: dict = field(default_factory=dict)      # status code or exception name -> count
    finish: dict = field(default_factory=dict)
    ttft: list = field(default_factory=list)
    e2e: list = field(default_factory=list)

    def error(self, key) -> None:
        self.errors[str(key)] = self.errors.get(str(key), 0) + 1


async def one_request(c: httpx.AsyncClient, url: str, body: dict, st: Stats, rng: random.Random,
                      max_backoff: float) -> float:
    """One streamed completion; returns how long to back off before the next one (429)."""
    t0 = time.perf_counter()
    ttft, usage, finish, err = None, None, None, None
    try:
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code == 429:
                await r.aread()
                st.too_many += 1
                ra = r.headers.get("retry-after")
                if ra is None:
                    st.too_many_without_retry_after += 1
                return min(max_backoff, float(ra or 1)) * rng.uniform(0.5, 1.0)
            if r.status_code != 200:
                await r.aread()
                st.error(r.status_code)
                return 0.5 * rng.random()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                if line == "data: [DONE]":
                    break
                d = json.loads(line[6:])
                if "error" in d:
                    err = d["error"].get("message", "stream error")
                elif d.get("usage"):
                    usage = d["usage"]
                elif d.get("choices"):
                    finish = d["choices"][0].get("finish_reason") or finish
    except (httpx.HTTPError, OSError) as e:
        st.error(type(e).__name__)
        return 0.5 * rng.random()
    if err is not None or usage is None:
        st.error("stream_error" if err is not None else "incomplete_stream")
        return 0.0
    st.done += 1
    st.tokens += usage["completion_tokens"]
    st.finish[finish] = st.finish.get(finish, 0) + 1
    st.ttft.append(ttft)
    st.e2e.append(time.perf_counter() - t0)
    return 0.0


async def client_loop(k: int, c: httpx.AsyncClient, url: str, until: float, budget: list[int], st_ref: list[Stats],
                      args) -> None:
    rng = random.Random(args.seed * 1000 + k)
    while time.perf_counter() < until and budget[0] > 0:
        budget[0] -= 1
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*args.prompt_words)))
        body = {"prompt": prompt, "max_tokens": rng.randint(*args.max_tokens), "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if args.request_timeout_s:
            body["timeout_s"] = args.request_timeout_s
        backoff = await one_request(c, url, body, st_ref[0], rng, args.max_backoff)
        if backoff:
            await asyncio.sleep(min(backoff, max(0.0, until - time.perf_counter())))


async def sample_rss(pid: int | None, samples: list, every: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        if pid:
            v = rss_mb(pid)
            if v is not None:
                samples.append((time.perf_counter(), v))
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


async def run_load(url: str, *, pid: int | None, concurrency: int, duration: float, warmup: float = 5.0,
                   grace: float = 60.0, max_requests: int = 1_000_000, seed: int = 0, max_tokens=(16, 64),
                   prompt_words=(3, 12), max_backoff: float = 1.0, rss_every: float = 0.5, report_every: float = 0.0,
                   request_timeout_s: float | None = None) -> dict:
    """Warm up, then load for `duration` seconds; returns the report (see `summarize`)."""
    args = argparse.Namespace(seed=seed, max_tokens=max_tokens, prompt_words=prompt_words, max_backoff=max_backoff,
                              request_timeout_s=request_timeout_s)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    timeout = httpx.Timeout(connect=10, read=grace + duration, write=10, pool=grace + duration)
    samples: list[tuple[float, float]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(pid, samples, rss_every, stop))
    budget = [max_requests]
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as c:
        warm = Stats()
        if warmup > 0:
            until = time.perf_counter() + warmup
            await asyncio.gather(*[client_loop(k, c, url, until, budget, [warm], args) for k in range(concurrency)])
        rss_warm = rss_mb(pid) if pid else None
        st = Stats()
        t0 = time.perf_counter()
        until = t0 + duration
        ref = [st]
        progress = None
        if report_every:
            async def report():
                while True:
                    await asyncio.sleep(report_every)
                    el = time.perf_counter() - t0
                    print(f"[{el:7.0f}s] done {st.done} errors {sum(st.errors.values())} 429 {st.too_many} "
                          f"tok/s {st.tokens / el:.1f} rss {rss_mb(pid) if pid else float('nan'):.1f} MB", flush=True)
            progress = asyncio.create_task(report())
        loops = [asyncio.create_task(client_loop(k, c, url, until, budget, ref, args)) for k in range(concurrency)]
        _, late = await asyncio.wait(loops, timeout=duration + grace)
        for t in late:                       # bounded: whatever is still in flight after the grace is abandoned
            t.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        st.errors["abandoned_after_grace"] = len(late) if late else 0
        if not late:
            del st.errors["abandoned_after_grace"]
        elapsed = time.perf_counter() - t0
        if progress:
            progress.cancel()
    await asyncio.sleep(min(1.0, rss_every * 2))      # one more sample after the load is gone
    stop.set()
    await sampler
    return summarize(st, elapsed, concurrency, duration, warm, rss_warm, samples, rss_mb(pid) if pid else None, t0)


def summarize(st: Stats, elapsed: float, concurrency: int, duration: float, warm: Stats, rss_warm, samples,
              rss_end, t0: float) -> dict:
    measured = [v for t, v in samples if t >= t0]
    r = lambda x: None if x is None else round(x, 4)      # noqa: E731
    return {
        "concurrency": concurrency, "duration_s": duration, "elapsed_s": round(elapsed, 2),
        "requests_done": st.done, "errors": dict(st.errors), "errors_total": sum(st.errors.values()),
        "http_429": st.too_many, "http_429_without_retry_after": st.too_many_without_retry_after,
        "finish_reasons": st.finish, "completion_tokens": st.tokens,
        "tokens_per_s": round(st.tokens / elapsed, 1) if elapsed else None,
        "requests_per_s": round(st.done / elapsed, 2) if elapsed else None,
        "ttft_s": {"p50": r(pct(st.ttft, 50)), "p90": r(pct(st.ttft, 90)), "p99": r(pct(st.ttft, 99))},
        "e2e_s": {"p50": r(pct(st.e2e, 50)), "p90": r(pct(st.e2e, 90)), "p99": r(pct(st.e2e, 99))},
        "warmup": {"requests_done": warm.done, "errors": dict(warm.errors), "http_429": warm.too_many},
        "rss_mb": {"after_warmup": r(rss_warm), "end": r(rss_end), "max": r(max(measured, default=None)),
                   "samples": len(measured),
                   "timeline": [(round(t - t0, 1), round(v, 1)) for t, v in samples[:: max(1, len(samples) // 60)]]},
    }


def print_report(rep: dict) -> None:
    rss = rep["rss_mb"]
    f = lambda x: "-" if x is None else f"{x:.1f}"     # noqa: E731
    ms = lambda d: " ".join(f"{k} {'-' if v is None else f'{v * 1e3:.0f}'} ms" for k, v in d.items())  # noqa: E731
    print(f"load: {rep['concurrency']} concurrent streams for {rep['duration_s']:.0f} s "
          f"(measured {rep['elapsed_s']:.1f} s after a warm-up of {rep['warmup']['requests_done']} requests)")
    print(f"  requests done   {rep['requests_done']}  ({rep['requests_per_s']}/s)")
    print(f"  errors          {rep['errors_total']}  {rep['errors'] or ''}")
    print(f"  429 (queue full) {rep['http_429']}  (without Retry-After: {rep['http_429_without_retry_after']})")
    print(f"  finish reasons  {rep['finish_reasons']}")
    print(f"  tokens/s        {rep['tokens_per_s']}  ({rep['completion_tokens']} completion tokens)")
    print(f"  TTFT            {ms(rep['ttft_s'])}")
    print(f"  end-to-end      {ms(rep['e2e_s'])}")
    print(f"  target RSS MB   after warm-up {f(rss['after_warmup'])}  end {f(rss['end'])}  max {f(rss['max'])}  "
          f"({rss['samples']} samples)")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running target (loopback); default: start a tiny draft + target stack")
    ap.add_argument("--pid", type=int, help="the target's pid, for RSS sampling (known when the stack is started)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--duration", type=float, help="seconds of load after warm-up (default 60; --soak: 1800)")
    ap.add_argument("--soak", action="store_true", help="a long run with progress lines")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--grace", type=float, default=60.0, help="seconds in-flight requests get after --duration")
    ap.add_argument("--max-requests", type=int, default=1_000_000)
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    ap.add_argument("--request-timeout-s", type=float, help="send timeout_s with every request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-every", type=float, default=0.5)
    ap.add_argument("--report-every", type=float, help="progress line period (default: off; --soak: 30)")
    ap.add_argument("--model", default="tiny-llama", help="started stack: target model")
    ap.add_argument("--drafter", default="tiny-llama-draft", help="started stack: draft server's drafter ('' = none)")
    ap.add_argument("--redis-url", default="", help="started stack: Redis (default: the embedded store)")
    ap.add_argument("--target-args", default="", help="started stack: extra target flags, e.g. '--max-queue 8'")
    ap.add_argument("--logdir", default="runs/load", help="started stack: process logs")
    ap.add_argument("--json", help="write the report here")
    a = ap.parse_args(argv)
    if a.duration is None:
        a.duration = 1800.0 if a.soak else 60.0
    if a.report_every is None:
        a.report_every = 30.0 if a.soak else 0.0
    if a.url and not a.url.startswith(("http://127.", "http://localhost", "http://[::1]")):
        ap.error("--url must be a loopback address")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    kw = dict(concurrency=a.concurrency, duration=a.duration, warmup=a.warmup, grace=a.grace,
              max_requests=a.max_requests, seed=a.seed, max_tokens=tuple(a.max_tokens), rss_every=a.rss_every,
              report_every=a.report_every, request_timeout_s=a.request_timeout_s)
    if a.url:
        rep = asyncio.run(run_load(a.url.rstrip("/"), pid=a.pid, **kw))
    else:
        with Stack(ROOT / a.logdir, model=a.model, drafter=a.drafter, target_args=a.target_args.split(),
                   redis_url=a.redis_url) as s:
            rep = asyncio.run(run_load(s.url, pid=s.target.pid, **kw))
    print_report(rep)
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
