"""End to end: tokens produced by speculative rejection sampling follow the target's distribution.

A vocab-16 tiny target and a deliberately different draft; N = 3000 seeded requests of one prompt, batched. We test
the first two generated tokens: the first against p(. | prompt), the second against its exact marginal
sum_t1 p(t1) p(. | prompt, t1) computed from the target. Chi-square at alpha = 1e-4 per test (fixed seeds make the
run deterministic; alpha bounds the chance a correct implementation fails for a random seed set). A planted bug —
residual sampled from p instead of max(p - q, 0) — must be rejected by the same check.
"""
import dataclasses

import numpy as np
import pytest
from scipy import stats

from specdec.draft.model import ModelDrafter
from specdec.engine.engine import Engine
from specdec.engine.layout import SeqInput
from specdec.engine.loader import tiny
from specdec.engine.registry import TINY_LLAMA
from specdec.speculative import accept as acc
from specdec.speculative.generator import GenRequest, SpeculativeGenerator
from specdec.speculative.sampling import SamplingParams, probs

CFG = dataclasses.replace(TINY_LLAMA, vocab_size=16, max_seq_len=64)
PARAMS = SamplingParams(temperature=4.0)               # flattens the peaked tiny models: many cells matter
PROMPT = [3, 7, 1, 12]
N, ALPHA = 3000, 1e-4


@pytest.fixture(scope="module")
def pair():
    target = tiny(CFG, 10)
    draft = tiny(CFG, 11)                                # an unrelated model: rejections are common
    return target, draft


def next_p(model, ctx):
    e = Engine(model, kv_tokens=256)
    logits = e.forward([SeqInput(e.new_sequence(), ctx)]).rows(0)
    return probs(logits, PARAMS)[0]


def sample_tokens(pair):
    target, draft = pair
    gen = SpeculativeGenerator(Engine(target, kv_tokens=N * 16, page_size=8), ModelDrafter(draft, kv_tokens=N * 16),
                               gamma=3, mode="rejection")
    outs = gen.generate([GenRequest(PROMPT, dataclasses.replace(PARAMS, seed=s), 2) for s in range(N)])
    alpha = sum(o.stats.accepted for o in outs) / sum(o.stats.drafted for o in outs)
    return np.array([o.tokens[:2] for o in outs]), alpha


def check(pair, tokens):
    target, _ = pair
    p1 = next_p(target, PROMPT)
    marg2 = sum(p1[t] * next_p(target, PROMPT + [t]) for t in range(16))
    pvals = []
    for col, p in ((0, p1), (1, marg2)):
        counts = np.bincount(tokens[:, col], minlength=16)
        keep = (p.numpy() * N) >= 5                      # pool sparse cells (chi-square validity)
        obs = np.append(counts[keep], counts[~keep].sum())
        exp = np.append(p.numpy()[keep] * N, p.numpy()[~keep].sum() * N)
        obs, exp = obs[exp > 0], exp[exp > 0]
        pvals.append(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
    return pvals


def test_rejection_output_follows_target(pair):
    tokens, alpha = sample_tokens(pair)
    assert 0.2 < alpha < 0.9                              # both branches (accept, residual) are exercised
    assert min(check(pair, tokens)) > ALPHA


def test_planted_wrong_residual_is_caught(pair, monkeypatch):
    monkeypatch.setattr(acc, "residual_weights", lambda p, q: p.clone())
    tokens, _ = sample_tokens(pair)
    assert min(check(pair, tokens)) < ALPHA
