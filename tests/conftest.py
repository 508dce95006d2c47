import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

from specdec.engine.engine import Engine
from specdec.engine.registry import load


# Tests run torch on the main thread, in-process servers on compute's thread (specdec/compute.py). With two threads
# each leading an OpenMP team of two on two cores, libgomp stops spinning between parallel regions and every region
# pays a wake-up: once the first in-process server had stepped (tests/test_compute.py), 2,000 small float64 ops took
# 85-470 ms instead of 14-37 (mostly 14-20) for the rest of the suite (measured). Giving only the compute thread one
# OpenMP thread did not hold (torch brings a thread back to the process-wide setting), so this process runs torch on
# one thread. Server processes keep their own settings; thread-count tests set theirs explicitly.
torch.set_num_threads(1)


_T0 = pytest.StashKey[float]()          # when a test's setup began


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_T0] = time.time()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the log tails of the server processes it started or still had running: pytest prunes
    the temporary directories those logs live in, and a flake is otherwise gone with them."""
    rep = (yield).get_result()
    stack = sys.modules.get("tests.stack")
    if rep.failed and stack is not None:
        t0 = item.stash.get(_T0, 0.0)
        for proc in stack.STARTED:
            if proc.started >= t0 or proc.alive():
                rep.sections.append((f"log of {proc.log.name} ({' '.join(proc.args[:2])})", proc.tail(80)))


def pytest_sessionstart(session):
    # build the C++ kernels (over a minute on a 2-core machine, once per source and CPU) before any test runs, so the
    # build is not charged to whichever test first loads them, in a subprocess under a timeout
    from specdec.engine import kernels
    kernels.available()


@pytest.fixture(scope="session")
def tiny_llama():
    return load("tiny-llama").model          # float64


@pytest.fixture(scope="session")
def tiny_qwen2():
    return load("tiny-qwen2").model          # float64, q/k/v bias, untied lm_head


@pytest.fixture
def tiny_engine(tiny_llama):
    return Engine(tiny_llama, kv_tokens=4096, page_size=8)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M in bf16 (the default real model), loaded once per session."""
    return load("smollm2-135m")


def random_drafter_case(kind: str):
    """A random bf16 block (or eagle) drafter on tiny-llama and inputs for its forward_train: (target, drafter, feats,
    next tokens, valid (one short, left-padded context), previous slot tokens)."""
    from specdec.draft.block import random_drafter_model
    target = load("tiny-llama", "bfloat16").model
    plain = random_drafter_model(target, kind=kind, draft_vocab=64, gamma=4, window=8, ffn_dim=96).bfloat16()
    with torch.no_grad():          # trans starts at zero (a no-op correction): give it weights to multiply
        plain.trans.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(3, 8, len(plain.cfg.layers) * plain.cfg.dim, generator=g).bfloat16()
    nxt = torch.randint(0, 64, (3, 8), generator=g)
    valid = torch.ones(3, 8, dtype=torch.bool)
    valid[0, :5] = False
    return target, plain, feats, nxt, valid, torch.randint(0, 64, (3, 4), generator=g)


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768                             # Linux's default range starts here


_EPHEMERAL_LOW = _ephemeral_low()          # the kernel hands out ports from here up
_ports = random.Random(os.getpid())


def free_port() -> int:
    """A free port below the kernel's ephemeral range. A port the kernel hands out (bind to 0) is free now but may be
    handed out again before the server under test binds it: a `--tp 2` target, loading for seconds, had its gRPC port
    taken by one of its own ranks' ephemeral sockets ("Address already in use"). Below the range nothing is handed out,
    so only another explicit choice could take it."""
    lo = _EPHEMERAL_LOW
    if lo < 3072:                                # no room below the range: the kernel's choice it is
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    while True:
        port = _ports.randrange(max(1024, lo - 20000), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_url():
    """The machine's Redis on 127.0.0.1:6379; when nothing answers there, a redis-server started for the session."""
    if _redis_answers(6379):
        yield "redis://127.0.0.1:6379/0"
        return
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("tests need Redis: nothing answers on 127.0.0.1:6379 and no redis-server is installed "
                    "(apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL)
    for _ in range(100):
        if _redis_answers(port):
            break
        time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


# -- one real stack per test module (draft server + target server on Redis), for the integration suites ------------
@pytest.fixture(scope="module")
def tmp(tmp_path_factory, request):
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])


@pytest.fixture(scope="module")
def ns():
    """A Redis namespace of the module's own, so suites never see each other's keys."""
    import uuid
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def lm():
    return load("tiny-llama")


@pytest.fixture(scope="module")
def draft(tmp):
    from .stack import Draft       # (stack imports this module: import here, not at the top)
    d = Draft(tmp).up()
    try:
        yield d
    finally:
        d.kill()


@pytest.fixture(scope="module")
def target(tmp, draft, redis_url, ns):
    from .stack import Target
    t = Target(tmp, draft=draft.addr, redis_url=redis_url, namespace=ns).up()
    try:
        yield t
    finally:
        t.kill()
