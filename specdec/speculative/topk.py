"""Plain decoding's token from a row's top-K log-probabilities, exact or not at all.

A remote verify backend (SGLang) returns, per verified position, the K most likely ids and their log-probabilities
(log-softmax of its logits), not the whole row. Greedy and coupled acceptance need only one thing per row: the token
plain decoding (sampling.next_token on the whole row) emits there. `decide` returns that token when the top-K
*proves* it, and None otherwise; the caller then asks again with a larger K, and with K = V the row is whole and
`decide` is sampling.next_token itself. So a wrong token is never certified; an uncertain one only costs a call.

Why the top-K can be enough for seeded sampling: Gumbel-max is shift-invariant, token = argmax_v(lp_v / T + G_v) over
the kept ids, and every id outside the top K has lp_v <= lp_K (the K-th best). So no outside id can win when the best
kept score beats lp_K / T + max over outside ids of G_v (the coins are known for every id). Filters:
  top-k   exact when k <= K (ids past rank k are dropped whatever they are);
  min-p   exact: p_v >= min_p * p_max  <=>  lp_v / T - lp_1 / T >= log(min_p), and outside ids are bounded by lp_K;
  top-p   needs the temperature's normaliser Z_T, which depends on the tail; it is bounded from the tail's mass at
          T = 1 (one minus the top-K mass, with a margin for the server's float32 rounding) and decided only when the
          bounds agree.
Every comparison keeps a margin, so last-ulp differences between this arithmetic and sampling.probs (float64 on the
dense row) cannot flip a certified answer. Rejection acceptance needs all of p (the residual) and is not served
from top-K: the capability table refuses it for such backends.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from . import sampling
from .coins import Stream, gumbel

# Relative margin on every certified comparison (scores, masses). Far above float64 rounding of the dense path.
MARGIN = 1e-6
# Uncertainty of the tail mass 1 - sum(top-K probabilities): servers compute log-softmax in float32.
TAIL_SLACK = 1e-4


@dataclasses.dataclass(frozen=True)
class TopKRow:
    """One position's top-K: ids [K] and log-probabilities [K] (log-softmax at T = 1), best first."""
    ids: torch.Tensor
    logprobs: torch.Tensor
    vocab_size: int

    @property
    def whole(self) -> bool:
        return self.ids.numel() == self.vocab_size

    def dense(self) -> torch.Tensor:
        """The whole row as log-probabilities [V] (only for a whole row)."""
        assert self.whole
        return torch.empty(self.vocab_size, dtype=torch.float64).scatter_(0, self.ids, self.logprobs.double())

    @classmethod
    def from_logprobs(cls, lp: torch.Tensor, k: int) -> "TopKRow":
        """The top-k of a dense row [V] (what a server would send; ties by lower id first, like sampling.probs)."""
        order = torch.sort(lp.double(), descending=True, stable=True).indices[:k]
        return cls(order, lp.double()[order], lp.numel())


def decide(row: TopKRow, params: sampling.SamplingParams, position: int) -> int | None:
    """The token sampling.next_token would emit on the whole row at `position`, or None when the top-K does not
    determine it."""
    if row.whole:
        return sampling.next_token(row.dense(), params, position)
    # Our order among equal log-probabilities (lower id first, as sampling.probs sorts), whatever the server's.
    by_id = torch.sort(row.ids.long(), stable=True)
    order = torch.sort(row.logprobs.double()[by_id.indices], descending=True, stable=True).indices
    ids, lp = by_id.values[order], row.logprobs.double()[by_id.indices][order]
    K, V = ids.numel(), row.vocab_size
    if K == 0:
        return None
    L = float(lp[-1])               # every id outside the top-K has lp <= L (and may equal it)
    if params.greedy:
        tied = lp == lp[0]
        return None if bool(tied[-1]) else int(ids[0])   # a tie reaching L may continue outside
    if params.top_k and params.top_k <= K and lp[params.top_k - 1] == (lp[params.top_k] if params.top_k < K else L):
        return None                 # a tie across the top-k cut, possibly with ids we were not sent
    T = params.temperature
    s = lp / T                      # scores up to a constant
    rel = torch.exp(s - s[0])       # p_v * Z_T / p_1 for the top-K, in (0, 1]
    keep = torch.ones(K, dtype=torch.bool)
    undecided = torch.zeros(K, dtype=torch.bool)
    tail_kept = True                # can an id outside the top-K be kept?

    if params.top_k:
        keep[params.top_k:] = False
        tail_kept &= params.top_k > K
    if params.top_p < 1.0:
        z_lo, z_hi = _normaliser_bounds(lp, T, V)
        before = torch.cumsum(rel, 0) - rel
        # ids tied at L may sort after outside ids of the same value (lower ids): their mass before grows by at most
        # the whole tail's
        before_hi = before + (lp == L).double() * (z_hi - float(rel.sum()))
        surely_in = before_hi / z_lo < params.top_p * (1 - MARGIN)
        surely_out = before / z_hi >= params.top_p * (1 + MARGIN)
        undecided |= ~(surely_in | surely_out)
        keep &= surely_in
        tail_kept &= not (float(rel.sum()) / z_hi >= params.top_p * (1 + MARGIN))
    if params.min_p > 0.0:
        cut, tol = math.log(params.min_p), MARGIN * max(1.0, abs(math.log(params.min_p)))
        d = s - s[0]
        undecided |= (d - cut).abs() <= tol
        keep &= d >= cut
        tail_kept &= not (L / T - float(s[0]) < cut - tol)
    if bool(undecided.any()):
        return None

    g = gumbel(params.seed, position, V, Stream.GUMBEL)
    score = torch.where(keep, s + g[ids], torch.tensor(-math.inf, dtype=torch.float64))
    two = torch.topk(score, min(2, K))
    best, winner = float(two.values[0]), int(ids[two.indices[0]])
    if best == -math.inf:
        return None
    margin = MARGIN * max(1.0, abs(best))
    if K > 1 and float(two.values[1]) > best - margin:
        return None                 # a near tie among the kept ids: leave it to the dense path
    if tail_kept:
        outside = g.clone()
        outside[ids] = -math.inf
        if not best - margin > L / T + float(outside.max()):
            return None
    return winner


def _normaliser_bounds(lp: torch.Tensor, T: float, V: int) -> tuple[float, float]:
    """Bounds on Z_T / exp(lp_1 / T) = sum over all ids of exp((lp_v - lp_1) / T), from the top-K and the tail's
    mass m at T = 1 (every tail id has lp <= lp_K =: L)."""
    K, L, top = lp.numel(), float(lp[-1]), float(lp[0])
    known = float(torch.exp((lp - top) / T).sum())
    n = V - K
    if n == 0:
        return known, known
    m = 1.0 - float(torch.exp(lp).sum())
    m_lo, m_hi = max(m - TAIL_SLACK, 0.0), min(max(m + TAIL_SLACK, 0.0), n * math.exp(L))
    # Each tail term exp(lp / T) with exp(lp) = x <= e^L: x^(1/T) relative to x is monotone in x, so the tail is
    # largest (T < 1) or smallest (T > 1) when its mass sits on as few ids as possible, at e^L each, and the other
    # way round when spread evenly over all n.
    at_cap = m_hi * math.exp(L * (1 / T - 1))                 # mass at e^L per id
    spread_hi = n * (m_hi / n) ** (1 / T) if m_hi > 0 else 0.0
    spread_lo = n * (m_lo / n) ** (1 / T) if m_lo > 0 else 0.0
    at_cap_lo = m_lo * math.exp(L * (1 / T - 1))
    hi, lo = (at_cap, spread_lo) if T <= 1 else (spread_hi, at_cap_lo)
    hi = min(hi, n * math.exp(L / T))
    scale = math.exp(-top / T)
    return known + lo * scale, known + hi * scale
