"""Acceptance the slow way: one request, one slot at a time, straight from DESIGN.md "Acceptance".

This is the specification `accept.accept` is tested against, and what it is checked against at run time with
SPECDEC_CHECK_ACCEPT=1. Keep it boring: scalar coins, Python floats, no vectorisation, no cleverness to share bugs
with the fast path. Same signature and result type as `accept.accept`; the layout is described there.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import sampling
from .accept import AcceptOutput, Mode, _prepare
from .coins import Stream, coin


def accept_reference(p: torch.Tensor, q: torch.Tensor | None, draft_tokens: torch.Tensor, cu_rows: torch.Tensor,
                     modes: Sequence[Mode | str], seeds: Sequence[int | None],
                     positions: Sequence[int]) -> AcceptOutput:
    b = _prepare(p, q, draft_tokens, cu_rows, modes, seeds, positions)
    num_accepted, tokens = [], []
    for i, (mode, seed, position) in enumerate(zip(b.modes, b.seeds, b.positions)):
        first_row, n_rows = b.cu[i], b.verify_len[i]
        out: list[int] = []
        for j in range(n_rows):
            row, at = p[first_row + j], position + j
            if j == n_rows - 1:                      # bonus row: every verified draft was accepted; plain decoding
                out.append(_target_token(row, mode, seed, at))
                break
            d = first_row - i + j                    # this slot's index into draft_tokens and q
            x = int(draft_tokens[d])
            if mode is Mode.REJECTION:
                if coin(seed, at, Stream.ACCEPT) * float(q[d, x]) < float(row[x]):
                    out.append(x)
                    continue
                residual = [max(pv - qv, 0.0) for pv, qv in zip(row.tolist(), q[d].tolist())]
                if not any(w > 0 for w in residual):     # p <= q everywhere: rounding only; fall back to p
                    residual = row.tolist()
                out.append(_inverse_cdf(residual, coin(seed, at, Stream.RESIDUAL)))
                break
            t = _target_token(row, mode, seed, at)   # greedy / coupled: accept iff the target picks the same
            out.append(t)
            if t != x:
                break
        num_accepted.append(len(out) - 1)
        tokens.append(out)
    return AcceptOutput(torch.tensor(num_accepted, dtype=torch.long), tokens)


def _target_token(row: torch.Tensor, mode: Mode, seed: int, position: int) -> int:
    """What the target emits from one row when no draft is in the way: plain decoding, in every mode."""
    if mode is Mode.GREEDY:
        return int(row.argmax())
    return sampling.sample_seeded(row, seed, position)


def _inverse_cdf(weights: list[float], u: float) -> int:
    """First id whose running sum exceeds u * total (a zero weight never qualifies: it leaves the sum unchanged);
    the last id with mass if rounding puts u * total at the total itself."""
    running, cdf = 0.0, []
    for w in weights:
        running += w
        cdf.append(running)
    if not running > 0:
        raise ValueError("cannot sample a distribution with no mass")
    target = u * running
    for v, c in enumerate(cdf):
        if c > target:
            return v
    return max(v for v, w in enumerate(weights) if w > 0)
