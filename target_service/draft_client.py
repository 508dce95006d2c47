"""The target's view of the remote draft server: a `Drafter` over gRPC, with a deadline and a circuit breaker.

Called from the scheduler's worker thread, so it uses a blocking channel. Any failure raises, and the speculative
step then runs as plain decoding for that step; after `fail_threshold` consecutive failures the breaker opens and
calls fail fast (no network) until `cooldown_s` has passed, then one call probes the server again.

The link can be secured: `token` is sent as metadata `authorization: Bearer <token>` on every call (the draft server's
--auth-token), and `tls_ca` (PEM bytes or a path) makes the channel TLS, trusting that CA. A draft server that refuses
the token, or a TLS mismatch, is just an unavailable draft: requests decode without speculation.

Answers are checked before use (the draft server is another process, maybe another host): a proposal with tokens
outside the vocabulary, more tokens than asked, or missing/malformed distributions counts as a failed call, so a
broken or hostile drafter can slow requests down but never fail or corrupt them.
"""
from __future__ import annotations

import dataclasses
import math
import os
import threading
import time

import grpc
import torch

from specdec import wire
from specdec.errors import SpecdecError
from specdec.speculative.accept import Mode
from specdec.speculative.propose import Drafter, DraftItem, Proposal
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pbg


class DraftUnavailable(Exception):
    pass


RECONNECT_MAX_MS = 1000    # the longest the draft channel waits between connection attempts


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


class BadProposal(Exception):
    pass


def _read_pem(ca: bytes | str | os.PathLike) -> bytes:
    if isinstance(ca, bytes):
        return ca
    try:
        with open(ca, "rb") as f:
            return f.read()
    except OSError as e:
        raise SpecdecError(f"cannot read the draft server's CA certificate {ca}: {e.strerror}",
                           field="draft_tls_ca", remedy="pass a readable PEM file") from None


def check_proposal(m: pb.Proposal, item: DraftItem, vocab_size: int) -> None:
    """Raise BadProposal unless `m` is a usable answer to `item`."""
    if m.status == pb.Proposal.NEED_CONTEXT:
        return
    if m.status != pb.Proposal.OK:
        raise BadProposal(f"unknown status {m.status}")
    n = len(m.tokens)
    if n > item.gamma or len(m.confidence) != n:
        raise BadProposal(f"{n} tokens, {len(m.confidence)} confidences for gamma {item.gamma}")
    if any(not 0 <= t < vocab_size for t in m.tokens) or not 0 <= m.anchor < vocab_size:
        raise BadProposal("token id outside the vocabulary")
    if not all(math.isfinite(c) for c in m.confidence):
        raise BadProposal("confidence is not finite")
    if len(m.alt_counts) > n or sum(m.alt_counts) != len(m.alt_tokens) or len(m.alt_probs) != len(m.alt_tokens):
        raise BadProposal(f"alternatives for {len(m.alt_counts)} slots of {n}, {len(m.alt_tokens)} tokens, "
                          f"{len(m.alt_probs)} probabilities")
    if any(not 0 <= t < vocab_size for t in m.alt_tokens) or not all(0 <= x <= 1 for x in m.alt_probs):
        raise BadProposal("alternative token outside the vocabulary or probability outside [0, 1]")
    needs_q = Mode(item.mode) is Mode.REJECTION and not item.params.greedy and n > 0
    if needs_q and len(m.q) != n or len(m.q) not in (0, n):
        raise BadProposal(f"{len(m.q)} distributions for {n} tokens")
    for d in m.q:                  # shapes here; values after conversion, vectorised (dense rows are vocab-long)
        if len(d.ids):
            if len(d.ids) != len(d.probs) or min(d.ids) < 0 or max(d.ids) >= vocab_size:
                raise BadProposal("malformed sparse distribution")
        elif len(d.probs) != vocab_size:
            raise BadProposal("malformed dense distribution")


def _converted(m: pb.Proposal, vocab_size: int) -> Proposal:
    p = wire.proposal_from_pb(m, vocab_size)
    q = p.q
    if q is not None and not (bool(torch.isfinite(q).all()) and bool((q >= 0).all()) and bool((q <= 1 + 1e-9).all())):
        raise BadProposal("probability outside [0, 1]")
    return p


class RemoteDrafter(Drafter):
    """`target_model`: the target Transformer in this process (embedded backend), the source of hidden states for a
    drafter that asks for them (ProposeResponse.feature_layers, learned from its first answer): each item then
    carries the rows of committed positions the draft server has not been sent (its whole window on a resend).
    Without one (tensor-parallel or SGLang target) such a drafter is unavailable and requests decode plainly."""

    def __init__(self, address: str, vocab_size: int, *, deadline_s: float = 1.0, max_message_mb: int = 64,
                 breaker: CircuitBreaker | None = None, token: str | None = None,
                 tls_ca: bytes | str | os.PathLike | None = None, target_model=None):
        self.address, self.vocab_size, self.deadline_s = address, vocab_size, deadline_s
        self.target_model = target_model
        self.feature_layers: tuple[int, ...] = ()
        self.feature_window = 0
        self.features = None             # FeatureStore tapped on target_model, once a drafter asks
        self.sent: dict[str, int] = {}   # sid -> rows of positions < this are on the draft server
        self.feature_bytes = 0
        self._dropped: list[str] = []
        # reconnect within RECONNECT_MAX_MS of the draft server coming (back) up: gRPC's default backoff grows to 120 s,
        # and calls fail at once meanwhile (served, a target that started before its draft server drafted nothing
        # for the first 12-20 s of a run)
        opts = [("grpc.max_receive_message_length", max_message_mb << 20),
                ("grpc.max_send_message_length", max_message_mb << 20),
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS)]
        if tls_ca:
            creds = grpc.ssl_channel_credentials(root_certificates=_read_pem(tls_ca))
            self.channel = grpc.secure_channel(address, creds, options=opts)
        else:
            self.channel = grpc.insecure_channel(address, options=opts)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
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
        except (BadProposal, ValueError, IndexError, TypeError) as e:   # a malformed answer (or request field)
            self.failures += 1
            self.breaker.record(False)
            raise DraftUnavailable(f"draft server {self.address}: unusable answer ({e})") from None
        self.breaker.record(True)
        return out

    def _call(self, items, with_context, deadline) -> list[Proposal | None]:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        for sid in dropped:
            self.sent.pop(sid, None)
            if self.features is not None:
                self.features.release(sid)
        if self.features is not None:
            items = [self._with_features(it, c) for it, c in zip(items, with_context)]
        req = pb.ProposeRequest(items=[wire.item_to_pb(it, c) for it, c in zip(items, with_context)])
        self.feature_bytes += sum(len(m.features) for m in req.items)
        resp = self.stub.Propose(req, timeout=max(0.001, deadline - time.monotonic()), metadata=self.metadata)
        if len(resp.proposals) != len(items):
            raise BadProposal(f"{len(resp.proposals)} proposals for {len(items)} items")
        for p, it in zip(resp.proposals, items):
            check_proposal(p, it, self.vocab_size)
        self._learn(tuple(resp.feature_layers), resp.feature_window)
        for p, it in zip(resp.proposals, items):
            if p.status == pb.Proposal.OK and it.features is not None:
                self.sent[it.sid] = it.features_start + it.features.shape[0]
        return [None if p.status == pb.Proposal.NEED_CONTEXT else _converted(p, self.vocab_size)
                for p in resp.proposals]

    def _learn(self, layers: tuple[int, ...], window: int) -> None:
        """The drafter says which hidden states it reads; start recording them (once, or when that changes)."""
        if layers == self.feature_layers and window == self.feature_window:
            return
        if self.target_model is None or max(layers, default=0) >= self.target_model.cfg.n_layers or window > 4096:
            raise BadProposal(f"the drafter needs target hidden states (layers {list(layers)}), which this target "
                              "cannot send (only the embedded, single-process backend taps its layers)")
        from specdec.draft.block import FeatureStore
        if self.features is not None:
            self.features.untap()
        self.features = FeatureStore(self.target_model, layers) if layers else None
        if self.features is not None:
            self.features.tap(self.target_model)
        self.feature_layers, self.feature_window, self.sent = layers, window, {}

    def _with_features(self, it: DraftItem, resend: bool) -> DraftItem:
        """Attach the rows of committed positions lo .. anchor-1 the draft server lacks (its window on a resend)."""
        a = it.committed_len - 1
        lo = max(0, a - self.feature_window, 0 if resend else self.sent.get(it.sid, 0))
        if a <= lo or it.context is None:
            return it
        rows = self.features.rows(it.sid, list(it.context), a - lo)
        return dataclasses.replace(it, features=rows, features_start=lo)

    def release(self, sid: str) -> None:
        self.release_all([sid])

    def release_all(self, sids: list[str]) -> None:
        """One Release for all: a call costs ~0.8 ms on loopback (an ngram draft server: 16 calls 11.5-15.8 ms, one
        call with 16 ids 0.8-0.95), made on the compute thread, where one call each for 32 requests finishing in one
        step would hold the next step ~25 ms."""
        with self._lock:               # called off the step's thread: the feature store is freed by the next call
            self._dropped.extend(sids)
        if not sids or not self.breaker.allow():
            return  # the server is gone; its sessions with it
        try:
            self.stub.Release(pb.ReleaseRequest(request_ids=list(sids)), timeout=self.deadline_s,
                              metadata=self.metadata)
        except grpc.RpcError:
            pass  # an unreleased session is evicted by the draft server's LRU

    def close(self) -> None:
        self.channel.close()
