"""Real weights, bitwise: SmolLM2-135M bf16 speculative output equals target-only output token for token.

No tie-margin allowance: with the batch-invariant engine a verify row's logits are bitwise those of a one-row decode,
so greedy speculation is exactly lossless, and seeded speculation in coupled mode reproduces plain seeded decoding.
Every configuration batches all its prompts into one generator run, so batching is exercised too.
"""
import pytest

from specdec.bench.prompts import CHAT, load_prompts
from specdec.draft import make_drafter
from specdec.engine.engine import Engine
from specdec.generate import Request, generate
from specdec.speculative.accept import Mode
from specdec.speculative.generator import GenRequest, SpeculativeGenerator
from specdec.speculative.propose import Drafter, Proposal
from specdec.speculative.sampling import SamplingParams

pytestmark = pytest.mark.slow

# Sized for CI on a 2-core CPU whose bf16 rows cost ~18 ms each (a multi-row verify costs its rows there):
# 2 chat + 2 code prompts x 48 tokens per configuration.
TOKENS = 48
SEEDED = {"T0.8-top_p0.95": SamplingParams(temperature=0.8, top_p=0.95, seed=7),
          "T1.0": SamplingParams(temperature=1.0, seed=1234)}


@pytest.fixture(scope="module")
def prompts(smollm2):
    chat = [smollm2.tokenizer.chat([{"role": "user", "content": q}]) for q in CHAT[:2]]
    code = [smollm2.tokenizer.encode(p["prompt"]) for p in load_prompts("humaneval", 2)]
    return chat + code


@pytest.fixture(scope="module")
def drafters(smollm2):
    return {"ngram": make_drafter("ngram"),
            "layer-skip": make_drafter("layer-skip", smollm2.model, skip="0-11,18-29", kv_tokens=32768)}


@pytest.fixture(scope="module")
def greedy_ref(smollm2, prompts):
    """Target-only greedy decoding, each prompt alone (batch of one): the definition of the output."""
    e = Engine(smollm2.model, kv_tokens=4096)
    return [generate(e, [Request(p, SamplingParams(), TOKENS)])[0].tokens for p in prompts]


def run(smollm2, drafter, reqs, **kw):
    return SpeculativeGenerator(Engine(smollm2.model, kv_tokens=32768), drafter, **kw).generate(reqs)


# Every pair of (drafter, gamma, layout) values appears once: 6 runs instead of the 12 of the full product, which
# cost a third of `make test` on an AVX2 machine (bf16 without hardware support). The layouts themselves are
# compared row by row at the forward level in tests/test_batch_invariance.py.
PAIRWISE = [("ngram", 1, "compact"), ("ngram", 4, "padded"), ("ngram", 8, "padded"),
            ("layer-skip", 1, "padded"), ("layer-skip", 4, "compact"), ("layer-skip", 8, "compact")]


@pytest.mark.parametrize("drafter,gamma,layout", PAIRWISE)
def test_greedy_speculative_equals_target_only(smollm2, prompts, drafters, greedy_ref, drafter, gamma, layout):
    outs = run(smollm2, drafters[drafter], [GenRequest(p, SamplingParams(), TOKENS) for p in prompts],
               gamma=gamma, layout=layout)
    for i, (o, ref) in enumerate(zip(outs, greedy_ref)):
        first = next((k for k, (a, b) in enumerate(zip(o.tokens, ref)) if a != b), None)
        assert o.tokens == ref, f"prompt {i}: first difference at output token {first}"
    assert sum(o.stats.accepted for o in outs) > 0          # it really speculated


@pytest.fixture(scope="module")
def seeded_ref(smollm2, prompts):
    """Plain seeded decoding (specdec.generate), four prompts, each sampling config."""
    e = Engine(smollm2.model, kv_tokens=4096)
    return {k: [generate(e, [Request(p, sp, TOKENS)])[0].tokens for p in prompts] for k, sp in SEEDED.items()}


@pytest.mark.parametrize("sampling", list(SEEDED))
@pytest.mark.parametrize("drafter", ["ngram", "layer-skip"])
def test_coupled_equals_plain_seeded_decoding(smollm2, prompts, drafters, seeded_ref, drafter, sampling):
    outs = run(smollm2, drafters[drafter], [GenRequest(p, SEEDED[sampling], TOKENS) for p in prompts],
               gamma=4, mode=Mode.COUPLED)
    assert [o.tokens for o in outs] == seeded_ref[sampling]
    assert sum(o.stats.accepted for o in outs) > 0


class ProposesNothing(Drafter):
    """A drafter that is up but never has a draft (an n-gram drafter without a match, everywhere)."""
    vocab_size = None

    def propose(self, items):
        return [Proposal(it.context[-1] if it.context else it.new_tokens[-1], [], []) for it in items]

    def release(self, sid):
        pass


@pytest.mark.parametrize("sampling", list(SEEDED))
@pytest.mark.parametrize("how", ["speculation off", "rejection, nothing proposed", "coupled, nothing proposed"])
def test_steps_without_drafts_are_plain_seeded_decoding(smollm2, prompts, seeded_ref, how, sampling):
    """One seeded sampler: a token no accepted draft decided is drawn exactly as plain decoding draws it."""
    reqs = [GenRequest(p, SEEDED[sampling], TOKENS) for p in prompts]
    if how == "speculation off":
        outs = run(smollm2, None, reqs, gamma=4)
    else:
        outs = run(smollm2, ProposesNothing(), reqs, gamma=4,
                   mode=Mode.REJECTION if how.startswith("rejection") else Mode.COUPLED)
    assert [o.tokens for o in outs] == seeded_ref[sampling]


def test_trained_block_drafter_is_exact(smollm2, prompts, greedy_ref, seeded_ref):
    """The shipped trained drafter (specdec/draft/checkpoints/smollm2-135m): greedy output is target-only output and
    coupled output is plain seeded decoding, bitwise, and it drafts tokens that are accepted."""
    d = make_drafter("block", smollm2.model)
    try:
        outs = run(smollm2, d, [GenRequest(p, SamplingParams(), TOKENS) for p in prompts], gamma=6)
        assert [o.tokens for o in outs] == greedy_ref
        assert sum(o.stats.accepted for o in outs) > 0
        outs = run(smollm2, d, [GenRequest(p, SEEDED["T1.0"], TOKENS) for p in prompts], gamma=4, mode=Mode.COUPLED)
        assert [o.tokens for o in outs] == seeded_ref["T1.0"]
    finally:
        d.close()


def test_the_targets_own_w4a8_copy_drafts_exactly(smollm2, prompts, greedy_ref, seeded_ref):
    """SmolLM2 on the int8-activation kernel (w4a8: the file's own 4-bit codes, which the bf16 target holds
    dequantised) as the bf16 target's drafter: greedy output is target-only output and coupled output plain seeded
    decoding, bitwise, and since the two differ only in rounding, most of its drafts are accepted."""
    d = make_drafter("smollm2-135m", quant="w4a8", kv_tokens=32768)
    outs = run(smollm2, d, [GenRequest(p, SamplingParams(), TOKENS) for p in prompts], gamma=4)
    assert [o.tokens for o in outs] == greedy_ref
    drafted, accepted = sum(o.stats.drafted for o in outs), sum(o.stats.accepted for o in outs)
    assert accepted > 0.8 * drafted, (accepted, drafted)
    outs = run(smollm2, d, [GenRequest(p, SEEDED["T1.0"], TOKENS) for p in prompts], gamma=4, mode=Mode.COUPLED)
    assert [o.tokens for o in outs] == seeded_ref["T1.0"]


def test_shipped_corpus_drafts_exactly(smollm2, prompts, greedy_ref, seeded_ref):
    """The corpus shipped beside the trained drafter (the target's own text from its training data): alone and as
    block+ngram+corpus, greedy output is target-only output and coupled output plain seeded decoding, bitwise; its
    blocks are copied (one-hot q) and some are accepted."""
    corpus = make_drafter("corpus", smollm2.model)
    outs = run(smollm2, corpus, [GenRequest(p, SamplingParams(), TOKENS) for p in prompts], gamma=6)
    assert [o.tokens for o in outs] == greedy_ref
    assert sum(o.stats.accepted for o in outs) > 0
    outs = run(smollm2, corpus, [GenRequest(p, SEEDED["T1.0"], TOKENS) for p in prompts], gamma=4, mode=Mode.COUPLED)
    assert [o.tokens for o in outs] == seeded_ref["T1.0"]
    d = make_drafter("block+ngram+corpus", smollm2.model)
    try:
        outs = run(smollm2, d, [GenRequest(p, SamplingParams(), TOKENS) for p in prompts], gamma=6)
        assert [o.tokens for o in outs] == greedy_ref
    finally:
        d.close()
