"""Run the whole stack on localhost, in the foreground: Redis (or the embedded store), the draft server, the target
server. `make run` runs this. Ctrl-C / SIGTERM stops everything; a child that dies takes the rest down with it.

  python deploy/run_local.py                       # smollm2-135m target, trained drafter on its own server, lookups
  python deploy/run_local.py --drafter layer-skip  # or any draft model preset / path sharing the target's vocab
  python deploy/run_local.py --check               # smoke test: start, one chat request, clean shutdown, exit 0
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRACE_S = 15          # per process: the servers drain in-flight work for up to 5 s, so this is ample
DEFAULT_PORTS = {"port": 8000, "grpc_port": 50051, "draft_port": 50061}


class Stop(Exception):
    """Raised by the SIGINT/SIGTERM handler so that any wait, sleep or request unwinds into the shutdown path."""


class Failed(Exception):
    """Startup or a child failed; the message says what, the exit status is 1."""


def say(msg: str) -> None:
    print(f"[run_local] {msg}", flush=True)


# --- ports -----------------------------------------------------------------------------------------------------

def port_free(port: int, host: str = "127.0.0.1") -> bool:
    # SO_REUSEADDR like uvicorn and grpc, so a port in TIME_WAIT counts as free; no SO_REUSEPORT, so a port another
    # grpc server listens on (grpc sets SO_REUSEPORT and would silently share it) counts as taken.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port(avoid: set[int] = frozenset(), host: str = "127.0.0.1") -> int:
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def pick_ports(args: argparse.Namespace) -> dict[str, int]:
    """None (not given): the default, or a free port if the default is taken. 0: any free port. N: N, or fail."""
    chosen: dict[str, int] = {}
    for name, default in DEFAULT_PORTS.items():
        want, flag = getattr(args, name), "--" + name.replace("_", "-")
        if want is None:
            if port_free(default) and default not in chosen.values():
                port = default
            else:
                port = free_port(set(chosen.values()))
                say(f"port {default} ({flag}) is taken; using {port} instead")
        elif want == 0:
            port = free_port(set(chosen.values()))
        elif want in chosen.values() or not port_free(want):
            raise Failed(f"{flag} {want}: the port is taken (omit the flag to get a free one)")
        else:
            port = want
        chosen[name] = port
    return chosen


# --- processes -------------------------------------------------------------------------------------------------

def _die_with_parent() -> None:
    # Linux: the child gets SIGTERM if this launcher is SIGKILLed, so no orphan keeps a port or a model in memory.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


LIGHT_DRAFTERS = ("block", "ngram", "corpus")     # draft servers that run no model of their own: one torch thread


def draft_threads(drafter: str, device: str) -> list[str]:
    """The draft server's torch threads, as flags. A light drafter on the target's CPU gets one: the block drafter's
    forward is ~2.5 ms of small ops (3.4 on one thread), and with torch's default of every core its OpenMP workers
    spin on after each answer, on the cores the target then verifies with (SmolLM2 at batch 1 on 2 cores, every draft
    verified: the verify after a draft 25.5 ms against 20.6 with one draft thread; drafting 7.9 ms against 7.1).
    A draft model keeps the default (its forward is long enough to want every core)."""
    return ["--threads", "1"] if drafter in LIGHT_DRAFTERS and device == "cpu" else []


class Child:
    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None):
        self.name, self.argv, self.log, self.env = name, argv, log, env or {}
        self.p: subprocess.Popen | None = None
        self.killed = False

    def start(self) -> Child:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               **self.env}
        with open(self.log, "wb") as out:
            # Own session: a terminal Ctrl-C reaches only the launcher, which then stops the children in order.
            self.p = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      # children start before any grpc/openai thread exists, so a preexec_fn is safe
                                      preexec_fn=_die_with_parent if sys.platform == "linux" else None)  # noqa: PLW1509
        return self

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return "(no log)"
        return "\n".join("    " + line for line in lines) or "    (empty log)"

    def stop(self) -> None:
        """SIGTERM, wait GRACE_S, then SIGKILL."""
        if not self.alive():
            return
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            say(f"{self.name} did not stop within {GRACE_S} s; killing it")
            self.killed = True
            self.p.kill()
            self.p.wait()


def check_children(children: list[Child]) -> None:
    for c in children:
        if c.p is not None and not c.alive():
            raise Failed(f"{c.name} exited unexpectedly (status {c.p.returncode}); last lines of {c.log}:\n{c.tail()}")


# --- health ----------------------------------------------------------------------------------------------------

def redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def grpc_serving(addr: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(addr) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def spin_env(drafter: str, device: str) -> dict[str, str]:
    """Extra environment for both servers where the draft server runs a model on the target's CPU. libgomp's workers
    spin ~300k rounds after each parallel region before they sleep: within a forward that saves wake-ups, but at one
    request the two servers take turns (verify, Propose, verify...), and each one's workers spin on the cores the other
    now computes with. GOMP_SPINCOUNT=10000 lets them sleep almost at once: served chat at one request with the
    target's own w4a8 copy drafting 1.92x and 1.87x against 1.50x and 1.61x (the draft server's alone: 1.59x, 1.61x).
    A light drafter runs one torch thread (draft_threads), and there it changed nothing measurable (the trained
    drafter at 1 / 8 requests: 1.35x / 1.08x against 1.26x / 1.11x), so it is left alone. A user's own setting stays."""
    if drafter in LIGHT_DRAFTERS or device != "cpu" or "GOMP_SPINCOUNT" in os.environ:
        return {}
    return {"GOMP_SPINCOUNT": "10000"}


def draft_flags(args: argparse.Namespace, drafter: str, port: int) -> list[str]:
    """The draft server's command-line flags (after `python -m draft_service`)."""
    return ["--host", "127.0.0.1", "--port", str(port), "--drafter", drafter, "--target-model", args.model,
            "--device", args.device, "--quant", args.draft_quant, *draft_threads(drafter, args.device)]


def wait_healthy(checks: list[tuple[str, callable]], children: list[Child], timeout: float) -> None:
    pending, end = dict(checks), time.monotonic() + timeout
    while pending:
        check_children(children)
        for what in [w for w, ok in pending.items() if ok()]:
            say(f"{what}: healthy")
            del pending[what]
        if pending and time.monotonic() > end:
            tails = "\n".join(f"  {c.name} ({c.log}):\n{c.tail(15)}" for c in children)
            raise Failed(f"not healthy after {timeout:.0f} s: {', '.join(pending)}\n{tails}")
        if pending:
            time.sleep(0.3)


# --- main ------------------------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="run_local.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="target model preset or path (default: smollm2-135m)")
    # Measured on SmolLM2 (chat set, greedy, batch 1, one interleaved run, gamma 4): the trained block drafter with
    # prompt lookup where the context repeats 1.26x target-only, block alone 1.13x, n-gram 1.16x (HumanEval: 1.94x,
    # 1.18x, 1.59x), hence block+ngram where a trained drafter ships; and the corpus of the target's own text where
    # the context has no match (served HumanEval at 8 requests 1.30x against 1.15-1.19x, chat unchanged: README).
    # The target's own w4a8 copy (--drafter smollm2-135m --draft-quant w4a8) is faster at one request (served chat
    # 1.87-1.92x with spin_env, against 1.26-1.33x) but the planner stops drafting with it from four (chat 0.93-1.00x
    # against 1.11-1.12x).
    ap.add_argument("--drafter", default="auto",
                    help="draft server's drafter: ngram | layer-skip | block | a draft model preset or path, each "
                         "optionally +ngram and/or +corpus: prompt lookup (and the corpus of the target's own text) "
                         "in the target, that drafter where lookup finds nothing "
                         "(default auto: block+ngram+corpus, the shipped trained drafter and corpus, for smollm2-135m "
                         "without --tp; "
                         "else ngram)")
    ap.add_argument("--draft-quant", default=os.environ.get("SPECDEC_DRAFT_QUANT", "none"),
                    help="a draft model's quantized linears, none | int8 | int4 | w8a8 | w4a8 (default none); "
                         "`--drafter smollm2-135m --draft-quant w4a8`: the target's own weights on the int8-activation "
                         "kernel, the fastest drafter at one request (README) [SPECDEC_DRAFT_QUANT]")
    ap.add_argument("--port", type=int, help="target REST port (default 8000; 0 = any free port)")
    ap.add_argument("--grpc-port", type=int, help="target gRPC port (default 50051; 0 = any free port)")
    ap.add_argument("--draft-port", type=int, help="draft gRPC port (default 50061; 0 = any free port)")
    ap.add_argument("--tp", type=int, default=1, help="target tensor-parallel ranks (default 1)")
    ap.add_argument("--device", default="cpu", help="target and draft device: cpu | cuda | cuda:N (default cpu)")
    ap.add_argument("--no-redis", action="store_true", help="use the embedded in-memory store even if Redis exists")
    ap.add_argument("--check", action="store_true",
                    help="smoke test: start, wait for health, send one chat request, shut down, exit 0")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "runs" / "logs", help="where the *.log files go")
    ap.add_argument("--timeout", type=float, default=180, help="seconds to wait for health (default 180)")
    return ap


def start_redis(log_dir: Path, children: list[Child], taken: set[int]) -> str:
    """A redis URL, or "" for the embedded store."""
    if redis_answers(6379):
        say("Redis: using the one answering on 127.0.0.1:6379")
        return "redis://127.0.0.1:6379/0"
    exe = shutil.which("redis-server")
    if exe is None:
        say("Redis: none on 127.0.0.1:6379 and no redis-server on PATH; using the embedded in-memory store "
            "(state is lost when the target stops)")
        return ""
    port = free_port(taken)
    taken.add(port)
    # No persistence: this Redis lives and dies with the launcher.
    c = Child("redis", [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
              log_dir / "redis.log")
    children.append(c)
    c.start()
    wait_healthy([(f"redis 127.0.0.1:{port}", lambda: redis_answers(port))], children, 30)
    say(f"Redis: started redis-server on 127.0.0.1:{port} (stopped at exit)")
    return f"redis://127.0.0.1:{port}/0"


def smoke_request(base: str, model: str) -> None:
    try:
        from openai import OpenAI
    except ImportError:
        raise Failed("--check needs the openai client (pip install openai; `make install` has it)") from None
    client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    question = "What is the capital of France?"
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                       max_tokens=32, temperature=0)
    dt = time.perf_counter() - t0
    if not r.choices or r.choices[0].message.content is None:
        raise Failed(f"chat completion came back without an answer: {r}")
    spec = (r.model_extra or {}).get("spec")
    say(f"check: Q: {question}")
    say(f"check: A: {r.choices[0].message.content!r}")
    say(f"check: {r.usage.completion_tokens} tokens in {dt:.2f} s, finish_reason={r.choices[0].finish_reason}"
        + (f", spec={spec}" if spec else ""))


def banner(model: str, ports: dict[str, int]) -> None:
    rest = f"http://127.0.0.1:{ports['port']}"
    chat = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 64, "temperature": 0})
    comp = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 32})
    print(f"""
  REST (OpenAI-compatible)  {rest}/v1
  metrics / health          {rest}/metrics   {rest}/health
  target gRPC               127.0.0.1:{ports['grpc_port']}
  draft gRPC                127.0.0.1:{ports['draft_port']}

  curl -s {rest}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{chat}'
  curl -s {rest}/v1/completions -H 'Content-Type: application/json' \\
    -d '{comp}'

  Ctrl-C stops everything.
""", flush=True)


def run(args: argparse.Namespace, children: list[Child]) -> int:
    args.log_dir.mkdir(parents=True, exist_ok=True)
    ports = pick_ports(args)
    redis_url = "" if args.no_redis else start_redis(args.log_dir, children, set(ports.values()))
    if args.no_redis:
        say("Redis: --no-redis, using the embedded in-memory store")
    draft_addr = f"127.0.0.1:{ports['draft_port']}"
    py = sys.executable
    # --target-model is what layer-skip keeps layers of; other drafters ignore it. NAME+ngram(+corpus): the target
    # looks up itself (no round trip for a copied block) and asks the draft server's NAME only where lookup finds
    # nothing.
    drafter, *looks = args.drafter.split("+")
    spin = spin_env(drafter, args.device)
    draft = Child("draft server", [py, "-m", "draft_service", *draft_flags(args, drafter, ports["draft_port"])],
                  args.log_dir / "draft.log", env=spin)
    target = Child("target server", [py, "-m", "target_service", "--host", "127.0.0.1", "--port", str(ports["port"]),
                                     "--grpc-port", str(ports["grpc_port"]), "--model", args.model,
                                     "--draft", draft_addr, "--draft-name", drafter, "--redis-url", redis_url,
                                     "--tp", str(args.tp), "--device", args.device,
                                     *(["--lookup", ",".join(looks)] if looks else [])],
                    args.log_dir / "target.log", env=spin)
    # Both at once: the target's draft channel connects lazily, and loading the two models overlaps.
    for c in (draft, target):
        children.append(c)             # tracked before it starts, so a signal right now still stops it
        c.start()
    say(f"starting draft ({args.drafter}) and target ({args.model}); logs in {args.log_dir}/")
    rest = f"http://127.0.0.1:{ports['port']}"
    wait_healthy([(f"draft gRPC {draft_addr}", lambda: grpc_serving(draft_addr)),
                  (f"target REST {rest}/health", lambda: http_ok(rest + "/health")),
                  (f"target gRPC 127.0.0.1:{ports['grpc_port']}",
                   lambda: grpc_serving(f"127.0.0.1:{ports['grpc_port']}"))], children, args.timeout)
    if args.check:
        smoke_request(rest + "/v1", args.model)
        return 0
    banner(args.model, ports)
    while True:                        # foreground until a signal (Stop) or a child dies (Failed)
        check_children(children)
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.drafter == "auto":   # the block drafter needs its checkpoint and the target's hidden states (no TP)
        args.drafter = "block+ngram+corpus" if args.model == "smollm2-135m" and args.tp == 1 else "ngram"

    def on_signal(sig, _frame):
        raise Stop(signal.Signals(sig).name)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    children: list[Child] = []
    status = 0
    try:
        status = run(args, children)
    except Stop as e:
        print(flush=True)
        say(f"{e}: stopping")
    except Failed as e:
        say(f"error: {e}")
        status = 1
    finally:
        # A second Ctrl-C during shutdown must not abandon the children half-stopped.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for c in reversed(children):   # target first (it releases draft sessions), then draft, then redis
            if c.alive():
                c.stop()
                say(f"{c.name} stopped (status {c.p.returncode})")
    if args.check and status == 0:
        unclean = [c.name for c in children if c.killed or c.p.returncode != 0]
        if unclean:
            say(f"check: unclean shutdown of {', '.join(unclean)}")
            return 1
        say("check: ok")
    return status


if __name__ == "__main__":
    sys.exit(main())
