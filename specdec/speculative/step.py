"""One speculative step for a batch of running requests: propose -> plan -> layout + verify -> accept -> commit.

The target KV of a request holds every committed token except the last one, the anchor; a step feeds the anchor plus
the drafts it verifies, and the commit truncates the KV back to "everything committed but the new anchor". So a
rejected draft costs nothing to undo, and a step with no drafts (drafter down, nothing proposed) is exactly one step of
plain decoding.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import torch

from ..engine.backend import TopKBackend
from ..engine.engine import Engine
from ..engine.layout import SeqInput
from .accept import Mode, accept, accept_targets, plain_targets
from .propose import DraftItem, Drafter, Proposal, SparseRows
from .tree import ALTS, kept_leaf, plan_leaves
from .sampling import SamplingParams, probs
from .verify import VerifyItem, verify


@dataclasses.dataclass
class RequestStats:
    steps: int = 0
    drafted: int = 0                       # draft tokens verified
    accepted: int = 0                      # chain drafts and kept leaves
    leaves: int = 0                        # leaves verified (speculative/tree.py)
    leaves_kept: int = 0
    fallback_steps: int = 0                # steps run as plain decoding because the drafter failed
    drafted_per_pos: list[int] = dataclasses.field(default_factory=list)
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def tokens_per_step(self, emitted: int) -> float:
        return emitted / self.steps if self.steps else 0.0


@dataclasses.dataclass
class SpecRequest:
    rid: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    mode: Mode
    gamma: int
    stop_ids: frozenset[int] = frozenset()
    seq: int = -1                          # target KV sequence
    output: list[int] = dataclasses.field(default_factory=list)
    draft_seen: int = 0                    # committed tokens already sent to the drafter
    finish_reason: str | None = None
    stats: RequestStats = dataclasses.field(default_factory=RequestStats)

    @property
    def committed(self) -> list[int]:
        return self.prompt + self.output

    @property
    def committed_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def left(self) -> int:
        """Tokens it may still emit (max_tokens less those emitted)."""
        return self.max_tokens - len(self.output)


@dataclasses.dataclass
class StepInfo:
    rows: int                              # target rows the verify forward ran
    verify_len: list[int]
    accepted: list[int]
    emitted: list[list[int]]
    draft_ok: bool
    draft_ms: float
    verify_ms: float
    accept_ms: float


def plan_full(reqs: list[SpecRequest], props: list[Proposal]) -> list[int]:
    """Verify every proposed draft, but never more rows than tokens the request may still emit."""
    return [max(1, min(len(p.tokens) + 1, r.gamma + 1, r.left)) for r, p in zip(reqs, props)]


# A planner is called with (requests, proposals) and returns verify_len per request; optionally it has
# begin(requests) (the coming step's batch), gamma(request) (block length to draft) and observe(requests, proposals,
# verify_len, accepted) (see speculative/plan.py).
Planner = Callable[[list[SpecRequest], list[Proposal]], list[int]]


def _q_rows(q, vocab_size: int) -> int:
    """Draft distributions a proposal carries for a vocabulary of `vocab_size` (0 when missing or malformed)."""
    if isinstance(q, SparseRows):
        return q.ids.shape[0] if q.ids.dim() == 2 and q.ids.shape == q.probs.shape else 0
    if isinstance(q, torch.Tensor) and q.dim() == 2 and q.shape[1] == vocab_size:
        return q.shape[0]
    return 0


def usable(prop: Proposal | None, r: SpecRequest, vocab_size: int) -> Proposal:
    """The proposal if this step can verify it, else an empty one: the anchor alone, i.e. plain decoding for the
    request this step, which is always sound (and what its output is defined by). One request's unusable answer thus
    never fails the batch.

    Rejection mode needs the draft's exact q for every verified draft. When it is missing (the wire drops empty
    distributions) or short, the drafts are dropped rather than judged against a one-hot q: one-hot would be exact only
    for a deterministic drafter (n-gram), and the target cannot know from the answer which drafter sampled it."""
    empty = Proposal(r.committed[-1], [], [])
    if prop is None or not prop.tokens:
        return empty
    if any(not 0 <= t < vocab_size for t in prop.tokens):
        return empty
    if r.mode is Mode.REJECTION and _q_rows(prop.q, vocab_size) < len(prop.tokens):
        return empty
    return prop


def speculative_step(target: Engine, drafter: Drafter | None, reqs: list[SpecRequest], *, layout: str = "compact",
                     plan: Planner = plan_full, prefill: Sequence[SeqInput] = (), tree_rows: int = 0) -> StepInfo:
    """One step for `reqs`. `prefill`: context rows of requests joining the batch, run in the same forward (a
    separate forward per admission streamed every weight once more for a few rows). `tree_rows`: at most this many
    leaf rows beside the chains (speculative/tree.py), where the backend runs them and proposals carry alternatives."""
    t0 = time.perf_counter()
    # 1. propose: one batched call; each request sends what was committed since its last call
    getattr(plan, "begin", lambda reqs: None)(reqs)    # the batch its blocks are decided for
    block = getattr(plan, "gamma", lambda r: r.gamma)  # a planner may shorten blocks (adaptive gamma), or skip them
    blocks = {r.rid: block(r) for r in reqs if r.gamma > 0}       # gamma 0: speculation off for this request
    # a drafter that copies from the context first is asked at the full block length (a copy costs nothing), unless
    # the planner plans no copies this step; the planner's length bounds its model's blocks
    looks_up = getattr(drafter, "looks_up", False)
    copies = looks_up and getattr(plan, "copies_wanted", lambda: True)()
    spec = [r for r in reqs if r.rid in blocks and (copies or blocks[r.rid] > 0)]
    # leaves take KV slots for the step: none where the pool is nearly full (a refused write fails the step)
    trees = tree_rows > 0 and layout == "compact" and getattr(target, "verify_leaves", False) and \
        target.kv_free_tokens >= tree_rows + target.kv_page_size * (len(reqs) + 1)
    items = [DraftItem(r.rid, r.committed[r.draft_seen:], r.committed_len, r.gamma if looks_up else blocks[r.rid],
                       r.params, r.mode, context=r.committed, model_gamma=blocks[r.rid] if looks_up else None,
                       alts=ALTS if trees and r.mode is not Mode.REJECTION else 0)
             for r in spec]
    answers: dict[str, Proposal | None] = {}
    draft_ok = True
    if drafter is not None and items:
        try:
            answers = dict(zip((r.rid for r in spec), drafter.propose(items)))
        except Exception:  # noqa: BLE001 - any drafter fault degrades this step to plain decoding, never fails it
            draft_ok = False
        for r in spec:
            if r.rid in answers:  # a lost session (None) gets the full context next time
                r.draft_seen = r.committed_len if answers[r.rid] is not None else 0
    # no usable proposal (no drafter, drafter down, lost session, unusable answer): verify the anchor alone, i.e.
    # plain decoding for that request
    V = target.vocab_size
    props = [usable(answers.get(r.rid), r, V) for r in reqs]
    t1 = time.perf_counter()

    # 2. plan, 3. layout + verify
    vlen = plan(reqs, props)
    if isinstance(target, TopKBackend):   # SGLang: the target's token per row instead of p
        if prefill:
            raise ValueError("this backend scores rows remotely: prefill it apart")
        return _step_by_tokens(target, reqs, props, vlen, plan, draft_ok, t0, t1)
    leaves = [[] for _ in reqs]
    if trees:
        leaves = plan.leaves(reqs, props, vlen, tree_rows) if hasattr(plan, "leaves") else \
            plan_leaves(props, vlen, [r.mode for r in reqs], tree_rows)
    logits, rows = verify(target, [VerifyItem(r.seq, r.committed_len - 1, r.committed[-1], p.tokens, v, lv)
                                   for r, p, v, lv in zip(reqs, props, vlen, leaves)], layout,
                          width=max(r.gamma for r in reqs) + 1, prefill=prefill)
    t2 = time.perf_counter()

    # 4. accept, vectorised over the ragged batch
    drafts = [pr.tokens[:v - 1] for pr, v in zip(props, vlen)]
    if all(r.mode is not Mode.REJECTION for r in reqs):
        # greedy and coupled slots pass iff the draft is plain decoding's token there: p only for the rows reached
        # (greedy: an argmax, not [rows, V] float64 one-hot p; 5 rows of Qwen's 151936 ids: ~3 ms)
        out = accept_targets([plain_targets(lg[:v], r.params, r.committed_len, d)
                              for lg, r, d, v in zip(logits, reqs, drafts, vlen)], drafts)
    else:
        p = torch.cat([probs(lg[:v], r.params) for lg, r, v in zip(logits, reqs, vlen)])
        dev = p.device                                   # acceptance runs where the logits are
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.long, device=dev)
        q = None
        if any(r.mode is Mode.REJECTION and v > 1 for r, v in zip(reqs, vlen)):
            # q rows only where rejection checks drafts; other requests (and rows of none) get zero-row fillers
            q = torch.cat([pr.q_dense(V)[:v - 1].to(dev, torch.float64) if r.mode is Mode.REJECTION and v > 1
                           else torch.zeros(v - 1, V, dtype=torch.float64, device=dev)
                           for r, pr, v in zip(reqs, props, vlen)])
        cu_rows = torch.tensor([0] + vlen).cumsum(0)
        out = accept(p, q, flat, cu_rows, [r.mode for r in reqs], [r.params.seed for r in reqs],
                     [r.committed_len for r in reqs])
    kept = _keep_leaves(target, reqs, vlen, logits, drafts, leaves, out)
    return _commit(target, reqs, props, vlen, plan, out, draft_ok, rows, t0, t1, t2, bool(prefill), kept,
                   looked_up=copies and bool(answers))


def _keep_leaves(target, reqs, vlen, logits, drafts, leaves, out) -> list[bool]:
    """Where a leaf stood in for the chain's first miss: its K/V into the missed position and plain decoding's token
    after it (from the leaf's row) onto the request's tokens."""
    kept = []
    for i, (r, v, lv) in enumerate(zip(reqs, vlen, leaves)):
        a = int(out.num_accepted[i])
        k = kept_leaf(a, out.tokens[i], drafts[i], lv) if lv else None
        kept.append(k is not None)
        r.stats.leaves += len(lv)
        if k is not None:
            d, x = lv[k]
            pos = r.committed_len - 1                                  # the anchor's; the leaf's row is written
            target.keep_leaf(r.seq, pos + v + k, pos + d, x)           # past the chain's v rows (engine/layout.py)
            out.tokens[i].append(plain_targets(logits[i][v + k][None], r.params, r.committed_len + d, ())[0])
    return kept


def _step_by_tokens(target, reqs: list[SpecRequest], props: list[Proposal], vlen: list[int], plan, draft_ok: bool,
                    t0: float, t1: float) -> StepInfo:
    """Verify + accept with a backend that scores rows remotely and returns, per row, the token plain decoding emits
    there (engine/sglang_backend.py). Greedy and coupled acceptance need nothing else; rejection needs p and is
    refused at admission by that backend's capability table."""
    from ..engine.sglang_backend import Row
    if any(r.mode is Mode.REJECTION for r in reqs):
        raise ValueError("rejection acceptance needs the whole target distribution; this backend gives top-K rows")
    rows = [Row(r.seq, r.committed_len - 1, r.committed[-1], list(p.tokens[:v - 1]), r.params)
            for r, p, v in zip(reqs, props, vlen)]
    targets = target.target_tokens(rows)
    t2 = time.perf_counter()
    out = accept_targets(targets, [row.drafts for row in rows])
    return _commit(target, reqs, props, vlen, plan, out, draft_ok, sum(vlen), t0, t1, t2)


def _commit(target, reqs: list[SpecRequest], props: list[Proposal], vlen: list[int], plan, out, draft_ok: bool,
            rows: int, t0: float, t1: float, t2: float, mixed: bool = False, kept: Sequence[bool] = (),
            looked_up: bool = False) -> StepInfo:
    if hasattr(plan, "observe"):  # online calibration: confidence -> acceptance, and the draft's cost
        # a forward that also prefilled says nothing about what verifying costs
        plan.observe(reqs, props, vlen, out.num_accepted.tolist(), draft_ms=(t1 - t0) * 1e3,
                     verify_ms=None if mixed else (t2 - t1) * 1e3, rows=rows, leaves_kept=sum(kept),
                     looked_up=looked_up)
    # 5. commit: append, stop at a stop id or max_tokens, roll the KV back to "all committed but the anchor"
    emitted = []
    for i, (r, v) in enumerate(zip(reqs, vlen)):
        toks = out.tokens[i][:r.left]
        stop = next((k for k, t in enumerate(toks) if t in r.stop_ids), None)
        if stop is not None:
            toks, r.finish_reason = toks[:stop + 1], "stop"
        elif len(r.output) + len(toks) >= r.max_tokens:
            r.finish_reason = "length"
        r.output += toks
        emitted.append(toks)
        target.truncate(r.seq, min(target.length(r.seq), r.committed_len - 1))
        a = int(out.num_accepted[i])
        s = r.stats
        s.steps += 1
        s.fallback_steps += not draft_ok
        s.drafted += v - 1
        leaf = bool(kept) and kept[i]
        s.accepted += a + leaf
        s.leaves_kept += leaf
        grow = r.gamma - len(s.drafted_per_pos)
        s.drafted_per_pos += [0] * grow
        s.accepted_per_pos += [0] * grow
        for j in range(v - 1):
            s.drafted_per_pos[j] += 1
            s.accepted_per_pos[j] += j < a
    t3 = time.perf_counter()
    return StepInfo(rows, vlen, out.num_accepted.tolist(), emitted, draft_ok,
                    (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3)
