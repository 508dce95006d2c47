"""Sampling parameters and the one function that turns logits into a distribution.

Draft q, target p and plain decoding all go through `probs`, so the three agree on what "the distribution" is:
softmax(logits / T), then top-k, top-p, min-p, renormalised, in float64.

Seeded sampling is Gumbel-max over coins: token = argmax_v(log p(v) + G(seed, position, v)). It needs no RNG state,
the coupled acceptance mode reproduces it exactly, and every mode uses it for each token no accepted draft decides
(speculation off, no drafts, the bonus row): one seeded sampler.
"""
from __future__ import annotations

import dataclasses

import torch

from .coins import Stream, gumbel, gumbel_at


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    min_p: float = 0.0         # 0 = off
    seed: int | None = None    # chosen at admission for non-greedy requests when the client gives none

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] logits -> [R, V] float64 probabilities after temperature, top-k, top-p, min-p (renormalised).

    Greedy requests get the one-hot of the argmax, so callers never special-case p."""
    logits = logits.to(torch.float64)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float64)
    p = torch.softmax(logits / params.temperature, dim=-1)
    keep = torch.ones_like(p, dtype=torch.bool)
    if params.top_k > 0 or params.top_p < 1.0:
        sp, order = p.sort(dim=-1, descending=True, stable=True)
        rank_keep = torch.ones_like(sp, dtype=torch.bool)
        if params.top_k > 0:
            rank_keep[:, params.top_k:] = False
        if params.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p
            before = sp.cumsum(-1) - sp
            rank_keep &= before < params.top_p
        keep = torch.zeros_like(keep).scatter(-1, order, rank_keep)
    if params.min_p > 0.0:
        keep &= p >= params.min_p * p.max(dim=-1, keepdim=True).values
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum(dim=-1, keepdim=True)


def sample_seeded(p: torch.Tensor, seed: int, position: int, ids: torch.Tensor | None = None) -> int:
    """Gumbel-max draw from one row p [V] with the coins of (seed, position). Zero-probability tokens never win.

    ids: p is over these vocabulary ids only (ascending; zero elsewhere): the draw on the dense row, with coins for
    those ids alone (ties go to the lower id either way)."""
    g = gumbel(seed, position, p.shape[-1], Stream.GUMBEL, p.device) if ids is None else gumbel_at(seed, position, ids)
    k = int((torch.log(p) + g).masked_fill(p <= 0, -torch.inf).argmax())
    return k if ids is None else int(ids[k])


def next_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Plain decoding of one row of logits [V] at absolute position `position`."""
    if params.greedy:
        return int(logits.argmax())
    assert params.seed is not None, "non-greedy sampling needs a seed (chosen at admission)"
    return sample_seeded(probs(logits[None], params)[0], params.seed, position)
