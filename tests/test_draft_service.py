"""The gRPC draft server as a real process (float64 tiny models): answers equal the in-process drafter's exactly,
sessions stay in sync, lost sessions ask for context, bad input is refused by field, SIGTERM drains cleanly."""
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec import wire
from specdec.draft.model import ModelDrafter
from specdec.draft.ngram import NgramDrafter
from specdec.engine.registry import load
from specdec.speculative.accept import Mode
from specdec.speculative.propose import DraftItem
from specdec.speculative.sampling import SamplingParams
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

from .conftest import free_port, random_prompt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 96                                   # tiny-llama vocabulary
SERVING = health_pb2.HealthCheckResponse.SERVING
GREEDY = SamplingParams()
REJECT = SamplingParams(temperature=0.9, seed=11)                 # untruncated: dense q on the wire
REJECT_TOPK = SamplingParams(temperature=0.8, top_k=10, seed=12)  # truncated: sparse q on the wire
COUPLED = SamplingParams(temperature=0.7, seed=5)


class Server:
    def __init__(self, drafter: str, log_path, *args: str):
        self.port, self.log_path = free_port(), log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "draft_service", "--drafter", drafter,
                                      "--port", str(self.port), "--kv-tokens", "4096", *args],
                                     cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.DrafterStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def output(self) -> str:
        self.log.flush()
        return open(self.log_path).read()

    def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"draft server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if self.status("") == SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        pytest.fail(f"draft server not SERVING after {timeout} s:\n{self.output()}")

    def status(self, service: str) -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status

    def propose(self, items: list[DraftItem], with_context: bool = False) -> pb.ProposeResponse:
        return self.stub.Propose(pb.ProposeRequest(items=[wire.item_to_pb(it, with_context) for it in items]),
                                 timeout=30)

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both servers start at once (their start-up is mostly importing torch)."""
    tmp = tmp_path_factory.mktemp("draft_service")
    s = {name: Server(name, tmp / f"{name}.log") for name in ("tiny-llama-draft", "ngram")}
    try:
        for srv in s.values():
            srv.wait_serving()
        yield s
    finally:
        for srv in s.values():
            srv.close()


@pytest.fixture(scope="module")
def model_server(servers):
    return servers["tiny-llama-draft"]


@pytest.fixture(scope="module")
def draft_model():
    return load("tiny-llama-draft").model


def assert_same(m: pb.Proposal, ref, vocab: int = V) -> None:
    assert m.status == pb.Proposal.OK
    assert m.anchor == ref.anchor and list(m.tokens) == ref.tokens
    assert list(m.confidence) == ref.confidence                       # float64 on the wire: exact
    if ref.q is None:
        assert len(m.q) == 0
    else:
        assert torch.equal(wire.dists_from_pb(m.q, vocab), ref.q_dense(vocab))


def test_health_serving_for_server_and_drafter_service(model_server):
    assert model_server.status("") == SERVING
    assert model_server.status("specdec.v1.Drafter") == SERVING
    assert "draft server: drafter tiny-llama-draft on 127.0.0.1:" in model_server.output()


def test_batch_equals_in_process_drafter(model_server, draft_model):
    items = [DraftItem("b-greedy", random_prompt(V, 7, 1), 7, 4, GREEDY, Mode.GREEDY),
             DraftItem("b-reject", random_prompt(V, 5, 2), 5, 5, REJECT, Mode.REJECTION),
             DraftItem("b-coupled", random_prompt(V, 9, 3), 9, 3, COUPLED, Mode.COUPLED)]
    resp = model_server.propose(items)
    refs = ModelDrafter(draft_model).propose(items)
    assert resp.drafter == "tiny-llama-draft" and len(resp.proposals) == 3
    for m, ref in zip(resp.proposals, refs):
        assert_same(m, ref)
    assert len(resp.proposals[1].q) == 5 and len(resp.proposals[1].q[0].ids) == 0   # dense rows


def test_follow_up_calls_stay_in_sync(model_server, draft_model):
    """Commit a few accepted drafts plus a correction each round; only the new tokens travel."""
    ref = ModelDrafter(draft_model)
    sessions = {"s-greedy": (GREEDY, Mode.GREEDY, 4), "s-topk": (REJECT_TOPK, Mode.REJECTION, 3),
                "s-coupled": (COUPLED, Mode.COUPLED, 5)}
    committed = {sid: random_prompt(V, 6 + k, 20 + k) for k, sid in enumerate(sessions)}
    new = {sid: list(toks) for sid, toks in committed.items()}
    for rnd in range(4):
        items = [DraftItem(sid, new[sid], len(committed[sid]), g, p, m) for sid, (p, m, g) in sessions.items()]
        resp = model_server.propose(items)
        for k, (it, m, r) in enumerate(zip(items, resp.proposals, ref.propose(items))):
            assert_same(m, r)
            if it.params.top_k and r.tokens:
                assert 0 < len(m.q[0].ids) <= 10                     # sparse rows
            if rnd == 2 and k == 0:
                new[it.sid] = []                                      # nothing committed this round
                continue
            accepted = r.tokens[:(rnd + k) % (len(r.tokens) + 1)]
            new[it.sid] = accepted + [(rnd * 7 + k * 13 + 1) % V]     # correction / bonus
            committed[it.sid] += new[it.sid]


def test_unknown_session_needs_context_then_release(model_server, draft_model):
    ref = ModelDrafter(draft_model)
    known = DraftItem("k-known", random_prompt(V, 6, 30), 6, 3)
    ctx = random_prompt(V, 9, 31)
    ghost = DraftItem("k-ghost", ctx[-1:], 9, 3, COUPLED, Mode.COUPLED, context=ctx)
    resp = model_server.propose([known, ghost])                     # context not sent: the server never saw it
    assert resp.proposals[1].status == pb.Proposal.NEED_CONTEXT
    assert_same(resp.proposals[0], ref.propose([known])[0])         # the other item is answered
    again = model_server.propose([ghost], with_context=True).proposals[0]
    assert_same(again, ref.propose([ghost])[0])

    model_server.stub.Release(pb.ReleaseRequest(request_ids=["k-ghost", "never-seen"]), timeout=10)
    step = DraftItem("k-ghost", [again.tokens[0]], 10, 3, COUPLED, Mode.COUPLED)
    assert model_server.propose([step]).proposals[0].status == pb.Proposal.NEED_CONTEXT


@pytest.mark.parametrize("change, field", [
    (dict(gamma=0), "items[1].gamma"),
    (dict(gamma=65), "items[1].gamma"),
    (dict(alts=9), "items[1].alts"),
    (dict(new_tokens=[1, V]), "items[1].new_tokens"),
    (dict(new_tokens=[1, -1]), "items[1].new_tokens"),
    (dict(sampling=pb.SamplingParams(temperature=-1.0)), "items[1].sampling.temperature"),
    (dict(sampling=pb.SamplingParams(temperature=0.5)), "items[1].sampling.seed"),          # sampled, no seed
    (dict(sampling=pb.SamplingParams(temperature=0.5, seed=1, top_p=-0.1)), "items[1].sampling.top_p"),
    (dict(mode=9), "items[1].mode"),
    (dict(committed_len=1), "items[1].committed_len"),                     # fewer than the new tokens
    (dict(committed_len=513), "items[1].committed_len"),                   # beyond the model context
    (dict(context=[1, 2, 3]), "items[1].context"),                         # length != committed_len
    (dict(request_id=""), "items[1].request_id"),
    (dict(request_id="v-good"), "items[1].request_id"),                    # twice in one call
    (dict(features=b"\x00\x01"), "items[1].features"),                    # this drafter reads no hidden states
])
def test_invalid_input_is_refused_by_field(model_server, change, field):
    good = pb.ProposeItem(request_id="v-good", new_tokens=[1, 2, 3], committed_len=3, gamma=2)
    fields = dict(request_id="v-bad", new_tokens=[4, 5], committed_len=2, gamma=2)
    bad = pb.ProposeItem(**{**fields, **change})
    with pytest.raises(grpc.RpcError) as e:
        model_server.stub.Propose(pb.ProposeRequest(items=[good, bad]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    # refused whole: the good item's session was not created either
    step = pb.ProposeItem(request_id="v-good", new_tokens=[4], committed_len=4, gamma=2)
    assert model_server.stub.Propose(pb.ProposeRequest(items=[step]), timeout=10).proposals[0].status \
        == pb.Proposal.NEED_CONTEXT
    model_server.stub.Release(pb.ReleaseRequest(request_ids=["v-good"]), timeout=10)
    assert model_server.status("") == SERVING


def test_kv_pool_exhausted_leaves_nothing_behind(model_server):
    """9 x 500 tokens cannot fit the 4096-token pool (8 can): RESOURCE_EXHAUSTED, the batch's sessions are dropped
    (NEED_CONTEXT), and no KV leaked (8 fit afterwards, idle sessions of earlier tests being evicted)."""
    items = [DraftItem(f"x-{k}", random_prompt(V, 500, 40 + k), 500, 2) for k in range(9)]
    with pytest.raises(grpc.RpcError) as e:
        model_server.propose(items)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    step = DraftItem("x-0", [1], 501, 2)
    assert model_server.propose([step]).proposals[0].status == pb.Proposal.NEED_CONTEXT
    assert all(p.status == pb.Proposal.OK and len(p.tokens) == 2 for p in model_server.propose(items[:8]).proposals)
    model_server.stub.Release(pb.ReleaseRequest(request_ids=[it.sid for it in items]), timeout=10)


def test_ngram_server(servers):
    srv, ref = servers["ngram"], NgramDrafter()
    toks = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    items = [DraftItem("n-greedy", toks, len(toks), 2), DraftItem("n-reject", toks, len(toks), 4, REJECT,
                                                                   Mode.REJECTION)]
    resp = srv.propose(items)
    assert resp.drafter == "ngram" and list(resp.proposals[0].tokens) == [8, 5]
    for m, r in zip(resp.proposals, ref.propose(items)):
        assert_same(m, r)
    follow = [DraftItem("n-greedy", [8], len(toks) + 1, 3), DraftItem("n-lost", [1], 5, 2)]
    resp = srv.propose(follow)
    assert_same(resp.proposals[0], ref.propose(follow[:1])[0])
    assert resp.proposals[1].status == pb.Proposal.NEED_CONTEXT
    with pytest.raises(grpc.RpcError) as e:
        srv.propose([DraftItem("n-bad", [1, 2], 2, 0)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "gamma" in e.value.details()


def test_sigterm_drains_and_exits_zero(servers):
    srv = servers["ngram"]          # the last test to use it
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(10) == 0
    assert "shutting down" in srv.output()


class _SlowDrafter(NgramDrafter):
    """An n-gram drafter that takes its time and records whether two calls ever overlapped."""
    name = "slow"

    def __init__(self):
        super().__init__()
        self.running, self.overlapped = 0, False

    def propose(self, items):
        self.running += 1
        self.overlapped |= self.running > 1
        time.sleep(0.4)
        try:
            return super().propose(items)
        finally:
            self.running -= 1


def test_in_process_engine_is_never_reentered_and_health_stays_live():
    """build_server in-process: a slow Propose runs off the event loop (health answers meanwhile), and one whose
    caller gave up still holds the engine until it finishes, so the next call never overlaps it."""
    import asyncio

    from draft_service import build_server

    async def run():
        drafter = _SlowDrafter()
        server, port = build_server(drafter, "127.0.0.1", 0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub, health = pb_grpc.DrafterStub(ch), health_pb2_grpc.HealthStub(ch)
                req = pb.ProposeRequest(items=[wire.item_to_pb(DraftItem("a", [1, 2, 1], 3, 2))])
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Propose(req, timeout=0.1)          # gives up; the draft goes on in its thread
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                second = asyncio.ensure_future(stub.Propose(req, timeout=10))
                t0 = time.monotonic()
                check = await health.Check(health_pb2.HealthCheckRequest(service="specdec.v1.Drafter"), timeout=5)
                assert check.status == SERVING and time.monotonic() - t0 < 0.2
                assert list((await second).proposals[0].tokens) == [2, 1]
                assert not drafter.overlapped
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_busy_port_is_refused(model_server):
    """grpc shares ports (SO_REUSEPORT) unless told not to; a second server must fail loudly instead."""
    out = subprocess.run([sys.executable, "-m", "draft_service", "--port", str(model_server.port)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot listen" in out.stderr
    assert model_server.status("") == SERVING


def test_unspecified_mode_means_coupled_for_sampled_items():
    """ACCEPTANCE_MODE_UNSPECIFIED is the default acceptance: coupled for sampled items (as on the target), greedy for
    temperature 0."""
    from draft_service.server import check_item
    sampled = pb.ProposeItem(request_id="x", new_tokens=[1, 2], committed_len=2, gamma=2,
                             sampling=pb.SamplingParams(temperature=0.8, seed=3))
    assert check_item(0, sampled, None, None).mode is Mode.COUPLED
    greedy = pb.ProposeItem(request_id="y", new_tokens=[1, 2], committed_len=2, gamma=2, mode=pb.REJECTION)
    assert check_item(0, greedy, None, None).mode is Mode.GREEDY
