"""Plain decoding's token from a top-K row (speculative/topk.py) against sampling.next_token on the whole row.

The contract is one-sided: `decide` may say None (ask with a larger K), never a wrong token. Rows imitate what a
server sends: log-softmax in float32 of bf16-rounded logits (so exact ties are common), read back as float64.
"""
import math

import pytest
import torch

from specdec.speculative import topk
from specdec.speculative.sampling import SamplingParams, next_token

V = 2048
PARAMS = [SamplingParams(),                                            # greedy
          SamplingParams(temperature=0.7, seed=11), SamplingParams(temperature=1.0, seed=12),
          SamplingParams(temperature=1.3, seed=13),
          SamplingParams(temperature=0.7, top_p=0.9, seed=14), SamplingParams(temperature=1.0, top_p=0.95, seed=15),
          SamplingParams(temperature=1.0, top_k=20, seed=16), SamplingParams(temperature=0.8, min_p=0.05, seed=17),
          SamplingParams(temperature=1.2, top_p=0.8, top_k=50, min_p=0.01, seed=18)]


def server_row(g: torch.Generator, peaked: float) -> torch.Tensor:
    logits = (torch.randn(V, generator=g) * peaked).to(torch.bfloat16).float()
    return torch.log_softmax(logits, -1).double()


def sweep(decide, ks=(8, 20, 64), rows=40, peaks=(1.0, 3.0, 6.0)):
    """(wrong, certified, total) over rows x params x K. Larger `peaks` (logit scale) look more like a real LM's
    rows; at 1.0 a row's mass is spread over hundreds of ids and little certifies below K = V."""
    g = torch.Generator().manual_seed(0)
    wrong = certified = total = 0
    for r in range(rows):
        lp = server_row(g, peaked=peaks[r % len(peaks)])
        for params in PARAMS:
            want = next_token(lp, params, position=100 + r)
            for k in ks:
                got = decide(topk.TopKRow.from_logprobs(lp, k), params, 100 + r)
                total += 1
                if got is not None:
                    certified += 1
                    wrong += got != want
    return wrong, certified, total


def test_certified_tokens_are_plain_decoding_and_most_rows_certify():
    wrong, certified, total = sweep(topk.decide)
    assert wrong == 0
    assert certified > 0.3 * total, (certified, total)
    wrong, certified, total = sweep(topk.decide, ks=(64,), rows=20, peaks=(6.0,))
    assert wrong == 0
    assert certified > 0.8 * total, (certified, total)   # not a certifier that always declines


def test_whole_row_is_plain_decoding():
    g = torch.Generator().manual_seed(1)
    lp = server_row(g, 2.0)
    for params in PARAMS:
        assert topk.decide(topk.TopKRow.from_logprobs(lp, V), params, 7) == next_token(lp, params, 7)


def test_server_order_among_ties_does_not_matter():
    """Equal log-probabilities sent in another order give the same answer (lower id first, like sampling.probs)."""
    lp = torch.full((V,), -20.0, dtype=torch.float64)
    lp[[5, 9, 3]] = math.log(0.3)
    lp[[40, 41]] = math.log(0.05)
    row = topk.TopKRow.from_logprobs(lp, 8)
    flipped = topk.TopKRow(row.ids.flip(0), row.logprobs.flip(0), V)
    for params in PARAMS:
        assert topk.decide(row, params, 3) == topk.decide(flipped, params, 3)
    assert topk.decide(row, SamplingParams(), 3) == 3 == next_token(lp, SamplingParams(), 3)


def test_greedy_tie_that_may_continue_outside_declines():
    lp = torch.full((V,), math.log(1 / V), dtype=torch.float64)      # uniform: every id ties
    assert topk.decide(topk.TopKRow.from_logprobs(lp, 8), SamplingParams(), 0) is None


@pytest.mark.parametrize("planted", ["no tail bound", "top-p from the top-K alone"])
def test_planted_unsound_certifier_is_caught(planted, monkeypatch):
    """Two plausible shortcuts, each wrong: ignoring ids outside the top-K, and renormalising top-p over the top-K
    as if it were the whole row. The sweep must find wrong tokens."""
    if planted == "no tail bound":
        real = topk.decide

        def decide(row, params, position):
            if row.whole or params.greedy:
                return real(row, params, position)
            dense = torch.full((row.vocab_size,), -math.inf, dtype=torch.float64)
            dense[row.ids] = row.logprobs
            return next_token(dense, params, position)     # as if the outside ids had probability 0
    else:
        monkeypatch.setattr(topk, "_normaliser_bounds",
                            lambda lp, T, V: (float(torch.exp((lp - lp[0]) / T).sum()),) * 2)
        decide = topk.decide
    wrong, _, _ = sweep(decide, ks=(8,), rows=30)
    assert wrong > 0
