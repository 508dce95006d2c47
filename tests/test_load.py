"""A short run of benchmarks/load.py against a real target process (tiny models, real Redis, loopback): more streams
than the batch and the queue hold, so admission control answers 429s; nothing else may fail, memory must not grow,
and the server must be idle and leak-free afterwards."""
import asyncio
import importlib.util
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from .stack import Draft, Target

pytestmark = pytest.mark.timeout(240)

_spec = importlib.util.spec_from_file_location("load_bench", Path(__file__).resolve().parent.parent / "benchmarks" /
                                               "load.py")
load_bench = sys.modules.setdefault("load_bench", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(load_bench)


def gauge(t: Target, name: str) -> float:
    return sum(float(x.split()[-1]) for x in httpx.get(t.url + "/metrics", timeout=10).text.splitlines()
               if x.startswith(name + "{") or x.startswith(name + " "))


def test_short_load_with_admission_control(tmp_path, redis_url):
    import redis
    ns = f"load-{uuid.uuid4().hex[:8]}"
    d = Draft(tmp_path).up()
    t = Target(tmp_path, draft=d.addr, redis_url=redis_url, namespace=ns,
               extra=["--max-running", "8", "--max-queue", "4", "--state-ttl-s", "600", "--log-level", "warning"])
    try:
        t.up()
        idle_kv = gauge(t, "specdec:kv_free_tokens")
        rep = asyncio.run(load_bench.run_load(t.url, pid=t.p.pid, concurrency=32, duration=15, warmup=3, grace=60,
                                              max_requests=5000, max_tokens=(8, 48)))
        load_bench.print_report(rep)
        assert rep["errors_total"] == 0, rep["errors"]                  # nothing failed but admission (429)
        assert rep["http_429"] > 0 and rep["http_429_without_retry_after"] == 0
        assert rep["requests_done"] > 20
        assert rep["e2e_s"]["p99"] is not None and rep["ttft_s"]["p99"] is not None
        rss = rep["rss_mb"]
        assert rss["samples"] > 10 and rss["end"] <= 1.5 * rss["after_warmup"], rss
        # idle and leak-free afterwards: no request left, every KV slot back, healthy
        assert gauge(t, "specdec:num_requests_running") == 0 and gauge(t, "specdec:num_requests_waiting") == 0
        assert gauge(t, "specdec:kv_free_tokens") == idle_kv
        assert httpx.get(t.url + "/health", timeout=10).json()["status"] == "ok"
        # a refused (429) request wrote no record: exactly one record per admitted request
        r = redis.Redis.from_url(redis_url)
        try:
            recs = [k for k in r.scan_iter(f"{ns}:req:*", count=1000) if not k.endswith(b":out")]
            for k in recs:
                r.delete(k, k + b":out")
        finally:
            r.close()
        assert len(recs) == rep["requests_done"] + rep["warmup"]["requests_done"]
    finally:
        t.kill()
        d.kill()
    assert not t.alive() and not d.alive()
