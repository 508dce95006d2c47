"""Real weights: SmolLM2-135M with its layer-skip draft (layers 0-11 + 18-29).

Greedy speculative output is not asserted equal to target-only output in bf16: a multi-row verify and a one-row
decode round differently, and a near-tie can flip (measured: 7 of 12 chat prompts diverge within 48 tokens, always
at a target logit margin <= 0.125, one bf16 ulp at |logit| in [16, 32)). What is asserted: wherever the two differ
first, the target itself was at a near-tie there (margin <= 0.25 in bf16, <= 1e-3 in fp32). A logic error — a wrong
token accepted, a KV rollback off by one — shows up as a clear margin and fails this test.
"""
import pytest

from specdec.draft import make_drafter
from specdec.engine.engine import Engine
from specdec.engine.registry import load
from specdec.spec.generator import GenRequest, SpeculativeGenerator
from specdec.spec.sampling import SamplingParams

QUESTIONS = ["Write a Python function that reverses a string.", "What causes the seasons on Earth?",
             "Explain what a hash table is in two sentences.", "Write a SQL query that counts orders per customer."]


@pytest.mark.slow
@pytest.mark.parametrize("dtype,bound", [("bf16", 0.25), ("fp32", 1e-3)])
def test_greedy_divergence_only_at_near_ties(dtype, bound):
    lm = load("smollm2-135m", dtype)
    prompts = [lm.tokenizer.chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    reqs = [GenRequest(p, SamplingParams(), 32) for p in prompts]
    ref = SpeculativeGenerator(Engine(lm.model), None).generate(reqs)
    outs = SpeculativeGenerator(Engine(lm.model), make_drafter("layer-skip", lm.model, skip="0-11,18-29"),
                                gamma=4).generate(reqs)
    assert sum(o.stats.accepted for o in outs) / sum(o.stats.drafted for o in outs) > 0.15   # it speculates
    e = Engine(lm.model)
    for p, o, r in zip(prompts, outs, ref):
        k = next((i for i, (a, b) in enumerate(zip(o.tokens, r.tokens)) if a != b), None)
        if k is None:
            assert o.tokens == r.tokens
            continue
        logits = e.score(p + r.tokens[:k])[-1]
        assert abs(float(logits[r.tokens[k]] - logits[o.tokens[k]])) <= bound, (k, dtype)
