"""The target's view of the remote draft server: a `Drafter` over gRPC, with a deadline and a circuit breaker.

Called from the scheduler's worker thread, so it uses a blocking channel. Any failure raises, and the speculative
step then runs as plain decoding for that step; after `fail_threshold` consecutive failures the breaker opens and
calls fail fast (no network) until `cooldown_s` has passed, then one call probes the server again.
"""
from __future__ import annotations

import threading
import time

import grpc

from specdec import wire
from specdec.spec.propose import DraftItem, Drafter, Proposal
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pbg


class DraftUnavailable(Exception):
    pass


class CircuitBreaker:
    def __init__(self, fail_threshold: int = 3, cooldown_s: float = 2.0):
        self.fail_threshold, self.cooldown_s = fail_threshold, cooldown_s
        self.failures, self.opened_at = 0, None

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half-open" if time.monotonic() - self.opened_at >= self.cooldown_s else "open"

    def allow(self) -> bool:
        return self.state != "open"

    def record(self, ok: bool) -> None:
        if ok:
            self.failures, self.opened_at = 0, None
        else:
            self.failures += 1
            if self.failures >= self.fail_threshold:
                self.opened_at = time.monotonic()   # (re)open: a failed probe waits another cooldown


class RemoteDrafter(Drafter):
    def __init__(self, address: str, vocab_size: int, *, deadline_s: float = 1.0, max_message_mb: int = 64,
                 breaker: CircuitBreaker | None = None):
        self.address, self.vocab_size, self.deadline_s = address, vocab_size, deadline_s
        opts = [("grpc.max_receive_message_length", max_message_mb << 20),
                ("grpc.max_send_message_length", max_message_mb << 20)]
        self.channel = grpc.insecure_channel(address, options=opts)
        self.stub = pbg.DrafterStub(self.channel)
        self.breaker = breaker or CircuitBreaker()
        self.name = f"remote:{address}"
        self.calls = self.failures = 0
        self._lock = threading.Lock()

    def propose(self, items: list[DraftItem]) -> list[Proposal | None]:
        if not self.breaker.allow():
            raise DraftUnavailable(f"draft server {self.address}: circuit open")
        self.calls += 1
        deadline = time.monotonic() + self.deadline_s
        try:
            out = self._call(items, [False] * len(items), deadline)
            lost = [i for i, p in enumerate(out) if p is None]
            if lost:  # sessions the drafter lost (evicted, restarted): resend those items with full context
                again = self._call([items[i] for i in lost], [True] * len(lost), deadline)
                for i, p in zip(lost, again):
                    out[i] = p
        except grpc.RpcError as e:
            self.failures += 1
            self.breaker.record(False)
            raise DraftUnavailable(f"draft server {self.address}: {e.code().name}") from None
        self.breaker.record(True)
        return out

    def _call(self, items, with_context, deadline) -> list[Proposal | None]:
        req = pb.ProposeRequest(items=[wire.item_to_pb(it, c) for it, c in zip(items, with_context)])
        resp = self.stub.Propose(req, timeout=max(0.001, deadline - time.monotonic()))
        return [None if p.status == pb.Proposal.NEED_CONTEXT else wire.proposal_from_pb(p, self.vocab_size)
                for p in resp.proposals]

    def release(self, sid: str) -> None:
        if not self.breaker.allow():
            return  # the server is gone; its sessions with it
        try:
            self.stub.Release(pb.ReleaseRequest(request_ids=[sid]), timeout=self.deadline_s)
        except grpc.RpcError:
            pass  # an unreleased session is evicted by the draft server's LRU

    def close(self) -> None:
        self.channel.close()
