"""Rejection sampling really samples the target: chi-square goodness-of-fit on the emitted tokens.

False-alarm rate. Each check is a chi-square test at ALPHA = 1e-4. The seeds are fixed (0..N-1), so every run is
deterministic: the alpha bounds the chance that a correct implementation would have failed for a seed set drawn at
random, i.e. the chance that this particular fixed set is an unlucky one. With the 8 checks below that chance is
below 8e-4 for the whole file. The planted-bug tests show the same checks do reject a wrong residual.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import scipy.stats
import torch

from specdec.speculative import accept as acc
from specdec.speculative.accept import accept, draft_sample, sample_residual

ALPHA = 1e-4
N = 20_000
POS = 12_345          # absolute position decided by row 0 (= draft slot 1)

# Fixed rows, independent of earlier tokens. Zeros in q where p has mass (ids 3, 6, 9: reachable only through the
# residual) and in p where q has mass (ids 1, 4: always rejected, must never be emitted).
P0 = np.array([0.22, 0.00, 0.15, 0.08, 0.00, 0.20, 0.05, 0.10, 0.12, 0.08])
Q0 = np.array([0.05, 0.20, 0.30, 0.00, 0.10, 0.05, 0.00, 0.10, 0.20, 0.00])
P1 = np.array([0.05, 0.30, 0.00, 0.10, 0.15, 0.00, 0.20, 0.05, 0.10, 0.05])
Q1 = np.array([0.10, 0.10, 0.20, 0.00, 0.30, 0.10, 0.00, 0.20, 0.00, 0.00])
P2 = np.array([0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10])
RESIDUAL0 = np.maximum(P0 - Q0, 0) / np.maximum(P0 - Q0, 0).sum()


@pytest.fixture(autouse=True)
def _no_runtime_check(monkeypatch):
    """The planted bugs would trip the fast-vs-reference switch; this file tests distributions, not agreement."""
    monkeypatch.setattr(acc, "CHECK_AGAINST_REFERENCE", False)
    monkeypatch.delenv("SPECDEC_CHECK_ACCEPT", raising=False)


def chi2_pvalue(samples, probs: np.ndarray) -> float:
    """Goodness of fit of integer samples to probs. A token with zero probability is a certain failure (p = 0)."""
    counts = np.bincount(np.asarray(samples, dtype=np.int64), minlength=len(probs))
    if counts[probs == 0].any():
        return 0.0
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return float(scipy.stats.chisquare(counts[keep], expected).pvalue)


def _t(*rows) -> torch.Tensor:
    return torch.tensor(np.array(rows), dtype=torch.float64)


@functools.lru_cache(maxsize=None)
def drafts(q_key: int, position: int, mode: str = "rejection") -> tuple[int, ...]:
    """Draft token of seed s at `position`, for s in 0..N-1, drawn from Q0 (q_key 0) or Q1 (q_key 1)."""
    q = torch.from_numpy((Q0, Q1)[q_key])
    return tuple(draft_sample(q, mode, s, position) for s in range(N))


def step(p_rows: torch.Tensor, q_rows: torch.Tensor | None, draft_cols: list[tuple[int, ...]], seeds: list[int],
         position: int, mode: str = "rejection"):
    """One accept() over len(seeds) requests that share the same rows: request k uses seed seeds[k] and drafts
    draft_cols[j][k] for slot j+1."""
    n, rows = len(seeds), p_rows.shape[0]
    draft_tokens = torch.tensor([col[k] for k in range(n) for col in draft_cols], dtype=torch.long)
    return accept(p_rows.repeat(n, 1), None if q_rows is None else q_rows.repeat(n, 1), draft_tokens,
                  torch.arange(0, rows * n + 1, rows), [mode] * n, seeds, [position] * n)


def first_token_pvalue(mode: str = "rejection") -> float:
    """verify_len = 2 (one draft slot): the first emitted token must follow row 0's p."""
    out = step(_t(P0, P2), _t(Q0), [drafts(0, POS, mode)], list(range(N)), POS, mode)
    return chi2_pvalue([t[0] for t in out.tokens], P0)


def residual_pvalue() -> float:
    """The residual sampler alone, fed by the coins accept() uses: must follow normalise(max(p - q, 0))."""
    seeds, pos = np.arange(N, dtype=np.uint64), np.full(N, POS, dtype=np.uint64)
    draws = sample_residual(_t(P0).repeat(N, 1), _t(Q0).repeat(N, 1), seeds, pos)
    return chi2_pvalue(draws.numpy(), RESIDUAL0)


# ----------------------------------------------------------------------------------------------------------- (a)

def test_draft_sampler_follows_q():
    assert chi2_pvalue(drafts(0, POS), Q0) > ALPHA


def test_first_token_follows_p():
    assert first_token_pvalue() > ALPHA


def test_second_token_follows_second_row():
    """verify_len = 3 (two slots). Requests that accept slot 1 get their second token from slot 2 (draft or
    residual) or nothing else; those that reject slot 1 decide the next position in the next step, here plain
    decoding (verify_len = 1: Gumbel-max over the GUMBEL coins of POS+1) of the same fixed row. Both the marginal
    and the accepted-slot-1 subset must follow P1: slot 2's coins (position POS+1) are independent of slot 1's, and
    so are the GUMBEL coins of POS+1 (another stream)."""
    out = step(_t(P0, P1, P2), _t(Q0, Q1), [drafts(0, POS), drafts(1, POS + 1)], list(range(N)), POS)
    assert chi2_pvalue([t[0] for t in out.tokens], P0) > ALPHA
    went_on = [t[1] for t in out.tokens if len(t) > 1]
    stopped = [s for s, t in enumerate(out.tokens) if len(t) == 1]
    assert 0.3 * N < len(went_on) < 0.7 * N          # acceptance of slot 1 is sum(min(P0, Q0)) = 0.47
    assert chi2_pvalue(went_on, P1) > ALPHA
    nxt = step(_t(P1), None, [], stopped, POS + 1)
    assert chi2_pvalue(went_on + [t[0] for t in nxt.tokens], P1) > ALPHA


def test_bonus_token_follows_bonus_row():
    """verify_len = 2 in rejection mode: requests that accept slot 1 emit the bonus row's token, drawn like plain
    seeded decoding (Gumbel-max, GUMBEL coins of POS+1). Selecting on acceptance does not bias it: acceptance was
    decided by the DRAFT and ACCEPT coins of POS, independent of the bonus coins, so the subset must follow P1."""
    out = step(_t(P0, P1), _t(Q0), [drafts(0, POS)], list(range(N)), POS)
    bonus = [t[1] for t in out.tokens if len(t) == 2]
    assert 0.3 * N < len(bonus) < 0.7 * N
    assert chi2_pvalue(bonus, P1) > ALPHA


def test_coupled_first_token_follows_p():
    """Coupled mode is Gumbel-max sampling: same marginal, with exactness shown in test_accept.py."""
    assert first_token_pvalue("coupled") > ALPHA


# ----------------------------------------------------------------------------------------------------------- (b)

def test_residual_sampler_follows_residual():
    assert residual_pvalue() > ALPHA


# ----------------------------------------------------------------------------------------------------- (c) planted

@pytest.mark.parametrize("wrong", ["p", "q"])
def test_planted_wrong_residual_is_caught(monkeypatch, wrong):
    """Sampling the correction from p (a classic bug: over-weights tokens the draft already covers) or from q must
    make both checks reject."""
    monkeypatch.setattr(acc, "residual_weights", (lambda p, q: p.clone()) if wrong == "p" else
                        (lambda p, q: q.clone()))
    assert residual_pvalue() < ALPHA
    assert first_token_pvalue() < ALPHA
