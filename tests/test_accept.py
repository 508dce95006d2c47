"""Acceptance: the vectorised fast path equals the per-slot reference, plus the properties each mode promises."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.speculative import accept as acc
from specdec.speculative import accept_ref, coins, sampling
from specdec.speculative.accept import AcceptOutput, Mode, accept, densify, draft_sample, inverse_cdf, residual_weights
from specdec.speculative.accept_ref import accept_reference

MODES = ["greedy", "rejection", "coupled"]


@pytest.fixture(autouse=True)
def _no_runtime_check(monkeypatch):
    """Compare fast and reference explicitly here; the debug switch has its own tests."""
    monkeypatch.setattr(acc, "CHECK_AGAINST_REFERENCE", False)
    monkeypatch.delenv("SPECDEC_CHECK_ACCEPT", raising=False)


# ------------------------------------------------------------------------------------------------------ batch maker

def _dist(rng: np.random.Generator, vocab: int, kind: str) -> np.ndarray:
    if kind == "onehot":
        d = np.zeros(vocab)
        d[rng.integers(vocab)] = 1.0
        return d
    if kind == "uniform":
        return np.full(vocab, 1.0 / vocab)
    d = rng.dirichlet(np.full(vocab, rng.choice([0.1, 1.0])))
    if kind == "sparse":                       # zeros in random places, at least one id kept
        d[rng.random(vocab) < 0.5] = 0.0
        if d.sum() <= 0:
            d[rng.integers(vocab)] = 1.0
        d /= d.sum()
    return d


def make_batch(rng: np.random.Generator, n_req: int, gamma: int, vocab: int, modes: list[str],
               draft_from: str = "mixed") -> dict:
    """A random batch in accept()'s layout. Drafts mostly come from draft_sample (so they are often accepted);
    draft_from="random" makes them arbitrary ids."""
    verify_len = [int(rng.integers(1, gamma + 2)) for _ in range(n_req)]
    seeds = [int(rng.integers(-2**63, 2**63)) if rng.random() < 0.2 else int(rng.integers(0, 2**31))
             for _ in range(n_req)]
    positions = [int(rng.integers(0, 1 << 20)) for _ in range(n_req)]
    p_rows, q_rows, drafts = [], [], []
    for mode, n, seed, pos in zip(modes, verify_len, seeds, positions):
        for j in range(n):
            p = _dist(rng, vocab, rng.choice(["dense", "sparse", "onehot", "uniform"]))
            if mode == "greedy" and rng.random() < 0.8:   # what sampling.probs hands over for greedy requests
                p = np.eye(vocab)[p.argmax()]
            p_rows.append(p)
            if j == n - 1:
                break
            rel = rng.choice(["same", "independent", "mixture", "onehot"])
            q = {"same": p, "independent": _dist(rng, vocab, rng.choice(["dense", "sparse", "uniform"])),
                 "mixture": 0.5 * p + 0.5 * _dist(rng, vocab, "dense"),
                 "onehot": _dist(rng, vocab, "onehot")}[rel]
            q_rows.append(q)
            how = "random" if draft_from == "random" else rng.choice(["sample", "sample", "sample", "argmax_p",
                                                                       "random"])
            if how == "sample":
                drafts.append(draft_sample(torch.from_numpy(q), mode, seed, pos + j))
            elif how == "argmax_p":
                drafts.append(int(p.argmax()))
            else:
                drafts.append(int(rng.integers(vocab)))
    cu = np.concatenate([[0], np.cumsum(verify_len)])
    return dict(p=torch.tensor(np.array(p_rows)), q=torch.tensor(np.array(q_rows)).reshape(-1, vocab),
                draft_tokens=torch.tensor(drafts, dtype=torch.long), cu_rows=torch.tensor(cu, dtype=torch.long),
                modes=list(modes), seeds=seeds, positions=positions)


def check_invariants(b: dict, out: AcceptOutput) -> None:
    cu = b["cu_rows"].tolist()
    for i, toks in enumerate(out.tokens):
        n, a = cu[i + 1] - cu[i], int(out.num_accepted[i])
        d0 = cu[i] - i
        assert 0 <= a <= n - 1 and len(toks) == a + 1
        assert toks[:a] == b["draft_tokens"][d0:d0 + a].tolist()
        for j, t in enumerate(toks):           # every committed token has target mass at the row that decided it
            assert b["p"][cu[i] + j, t] > 0


@st.composite
def batches(draw):
    n_req, gamma, vocab = draw(st.integers(1, 6)), draw(st.integers(1, 8)), draw(st.integers(2, 40))
    modes = draw(st.lists(st.sampled_from(MODES), min_size=n_req, max_size=n_req))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return make_batch(rng, n_req, gamma, vocab, modes, draw(st.sampled_from(["mixed", "random"])))


# ------------------------------------------------------------------------------------------------ fast == reference

@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=batches())
def test_fast_equals_reference(b):
    fast, ref = accept(**b), accept_reference(**b)
    assert fast == ref
    assert fast.num_accepted.dtype == torch.long and fast.num_accepted.shape == (len(b["modes"]),)
    check_invariants(b, fast)
    # No hidden state: each request alone gives what it got inside the batch.
    cu = b["cu_rows"].tolist()
    for i in range(len(b["modes"])):
        lo, hi = cu[i], cu[i + 1]
        one = accept(b["p"][lo:hi], b["q"][lo - i:hi - i - 1], b["draft_tokens"][lo - i:hi - i - 1],
                     torch.tensor([0, hi - lo]), b["modes"][i:i + 1], b["seeds"][i:i + 1], b["positions"][i:i + 1])
        assert one.tokens == [fast.tokens[i]]


@pytest.mark.parametrize("gap", [float("inf"), float("-inf")])
def test_coupled_tie_guard_does_not_change_results(monkeypatch, gap):
    """inf: every coupled row is re-decided by sampling.sample_seeded; -inf: none is. Both must agree, which also
    shows the batched Gumbel noise equals coins.gumbel bit for bit."""
    monkeypatch.setattr(acc, "_TIE_GAP", gap)
    rng = np.random.default_rng(7)
    for vocab in (2, 17, 40, 3000):
        b = make_batch(rng, 6, 8, vocab, ["coupled"] * 6)
        assert accept(**b) == accept_reference(**b)


def test_coupled_hashes_only_the_rows_it_reaches(monkeypatch):
    """The Gumbel hash is the one costly step (a hash per vocabulary id), so coupled rows past a request's first
    mismatch are never evaluated: total work = sum(a_i + 1), as in plain decoding. Rejection requests hash only their
    bonus row, and only when they reach it (one extra batched call)."""
    seen = []
    real = acc._gumbel_argmax
    monkeypatch.setattr(acc, "_gumbel_argmax", lambda p, r, s, x: seen.append(r.numel()) or real(p, r, s, x))
    rng = np.random.default_rng(2)
    for _ in range(10):
        seen.clear()
        b = make_batch(rng, 6, 8, 30, ["coupled", "greedy", "rejection"] * 2)
        out = accept(**b)
        cu = b["cu_rows"].tolist()
        coupled = [i for i, m in enumerate(b["modes"]) if m == "coupled"]
        bonus = [i for i, m in enumerate(b["modes"]) if m == "rejection" and len(out.tokens[i]) == cu[i + 1] - cu[i]]
        assert sum(seen) == sum(len(out.tokens[i]) for i in coupled) + len(bonus)
        assert len(seen) <= 10


def test_coins_many_matches_scalar_coins():
    rng = np.random.default_rng(3)
    seeds = [0, 1, 2**63, 2**64 - 1, -1, -(2**63)] + [int(s) for s in rng.integers(-2**63, 2**63, 30)]
    positions = [0, 1, 2**40, 2**64 - 1] + [int(x) for x in rng.integers(0, 2**62, 32)]
    for stream in coins.Stream:
        for column in (0, 5):
            got = coins.coins_many(coins.as_coords(seeds), coins.as_coords(positions), stream, column)
            want = [coins.coin(s, x, stream, column) for s, x in zip(seeds, positions)]
            assert got.tolist() == want


# ------------------------------------------------------------------------------------------------- mode properties

def test_greedy_all_match_accepts_everything_and_emits_bonus_argmax():
    torch.manual_seed(0)
    verify_len, vocab = [1, 2, 5, 9], 23
    n_rows = sum(verify_len)
    p = sampling.probs(torch.randn(n_rows, vocab), sampling.SamplingParams(temperature=0.0))
    cu = torch.tensor([0, *np.cumsum(verify_len)])
    checking = torch.cat([torch.arange(lo, hi - 1) for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist())])
    drafts = p[checking].argmax(-1)
    b = dict(p=p, q=None, draft_tokens=drafts, cu_rows=cu, modes=["greedy"] * 4, seeds=[None] * 4,
             positions=[10, 20, 30, 40])
    out = accept(**b)
    assert out == accept_reference(**b)
    assert out.num_accepted.tolist() == [n - 1 for n in verify_len]
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        assert out.tokens[i] == p[lo:hi].argmax(-1).tolist()


def test_greedy_emits_argmax_of_first_mismatch():
    p = torch.eye(5, dtype=torch.float64)[[1, 2, 3, 4]]   # rows' argmaxes 1, 2, 3, 4
    out = accept(p, None, torch.tensor([1, 0, 3]), torch.tensor([0, 4]), ["greedy"], [None], [0])
    assert out.num_accepted.tolist() == [1] and out.tokens == [[1, 2]]


@pytest.mark.parametrize("draft_from", ["mixed", "random"])
def test_coupled_equals_plain_seeded_decoding(draft_from):
    """Whatever the drafts, coupled output is the accepted prefix plus the first target sample, and every token is
    what sampling.sample_seeded would have produced at that position without speculation."""
    rng = np.random.default_rng(11)
    for _ in range(20):
        b = make_batch(rng, 5, 8, int(rng.integers(2, 40)), ["coupled"] * 5, draft_from)
        out = accept(**b)
        cu = b["cu_rows"].tolist()
        for i, toks in enumerate(out.tokens):
            plain = [sampling.sample_seeded(b["p"][cu[i] + j], b["seeds"][i], b["positions"][i] + j)
                     for j in range(len(toks))]
            assert toks == plain
            a, d0 = len(toks) - 1, cu[i] - i
            if a < cu[i + 1] - cu[i] - 1:      # stopped early: the draft really disagreed there
                assert int(b["draft_tokens"][d0 + a]) != toks[a]


def test_rejection_identical_p_q_accepts_and_zero_p_rejects():
    """u < 1 so p == q accepts every slot; a draft with p(x) = 0 is always rejected."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]], dtype=torch.float64)
    out = accept(p, p[:2].clone(), torch.tensor([1, 2]), torch.tensor([0, 3]), ["rejection"], [9], [100])
    assert out.num_accepted.tolist() == [2] and out.tokens == [[1, 2, 2]]
    out = accept(p, p[:2].clone(), torch.tensor([2, 2]), torch.tensor([0, 3]), ["rejection"], [9], [100])
    assert out.num_accepted.tolist() == [0] and out.tokens[0][0] in (0, 1)


def test_residual_without_mass_falls_back_to_p():
    """q >= p everywhere (an unnormalised q stands in for rounding): a rejection must then sample p."""
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.6, 0.6, 0.1]], dtype=torch.float64)
    assert torch.equal(residual_weights(p[:1], q), p[:1])
    rejected = 0
    for seed in range(200):
        b = dict(p=p, q=q, draft_tokens=torch.tensor([0]), cu_rows=torch.tensor([0, 2]), modes=["rejection"],
                 seeds=[seed], positions=[5])
        out = accept(**b)
        assert out == accept_reference(**b)
        if out.num_accepted.item() == 0:
            rejected += 1
            assert out.tokens[0][0] in (0, 1)
    assert rejected > 0


def test_inverse_cdf_never_draws_zero_mass_even_at_u_one():
    """coins can return exactly 1.0 (see the report on coins.py); the draw then is the last id with mass."""
    w = torch.tensor([[0.0, 0.2, 0.0, 0.8, 0.0, 0.0]], dtype=torch.float64)
    for u in (1e-300, 0.1, 0.2, 0.5, 1 - 2**-53, 1.0):
        got = int(inverse_cdf(w, torch.tensor([u], dtype=torch.float64))[0])
        assert got in (1, 3) and got == accept_ref._inverse_cdf(w[0].tolist(), u)
    assert int(inverse_cdf(w, torch.tensor([1.0], dtype=torch.float64))[0]) == 3
    with pytest.raises(ValueError):
        inverse_cdf(torch.zeros(1, 3, dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64))


def test_draft_sample_modes():
    rng = np.random.default_rng(5)
    for _ in range(50):
        q = torch.from_numpy(_dist(rng, 30, "sparse"))
        seed, pos = int(rng.integers(0, 2**40)), int(rng.integers(0, 2**20))
        assert draft_sample(q, "greedy", None, pos) == int(q.argmax())
        assert draft_sample(q, Mode.COUPLED, seed, pos) == sampling.sample_seeded(q, seed, pos)
        x = draft_sample(q, "rejection", seed, pos)
        assert q[x] > 0 and x == accept_ref._inverse_cdf(q.tolist(), coins.coin(seed, pos, coins.Stream.DRAFT))


def test_draft_sample_over_a_restricted_vocabulary_is_the_dense_draw():
    """A drafter with a restricted vocabulary samples q over its ids only (no [V] row, no hash per id of the whole
    vocabulary): the token must be the dense row's in every mode, ties and zero-mass ids included."""
    rng = np.random.default_rng(6)
    V = 300
    for trial in range(200):
        ids = torch.from_numpy(np.sort(rng.choice(V, size=int(rng.integers(1, 40)), replace=False)))
        q = torch.from_numpy(_dist(rng, len(ids), ("sparse", "dense", "onehot")[trial % 3]))
        if trial % 7 == 0 and len(ids) > 1:
            q[:] = 1.0 / len(ids)                                 # all tied: the lower id wins, as on the dense row
        dense = densify(ids[None], q[None], V)[0]
        seed, pos = int(rng.integers(0, 2**40)), int(rng.integers(0, 2**20))
        for mode in Mode:
            assert draft_sample(q, mode, seed, pos, ids=ids) == draft_sample(dense, mode, seed, pos), (trial, mode)
        cols = ids[torch.from_numpy(rng.permutation(len(ids)))]
        assert torch.equal(coins.gumbel_at(seed, pos, cols), coins.gumbel(seed, pos, V)[cols])


def test_densify():
    ids, probs = torch.tensor([[3, 1, 0], [2, 2, 0]]), torch.tensor([[0.5, 0.5, 0.0], [0.25, 0.75, 0.0]])
    dense = densify(ids, probs, 5)
    assert dense.dtype == torch.float64
    assert dense.tolist() == [[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]]
    assert densify(torch.tensor([4]), torch.tensor([1.0]), 5).tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_plain_decoding_batch_and_empty_batch():
    """verify_len = 1 everywhere: no drafts, no q, one target token each."""
    p = torch.tensor([[0.1, 0.9], [0.7, 0.3], [0.5, 0.5]], dtype=torch.float64)
    b = dict(p=p, q=None, draft_tokens=torch.zeros(0, dtype=torch.long), cu_rows=torch.tensor([0, 1, 2, 3]),
             modes=MODES, seeds=[None, 4, 4], positions=[0, 1, 2])
    out = accept(**b)
    assert out == accept_reference(**b) and out.num_accepted.tolist() == [0, 0, 0] and out.tokens[0] == [1]
    empty = accept(torch.zeros(0, 2, dtype=torch.float64), None, torch.zeros(0, dtype=torch.long),
                   torch.tensor([0]), [], [], [])
    assert empty.tokens == [] and empty.num_accepted.shape == (0,)


@pytest.mark.parametrize("mode", MODES)
def test_step_without_drafts_is_plain_decoding(mode):
    """verify_len 1 (speculation off, drafter down, empty proposal): every mode emits exactly what plain decoding
    (sampling.next_token, as specdec.generate uses it) emits at that position."""
    torch.manual_seed(3)
    cases = [sampling.SamplingParams()] if mode == "greedy" else [
        sampling.SamplingParams(temperature=0.8, top_p=0.95, seed=11),
        sampling.SamplingParams(temperature=1.3, top_k=7, min_p=0.05, seed=2**62 + 5)]
    for params in cases:
        logits = torch.randn(16, 50, dtype=torch.float64) * 3
        positions = list(range(100, 116))
        b = dict(p=sampling.probs(logits, params), q=None, draft_tokens=torch.zeros(0, dtype=torch.long),
                 cu_rows=torch.arange(17), modes=[mode] * 16,
                 seeds=[params.seed] * 16, positions=positions)
        out = accept(**b)
        assert out == accept_reference(**b)
        assert out.tokens == [[sampling.next_token(lg, params, x)] for lg, x in zip(logits, positions)]


def test_bonus_row_is_plain_seeded_decoding_in_every_mode():
    """Whenever every verified draft is accepted, the bonus token is plain decoding's token at the bonus position
    (argmax for greedy, sample_seeded otherwise), whatever the mode."""
    rng = np.random.default_rng(17)
    reached = {m: 0 for m in MODES}
    for _ in range(40):
        modes = [str(m) for m in rng.choice(MODES, 6)]
        b = make_batch(rng, 6, 4, int(rng.integers(2, 30)), modes)
        out = accept(**b)
        assert out == accept_reference(**b)
        cu = b["cu_rows"].tolist()
        for i, toks in enumerate(out.tokens):
            n = cu[i + 1] - cu[i]
            if len(toks) < n:
                continue                       # stopped by a draft: not the bonus row
            reached[modes[i]] += 1
            row = b["p"][cu[i + 1] - 1]
            want = int(row.argmax()) if modes[i] == "greedy" else \
                sampling.sample_seeded(row, b["seeds"][i], b["positions"][i] + n - 1)
            assert toks[-1] == want
    assert min(reached.values()) > 10


@pytest.mark.parametrize("bad", ["cu_not_zero", "empty_request", "q_missing", "lengths", "token_range", "seed"])
def test_invalid_inputs_are_refused(bad):
    p = torch.full((3, 4), 0.25, dtype=torch.float64)
    b = dict(p=p, q=p[:2].clone(), draft_tokens=torch.tensor([0, 1]), cu_rows=torch.tensor([0, 1, 3]),
             modes=["rejection", "rejection"], seeds=[1, 2], positions=[0, 0])
    b.update({"cu_not_zero": dict(cu_rows=torch.tensor([1, 2, 3])),
              "empty_request": dict(cu_rows=torch.tensor([0, 0, 3]), draft_tokens=torch.tensor([0])),
              "q_missing": dict(q=None), "lengths": dict(seeds=[1]),
              "token_range": dict(draft_tokens=torch.tensor([0, 4])), "seed": dict(seeds=[1, None])}[bad])
    for fn in (accept, accept_reference):
        with pytest.raises(ValueError):
            fn(**b)


# ----------------------------------------------------------------------------------------------- the debug switch

def _batch_for_switch() -> dict:
    return make_batch(np.random.default_rng(1), 4, 4, 12, ["greedy", "rejection", "coupled", "rejection"])


def test_switch_passes_when_paths_agree(monkeypatch):
    monkeypatch.setattr(acc, "CHECK_AGAINST_REFERENCE", True)
    b = _batch_for_switch()
    assert accept(**b) == accept_reference(**b)


def test_switch_catches_a_wrong_reference(monkeypatch):
    b = _batch_for_switch()
    good = accept_reference(**b)
    wrong = AcceptOutput(good.num_accepted.clone(), [t[:-1] + [(t[-1] + 1) % 12] for t in good.tokens])
    monkeypatch.setattr(accept_ref, "accept_reference", lambda *a, **k: wrong)
    assert accept(**b) == good                 # switch off: nothing runs the reference
    monkeypatch.setattr(acc, "CHECK_AGAINST_REFERENCE", True)
    with pytest.raises(AssertionError, match="disagrees"):
        accept(**b)


def test_env_switch_catches_a_wrong_fast_path(monkeypatch):
    b = _batch_for_switch()
    real = acc._accept_fast

    def planted(*args):                         # off by one in the accepted count of request 0
        out = real(*args)
        out.num_accepted[0] += 1
        return out

    monkeypatch.setattr(acc, "_accept_fast", planted)
    accept(**b)                                 # switch off: the bug goes unnoticed
    monkeypatch.setenv("SPECDEC_CHECK_ACCEPT", "1")
    with pytest.raises(AssertionError, match="disagrees"):
        accept(**b)


def test_plain_targets_accept_as_the_whole_rows_do():
    """Greedy and coupled requests accept from plain decoding's token at the rows they reach (accept.plain_targets,
    computed lazily from the logits); that must equal accept() on every row's p, drafts partly the target's own."""
    rng = np.random.default_rng(8)
    for trial in range(60):
        V, n_req = int(rng.integers(2, 80)), int(rng.integers(1, 5))
        lgs, reqs, drafts = [], [], []
        for i in range(n_req):
            n = int(rng.integers(1, 6))
            lg = torch.from_numpy(rng.normal(0, 3, (n, V)))
            params = (sampling.SamplingParams() if rng.random() < 0.3 else
                      sampling.SamplingParams(temperature=float(rng.choice([0.5, 1.0, 1.5])),
                                              top_k=int(rng.choice([0, 5])), seed=int(rng.integers(0, 2**40))))
            pos = int(rng.integers(0, 1000))
            truth = [sampling.next_token(lg[j], params, pos + j) for j in range(n)]
            d = [t if rng.random() < 0.7 else int(rng.integers(V)) for t in truth[:n - 1]]
            lgs.append(lg), reqs.append((params, pos)), drafts.append(d)
        got = acc.accept_targets([acc.plain_targets(lg, pr, pos, d) for lg, (pr, pos), d in zip(lgs, reqs, drafts)],
                                 drafts)
        p = torch.cat([sampling.probs(lg, pr) for lg, (pr, _) in zip(lgs, reqs)])
        cu = torch.tensor([0] + [len(lg) for lg in lgs]).cumsum(0)
        want = accept(p, None, torch.tensor([t for d in drafts for t in d], dtype=torch.long), cu,
                      ["greedy" if pr.greedy else "coupled" for pr, _ in reqs], [pr.seed for pr, _ in reqs],
                      [pos for _, pos in reqs])
        assert got == want, trial
