"""Real processes on loopback for integration tests: draft server, target server, and waiting for their health."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.state import open_store

from .conftest import free_port

ROOT = Path(__file__).resolve().parent.parent


STARTED: list["Proc"] = []          # every process a test started: conftest shows their log tails when it fails


class Proc:
    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.args, self.log = args, log
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.p: subprocess.Popen | None = None

    def start(self) -> "Proc":
        self.p = subprocess.Popen([sys.executable, *self.args], cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                  stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        self.started = time.time()
        STARTED.append(self)
        return self

    def kill(self, sig=signal.SIGKILL) -> int:
        if self.p and self.p.poll() is None:
            self.p.send_signal(sig)
            return self.p.wait(30)
        return self.p.returncode if self.p else 0

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def tail(self, n=40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""


def wait_grpc(addr: str, proc: Proc, timeout: float = 90) -> None:
    end = time.time() + timeout
    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.time() < end:
            if not proc.alive():
                raise RuntimeError(f"process died:\n{proc.tail()}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{addr} not SERVING after {timeout}s:\n{proc.tail()}")


def wait_for(cond, timeout: float, every: float = 0.05) -> float:
    """Poll `cond` until true; the seconds it took. Fails after `timeout`."""
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(every)
    return time.perf_counter() - t0


def wait_http(url: str, proc: Proc, timeout: float = 90) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if not proc.alive():
            raise RuntimeError(f"process died:\n{proc.tail()}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout}s:\n{proc.tail()}")


class Draft(Proc):
    def __init__(self, tmp: Path, drafter: str = "tiny-llama-draft", port: int | None = None, extra=()):
        self.port = port or free_port()
        super().__init__(["-m", "draft_service", "--drafter", drafter, "--port", str(self.port), *extra],
                         tmp / f"draft-{self.port}.log")

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def up(self, timeout: float = 90) -> "Draft":
        self.start()
        wait_grpc(self.addr, self, timeout)
        return self


class Target(Proc):
    def __init__(self, tmp: Path, *, model="tiny-llama", draft: str = "", redis_url: str = "", namespace="specdec",
                 extra=(), port=None, grpc_port=None):
        self.port, self.grpc_port = port or free_port(), grpc_port or free_port()
        self.trace = tmp / f"trace-{self.port}.jsonl"
        args = ["-m", "target_service", "--model", model, "--port", str(self.port), "--grpc-port",
                str(self.grpc_port), "--draft", draft, "--trace", str(self.trace), "--redis-namespace", namespace,
                "--draft-deadline-ms", "5000", *extra]
        # a generous draft deadline (the suites that test late drafts pass their own): with 500 ms, a request of
        # test_services that asserts speculation ran drafted nothing once under make test's two workers; a draft
        # server starved past the deadline three times opens the breaker for 2 s, the likely cause (its trace was lost)
        if "--planner" not in extra:
            # these suites test what speculation does over the real stack, so every request drafts and verifies its
            # drafts; the default cost planner may stop drafting where a draft costs more than it saves (a tiny
            # model's step is cheaper than a gRPC round trip): test_services checks the stack under it
            args += ["--planner", "full"]
        if redis_url:
            args += ["--redis-url", redis_url]
        super().__init__(args, tmp / f"target-{self.port}.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def up(self, timeout: float = 90) -> "Target":
        self.start()
        wait_http(self.url + "/health", self, timeout)
        wait_grpc(self.grpc_addr, self, timeout)
        return self


def redis_record(redis_url, ns, rid):
    """The store's record of a request (a fresh connection, closed again)."""
    async def get():
        store = open_store(redis_url, namespace=ns)
        try:
            return await store.get(rid)
        finally:
            await store.close()
    return asyncio.run(get())
