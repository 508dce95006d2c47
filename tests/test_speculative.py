"""The speculative loop on float64 tiny models: exact against target-only decoding, whatever the drafter, gamma,
layout or batch."""
import io
import json

import pytest

from specdec.draft import make_drafter
from specdec.draft.corpus import Corpus, CorpusDrafter
from specdec.draft.hybrid import HybridDrafter
from specdec.draft.model import ModelDrafter, restrict_vocab
from specdec.draft.ngram import NgramDrafter
from specdec.engine.engine import Engine
from specdec.engine.registry import load
from specdec.generate import Request, generate
from specdec.speculative.generator import GenRequest, SpeculativeGenerator
from specdec.speculative.propose import Drafter, Proposal
from specdec.speculative.sampling import SamplingParams

from .conftest import random_prompt

PAIRS = [("tiny-llama", "tiny-llama-draft"), ("tiny-qwen2", "tiny-qwen2-draft")]


@pytest.fixture(scope="module")
def models():
    return {n: load(n).model for pair in PAIRS for n in pair}


def own_corpus(target):
    """The target's own greedy text on some test prompts, cut short: a corpus whose blocks are often right."""
    prompts = prompts_for(target)[1:4]
    docs = [p + out for p, out in zip(prompts, target_only(target, prompts, SamplingParams(), 12))]
    return Corpus([t for d in docs for t in d], [len(d) for d in docs])


def drafters(target, draft):
    corpus = own_corpus(target)
    return {"model": ModelDrafter(draft, kv_tokens=4096), "ngram": make_drafter("ngram"),
            "corpus": CorpusDrafter(corpus),
            "model+ngram+corpus": HybridDrafter(ModelDrafter(draft, kv_tokens=4096),
                                                lookups=[NgramDrafter(3, 2), CorpusDrafter(corpus)]),
            "model-first-64-ids": ModelDrafter(restrict_vocab(draft, 64), kv_tokens=4096),
            "model-min-conf": ModelDrafter(draft, kv_tokens=4096, min_conf=0.3),
            "model+ngram": HybridDrafter(ModelDrafter(draft, kv_tokens=4096)),
            "layer-skip": make_drafter("layer-skip", target, skip="0,1")}


def prompts_for(model, n=6):
    V = model.cfg.vocab_size
    # varied lengths, incl. a single token and a repetitive prompt that the n-gram drafter can exploit
    ps = [random_prompt(V, k, seed=k) for k in (1, 4, 9, 17, 30)][:n]
    return ps + [random_prompt(V, 5, seed=99) * 4]


def target_only(model, prompts, params, max_tokens, stop_ids=frozenset()):
    return [o.tokens for o in generate(Engine(model), [Request(p, params, max_tokens, stop_ids) for p in prompts])]


def speculative(model, drafter, prompts, params, max_tokens, **kw):
    gen = SpeculativeGenerator(Engine(model, kv_tokens=8192, page_size=8), drafter, **kw)
    return gen.generate([GenRequest(p, params, max_tokens) for p in prompts]), gen


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p[0])
def test_greedy_lossless(models, pair):
    target, draft = models[pair[0]], models[pair[1]]
    prompts = prompts_for(target)
    ref = target_only(target, prompts, SamplingParams(), 24)
    for i, (name, drafter) in enumerate(drafters(target, draft).items()):
        for gamma in range(1, 9):      # every drafter at every gamma; the layout alternates, so each drafter and
            layout = ("compact", "padded")[(i + gamma) % 2]         # each gamma meets both (half the full product)
            outs, gen = speculative(target, drafter, prompts, SamplingParams(), 24, gamma=gamma, layout=layout)
            assert [o.tokens for o in outs] == ref, (name, gamma, layout)
    # the pair really speculates: drafts are accepted and steps emit several tokens
    outs, _ = speculative(target, ModelDrafter(draft), prompts, SamplingParams(), 24, gamma=4)
    assert 0.2 < sum(o.stats.accepted for o in outs) / sum(o.stats.drafted for o in outs) < 0.95
    # and the corpus's copies of the target's own text are accepted (a corpus drafting off by one token: none are)
    outs, _ = speculative(target, CorpusDrafter(own_corpus(target)), prompts, SamplingParams(), 24, gamma=4)
    assert sum(o.stats.accepted for o in outs) > sum(o.stats.drafted for o in outs) / 2


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p[0])
def test_coupled_equals_target_only_seeded(models, pair):
    target, draft = models[pair[0]], models[pair[1]]
    prompts = prompts_for(target)
    for j, params in enumerate((SamplingParams(temperature=0.8, seed=5),
                                SamplingParams(temperature=1.3, top_k=20, top_p=0.9, min_p=0.02, seed=77))):
        ref = target_only(target, prompts, params, 20)
        for i, (name, drafter) in enumerate(drafters(target, draft).items()):
            # every drafter at every gamma and both layouts, under one of the two samplings in turn
            for gamma in [g for k, g in enumerate((1, 2, 3, 5, 8)) if (i + j + k) % 2 == 0]:
                outs, _ = speculative(target, drafter, prompts, params, 20, gamma=gamma, mode="coupled",
                                      layout="padded" if gamma % 2 else "compact")
                assert [o.tokens for o in outs] == ref, (name, gamma, j)


def test_seeded_rejection_deterministic_across_batch_and_layout(models):
    target, draft = models["tiny-llama"], models["tiny-llama-draft"]
    V = target.cfg.vocab_size
    mine = random_prompt(V, 6, seed=1)
    others = [random_prompt(V, k, seed=50 + k) for k in range(2, 9)]          # 7 other requests
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=2024)
    q = SamplingParams(temperature=0.7, seed=3)
    runs = []
    for batch in ([mine], [mine] + others, others[:3] + [mine] + others[3:]):
        for layout in ("compact", "padded"):
            gen = SpeculativeGenerator(Engine(target), ModelDrafter(draft), gamma=4, mode="rejection", layout=layout)
            outs = gen.generate([GenRequest(x, p if x is mine else q, 24) for x in batch])
            runs.append(next(o.tokens for o, x in zip(outs, batch) if x is mine))
    assert all(r == runs[0] for r in runs)
    other_seed = SpeculativeGenerator(Engine(target), ModelDrafter(draft), gamma=4).generate(
        [GenRequest(mine, SamplingParams(temperature=1.0, top_p=0.95, seed=2025), 24)])[0].tokens
    assert other_seed != runs[0]


def test_compact_runs_only_verified_rows(models):
    target, draft = models["tiny-llama"], models["tiny-llama-draft"]
    prompts = prompts_for(target)
    for layout in ("compact", "padded"):
        outs, gen = speculative(target, ModelDrafter(draft), prompts, SamplingParams(), 12, gamma=4, layout=layout)
        for info in gen.steps:
            expect = sum(info.verify_len) if layout == "compact" else 5 * len(info.verify_len)
            assert info.rows == expect
        assert any(len(set(info.verify_len)) > 1 for info in gen.steps) or layout == "padded"


class Broken(Drafter):
    def __init__(self, inner, fail_every):
        self.inner, self.fail_every, self.calls = inner, fail_every, 0

    def propose(self, items):
        self.calls += 1
        if self.calls % self.fail_every == 0:
            raise ConnectionError("draft down")
        return self.inner.propose(items)

    def release(self, sid):
        self.inner.release(sid)


def test_drafter_failure_falls_back_to_plain_decoding(models):
    target, draft = models["tiny-llama"], models["tiny-llama-draft"]
    prompts = prompts_for(target)
    ref = target_only(target, prompts, SamplingParams(), 20)
    outs, gen = speculative(target, Broken(ModelDrafter(draft), 2), prompts, SamplingParams(), 20, gamma=3)
    assert [o.tokens for o in outs] == ref
    assert any(not i.draft_ok for i in gen.steps) and any(i.draft_ok for i in gen.steps)
    assert all(o.stats.fallback_steps > 0 for o in outs)


class NoDrafts(Drafter):
    """Answers every item with an empty block, q None: an n-gram drafter without a match, as the wire delivers it."""

    def propose(self, items):
        return [Proposal(it.context[-1], [], []) for it in items]

    def release(self, sid):
        pass


class WireLike(Drafter):
    """An inner drafter's answers as they come off the wire: an empty block loses its (empty) q, and with
    drop_q=True every q is lost (a drafter that sends none)."""

    def __init__(self, inner, drop_q=False):
        self.inner, self.drop_q = inner, drop_q

    def propose(self, items):
        return [p if p is None else Proposal(p.anchor, p.tokens, p.confidence,
                                             None if self.drop_q or not p.tokens else p.q)
                for p in self.inner.propose(items)]

    def release(self, sid):
        self.inner.release(sid)


@pytest.mark.parametrize("mode", ["rejection", "coupled"])
def test_steps_without_drafts_are_plain_seeded_decoding(models, mode):
    """No drafter, a drafter that is always down, empty proposals, drafts whose q is missing (rejection drops them):
    every one of these runs is plain seeded decoding, token for token, in every mode."""
    target, draft = models["tiny-llama"], models["tiny-llama-draft"]
    prompts = prompts_for(target)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=31)
    ref = target_only(target, prompts, params, 20)
    runs = {"none": None, "down": Broken(ModelDrafter(draft), 1), "empty": NoDrafts()}
    if mode == "rejection":
        runs["q missing"] = WireLike(ModelDrafter(draft), drop_q=True)
    for name, drafter in runs.items():
        outs, _ = speculative(target, drafter, prompts, params, 20, gamma=3, mode=mode)
        assert [o.tokens for o in outs] == ref, name
        assert all(o.stats.drafted == 0 for o in outs), name


def test_rejection_batch_with_empty_wire_proposals(models):
    """The bug behind 500s on concurrent seeded requests: in rejection mode, a batch where some requests' n-gram
    proposals are empty (q None off the wire) and others carry drafts. It must run, and each request's output must be
    what it gets alone (its proposals depend on its own context only)."""
    target = models["tiny-llama"]
    V = target.cfg.vocab_size
    prompts = [random_prompt(V, 5, seed=70 + k) for k in range(4)] + [random_prompt(V, 4, seed=90) * 3] * 2
    reqs = [GenRequest(p, SamplingParams(temperature=0.8, top_p=0.95, seed=100 + k), 24, mode="rejection")
            for k, p in enumerate(prompts)]
    gen = SpeculativeGenerator(Engine(target), WireLike(make_drafter("ngram")), gamma=4)
    batched = gen.generate(reqs)
    mixed = [info for info in gen.steps if 1 in info.verify_len and max(info.verify_len) > 1]
    assert mixed, "no step mixed empty and non-empty proposals"
    assert sum(o.stats.drafted for o in batched) > 0
    for r, o in zip(reqs, batched):
        alone = SpeculativeGenerator(Engine(target), WireLike(make_drafter("ngram")), gamma=4).generate([r])[0]
        assert alone.tokens == o.tokens


def test_drafter_evicts_lru_sessions_and_rebuilds(models):
    target, draft = models["tiny-llama"], models["tiny-llama-draft"]
    prompts = [random_prompt(target.cfg.vocab_size, 40, seed=i) for i in range(6)]
    ref = target_only(target, prompts, SamplingParams(), 16)
    small = ModelDrafter(draft, kv_tokens=160)      # room for ~2 sessions: the others get evicted and rebuilt
    gen = SpeculativeGenerator(Engine(target), small, gamma=3)
    outs = []
    for p in prompts:                               # sequential requests leave idle sessions behind
        outs += gen.generate([GenRequest(p, SamplingParams(), 16)])
    assert [o.tokens for o in outs] == ref
    both = gen.generate([GenRequest(p, SamplingParams(), 16) for p in prompts[:3]])
    assert [o.tokens for o in both] == ref[:3]


def test_stop_ids_and_max_tokens(models):
    target, draft = models["tiny-llama"], models["tiny-llama-draft"]
    prompts = prompts_for(target)
    free = target_only(target, prompts, SamplingParams(), 30)
    stop = frozenset({free[2][7]})                  # a token that occurs mid-output
    ref = [o for o in generate(Engine(target), [Request(p, SamplingParams(), 30, stop) for p in prompts])]
    gen = SpeculativeGenerator(Engine(target), ModelDrafter(draft), gamma=6)
    outs = gen.generate([GenRequest(p, SamplingParams(), 30, stop_ids=stop) for p in prompts])
    assert [o.tokens for o in outs] == [r.tokens for r in ref]
    assert [o.finish_reason for o in outs] == [r.finish_reason for r in ref]
    assert outs[2].finish_reason == "stop" and outs[2].tokens[-1] in stop
    assert all(len(o.tokens) <= 30 for o in outs)


def test_stop_strings_cut_the_text(models):
    lm = load("tiny-llama")
    prompt = lm.tokenizer.encode("hello")
    gen = SpeculativeGenerator(Engine(lm.model), ModelDrafter(models["tiny-llama-draft"]), gamma=4,
                               tokenizer=lm.tokenizer)
    full = gen.generate([GenRequest(prompt, max_tokens=30)])[0].text
    stop = full[10:12]
    out = gen.generate([GenRequest(prompt, max_tokens=30, stop=(stop,))])[0]
    assert out.finish_reason == "stop" and out.text == full[:full.find(stop)]


def test_trace_and_stats(models):
    target, draft = models["tiny-llama"], models["tiny-llama-draft"]
    buf = io.StringIO()
    gen = SpeculativeGenerator(Engine(target), ModelDrafter(draft), gamma=4, trace=buf)
    outs = gen.generate([GenRequest(p, SamplingParams(temperature=0.9, seed=i), 16) for i, p in
                         enumerate(prompts_for(target)[:3])])
    recs = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert len(recs) == sum(o.stats.steps for o in outs)
    assert {"step", "request", "verify_len", "layout_rows", "accepted", "mode", "seeded", "draft_ms",
            "verify_ms"} <= set(recs[0])
    for o in outs:
        mine = [r for r in recs if r["request"] == o.rid]
        assert sum(r["accepted"] for r in mine) == o.stats.accepted
        assert sum(r["emitted"] for r in mine) == len(o.tokens)
        assert sum(o.stats.accepted_per_pos) == o.stats.accepted
        assert o.stats.drafted == sum(r["verify_len"] - 1 for r in mine)
        assert all(r["mode"] == "coupled" and r["seeded"] for r in mine)     # the default for sampled requests


def test_loop_with_runtime_reference_check(models, monkeypatch):
    """SPECDEC_CHECK_ACCEPT=1 makes every accept() also run the slow reference and assert equality."""
    monkeypatch.setenv("SPECDEC_CHECK_ACCEPT", "1")
    target, draft = models["tiny-qwen2"], models["tiny-qwen2-draft"]
    prompts = prompts_for(target)
    mixed = [GenRequest(p, SamplingParams() if i % 3 == 0 else SamplingParams(temperature=0.9, seed=i), 16,
                        mode="coupled" if i % 3 == 1 else "rejection") for i, p in enumerate(prompts)]
    outs = SpeculativeGenerator(Engine(target), ModelDrafter(draft), gamma=5).generate(mixed)
    assert [o.mode.value for o in outs][:3] == ["greedy", "coupled", "rejection"]


def test_cli_speculative(tmp_path):
    import subprocess
    import sys
    trace = tmp_path / "t.jsonl"
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", "tiny-llama", "--draft",
                        "tiny-llama-draft", "--gamma", "3", "--prompt", "hello", "--max-tokens", "20",
                        "--temperature", "0.8", "--seed", "3", "--trace", str(trace)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "AL " in r.stderr and "AR " in r.stderr and "seed 3" in r.stderr and "tokens/s" in r.stderr
    recs = [json.loads(x) for x in trace.read_text().splitlines()]
    assert recs and all(x["mode"] == "coupled" and x["seeded"] for x in recs)
    assert sum(x["emitted"] for x in recs) == 20
