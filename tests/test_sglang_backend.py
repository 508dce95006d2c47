"""The sglang verify backend against a real HTTP scorer built from our own engine (tests/sglang_fake.py): speculative
greedy and coupled output through top-K rows equals plain decoding of the scorer's whole rows, token for token, with
re-asks (larger K) counted when the top-K does not certify a row; rejection refused; outages retryable."""
from __future__ import annotations

import random
import signal
import time

import httpx
import pytest
import torch

from specdec.engine.sglang_backend import CAPS, BackendUnavailable, SGLangBackend
from specdec.errors import InvalidRequest, SpecdecError
from specdec.speculative import sampling
from specdec.speculative.accept import Mode
from specdec.speculative.propose import Drafter, Proposal
from specdec.speculative.sampling import SamplingParams
from specdec.speculative.step import SpecRequest, speculative_step
from specdec.speculative.validation import validate_request
from tests.sglang_fake import FakeScorer


@pytest.fixture(scope="module")
def scorer():
    s = FakeScorer("tiny-llama")
    yield s
    s.close()


def plain(scorer: FakeScorer, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    """Plain decoding from the scorer's whole rows: the reference."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(sampling.next_token(scorer.logprob_rows(ids)[-1], params, len(ids)))
    return ids[len(prompt):]


class OracleDrafter(Drafter):
    """Proposes the reference continuation with a wrong token now and then: exercises accepts, mismatches and
    bonus rows at every depth."""
    name = "oracle"

    def __init__(self, refs: dict[str, list[int]], prompts: dict[str, list[int]], seed: int = 0):
        self.refs, self.prompts, self.rng = refs, prompts, random.Random(seed)

    def propose(self, items):
        out = []
        for it in items:
            done = it.committed_len - len(self.prompts[it.sid])
            toks = self.refs[it.sid][done:done + it.gamma]
            if toks and self.rng.random() < 0.5:
                j = self.rng.randrange(len(toks))
                toks = toks[:j] + [(toks[j] + 1) % 96] + toks[j + 1:]
            out.append(Proposal(it.context[-1] if it.context else 0, toks, [1.0] * len(toks)))
        return out

    def release(self, sids):
        pass


def run(backend, drafter, reqs: list[SpecRequest]) -> None:
    for r in reqs:
        r.seq = backend.new_sequence()
        backend.prefill([r.seq], [r.committed[:-1]])
    while live := [r for r in reqs if not r.finish_reason]:
        speculative_step(backend, drafter, live)


# K = 3 of 96 rarely certifies a sampled token (re-asks), K = 20 mostly does; each filter under one of the two.
@pytest.mark.parametrize("params,k", [(SamplingParams(), 3), (SamplingParams(temperature=1.0, seed=7), 3),
                                      (SamplingParams(temperature=0.7, seed=11, top_k=5), 20),
                                      (SamplingParams(temperature=1.0, seed=3, top_p=0.9), 3),
                                      (SamplingParams(temperature=0.8, seed=5, min_p=0.05), 20)],
                         ids=["greedy-K3", "T1-K3", "T0.7-topk5-K20", "T1-topp0.9-K3", "T0.8-minp-K20"])
def test_speculative_equals_plain_decoding(scorer, params, k):
    prompts = {f"r{i}": [1 + (7 * i + j) % 90 for j in range(5 + i)] for i in range(3)}
    n = 8
    refs = {rid: plain(scorer, p, params, n) for rid, p in prompts.items()}
    be = SGLangBackend(scorer.url, scorer.lm.cfg, k=k)
    mode = Mode.GREEDY if params.greedy else Mode.COUPLED
    reqs = [SpecRequest(rid, p, params, n, mode, gamma=3) for rid, p in prompts.items()]
    run(be, OracleDrafter(refs, prompts), reqs)
    for r in reqs:
        assert r.output == refs[r.rid], r.rid
    assert sum(r.stats.accepted for r in reqs) > 0
    st = be.stats
    assert st.rows == st.decided + st.fallback_rows
    if k == 3 and not params.greedy and not params.top_k:
        assert st.fallback_rows > 0            # K = 3 of 96 rarely certifies a sampled token: re-asks happened
    be.close()


def test_whole_row_reask_counts_and_batches(scorer):
    """K = 1 never certifies a sampled row: every row is asked again (8, then the whole vocabulary); one call per
    escalation for the whole batch, not per request."""
    params = SamplingParams(temperature=1.0, seed=1)
    prompts = {"a": [5, 6, 7], "b": [9, 10, 11, 12]}
    refs = {rid: plain(scorer, p, params, 4) for rid, p in prompts.items()}
    be = SGLangBackend(scorer.url, scorer.lm.cfg, k=1)
    reqs = [SpecRequest(rid, p, params, 4, Mode.COUPLED, gamma=2) for rid, p in prompts.items()]
    run(be, None, reqs)
    assert [r.output for r in reqs] == [refs["a"], refs["b"]]
    assert be.stats.decided == 0 and be.stats.fallback_rows == be.stats.rows > 0
    assert be.stats.calls <= 4 * 3              # per step: K=1, K=8, K=96 at most


def test_rejection_refused_by_capabilities(scorer):
    with pytest.raises(InvalidRequest) as e:
        validate_request([1, 2], SamplingParams(temperature=1.0, seed=1), 4, 2, "rejection", CAPS, 96, 512)
    assert e.value.field == "acceptance" and "sglang" in str(e.value)
    validate_request([1, 2], SamplingParams(temperature=1.0, seed=1), 4, 2, "coupled", CAPS, 96, 512)


def test_outage_is_retryable_and_resume_is_identical(scorer):
    params = SamplingParams(temperature=1.0, seed=9)
    prompt = [3, 4, 5, 6]
    ref = plain(scorer, prompt, params, 8)
    be = SGLangBackend(scorer.url, scorer.lm.cfg, k=8, retries=1, backoff_s=0.01)
    r = SpecRequest("x", prompt, params, 8, Mode.COUPLED, gamma=2)
    r.seq = be.new_sequence()
    be.prefill([r.seq], [prompt[:-1]])
    speculative_step(be, None, [r])
    scorer.down = True
    try:
        out_before = list(r.output)
        with pytest.raises(BackendUnavailable):
            speculative_step(be, None, [r])
        assert r.output == out_before          # nothing emitted by the failed step
        assert not be.reachable(max_age_s=0)
        assert be.stats.retries >= 1
    finally:
        scorer.down = False
    assert be.reachable(max_age_s=0)
    be.truncate(r.seq, r.committed_len - 1)    # what the scheduler's undo does
    while not r.finish_reason:
        speculative_step(be, None, [r])
    assert r.output == ref


def test_start_checks(scorer):
    be = SGLangBackend(scorer.url, scorer.lm.cfg)
    assert be.check(scorer.lm.tokenizer)["model_path"] == "tiny-llama"
    dead = SGLangBackend("http://127.0.0.1:9", scorer.lm.cfg, timeout_s=1)
    with pytest.raises(SpecdecError, match="no SGLang server answers"):
        dead.check()


def test_topk_rows_match_scorer(scorer):
    """The rows the backend parses are the scorer's rows (field layout: anchor entry empty, bonus in output)."""
    be = SGLangBackend(scorer.url, scorer.lm.cfg)
    from specdec.engine.sglang_backend import Row
    seq = be.new_sequence()
    be.prefill([seq], [[1, 2, 3]])
    row = Row(seq, 3, 4, [5, 6], SamplingParams())
    be.target_tokens([row])
    lp = scorer.logprob_rows([1, 2, 3, 4, 5, 6])
    (tops,) = be.score([row], 96)
    for j, t in enumerate(tops):
        assert torch.equal(t.dense(), lp[3 + j])


# -- the top-K acceptance against full-logit acceptance, on real rows (SmolLM2) --------------------------------------
TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village by the sea,")


@pytest.mark.slow
def test_topk_acceptance_equals_full_logit_acceptance_on_real_rows(smollm2):
    """On SmolLM2's own rows (log-softmax rounded to float32, as a server sends them): for greedy and coupled modes,
    the top-K path (decide per row, then accept_targets) gives exactly what `accept` gives on the whole rows, for
    drafts that match, mismatch, and run to the bonus row. A row the top-K does not certify is decided from the whole
    row, as the backend's re-ask does. Prints the certified fraction per K and temperature."""
    from specdec.engine.engine import Engine
    from specdec.engine.layout import SeqInput
    from specdec.speculative.accept import accept, accept_targets
    from specdec.speculative.topk import TopKRow, decide

    ids = smollm2.tokenizer.encode(TEXT)
    eng = Engine(smollm2.model, kv_tokens=1024)
    seq = eng.new_sequence()
    logits = eng.forward([SeqInput(seq, ids, start=0, logits="all")]).rows(0).double()
    eng.release(seq)
    lp = torch.log_softmax(logits, -1).float().double()        # what a server's float32 log-softmax gives
    n, gamma, V = lp.shape[0], 4, lp.shape[1]
    order = torch.sort(lp, dim=-1, descending=True, stable=True).indices   # what a server sends first (ties: lower id)
    rng = random.Random(0)
    cert = {}
    # (top-p / min-p bounds are covered on many synthetic rows in test_topk.py; their dense sort is slow at V = 49152)
    for params in [SamplingParams(), SamplingParams(temperature=0.7, seed=21), SamplingParams(temperature=1.0, seed=22)]:
        mode = Mode.GREEDY if params.greedy else Mode.COUPLED
        plain_tok = [sampling.next_token(lp[i], params, i + 1) for i in range(n)]
        for K in (8, 20, 64):
            got = [decide(TopKRow(order[i, :K], lp[i, order[i, :K]], V), params, i + 1) for i in range(n)]
            assert all(g is None or g == t for g, t in zip(got, plain_tok)), (params, K)   # never a wrong token
            cert[(params.temperature, params.top_p, K)] = sum(g is not None for g in got) / n
            if K != 8:
                continue
            # the backend's path at K = 8: certified rows from the top-K, the others re-asked as whole rows
            whole = [g if g is not None else plain_tok[i] for i, g in enumerate(got)]   # decide(whole) = next_token
            for a in range(0, n - gamma - 1, 6):                # a: the anchor's position; rows a .. a + gamma
                drafts = [plain_tok[a + j] for j in range(gamma)]
                if rng.random() < 0.6:                          # a wrong draft somewhere (or none: the bonus row)
                    j = rng.randrange(gamma)
                    drafts[j] = (drafts[j] + 1 + rng.randrange(100)) % V
                p = sampling.probs(lp[a:a + gamma + 1], params)
                full = accept(p, None, torch.tensor(drafts), torch.tensor([0, gamma + 1]), [mode], [params.seed],
                              [a + 1])
                top = accept_targets([whole[a:a + gamma + 1]], [drafts])
                assert top.tokens == full.tokens and top.num_accepted.tolist() == full.num_accepted.tolist(), \
                    (params, K, a)
    print("\ncertified fraction (SmolLM2 rows; T, top_p, K):",
          ", ".join(f"T{t} p{p} K{k}: {v:.2f}" for (t, p, k), v in cert.items()))
    assert cert[(0.0, 1.0, 8)] > 0.9                          # greedy: only exact ties at the K-th decline


def test_server_flags_refused_with_remedy():
    import argparse

    from specdec.engine.sglang_backend import open_sglang_for_server
    base = dict(sglang_url="http://127.0.0.1:9", tp=1, acceptance="coupled", sglang_top_k=20, sglang_timeout_s=1,
                model="tiny-llama")
    for bad, field in [({"sglang_url": ""}, "sglang_url"), ({"tp": 2}, "tp"), ({"acceptance": "rejection"}, "acceptance"),
                       ({"sglang_top_k": 0}, "sglang_top_k")]:
        with pytest.raises(InvalidRequest) as e:
            open_sglang_for_server(argparse.Namespace(**{**base, **bad}))
        assert e.value.field == field


def test_target_server_on_sglang_backend(scorer, tmp_path):
    """The real target process with --backend sglang on the scorer: the openai client gets plain decoding's text,
    rejection is refused naming the field, /health is 503 while the scorer is down and 200 when it is back, and the
    scoring counters are on /metrics."""
    from openai import BadRequestError, OpenAI

    from tests.stack import Target
    t = Target(tmp_path, model="tiny-llama", extra=["--backend", "sglang", "--sglang-url", scorer.url]).up(120)
    try:
        oc = OpenAI(base_url=t.url + "/v1", api_key="x", max_retries=0, timeout=120)
        prompt = [4, 8, 15, 16, 23]
        params = SamplingParams(temperature=0.9, seed=42)
        r = oc.completions.create(model="tiny-llama", prompt=prompt, max_tokens=6, temperature=0.9, seed=42)
        assert r.choices[0].text == scorer.lm.tokenizer.decode(plain(scorer, prompt, params, 6))
        with pytest.raises(BadRequestError, match="acceptance"):
            oc.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2, temperature=0.9,
                                  extra_body={"speculative": {"acceptance": "rejection"}})
        metrics = httpx.get(t.url + "/metrics").text
        assert "specdec_sglang_calls" in metrics and "specdec_sglang_fallback_rows" in metrics
        scorer.down = True
        try:
            time.sleep(1.1)                               # the backend re-probes at most once a second
            h = httpx.get(t.url + "/health", timeout=30)
            assert h.status_code == 503 and h.json()["backend"] == "down"
        finally:
            scorer.down = False
        time.sleep(1.1)
        assert httpx.get(t.url + "/health", timeout=30).status_code == 200
    finally:
        t.kill(signal.SIGTERM)
