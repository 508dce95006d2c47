"""The plan step: how many rows each request verifies (verify_len) and how long a block it asks the drafter for.

Compact verify makes a shorter verify_len save real compute, so it pays to verify only the draft tokens likely to be
accepted. Inputs:
- an SPS table, cost(rows): the target's verify time for a packed forward of `rows` rows, profiled at start-up;
- an STS calibration, P(accept | draft confidence), learned online from what was accepted;
- a fixed per-step cost (drafting, overhead) that every step pays whatever it verifies.

Request i verifying v_i rows emits 1 + sum_{j<v_i} g_ij tokens in expectation, g_ij = prod_{k<=j} a_ik (slot j is
emitted only if slots 1..j are all accepted). The g_ij decrease along a request's block, so for a total of R draft rows
the best choice is the R largest g_ij overall (each request gets a prefix); the plan takes the R that maximises
(B + sum of the top R gains) / (fixed + cost(B + R)). `brute_force_plan` checks that against every combination.

Adaptive gamma: each request's block length maximises E(gamma) / (1 + gamma * c) for its own acceptance history
(EMA of per-token acceptance), E(gamma) = (1 - alpha^(gamma+1)) / (1 - alpha).

Blocks copied from the context (prompt lookup, `Proposal.copied`) cost no drafting and are right far more often than a
model's blocks on the text where they are found: they get their own calibration, and neither their acceptance nor
their steps teach the planner anything about the model's blocks (adaptive gamma decides the model's block only).
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import time
from typing import Sequence

from .accept import Mode
from .propose import Proposal
from .step import plan_full
from .tree import as_leaves, leaf_candidates


# -- SPS: verify cost by packed row count ----------------------------------------------------------------------------
@dataclasses.dataclass
class CostTable:
    rows: list[int]              # measured row counts, ascending
    ms: list[float]              # verify time at each

    def __call__(self, n: int) -> float:
        """Piecewise-linear in rows; linear extrapolation past the last point."""
        r, m = self.rows, self.ms
        if n <= r[0]:
            return m[0]
        i = bisect.bisect_left(r, n)
        if i == len(r):
            i -= 1
        lo, hi = i - 1, i
        return m[lo] + (m[hi] - m[lo]) * (n - r[lo]) / (r[hi] - r[lo])

    def __post_init__(self):
        self.ms = self._non_decreasing(self.ms)
        self.profiled = list(self.ms)
        self.measured: dict[int, float] = {}     # index -> the online estimate at that profiled row count

    def update(self, n: int, ms: float, ema: float = 0.2) -> None:
        """Online correction from a verify measured at a profiled row count (others are ignored): that point moves
        toward it, and points not measured yet keep their profiled ratio to the nearest measured one. A start-up
        profile taken on a busy machine is too high at every row count: with only the measured point corrected (served:
        1 row profiled at 111 ms, run at 15; 2 and 4 rows left at 111) a second row looked 7x dearer than the first,
        and no draft was verified again."""
        if n not in self.rows:
            return
        i = self.rows.index(n)
        self.measured[i] = (1 - ema) * self.measured.get(i, self.profiled[i]) + ema * ms
        out = []
        for k, p in enumerate(self.profiled):
            j = k if k in self.measured else \
                min(self.measured, key=lambda j: (abs(self.rows[j] - self.rows[k]), j))
            out.append(self.measured[k] if j == k else p * self.measured[j] / self.profiled[j])
        for k in range(len(out) - 2, -1, -1):    # a derived point is never above the next one
            if k not in self.measured:
                out[k] = min(out[k], out[k + 1])
        self.ms = self._non_decreasing(out)

    @staticmethod
    def _non_decreasing(ms: Sequence[float]) -> list[float]:
        """Cost never decreases with rows (a lower point measured dearer than a higher one is noise)."""
        return list(itertools.accumulate(ms, max))

    @classmethod
    def linear(cls, base_ms: float, per_row_ms: float, max_rows: int = 256) -> "CostTable":
        return cls([1, max_rows], [base_ms + per_row_ms, base_ms + per_row_ms * max_rows])


def profile_rows(tile_rows: int | None = None, most: int = 64, gemm_rows: int = 16) -> list[int]:
    """Row counts to profile: powers of two up to `most`, and both sides of every multiple of the engine's linear
    tile (`RowTiles.hi`, engine/row_tiles.py) and of `gemm_rows`. Past a tile multiple the forward makes one more call
    per linear, streaming every weight once more: on a Sapphire Rapids Xeon with 32-row tiles a SmolLM2 verify took
    49 ms at 32 rows and 71 at 40, where interpolating 32 and 64 rows said 60, and the planner thought a 33rd row
    nearly free. Past a multiple of 16 an AMX GEMM computes another 16-row block: the same Xeon, SmolLM2 bf16, 30.0
    ms at 16 rows, 34.2 at 17, 38.1 at 32 (however the rows are spread over sequences), where 16 and 32 alone said
    30.5 at 17; served at 16 concurrent requests, the planner verified copied blocks at 17-20 rows that did not pay."""
    rows = {1 << k for k in range(most.bit_length()) if 1 << k <= most}
    for edge in {tile_rows, gemm_rows} - {None, 0}:
        rows |= {n + d for n in range(edge, most + 1, edge) for d in (0, 1)}
    return sorted(rows)


def profile_cost(engine, rows: Sequence[int] | None = None, context: int = 128, reps: int = 3) -> CostTable:
    """Measure the engine's packed verify cost for each row count (rows spread over sequences of <= 9 rows, on a
    cached context): the fastest of `reps` rounds, each round timing every row count once, after a warm-up round.
    Other work on the machine only adds time, and a burst of it costs one round of every row count rather than every
    measurement of a few: a served profile taken while the draft server finished loading beside the target said
    74.9 ms for 1 to 17 rows (15-20 ms for 1 row unloaded), and the planner, correcting the row count it ran, then
    found a second row 3.7x dearer than the first and verified no draft (a median over back-to-back repeats). Default
    rows: `profile_rows` at the engine's linear tiles."""
    from ..engine.layout import SeqInput
    if rows is None:
        tiles = getattr(engine, "row_tiles", None)
        rows = profile_rows(tiles.hi if tiles is not None else None)
    spread = {n: [min(9, n - 9 * k) for k in range(math.ceil(n / 9))] for n in rows}
    seqs = [engine.new_sequence() for _ in range(max(len(per) for per in spread.values()))]
    best = {n: math.inf for n in rows}
    try:
        engine.prefill(seqs, [[1 + (i % 50)] * context for i in range(len(seqs))])
        for rnd in range(reps + 1):
            for n in rows:           # every row count rewrites the same positions after the context
                t = time.perf_counter()
                engine.forward([SeqInput(s, [2] * k, start=context, logits="all") for s, k in zip(seqs, spread[n])])
                if rnd:
                    best[n] = min(best[n], (time.perf_counter() - t) * 1e3)
    finally:
        for s in seqs:
            engine.release(s)
    return CostTable(list(rows), [best[n] for n in rows])      # made non-decreasing by the table


# -- STS: confidence -> acceptance probability -----------------------------------------------------------------------
class Calibration:
    """Binned online estimate of P(accept | draft confidence), with a Beta prior pulling each bin toward its
    confidence (a well-calibrated draft accepts at its confidence). decay > 0: each bin remembers about its last
    1 / decay observations (counts fade by 1 - decay at each new one), so the estimate follows the traffic."""

    def __init__(self, bins: int = 10, prior: float = 4.0, decay: float = 0.0):
        self.bins, self.prior, self.keep = bins, prior, 1.0 - decay
        self.tried = [0.0] * bins
        self.accepted = [0.0] * bins

    def _bin(self, c: float) -> int:
        return min(self.bins - 1, max(0, int(c * self.bins)))

    def prob(self, c: float) -> float:
        b = self._bin(c)
        centre = (b + 0.5) / self.bins
        return (self.accepted[b] + self.prior * centre) / (self.tried[b] + self.prior)

    def observe(self, confidences: Sequence[float], accepted: int) -> None:
        """Slots 1..accepted were accepted, slot accepted+1 (if verified) was rejected; later ones say nothing."""
        for j, c in enumerate(confidences[:accepted + 1]):
            b = self._bin(c)
            self.tried[b] = self.tried[b] * self.keep + 1
            self.accepted[b] = self.accepted[b] * self.keep + (j < accepted)


# -- the plan ----------------------------------------------------------------------------------------------------------
def gains(probs: Sequence[float]) -> list[float]:
    """g_j = prod_{k<=j} a_k: the expected extra tokens of verifying slot j."""
    return list(itertools.accumulate(probs, lambda a, b: a * b))


def best_plan(slot_probs: list[list[float]], caps: list[int], cost: CostTable, fixed_ms: float = 0.0,
              floors: list[int] | None = None, worth: list[float] | None = None) -> list[int]:
    """verify_len per request maximising expected emitted tokens per unit step cost: floors[i] <= verify_len <=
    caps[i] (floors: rows that are verified whatever the plan, e.g. a rejection-sampled request's whole block).
    worth[i]: what an extra token of request i is worth against a plain step's token (1 each by default; see
    CostPlanner.burst_worth)."""
    B = len(slot_probs)
    floors = floors or [1] * B
    worth = worth or [1.0] * B
    cand = sorted(((worth[i] * g, i) for i, ps in enumerate(slot_probs)
                   for g in gains(ps[:max(0, caps[i] - 1)])[floors[i] - 1:]), reverse=True)
    base_rows = sum(floors)
    total = float(sum(1 + w * sum(gains(ps[:f - 1])) for ps, f, w in zip(slot_probs, floors, worth)))
    best_r, best = 0, total / (fixed_ms + cost(base_rows))
    for r, (g, _) in enumerate(cand, 1):
        total += g
        val = total / (fixed_ms + cost(base_rows + r))
        if val > best:
            best_r, best = r, val
    vlen = list(floors)
    for _, i in cand[:best_r]:
        vlen[i] += 1
    return vlen


def expected_rate(slot_probs, vlen, cost: CostTable, fixed_ms: float = 0.0, worth=None) -> float:
    worth = worth or [1.0] * len(vlen)
    tokens = sum(1 + w * sum(gains(ps[:v - 1])) for ps, v, w in zip(slot_probs, vlen, worth))
    return tokens / (fixed_ms + cost(sum(vlen)))


def brute_force_plan(slot_probs, caps, cost: CostTable, fixed_ms: float = 0.0,
                     floors: list[int] | None = None, worth=None) -> tuple[list[int], float]:
    """Every combination of verify lengths: the reference `best_plan` is tested against."""
    best, best_v = -1.0, None
    floors = floors or [1] * len(caps)
    for vlen in itertools.product(*[range(f, c + 1) for f, c in zip(floors, caps)]):
        val = expected_rate(slot_probs, vlen, cost, fixed_ms, worth)
        if val > best + 1e-12:
            best, best_v = val, list(vlen)
    return best_v, best


def leviathan_gain(alpha: float, gamma: int) -> float:
    """E(gamma): expected tokens per step with per-token acceptance alpha."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def best_gamma(alpha: float, c: float, gamma_max: int, gamma_min: int = 1) -> int:
    """The block length maximising tokens per unit cost, c = drafting cost per token / a target step (0: drafting
    does not pay, since leviathan_gain(alpha, 0) = 1 at no drafting cost)."""
    return max(range(gamma_min, gamma_max + 1), key=lambda g: leviathan_gain(alpha, g) / (1 + g * c))


EXPLORE_SHARE = 0.02       # the most of the time exploration may take while drafting does not pay
MEASURED_AFTER = 8         # steps of each kind at a batch size class before their measured rates decide
CLEAR_LOSS = (3, 0.5)      # ... or this many steps of a kind that emitted under this share of plain steps' tokens/ms
UNUSED_LOOKUPS = (8, 0.02)  # lookups in a row that gave the plan no copy, each costing over this share of a forward
CATCH_UP_TOKENS = 16       # unseen tokens a drafting step must have caught up on to measure the catch-up's cost
CATCH_UP_MINOR = 0.5       # a request's catch-up under this share of a plain step is not priced (too little to lose)
AHEAD_WORTH = 0.5          # the least a token of a request ahead of a burst's slowest is worth (burst_worth)


class CostPlanner:
    """The verify-length planner (and adaptive gamma). Usable as `plan=` of speculative_step."""

    def __init__(self, cost: CostTable, *, fixed_ms: float = 0.0, draft_ms_per_token: float = 0.0,
                 adaptive_gamma: bool = True, calibration: Calibration | None = None, ema: float = 0.2,
                 learn_costs: bool = True, explore_every: int = 8):
        self.cost, self.fixed_ms, self.draft_ms = cost, fixed_ms, draft_ms_per_token
        self.learn_costs = learn_costs
        self.adaptive_gamma, self.cal, self.ema = adaptive_gamma, calibration or Calibration(), ema
        # copied blocks: P(accept) at each slot, apart from the model's. Fading: how often a copy is right depends on
        # the text (HumanEval's answers copy the prompt, chat's rarely); with counts kept for good, a served HumanEval
        # run after chat runs kept its copies unverified (AL 1.38 against 1.82 on a fresh server)
        self.cal_copied = Calibration(decay=0.01)
        self.alpha: dict[str, float] = {}
        self.alpha_prior = 0.5                # acceptance over all requests (slower smoothing): a new one's start
        self.idle: dict[str, int] = {}        # steps since a request last verified a draft
        self.undrafted: dict[str, int] = {}   # steps since a request last drafted
        self.explore: set[str] = set()        # requests drafting this step only to explore: verify one draft
        self.explore_every = explore_every
        self.next_explorer: str | None = None  # while drafting does not pay: the one request that may explore
        self.steps = 0                        # steps planned so far (the exploration clock)
        self.explore_ms = 0.0                 # drafting time of steps where only explorers drafted (smoothed)
        self.exploring = False                # the step being planned: only explorers drafted
        self.drafted_last: set[str] = set()   # requests the model drafted for in the latest step
        self.model_seen: dict[str, int] = {}  # per request: its committed length when the model last drafted for it
        self.catch_up_sums = (0.0, 0.0)       # (ms, tokens) of the catch-ups measured, fading: catch_up_ms
        self.catch_ups_withheld = 0           # request-steps not drafted for because the catch-up would not pay
        # Does drafting pay for the batch as a whole (at large batches verify rows stop being nearly free)? Predicted:
        # the plans' expected tokens/ms (drafting included) over plain decoding's by the cost table. Realised: each
        # step's tokens/ms over the table's plain rate, for steps the model drafted ("draft"), steps that verified
        # copied blocks only ("copy") and steps that verified nothing ("plain"), smoothed, per batch size class (what
        # pays at batch 1 says nothing about batch 16).
        self.predicted_pays = 1.0
        self.realized: dict[tuple[int, str], float] = {}
        self.realized_n: dict[tuple[int, str], int] = {}
        self.batch = 1                        # the coming step's batch (begin()): the class gamma() decides for
        self.unused_lookups: dict[int, int] = {}   # per class: lookups in a row, each dear, that verified no copy
        self.explored: set[str] = set()       # requests whose draft the latest plan verified only to explore (either
        #                                       kind of exploration below: an explorer's block may be a copy)
        self.closed = False                   # no request waits for admission (the scheduler says): see burst_worth

    @staticmethod
    def batch_class(B: int) -> int:
        """1, 2, 3-4, 5-8, 9-16, ...: the measured rates are kept per class. (It was B's bit length, i.e. 2-3, 4-7,
        8-15: 8 concurrent requests, whose batch moves between 5 and 8 as they finish and others join, straddled two
        classes, each learning on its own.)"""
        return (max(1, B) - 1).bit_length() + 1

    def _measured(self, kind: str) -> float | None:
        """Tokens/ms of `kind` steps over plain steps at the current batch size class, once each has run there
        MEASURED_AFTER times, or `kind` CLEAR_LOSS[0] times clearly losing. A class's first drafting step catches a
        model drafter up on every request's prompt: served chat at 4 requests with the target's w4a8 copy drafting,
        that step emitted 0.56 of plain steps' tokens per ms, and decided on alone it kept drafting off for the run
        (1.03x, AL 1.12; every draft verified gives 1.20x-1.22x in process); decided on the first 4 drafting steps, too
        (1.10x, AL 1.25); on 8, 1.22x and 1.24x."""
        k = self.batch_class(self.batch)
        n, n_plain = self.realized_n.get((k, kind), 0), self.realized_n.get((k, "plain"), 0)
        if min(n, n_plain) >= MEASURED_AFTER:
            return self.realized[k, kind] / max(1e-9, self.realized[k, "plain"])
        # A clear loss decides sooner, against the cost table's plain rate (1) until plain steps are measured: served
        # chat at 32 requests with the w4a8 copy (a batch of 16, a new request nearly every step, so every drafting
        # step caught up on new prompts: ~470 ms against a ~60 ms plain step), the class's first 16 drafting steps
        # took 16% of the run (0.81x).
        ratio = self.realized.get((k, kind), 1.0) / (self.realized[k, "plain"] if n_plain >= MEASURED_AFTER else 1.0)
        return ratio if n >= CLEAR_LOSS[0] and ratio < CLEAR_LOSS[1] else None

    @property
    def draft_pays(self) -> float:
        """Tokens/ms with the model drafting over without at the current batch size: measured once both kinds of step
        have run at its class, else predicted."""
        measured = self._measured("draft")
        return self.predicted_pays if measured is None else measured

    @property
    def copies_pay(self) -> float:
        """Tokens/ms of steps that verified copied blocks (and drafted nothing) over plain steps at the current batch
        size, once measured (1 before). Served chat at 16 concurrent requests: every step that verified copies
        emitted 0.45-0.54 tokens/ms against plain steps' 0.54; and their extra tokens made requests finish at
        different steps, so new ones were admitted one at a time, each prefilled inside a step at a higher cost per row
        than a group (a 50-token prompt: 35 ms alone, 25 ms each in a group of 2-16)."""
        measured = self._measured("copy")
        return 1.0 if measured is None else measured

    def begin(self, reqs) -> None:
        """The coming step's batch: gamma() decides for its class. (It decided for the latest step's: served chat at
        32 requests with the w4a8 copy, a round's first 10 requests arrived after the round before had ended at a
        batch of 1-4, where drafting paid, and all of them drafted at once, catching the draft model up on their
        prompts: 591 ms against a 45 ms plain step, at a batch size where drafting had been measured not to pay.)"""
        self.batch = len(reqs)

    def gamma(self, r) -> int:
        """Block length to ask the drafter for: adaptive to the request's acceptance history, 0 (no draft) when
        its acceptance does not pay for the drafting, except on exploration steps (one in `explore_every`, the same
        steps for every request) so that a request whose text turns predictable is noticed."""
        if not self.adaptive_gamma:
            return r.gamma
        # a new request starts from what other requests' drafts measured (it used to draft a full block until its
        # own first verified draft: at 32 concurrent 64-token requests some new one drafted nearly every step)
        alpha = self.alpha.get(r.rid, self.alpha_prior)
        if not self.catch_up_pays(r, alpha):
            self.catch_ups_withheld += 1
            return 0                          # nor does it explore: what it could find would not pay for the catch-up
        c = self.draft_ms / max(1e-9, self.cost(1))
        g = min(r.gamma, best_gamma(alpha, c, r.gamma, gamma_min=0)) if self.draft_pays >= 1 else 0
        if g > 0:
            self.undrafted.pop(r.rid, None)
            return g
        self.undrafted[r.rid] = self.undrafted.get(r.rid, 0) + 1
        # Every request explores on the same steps: a step that drafts for any request pays the drafter's fixed cost
        # (a served Propose of 8 requests: 9-26 ms against a 48 ms step, measured), and staggered, nearly every step
        # would. While drafting does not pay for the batch, at least 4x less often (explore_period) and one request a
        # step, in turn: the calibration and the batch's measured rates are shared, and every explorer adds its
        # features to the Propose and a row to the verify (served chat at 8 requests: 14-22 ms of drafting a step for
        # all of them, 6-16 ms for one; model-drafting steps cost ~3% of the run in a trace).
        pays = self.draft_pays >= 1
        period = self.explore_every if pays else self.explore_period()
        if self.undrafted[r.rid] < self.explore_every or self.steps % period:
            return 0
        if not pays and self.next_explorer not in (None, r.rid):
            return 0
        self.undrafted[r.rid] = 0
        self.explore.add(r.rid)
        # explore at the block length drafting would use, so the measured drafting steps are representative
        return min(r.gamma, best_gamma(alpha, c, r.gamma))

    @property
    def catch_up_ms(self) -> float:
        """A model drafter's catch-up per token it had not seen (0 until one is measured)."""
        ms, tokens = self.catch_up_sums
        return ms / tokens if tokens else 0.0

    def unseen(self, r) -> int:
        """Tokens of `r` the model drafter has not seen: all it committed since the model last drafted for it."""
        return r.committed_len - self.model_seen.get(r.rid, 0)

    def catch_up_pays(self, r, alpha: float) -> bool:
        """May the model draft for `r` where it must first catch up on the text it has not seen (a model drafter
        prefills it: a new request's prompt, or all since it last drafted for it)? Only where that catch-up, at the
        measured cost per token, is less than what drafting could save over the request's remaining tokens at the
        coming batch, counted generously: drafting free, only verify rows paid (the cost table), at the request's
        acceptance. Served chat at 16 and 32 concurrent requests with the target's w4a8 copy (a Xeon with AMX), a
        batch size class's first drafting step caught 16 prompts up in 339 ms and 32 in 748 ms against a 27-45 ms
        plain step, and each exploration after it one prompt in 45-85 ms, for drafts that could not pay there. A
        catch-up under CATCH_UP_MINOR of a plain step is not priced: the saving is an estimate, and where it is wrong
        such a catch-up loses little. At a quarter, served chat at 8 requests with the trained drafter (a Zen 4 EPYC)
        withheld 521-1,548 request-steps a run (19-287 at a half), while the copy's counts at 16 stayed at ~5,500
        (README, "Catch-ups priced before they are paid", "... weighed by their tokens")."""
        unseen = self.unseen(r)
        if unseen <= r.gamma + 1:             # no more than a block's commits behind (every step of a steady request)
            return True
        B = max(1, self.batch)
        plain = self.cost(B)
        if unseen * self.catch_up_ms <= CATCH_UP_MINOR * plain:
            return True                       # a catch-up costing little
        speedup = max(leviathan_gain(alpha, g) * plain / self.cost(B * (g + 1)) for g in range(1, max(1, r.gamma) + 1))
        saving = max(0.0, 1 - 1 / speedup) * r.left * plain / B   # its share of the time
        return unseen * self.catch_up_ms <= saving

    def explore_period(self) -> int:
        """Steps between explorations while drafting does not pay: 4 * explore_every, or more where that would spend
        over EXPLORE_SHARE of the time on them. An explorer's drafter first catches up on all the request's text it
        has not seen (a model drafter prefills it): served chat at 8 requests with the target's own w4a8 copy, each
        exploration's Propose took 70-220 ms against a 40 ms step, every 32 steps, 13% of the run (0.89x)."""
        return max(4 * self.explore_every, math.ceil(self.explore_ms / (EXPLORE_SHARE * self.cost(self.batch))))

    def _explores_copies(self, step: int) -> bool:
        """Every 4th exploration step plans copied blocks whatever was measured, which keeps measuring them."""
        return step % (4 * self.explore_every) == 0

    def _copies_on(self, step: int) -> bool:
        """Does step `step` plan copied blocks? Not where verifying them was measured not to pay at this batch size
        (they are worth nothing to its plan), except on the steps that explore them."""
        return self.copies_pay >= 1 or self._explores_copies(step)

    def copies_wanted(self) -> bool:
        """Whether the coming step plans copied blocks: speculative_step asks a drafter that looks up only then for
        requests whose model block is 0 (served chat at 16 requests, looking up cost 0.35 ms a step, ~1%). Nor where
        the latest UNUSED_LOOKUPS[0] lookups at this batch size each cost over UNUSED_LOOKUPS[1] of a forward and had
        no copy verified, but on every 4th exploration step: served chat at a batch of 17-32, every step looked up
        (2.1 ms of a ~52 ms forward) and the plan verified no copy in 376 of 377 steps; with no step that verified
        copies, they were never measured not to pay (copies_pay), and the lookups went on for the whole run (0.96x)."""
        step = self.steps + 1
        unused = self.unused_lookups.get(self.batch_class(self.batch), 0) >= UNUSED_LOOKUPS[0]
        return self._copies_on(step) and (not unused or self._explores_copies(step))

    def floors(self, reqs, caps: list[int]) -> list[int]:
        """Rows each request verifies whatever the plan (CostPlanner: only its anchor)."""
        return [1] * len(reqs)

    @staticmethod
    def _modelled(reqs, props: list[Proposal]) -> list[str]:
        """The requests a model drafted for this step (a block copied from the context costs no drafting)."""
        return [r.rid for r, p in zip(reqs, props) if p.tokens and not p.copied]

    def __call__(self, reqs, props: list[Proposal]) -> list[int]:
        self.steps += 1
        self.batch = len(reqs)
        caps = plan_full(reqs, props)                  # verifying everything is the most a request may verify
        copies = self._copies_on(self.steps)
        probs = [[(self.cal_copied.prob(c) if copies else 0.0) if p.copied else self.cal.prob(c)
                  for c in p.confidence] for p in props]
        modelled = self._modelled(reqs, props)
        self.exploring = bool(modelled) and all(rid in self.explore for rid in modelled)
        # the drafting this step paid (the plan's fixed cost): none when every block was copied
        vlen = best_plan(probs, caps, self.cost, self.fixed_ms if modelled else 0.0, self.floors(reqs, caps),
                         self.burst_worth(reqs, props) if self.closed else None)
        planned = list(vlen)
        if modelled:
            ratio = expected_rate(probs, vlen, self.cost, self.fixed_ms) / (len(reqs) / self.cost(len(reqs)))
            self.predicted_pays = (1 - self.ema) * self.predicted_pays + self.ema * ratio
        # Exploration: drafts left unverified for `explore_every` steps get one verified, so the calibration keeps
        # learning (a pessimistic start would otherwise never be corrected); one request's (the longest idle) every
        # `explore_every` steps, since the calibration is shared: one per request cost 5-7% of throughput at batch 8
        # where a row costs nearly a decode (bf16 on an AVX2 CPU, measured), for no better a calibration.
        for i, (r, cap) in enumerate(zip(reqs, caps)):
            if r.rid in self.explore:
                self.explore.discard(r.rid)
                if self._cheap_row(sum(vlen)):
                    vlen[i] = max(vlen[i], min(cap, 2))
            if vlen[i] > 1 or cap < 2:
                self.idle.pop(r.rid, None)
            else:
                self.idle[r.rid] = self.idle.get(r.rid, 0) + 1
        self.next_explorer = max((r.rid for r in reqs), key=lambda rid: self.undrafted.get(rid, 0), default=None)
        idle = [i for i, r in enumerate(reqs) if self.idle.get(r.rid, 0) >= self.explore_every]
        if idle and self.steps % self.explore_every == 0 and self._cheap_row(sum(vlen)):
            i = max(idle, key=lambda k: self.idle[reqs[k].rid])
            vlen[i], self.idle[reqs[i].rid] = 2, 0
        self.explored = {r.rid for r, v, w in zip(reqs, vlen, planned) if v > w}   # rows only exploration added
        return vlen

    def burst_worth(self, reqs, props: list[Proposal]) -> list[float]:
        """What an extra token of each request is worth (against a plain step's token) where no request waits for
        admission: the batch then only shrinks, and lasts as long as the request with the most tokens left. A token
        shortens it for that request; where several are within a block of the most left, only if each of them gains,
        so each one's counts by the share of them with a draft to verify (copies for a few of 16 requests started
        together shorten nothing). A request further ahead finishing sooner saves the steps after it only its own
        row, cost(B) - cost(B - 1), against a plain token's cost(B) / B (nothing where the forward's cost is flat in
        rows: on a Xeon with AMX, 13 to 16 rows all took ~35 ms); it is worth at least AHEAD_WORTH all the same (its
        own user waits less), so where verify rows are nearly free (a small batch) it is still verified. Served chat
        at 16 requests started together (the trained drafter, a Xeon with AMX), the plan verified copies in 276 of
        308 steps at a batch of 9-16, which emitted about what plain steps do per ms (0.399 tokens against 0.405),
        but the extra tokens went to the requests the copies suited (up to 2.06 tokens a step; 1.06-1.3 for three in
        four): a part lasted as long as its slowest request (58-60 steps against 64-65), at 42.7 ms a step against
        35.6 (0.93x)."""
        B = len(reqs)
        left = [r.left for r in reqs]
        most = max(left, default=0)
        last = [most - n <= max(1, r.gamma) for r, n in zip(reqs, left)]
        drafted = sum(bool(p.tokens) for p, is_last in zip(props, last) if is_last)
        row = (self.cost(B) - self.cost(B - 1)) * B / self.cost(B) if B > 1 else 1.0
        ahead = min(1.0, max(AHEAD_WORTH, row))
        return [max(ahead, drafted / sum(last)) if is_last else ahead for is_last in last]

    def leaves(self, reqs, props: list[Proposal], vlen: list[int], budget: int) -> list[list[tuple[int, int]]]:
        """Verify-tree leaves (speculative/tree.py), the likeliest first, while each raises the step's expected
        tokens per ms: a leaf's value (expected extra tokens) against what its row adds to the forward's cost."""
        probs = [[self.cal.prob(c) for c in p.confidence] for p in props]
        tokens = sum(1 + sum(gains(ps[:v - 1])) for ps, v in zip(probs, vlen))
        rows = sum(vlen)
        fixed = self.fixed_ms if any(p.tokens and not p.copied for p in props) else 0.0
        chosen = []
        for c in leaf_candidates(props, vlen, [r.mode for r in reqs], self.cal.prob)[:max(0, budget)]:
            if (tokens + c[0]) / (fixed + self.cost(rows + 1)) <= tokens / (fixed + self.cost(rows)):
                break
            tokens, rows = tokens + c[0], rows + 1
            chosen.append(c)
        return as_leaves(chosen, len(props))

    def _cheap_row(self, rows: int) -> bool:
        """May exploration add a row to a forward of `rows`? Not where that row costs more than the forward's rows do
        on average: past a linear tile's edge one row costs a third of a step (32 -> 33 rows on a Xeon: 49 -> ~65 ms),
        so a batch of 32 exploring every 8 steps there would spend ~4% more time for drafts the plan already left
        unverified (an estimate from the cost table)."""
        return self.cost(rows + 1) - self.cost(rows) <= self.cost(rows) / max(1, rows)

    def forget(self, rid: str) -> None:
        """A finished request's acceptance history (a long-running service would otherwise keep every one)."""
        for table in (self.alpha, self.idle, self.undrafted, self.model_seen):
            table.pop(rid, None)
        self.explore.discard(rid)

    def observe(self, reqs, props: list[Proposal], vlen: list[int], accepted: list[int],
                draft_ms: float | None = None, verify_ms: float | None = None, rows: int | None = None,
                leaves_kept: int = 0, looked_up: bool = False) -> None:
        """accepted: each chain's accepted drafts (the calibration's evidence); rows: the forward's rows (verify-tree
        leaves included); leaves_kept: tokens the leaves added (speculative/tree.py); looked_up: a drafter was asked
        to copy blocks from the context (a copied proposal says so too)."""
        if verify_ms is not None and self.learn_costs:
            self.cost.update(rows or sum(vlen), verify_ms)
        drafted = max((len(p.tokens) for p in props if not p.copied), default=0)   # by a model
        modelled = set(self._modelled(reqs, props))
        # steady: every request drafted for also drafted the step before, so the drafter caught up on nothing (a
        # model drafter first prefills the text it has not seen: a new request's prompt, or all since its last draft)
        steady = bool(modelled) and modelled <= self.drafted_last
        behind = sum(self.unseen(r) for r in reqs if r.rid in modelled and r.rid not in self.drafted_last)
        if draft_ms is not None and self.learn_costs and behind >= CATCH_UP_TOKENS:
            # the catch-up's cost per token: the time beyond what a steady drafting step costs (the whole step's, an
            # upper bound, where that is not measured yet) over the tokens caught up, each summed over the catch-ups
            # seen (fading), so that one of a few tokens weighs little: a step that caught 16 tokens up and ran a few
            # ms over the steady cost (a trained drafter's steps at 8 served requests: 7-19 ms) read, averaged per step,
            # as a catch-up many times dearer than one of hundreds of tokens
            self.catch_up_sums = ((1 - self.ema) * self.catch_up_sums[0] + max(0.0, draft_ms - self.fixed_ms),
                                  (1 - self.ema) * self.catch_up_sums[1] + behind)
        self.drafted_last = modelled
        for r in reqs:
            if r.rid in modelled:
                self.model_seen[r.rid] = r.committed_len
        if draft_ms is not None and drafted and self.exploring:     # what an exploration costs, catching up included
            self.explore_ms = (1 - self.ema) * self.explore_ms + self.ema * draft_ms if self.explore_ms else draft_ms
        if draft_ms is not None and self.learn_costs and steady:     # steady: a model drafted
            # drafting is paid every step whatever is verified: it is the plan's fixed cost (learned from steps that
            # drafted: one without drafts says nothing about a draft's cost). Not from catch-ups: a request pays
            # one once, and a catch-up priced per drafted token (served, 4 prompts in one Propose: 89-109 ms, against
            # 40-53 for 4 slots after) gave every request gamma 0 at once. The batch's measured rates below count them.
            self.fixed_ms = (1 - self.ema) * self.fixed_ms + self.ema * draft_ms
            self.draft_ms = (1 - self.ema) * self.draft_ms + self.ema * draft_ms / drafted
        if reqs and (looked_up or any(p.copied for p in props)):
            k = self.batch_class(len(reqs))
            # a copy only exploration verified is not the plan using lookups (served chat at 17-32 requests: one
            # every 8th step reset the count at 7, and the target looked up every step)
            if any(p.copied and v > 1 and r.rid not in self.explored for r, p, v in zip(reqs, props, vlen)):
                self.unused_lookups[k] = 0
            elif not drafted and draft_ms is not None and draft_ms > UNUSED_LOOKUPS[1] * self.cost(len(reqs)):
                self.unused_lookups[k] = self.unused_lookups.get(k, 0) + 1
        if draft_ms is not None and verify_ms is not None and reqs:
            B = self.batch = len(reqs)
            rate = (B + sum(accepted) + leaves_kept) / max(1e-9, draft_ms + verify_ms) / (B / self.cost(B))
            copied = any(p.copied and v > 1 for p, v in zip(props, vlen))
            key = (self.batch_class(B), "draft" if drafted else "copy" if copied else "plain")
            # slower smoothing (one step's tokens vary from 1 to gamma + 1), but a plain mean over the first steps: an
            # EMA from the first step kept that step's rate for ~20 steps (served chat at 32 concurrent requests: the
            # first drafting step, at batch 1, paid; every request then drafted at batch 16 for 7 losing steps)
            n = self.realized_n[key] = self.realized_n.get(key, 0) + 1
            w = max(self.ema / 4, 1 / n)
            self.realized[key] = (1 - w) * self.realized.get(key, 0.0) + w * rate
        for r, p, v, a in zip(reqs, props, vlen, accepted):
            if v <= 1:
                continue
            if p.copied:
                self.cal_copied.observe(p.confidence[:v - 1], a)
                continue
            self.cal.observe(p.confidence[:v - 1], a)
            # per-token acceptance of this step: a accepted out of a + (1 if a rejection happened)
            tried = a + (a < v - 1)
            prev = self.alpha.get(r.rid, self.alpha_prior)
            self.alpha[r.rid] = (1 - self.ema) * prev + self.ema * (a / tried)
            self.alpha_prior = (1 - self.ema / 4) * self.alpha_prior + self.ema / 4 * (a / tried)


class ServicePlanner(CostPlanner):
    """The service's default planner: the cost plan (and adaptive gamma) for requests whose output cannot depend on
    how much is verified -- greedy and coupled, which emit exactly plain decoding's tokens whatever the blocks -- and
    every draft verified, at the requested gamma, for rejection-sampled requests, whose seeded text depends on the
    blocks: their blocks must not depend on what the planner learned from other requests, or a replay would differ."""

    @staticmethod
    def _fixed(r) -> bool:
        return Mode(r.mode) is Mode.REJECTION and not r.params.greedy

    def gamma(self, r) -> int:
        return r.gamma if self._fixed(r) else super().gamma(r)

    def floors(self, reqs, caps: list[int]) -> list[int]:
        # a rejection request's whole block is in the forward, so the others are planned around its rows
        return [c if self._fixed(r) else 1 for r, c in zip(reqs, caps)]
