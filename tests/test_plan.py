"""The verify-length planner: exact optimum (against brute force), calibration, adaptive gamma, and compact rows."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.draft.model import ModelDrafter
from specdec.engine.engine import Engine
from specdec.engine.registry import load
from specdec.speculative.generator import GenRequest, SpeculativeGenerator
from specdec.speculative.plan import (AHEAD_WORTH, MEASURED_AFTER, Calibration, CostPlanner, CostTable, best_gamma,
                                      best_plan, brute_force_plan, expected_rate, leviathan_gain)

COSTS = [CostTable([1, 2, 4, 8, 16, 32], [10, 10.4, 11, 12.5, 16, 25]),   # verify nearly free up to ~8 rows
         CostTable.linear(2.0, 3.0),                                       # every row costs: short blocks win
         CostTable([1, 4, 16], [5, 5, 40])]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(0, 2), st.floats(0, 20), st.data())
def test_best_plan_matches_brute_force(B, ci, fixed, data):
    caps = [data.draw(st.integers(1, 5)) for _ in range(B)]
    probs = [sorted(data.draw(st.lists(st.floats(0.01, 0.99), min_size=c - 1, max_size=c - 1)), reverse=True)
             for c in caps]
    cost = COSTS[ci]
    floors = [data.draw(st.integers(1, c)) if data.draw(st.booleans()) else 1 for c in caps]
    worth = [data.draw(st.sampled_from([0.0, 0.3, 1.0])) for _ in caps] if data.draw(st.booleans()) else None
    v, _ = brute_force_plan(probs, caps, cost, fixed, floors, worth)
    got = best_plan(probs, caps, cost, fixed, floors, worth)
    assert all(f <= g <= c for f, g, c in zip(floors, got, caps))
    assert expected_rate(probs, got, cost, fixed, worth) == \
        pytest.approx(expected_rate(probs, v, cost, fixed, worth), rel=1e-9)


def test_best_plan_shapes():
    flat = CostTable([1, 64], [10, 10.001])          # verify is free: verify everything proposed
    assert best_plan([[0.9] * 4, [0.1] * 4], [5, 5], flat) == [5, 5]
    steep = CostTable.linear(0.0, 1.0)               # each row costs what an anchor does: only sure bets pay...
    assert best_plan([[0.99, 0.98, 0.2], [0.1, 0.1, 0.1]], [4, 4], steep) == [1, 1]
    # ...and with a fixed per-step cost (drafting, overhead) the likely slots become worth verifying
    assert best_plan([[0.99, 0.98, 0.2], [0.1, 0.1, 0.1]], [4, 4], steep, fixed_ms=2.0) == [3, 1]


def test_calibration_learns():
    cal = Calibration(bins=4, prior=2)
    assert cal.prob(0.9) == pytest.approx(0.875)     # prior: the bin centre
    rng = random.Random(0)
    for _ in range(2000):                             # a draft that is over-confident: accepts 30% at conf 0.9
        cal.observe([0.9], int(rng.random() < 0.3))
    assert cal.prob(0.9) == pytest.approx(0.3, abs=0.05)


def test_fading_calibration_follows_the_traffic():
    """Copies accepted 20% of the time (chat) and then 90% (HumanEval): with fading counts the estimate follows within
    a few hundred observations; counts kept for good stay near the old rate (what kept copies unverified)."""
    rng = random.Random(1)
    fading, kept = Calibration(decay=0.01), Calibration()
    for rate in (0.2, 0.9):
        for _ in range(1500 if rate == 0.2 else 300):
            ok = int(rng.random() < rate)
            for cal in (fading, kept):
                cal.observe([0.95], ok)
    assert fading.prob(0.95) == pytest.approx(0.9, abs=0.06) and kept.prob(0.95) < 0.4


def test_cost_table_learns_online():
    t = CostTable([1, 2, 4, 8], [100.0, 200.0, 400.0, 800.0])     # profiled on a busy machine
    for _ in range(40):
        t.update(4, 20.0)
        t.update(1, 18.0)
    assert t(4) == pytest.approx(20.0, rel=0.01) and t(1) == pytest.approx(18.0, rel=0.01)
    assert all(a <= b for a, b in zip(t.ms, t.ms[1:]))
    t.update(3, 1.0)                                              # not a profiled point: ignored
    assert t(4) == pytest.approx(20.0, rel=0.01)


def test_a_profile_taken_on_a_busy_machine_comes_down_with_the_rows_measured():
    """Points not measured online keep their profiled ratio to the nearest measured one: a profile 7x too high
    throughout, and a service that verifies only anchors (1 row) while a second row looks dear, would otherwise
    never verify a draft again."""
    true = [15.0, 16.0, 18.0, 26.0]
    t = CostTable([1, 2, 4, 8], [7 * x for x in true])
    for _ in range(30):
        t.update(1, 15.0)
    assert t.ms == pytest.approx(true, rel=0.02)
    for _ in range(30):
        t.update(8, 40.0)                                         # 8 rows measured dearer than profiled
    assert t(8) == pytest.approx(40.0, rel=0.02) and t(1) == pytest.approx(15.0, rel=0.02)
    assert t(4) == pytest.approx(18.0, rel=0.02)                  # nearer to 1 row than to 8: 1 row's ratio


def test_gamma_adapts():
    assert leviathan_gain(0.0, 4) == 1 and leviathan_gain(1.0, 4) == 5
    assert best_gamma(0.95, 0.05, 8) >= 6 and best_gamma(0.2, 0.3, 8) == 1


def test_planner_in_the_loop_is_lossless_and_compact_rows_match():
    target, draft = load("tiny-llama").model, load("tiny-llama-draft").model
    V = target.cfg.vocab_size
    prompts = [[1 + (i * 7 + k) % (V - 1) for k in range(5 + i)] for i in range(6)]
    ref = SpeculativeGenerator(Engine(target), None).generate([GenRequest(p, max_tokens=24) for p in prompts])
    planner = CostPlanner(CostTable.linear(1.0, 0.6), fixed_ms=1.0, draft_ms_per_token=0.3)
    gen = SpeculativeGenerator(Engine(target), ModelDrafter(draft), gamma=6, plan=planner)
    outs = gen.generate([GenRequest(p, max_tokens=24) for p in prompts])
    assert [o.tokens for o in outs] == [o.tokens for o in ref]
    assert all(info.rows == sum(info.verify_len) for info in gen.steps)      # compact: rows == sum(verify_len)
    assert any(len(set(info.verify_len)) > 1 for info in gen.steps)          # the planner mixes lengths
    assert sum(planner.cal.tried) > 0 and planner.alpha


def test_service_planner_leaves_rejection_requests_full_blocks():
    """The service's planner plans greedy/coupled requests by cost and adapts their gamma, but a rejection-sampled
    request (whose seeded text depends on its blocks) always drafts its own gamma and verifies every draft."""
    from specdec.speculative.plan import ServicePlanner
    from specdec.speculative.propose import Proposal
    from specdec.speculative.sampling import SamplingParams
    from specdec.speculative.step import SpecRequest
    from specdec.speculative.accept import Mode
    planner = ServicePlanner(CostTable.linear(1.0, 5.0), fixed_ms=0.0, draft_ms_per_token=2.0)
    reqs = [SpecRequest("g", [1], SamplingParams(), 50, Mode.GREEDY, 6),
            SpecRequest("c", [1], SamplingParams(temperature=0.7, seed=1), 50, Mode.COUPLED, 6),
            SpecRequest("r", [1], SamplingParams(temperature=0.7, seed=1), 50, Mode.REJECTION, 6)]
    props = [Proposal(1, [2] * 6, [0.05] * 6) for _ in reqs]      # confident of nothing: not worth verifying
    assert planner(reqs, props) == [1, 1, 7]
    for _ in range(planner.explore_every - 2):
        assert planner(reqs, props) == [1, 1, 7]
    assert planner(reqs, props) == [2, 1, 7]        # every explore_every-th step, the longest idle verifies one
    for _ in range(planner.explore_every - 1):
        assert planner(reqs, props) == [1, 1, 7]
    assert planner(reqs, props) == [1, 2, 7]        # one request a time: the calibration is shared
    for r in reqs:
        planner.alpha[r.rid] = 0.05                                 # a history of rejections
    planner.gamma(reqs[0]), planner.gamma(reqs[0])                 # "g" stopped drafting two steps before "c"
    one, none = Proposal(1, [2], [0.05]), Proposal(1, [], [])
    blocks = []
    for _ in range(20 * planner.explore_every):                    # a step: blocks per request, then the plan
        blocks.append([planner.gamma(r) for r in reqs])
        vlen = planner(reqs, [one if b else none for b in blocks[-1][:2]] + [props[2]])
        assert vlen == [1 + (b > 0) for b in blocks[-1][:2]] + [7]  # an explored draft is verified
    # drafting does not pay: no draft, except that the two explore (at the adaptive length, here 1) in turn, one a
    # step, on the exploration steps, at most one in explore_every
    explored = [i for i, b in enumerate(blocks) if b != [0, 0, 6]]
    assert len(explored) >= 4 and all(sorted(blocks[i][:2]) == [0, 1] and blocks[i][2] == 6 for i in explored)
    assert [blocks[i][0] for i in explored[:4]] in ([1, 0, 1, 0], [0, 1, 0, 1])
    assert min(b - a for a, b in zip(explored, explored[1:])) >= planner.explore_every
    planner.forget("g")
    assert "g" not in planner.alpha and "g" not in planner.undrafted


def test_profile_rows_straddle_the_linear_tiles():
    """The cost table is measured on both sides of each tile edge: past one, a forward makes another call per linear
    (the cliff the planner must see), which interpolating between powers of two hides; and of each 16-row GEMM block
    (AMX: a 17th row computes a second block)."""
    from specdec.speculative.plan import profile_rows
    assert profile_rows(gemm_rows=0) == [1, 2, 4, 8, 16, 32, 64]
    assert profile_rows(32, gemm_rows=0) == [1, 2, 4, 8, 16, 32, 33, 64, 65]
    assert profile_rows() == [1, 2, 4, 8, 16, 17, 32, 33, 48, 49, 64, 65]
    assert profile_rows(32) == profile_rows()
    assert profile_rows(24) == [1, 2, 4, 8, 16, 17, 24, 25, 32, 33, 48, 49, 64, 65]


def test_profile_cost_measures_the_engines_tile_edges():
    from specdec.speculative.plan import profile_cost
    eng = Engine(load("tiny-llama", "float64").model, kv_tokens=2048)
    hi = eng.row_tiles.hi
    t = profile_cost(eng, reps=1)
    assert hi in t.rows and hi + 1 in t.rows and all(a <= b for a, b in zip(t.ms, t.ms[1:]))
    assert Engine(load("tiny-llama", "float64").model, kv_tokens=256, batch_invariant=False).row_tiles is None


@pytest.mark.parametrize("burst_at", [1, 4, 12, 30])
def test_profile_cost_is_not_misled_by_a_burst_of_other_work(burst_at):
    """Other work only adds time, so the profile keeps each row count's fastest round, and its rounds interleave the
    row counts: a burst as long as a few forwards (the draft server loading beside the target at start-up) costs one
    round of a few row counts, whichever forward it starts at. Served, the median of back-to-back repeats once said
    75 ms for 1 to 17 rows where 1 row took 15-20 ms, and the planner then verified no draft."""
    import time as _time
    from specdec.speculative.plan import profile_cost
    eng = Engine(load("tiny-llama", "float64").model, kv_tokens=2048)
    forward, calls = eng.forward, []

    def busy_forward(inputs):
        calls.append(1)
        if burst_at <= len(calls) - 1 < burst_at + 5:      # five forwards in a row run beside other work
            _time.sleep(0.25)
        return forward(inputs)
    eng.forward = busy_forward
    t = profile_cost(eng, rows=[1, 2, 4, 8, 16, 17], reps=3)
    assert max(t.ms) < 200, t.ms


def test_exploration_stays_off_a_tile_edge():
    """A forced exploration row is skipped where it would cost more than the forward's rows do on average: at 32
    requests on 32-row tiles a 33rd row costs a third of the step, for a draft the plan already judged not to pay."""
    from specdec.speculative.plan import ServicePlanner
    from specdec.speculative.propose import Proposal
    from specdec.speculative.sampling import SamplingParams
    from specdec.speculative.step import SpecRequest
    from specdec.speculative.accept import Mode
    cost = CostTable([1, 8, 32, 33, 64], [30.0, 32.0, 49.0, 65.0, 91.0])     # a Xeon's SmolLM2 bf16 verify

    def explored(batch: int) -> int:
        planner = ServicePlanner(cost)
        reqs = [SpecRequest(f"g{i}", [1], SamplingParams(), 50, Mode.GREEDY, 4) for i in range(batch)]
        props = [Proposal(1, [2] * 4, [0.05] * 4) for _ in reqs]
        return sum(sum(planner(reqs, props)) > batch for _ in range(4 * planner.explore_every))

    assert explored(8) == 4           # below the edge: one exploration row every explore_every steps
    assert explored(32) == 0          # at the edge: none


def test_service_planner_plans_around_a_rejection_requests_rows():
    """A rejection-sampled request's whole block is in the forward whatever the plan, so the others are planned
    with its rows counted: here the verify cost is flat up to 8 rows and steep after, and a greedy request that
    would verify 6 rows alone in the plan verifies 2 next to a 7-row rejection block."""
    from specdec.speculative.plan import ServicePlanner
    from specdec.speculative.propose import Proposal
    from specdec.speculative.sampling import SamplingParams
    from specdec.speculative.step import SpecRequest
    from specdec.speculative.accept import Mode
    cost = CostTable([1, 8, 16], [10, 11, 30])
    planner = ServicePlanner(cost)
    planner.cal.prob = lambda c: c                                   # calibrated: confidence = acceptance
    reqs = [SpecRequest("g", [1], SamplingParams(), 50, Mode.GREEDY, 6),
            SpecRequest("r", [1], SamplingParams(temperature=0.7, seed=1), 50, Mode.REJECTION, 6)]
    props = [Proposal(1, [2] * 6, [0.7] * 6), Proposal(1, [2] * 6, [0.3] * 6)]
    assert best_plan([[0.7] * 6, [0.3] * 6], [7, 7], cost) == [6, 2]     # as if the rejection block could shrink
    assert planner(reqs, props) == [2, 7]


def test_planner_follows_measured_throughput_of_drafting_steps():
    """Whether drafting pays for the batch is decided by measurement once both kinds of step have run: steps that
    drafted against steps that did not, each as tokens/ms over the cost table's plain rate. A planted slow drafter
    (its steps emit fewer tokens per ms than plain steps) turns drafting off; a good one turns it back on."""
    from specdec.speculative.propose import Proposal
    from specdec.speculative.sampling import SamplingParams
    from specdec.speculative.step import SpecRequest
    from specdec.speculative.accept import Mode
    planner = CostPlanner(CostTable.linear(0.0, 10.0), learn_costs=False)
    reqs = [SpecRequest(f"r{i}", [1], SamplingParams(), 50, Mode.GREEDY, 4) for i in range(4)]
    for r in reqs:
        planner.alpha[r.rid] = 0.9
    drafts, none = [Proposal(1, [2] * 4, [0.9] * 4)] * 4, [Proposal(1, [], [])] * 4
    assert planner.gamma(reqs[0]) == 4                                 # nothing measured: the prediction says yes
    for _ in range(10):
        planner.observe(reqs, none, [1] * 4, [0] * 4, draft_ms=0.0, verify_ms=40.0)        # 4 tokens / 40 ms
        planner.observe(reqs, drafts, [5] * 4, [1] * 4, draft_ms=30.0, verify_ms=60.0)     # 8 tokens / 90 ms
    assert planner.draft_pays == pytest.approx(0.889, abs=0.01) and planner.gamma(reqs[0]) == 0
    newcomer = SpecRequest("new", [1], SamplingParams(), 50, Mode.GREEDY, 4)
    assert planner.gamma(newcomer) == 0               # nor does a new request (it used to draft until it verified)
    assert [planner.gamma(reqs[0]) for _ in range(planner.explore_every - 1)][-1] == 4     # explores a full block
    for _ in range(60):
        planner.observe(reqs, drafts, [5] * 4, [3] * 4, draft_ms=30.0, verify_ms=60.0)     # 16 tokens / 90 ms
    assert planner.draft_pays > 1.5 and planner.gamma(reqs[0]) == 4


@pytest.mark.parametrize("explore_ms", [5.0, 150.0])
def test_exploring_while_drafting_does_not_pay_takes_at_most_its_share_of_the_time(explore_ms):
    """While drafting does not pay, one request explores every 4 * explore_every steps, or less often where that
    would spend more than EXPLORE_SHARE of the time on it: an explorer's model drafter first prefills all of the
    request's text it has not seen (served chat at 8 requests, the target's w4a8 copy drafting: 70-220 ms a Propose
    against a 40 ms step, 13% of the run every 32 steps)."""
    from specdec.speculative.plan import EXPLORE_SHARE
    from specdec.speculative.propose import Proposal
    from specdec.speculative.sampling import SamplingParams
    from specdec.speculative.step import SpecRequest
    from specdec.speculative.accept import Mode
    planner = CostPlanner(CostTable([1, 8, 9, 16], [20.0, 40.0, 41.0, 60.0]))
    reqs = [SpecRequest(f"r{i}", [1], SamplingParams(), 10**6, Mode.GREEDY, 4) for i in range(8)]
    spent, total, explorations = 0.0, 0.0, 0
    for step in range(3000):
        blocks = [planner.gamma(r) for r in reqs]
        props = [Proposal(1, [2] * k, [0.5] * k) for k in blocks]
        vlen = planner(reqs, props)
        draft_ms = explore_ms if any(blocks) else 0.0
        planner.observe(reqs, props, vlen, [0] * 8, draft_ms=draft_ms, verify_ms=40.0)   # no draft is accepted
        if step >= 100:                          # past the start, where every request drafts until it is measured
            spent, total, explorations = spent + draft_ms, total + draft_ms + 40.0, explorations + any(blocks)
    assert planner.draft_pays < 1
    if explore_ms < EXPLORE_SHARE * 40 * 4 * planner.explore_every:
        assert explorations == pytest.approx(2900 / (4 * planner.explore_every), abs=2)   # cheap: every 32 steps
    else:
        assert 2 <= explorations and spent / total <= EXPLORE_SHARE * 1.05


def test_one_lucky_drafting_step_does_not_keep_drafting_on():
    """The measured rates are plain means over their first steps, then smoothed: with a slow EMA from the first step,
    one lucky drafting step (every draft accepted) kept drafting on through ~20 losing steps (served, the first
    drafting step had a batch of 1; the next 7, at 16 requests, lost)."""
    from specdec.speculative.propose import Proposal
    from specdec.speculative.sampling import SamplingParams
    from specdec.speculative.step import SpecRequest
    from specdec.speculative.accept import Mode
    planner = CostPlanner(CostTable.linear(0.0, 10.0), learn_costs=False)
    reqs = [SpecRequest(f"r{i}", [1], SamplingParams(), 50, Mode.GREEDY, 4) for i in range(4)]
    drafts, none = [Proposal(1, [2] * 4, [0.9] * 4)] * 4, [Proposal(1, [], [])] * 4
    for _ in range(MEASURED_AFTER):
        planner.observe(reqs, none, [1] * 4, [0] * 4, draft_ms=0.0, verify_ms=40.0)        # plain rate 1.0
    planner.observe(reqs, drafts, [5] * 4, [4] * 4, draft_ms=30.0, verify_ms=60.0)         # lucky: 20 tokens / 90 ms
    assert planner.draft_pays == planner.predicted_pays          # one drafting step decides nothing (below)
    for _ in range(MEASURED_AFTER - 1):
        planner.observe(reqs, drafts, [5] * 4, [0] * 4, draft_ms=30.0, verify_ms=60.0)     # then 4 tokens / 90 ms
    assert planner.draft_pays < 1 and planner.gamma(reqs[0]) == 0


def _teach_pays_alone_not_at_16(planner: CostPlanner, one, many) -> None:
    """MEASURED_AFTER steps of each kind at one request (drafting pays: verify rows nearly free) and at 16 (it does not),
    by CostTable.linear(20.0, 1.0); the latest step has 16 requests."""
    from specdec.speculative.propose import Proposal
    d = lambda n, a: ([Proposal(1, [2] * 4, [0.9] * 4)] * n, [5] * n, [a] * n)
    for _ in range(MEASURED_AFTER):
        planner.observe(one, [Proposal(1, [], [])], [1], [0], draft_ms=0.0, verify_ms=21.0)      # 1 token / 21 ms
        planner.observe(one, *d(1, 3), draft_ms=2.0, verify_ms=25.0)                             # 4 tokens / 27 ms
        planner.observe(many, [Proposal(1, [], [])] * 16, [1] * 16, [0] * 16, draft_ms=0.0, verify_ms=36.0)
        planner.observe(many, *d(16, 1), draft_ms=25.0, verify_ms=100.0)                          # 32 tokens / 125 ms


def test_what_pays_at_batch_1_is_not_taken_for_batch_16():
    """Drafting's measured rates are kept per batch size class: a batch-1 step that paid (verify rows nearly free)
    does not keep 16 requests drafting, and the losing batch-16 steps do not stop drafting at batch 1."""
    from specdec.speculative.propose import Proposal
    from specdec.speculative.sampling import SamplingParams
    from specdec.speculative.step import SpecRequest
    from specdec.speculative.accept import Mode
    planner = CostPlanner(CostTable.linear(20.0, 1.0), learn_costs=False)
    reqs = [SpecRequest(f"r{i}", [1], SamplingParams(), 50, Mode.GREEDY, 4) for i in range(16)]
    for r in reqs:
        planner.alpha[r.rid] = 0.9
    one, many = reqs[:1], reqs
    _teach_pays_alone_not_at_16(planner, one, many)
    assert planner.draft_pays < 1 and planner.gamma(reqs[0]) == 0       # the latest step had 16 requests
    planner.observe(one, [Proposal(1, [], [])], [1], [0], draft_ms=0.0, verify_ms=21.0)
    assert planner.draft_pays > 2 and planner.gamma(reqs[0]) == 4       # alone again: drafting pays


def test_copied_blocks_are_planned_apart_from_the_models():
    """Prompt-lookup blocks (Proposal.copied) have their own calibration and teach the planner nothing about the model's
    blocks (acceptance, drafting cost); a step of copies alone is planned with no drafting cost."""
    from specdec.speculative.propose import Proposal
    from specdec.speculative.sampling import SamplingParams
    from specdec.speculative.step import SpecRequest
    from specdec.speculative.accept import Mode
    cost = CostTable.linear(2.0, 3.0)
    planner = CostPlanner(cost, fixed_ms=50.0, draft_ms_per_token=5.0)
    reqs = [SpecRequest(f"r{i}", [1], SamplingParams(), 50, Mode.GREEDY, 6) for i in range(2)]
    copy, model = Proposal(1, [2] * 6, [1.0] * 6, copied=True), Proposal(1, [2] * 6, [0.95] * 6)
    for _ in range(30):      # copies always accepted, the model's confident blocks never
        planner.observe(reqs, [copy, copy], [7, 7], [6, 6], draft_ms=0.1, verify_ms=20.0)
        for _ in range(2):   # the model's drafting cost is learned from a step that caught up on nothing (the second)
            planner.observe(reqs, [model, model], [7, 7], [0, 0], draft_ms=60.0, verify_ms=20.0)
    assert planner.cal_copied.prob(1.0) > 0.95 and planner.cal.prob(0.95) < 0.2 and planner.cal.prob(1.0) < 0.2
    assert max(planner.alpha.values()) < 0.01                       # the model's acceptance alone
    assert planner.draft_ms > 9                                      # 60 ms / 6 tokens: copies cost no drafting
    assert planner(reqs, [copy, model]) == [7, 1]
    # copies alone: no drafting was paid this step, so the plan's fixed cost is 0 (a 50 ms one would verify more)
    weak = Proposal(1, [2] * 6, [1.0] * 6, copied=True)
    planner.cal_copied = Calibration()
    planner.cal_copied.prob = lambda c: 0.45
    probs = [[0.45] * 6] * 2
    assert planner(reqs, [weak, weak]) == best_plan(probs, [7, 7], cost, 0.0) != best_plan(probs, [7, 7], cost, 50.0)


def test_lookup_drafts_while_the_planner_keeps_the_model_off():
    """A drafter that looks up first is asked every step at the full block length, whatever block the planner gives
    its model: with the model's block at 0, copied blocks are still verified (output = plain decoding), and the model
    is never asked."""
    from specdec.draft.hybrid import HybridDrafter
    target, draft = load("tiny-llama").model, load("tiny-llama-draft").model
    prompts = [[1 + (i * 7 + k) % 9 for k in range(12)] for i in range(3)]      # repeats: lookup finds matches
    ref = SpeculativeGenerator(Engine(target), None).generate([GenRequest(p, max_tokens=24) for p in prompts])

    class ModelOff(CostPlanner):
        def gamma(self, r):
            return 0
    hybrid = HybridDrafter(ModelDrafter(draft))
    asked = []
    ask = hybrid.model.propose
    hybrid.model.propose = lambda items: asked.append(items) or ask(items)
    planner = ModelOff(CostTable.linear(1.0, 0.01))
    gen = SpeculativeGenerator(Engine(target), hybrid, gamma=4, plan=planner)
    outs = gen.generate([GenRequest(p, max_tokens=24) for p in prompts])
    assert [o.tokens for o in outs] == [o.tokens for o in ref]
    assert not asked and sum(planner.cal_copied.tried) > 0 and sum(planner.cal.tried) == 0
    assert any(v > 1 for info in gen.steps for v in info.verify_len)     # copied drafts were verified


def test_copies_that_do_not_pay_at_a_batch_size_are_not_verified_there():
    """Steps that verified copied blocks are measured apart from plain steps, per batch size class: where they emitted
    fewer tokens/ms (served chat at 16 requests: a 17th row starts another 16-row AMX block), copies are left
    unverified but on every 4th exploration step, which keeps measuring them; at batch 1, where they pay, and at a
    batch size not measured yet, the calibration alone decides as before."""
    from specdec.speculative.propose import Proposal
    from specdec.speculative.sampling import SamplingParams
    from specdec.speculative.step import SpecRequest
    from specdec.speculative.accept import Mode
    planner = CostPlanner(CostTable([1, 16, 17, 32], [20.0, 30.0, 34.0, 38.0]), learn_costs=False)
    reqs = [SpecRequest(f"r{i}", [1], SamplingParams(), 50, Mode.GREEDY, 4) for i in range(16)]
    copy, none = Proposal(1, [2] * 4, [0.9] * 4, copied=True), Proposal(1, [], [])
    planner.cal_copied.prob = lambda c: 0.95
    assert planner.copies_pay == 1.0 and sum(planner(reqs, [copy] * 16)) > 16        # not measured: verified
    for _ in range(MEASURED_AFTER):
        planner.observe(reqs, [none] * 16, [1] * 16, [0] * 16, draft_ms=0.0, verify_ms=30.0)     # 16 / 30 ms
        planner.observe(reqs, [copy] * 16, [2] * 16, [0] * 16, draft_ms=0.0, verify_ms=38.0)     # 16 / 38 ms
    assert planner.copies_pay == pytest.approx(30 / 38, abs=0.01)
    planner.cal_copied.prob = lambda c: 0.95    # however confident the copies (the realised rate is what counts)
    verified, wanted = [], []
    for _ in range(4 * planner.explore_every):
        if planner.copies_wanted():         # speculative_step asks a looking-up drafter only then
            wanted.append(planner.steps + 1)
        if sum(planner(reqs, [copy] * 16)) > 16:
            verified.append(planner.steps)
    assert len(verified) == 1 and verified[0] % (4 * planner.explore_every) == 0 and wanted == verified
    one = reqs[:1]                # batch 1: copies measured to pay there
    for _ in range(MEASURED_AFTER):
        planner.observe(one, [none], [1], [0], draft_ms=0.0, verify_ms=20.0)
        planner.observe(one, [copy], [3], [2], draft_ms=0.0, verify_ms=21.0)
    assert planner.copies_pay > 2 and planner(one, [copy]) != [1]
    planner.batch = 8             # 5-8: nothing measured
    assert planner.copies_pay == 1.0


def test_a_looking_up_drafter_is_not_asked_when_no_copy_is_planned():
    """With copies measured not to pay and the model's blocks at 0, a step asks the drafter nothing (plain decoding's
    forward, no lookup); on the exploration step that plans copies it is asked again, and output is unchanged."""
    from specdec.draft.ngram import NgramDrafter
    target = load("tiny-llama").model
    prompts = [[1 + (i * 7 + k) % 9 for k in range(12)] for i in range(2)]      # repeats: lookup finds matches
    ref = SpeculativeGenerator(Engine(target), None).generate([GenRequest(p, max_tokens=40) for p in prompts])

    class CopiesLose(CostPlanner):
        copies_pay = 0.5

        def gamma(self, r):
            return 0
    drafter, asked = NgramDrafter(), []
    ask = drafter.propose
    drafter.propose = lambda items: asked.append(len(items)) or ask(items)
    planner = CopiesLose(CostTable.linear(1.0, 0.01))
    gen = SpeculativeGenerator(Engine(target), drafter, gamma=4, plan=planner)
    outs = gen.generate([GenRequest(p, max_tokens=40) for p in prompts])
    assert [o.tokens for o in outs] == [o.tokens for o in ref]
    assert 1 <= len(asked) <= planner.steps // (4 * planner.explore_every) + 1 < len(gen.steps)


def test_batch_classes():
    """Measured rates are kept per class of batch size: 1, 2, 3-4, 5-8, 9-16, ... (8 concurrent requests, whose
    batch moves between 5 and 8, stay in one class)."""
    classes = [CostPlanner.batch_class(B) for B in range(1, 18)]
    assert classes == [1, 2, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6]
    assert CostPlanner.batch_class(0) == 1 and CostPlanner.batch_class(32) == 6 and CostPlanner.batch_class(33) == 7


def _reqs(n: int, alpha: float, planner: CostPlanner, first: int = 0, prompt_len: int = 1, max_tokens: int = 10**6):
    from specdec.speculative.accept import Mode
    from specdec.speculative.sampling import SamplingParams
    from specdec.speculative.step import SpecRequest
    reqs = [SpecRequest(f"r{i}", [1] * prompt_len, SamplingParams(), max_tokens, Mode.GREEDY, 4)
            for i in range(first, first + n)]
    for r in reqs:
        planner.alpha[r.rid] = alpha
    return reqs


def test_a_catch_up_is_not_priced_as_drafting():
    """A model drafter's first Propose for a request prefills its prompt (and after a pause, all the text since its
    last draft): served chat at 4 requests with the target's w4a8 copy drafting, 4 prompts made one Propose 89 ms
    where later ones took 10-20, and that step priced per drafted token gave every request gamma 0 at once (1.03x, AL
    1.12; in process every draft verified gives 1.20x-1.22x). Drafting's costs are learned from steps whose requests
    all drafted the step before; the batch's measured rates still count catch-ups."""
    from specdec.speculative.propose import Proposal
    planner = CostPlanner(CostTable.linear(20.0, 0.1), fixed_ms=8.0, draft_ms_per_token=2.0)
    reqs = _reqs(4, 0.6, planner)
    block = lambda n: [Proposal(1, [2] * 4, [0.6] * 4)] * n
    planner.observe(reqs, block(4), [5] * 4, [2] * 4, draft_ms=400.0, verify_ms=21.0)    # 4 prompts caught up
    assert (planner.draft_ms, planner.fixed_ms) == (2.0, 8.0) and min(planner.gamma(r) for r in reqs) >= 3
    planner.observe(reqs, block(4), [5] * 4, [2] * 4, draft_ms=16.0, verify_ms=21.0)     # steady: 4 ms a slot
    assert planner.draft_ms == pytest.approx(2.4) and planner.fixed_ms == pytest.approx(9.6)
    more = reqs + _reqs(1, 0.6, planner, first=4)                                         # a new request's prompt
    planner.observe(more, block(5), [5] * 5, [2] * 5, draft_ms=120.0, verify_ms=21.0)
    assert planner.draft_ms == pytest.approx(2.4) and planner.gamma(more[-1]) >= 3


def test_one_slow_first_drafting_step_does_not_turn_drafting_off():
    """A batch size class's first drafting step pays every request's catch-up; with the next step plain, that one
    step decided alone that drafting did not pay, and the one-request explorations after it (each a catch-up again)
    never turned it back on. The measured rates decide once each kind has MEASURED_AFTER steps at the class."""
    from specdec.speculative.propose import Proposal
    planner = CostPlanner(CostTable.linear(0.0, 10.0), learn_costs=False)
    reqs = _reqs(4, 0.9, planner)
    drafts, none = [Proposal(1, [2] * 4, [0.9] * 4)] * 4, [Proposal(1, [], [])] * 4
    for _ in range(MEASURED_AFTER):
        planner.observe(reqs, none, [1] * 4, [0] * 4, draft_ms=0.0, verify_ms=40.0)          # 4 tokens / 40 ms
    planner.observe(reqs, drafts, [5] * 4, [3] * 4, draft_ms=260.0, verify_ms=60.0)         # 16 / 320 ms: catch-up
    assert planner.draft_pays == planner.predicted_pays and planner.gamma(reqs[0]) == 4
    for _ in range(MEASURED_AFTER - 1):
        planner.observe(reqs, drafts, [5] * 4, [3] * 4, draft_ms=20.0, verify_ms=60.0)      # 16 / 80 ms
    assert planner.draft_pays > 1.3 and planner.gamma(reqs[0]) == 4


@pytest.mark.parametrize("plain_measured", [False, True])
def test_drafting_steps_that_clearly_lose_turn_drafting_off_before_measured_after(plain_measured):
    """Served chat at 32 requests with the w4a8 copy drafting (a batch of 16, a new request nearly every step), every
    drafting step caught the draft model up on new prompts (~470 ms against a ~60 ms plain step), and the class's
    first 16 drafting steps, waiting for MEASURED_AFTER of each kind, took 16% of the run (0.81x). From CLEAR_LOSS[0]
    drafting steps on, a mean rate under CLEAR_LOSS[1] of plain's (the cost table's before plain steps are measured)
    decides at once; a mean loss that is not that clear still waits."""
    from specdec.speculative.plan import CLEAR_LOSS
    from specdec.speculative.propose import Proposal
    planner = CostPlanner(CostTable.linear(0.0, 4.0), learn_costs=False)
    reqs = _reqs(16, 0.9, planner)
    drafts, none = [Proposal(1, [2] * 4, [0.9] * 4)] * 16, [Proposal(1, [], [])] * 16
    for _ in range(MEASURED_AFTER if plain_measured else 0):
        planner.observe(reqs, none, [1] * 16, [0] * 16, draft_ms=0.0, verify_ms=64.0)      # plain: the table's rate
    planner.observe(reqs, drafts, [5] * 16, [1] * 16, draft_ms=20.0, verify_ms=100.0)      # 32 / 120 ms: 1.07x
    for _ in range(CLEAR_LOSS[0] - 1):
        planner.observe(reqs, drafts, [5] * 16, [0] * 16, draft_ms=113.0, verify_ms=100.0)  # 16 / 213 ms: 0.30x
    assert planner.draft_pays == planner.predicted_pays and planner.gamma(reqs[0]) == 4    # mean 0.56x: not clear
    planner.observe(reqs, drafts, [5] * 16, [0] * 16, draft_ms=113.0, verify_ms=100.0)
    assert planner.draft_pays < CLEAR_LOSS[1] and planner.gamma(reqs[0]) == 0             # 4 steps, mean 0.49x


def test_two_slow_drafting_steps_decide_nothing():
    """A class's first drafting steps pay catch-ups: fewer than CLEAR_LOSS[0] of them, however slow, decide nothing
    (at 4 requests one such step, decided on alone, kept drafting off for a run: 1.03x against 1.22x)."""
    from specdec.speculative.plan import CLEAR_LOSS
    from specdec.speculative.propose import Proposal
    planner = CostPlanner(CostTable.linear(0.0, 10.0), learn_costs=False)
    reqs = _reqs(4, 0.9, planner)
    drafts = [Proposal(1, [2] * 4, [0.9] * 4)] * 4
    for _ in range(CLEAR_LOSS[0] - 1):
        planner.observe(reqs, drafts, [5] * 4, [0] * 4, draft_ms=400.0, verify_ms=60.0)     # 4 / 460 ms: 0.09x
    assert planner.draft_pays == planner.predicted_pays and planner.gamma(reqs[0]) == 4


def test_blocks_are_decided_for_the_coming_steps_batch():
    """Served chat at 32 requests with the w4a8 copy: a round's first 10 requests arrived after the round before had
    ended at a batch of 1-4, where drafting paid; decided for the latest step's batch, all of them drafted at once,
    catching the draft model up on their prompts (591 ms against a 45 ms plain step) at a batch size where drafting
    was measured not to pay. speculative_step tells the planner the coming batch (begin) first."""
    from specdec.speculative.propose import Proposal
    target, draft = load("tiny-llama").model, load("tiny-llama-draft").model
    V = target.cfg.vocab_size
    planner = CostPlanner(CostTable.linear(20.0, 1.0), learn_costs=False)
    one, many = _reqs(1, 0.9, planner), _reqs(16, 0.9, planner, first=1)
    _teach_pays_alone_not_at_16(planner, one, many)
    planner.observe(one, [Proposal(1, [], [])], [1], [0], draft_ms=0.0, verify_ms=21.0)
    assert planner.draft_pays > 1                                           # the latest step had one request
    drafter, asked = ModelDrafter(draft), []
    ask = drafter.propose
    drafter.propose = lambda items: asked.append(sum(i.gamma > 0 for i in items)) or ask(items)
    prompts = [[1 + (i * 7 + k) % (V - 1) for k in range(5 + i % 4)] for i in range(16)]
    ref = SpeculativeGenerator(Engine(target), None).generate([GenRequest(p, max_tokens=3) for p in prompts])
    gen = SpeculativeGenerator(Engine(target), drafter, gamma=4, plan=planner)
    outs = gen.generate([GenRequest(p, max_tokens=3) for p in prompts])
    assert [o.tokens for o in outs] == [o.tokens for o in ref]
    assert gen.steps[0].verify_len == [1] * 16 and sum(asked) == 0          # 16 requests: no drafting


def test_lookups_the_plan_never_uses_stop_where_they_cost():
    """Served chat at a batch of 17-32: every step looked up (2.1 ms of a ~52 ms forward) and the plan verified no copy
    in 376 of 377 steps; with no step that verified copies, they were never measured not to pay, and the lookups went
    on all run. After UNUSED_LOOKUPS[0] such lookups in a row at a batch size class, each over UNUSED_LOOKUPS[1] of a
    forward, the drafter is asked only on every 4th exploration step; a verified copy turns them back on, and cheap
    lookups (in process: ~0.05 ms) are asked every step whatever they find."""
    from specdec.speculative.plan import UNUSED_LOOKUPS
    from specdec.speculative.propose import Proposal
    planner = CostPlanner(CostTable([1, 16, 32], [20.0, 30.0, 40.0]), learn_costs=False)
    reqs, none = _reqs(16, 0.9, planner), [Proposal(1, [], [])] * 16
    copy = [Proposal(1, [2] * 4, [0.9] * 4, copied=True)] + none[1:]

    def run(steps: int, draft_ms: float, props=none, vlen=None) -> list[int]:
        """Steps as speculative_step runs them; the steps at which the drafter was asked to look up."""
        asked = []
        for _ in range(steps):
            planner.begin(reqs)
            now = planner.copies_wanted()
            planner(reqs, props)
            if now:
                asked.append(planner.steps)
            planner.observe(reqs, props, vlen or [1] * 16, [0] * 16, draft_ms=draft_ms if now else 0.0,
                            verify_ms=30.0, looked_up=now)
        return asked

    assert len(run(100, 0.05)) == 100                                   # cheap: 0.2% of a forward
    asked = run(UNUSED_LOOKUPS[0] + 4 * planner.explore_every, 2.0)     # dear: 6.7% of a forward
    assert len(asked) == UNUSED_LOOKUPS[0] + 1 and asked[-1] % (4 * planner.explore_every) == 0
    assert run(1, 2.0, copy, [5] + [1] * 15) == []                      # not asked (a copy of another step)
    planner.observe(reqs, copy, [5] + [1] * 15, [3] + [0] * 15, draft_ms=2.0, verify_ms=31.0, looked_up=True)
    assert len(run(UNUSED_LOOKUPS[0], 2.0)) == UNUSED_LOOKUPS[0]       # a verified copy: asked again
    planner.begin(reqs[:1])                                             # batch 1: its own count, none yet
    assert planner.copies_wanted()


def test_a_copy_verified_only_to_explore_keeps_no_lookups_on():
    """Served chat at a batch of 17-32, the plan verified no copy of its own, but every 8th step exploration verified
    the longest idle request's block, a copy, and that reset UNUSED_LOOKUPS' count at 7: the target looked up every
    step (a trace's steps: a copy verified, 7 lookups that verified nothing, a copy, ...). A copy only exploration
    verified does not count as the plan using lookups."""
    from specdec.speculative.plan import UNUSED_LOOKUPS
    from specdec.speculative.propose import Proposal
    planner = CostPlanner(CostTable([1, 16, 32], [20.0, 30.0, 40.0]), learn_costs=False)
    reqs = _reqs(16, 0.9, planner)
    unsure = [Proposal(1, [2] * 4, [0.05] * 4, copied=True)] * 16      # worth no row to the plan
    asked, explored = [], 0
    for _ in range(64):
        planner.begin(reqs)
        now = planner.copies_wanted()
        props = unsure if now else [Proposal(1, [], [])] * 16
        vlen = planner(reqs, props)
        explored += sum(v > 1 for v in vlen)
        if now:
            asked.append(planner.steps)
        planner.observe(reqs, props, vlen, [0] * 16, draft_ms=2.0 if now else 0.0, verify_ms=30.0, looked_up=now)
    assert explored                                        # exploration verified a copy (step 8)
    assert asked == list(range(1, UNUSED_LOOKUPS[0] + 1)) + [32, 64]    # then only every 4th exploration step

    # the other exploration, a request drafting to explore whose block a lookup answered (a copy): the same
    planner = CostPlanner(CostTable([1, 16, 32], [20.0, 30.0, 40.0]), learn_costs=False)
    asked = []
    for _ in range(16):
        planner.begin(reqs)
        now = planner.copies_wanted()
        props = unsure if now else [Proposal(1, [], [])] * 16
        planner.explore.add(reqs[0].rid)                   # as gamma() marks an explorer
        vlen = planner(reqs, props)
        assert vlen[0] == (2 if now else 1)
        if now:
            asked.append(planner.steps)
        planner.observe(reqs, props, vlen, [0] * 16, draft_ms=2.0 if now else 0.0, verify_ms=30.0, looked_up=now)
    assert asked == list(range(1, UNUSED_LOOKUPS[0] + 1))


def test_a_step_that_asks_a_looking_up_drafter_says_so():
    """speculative_step tells the planner whether it asked the drafter to look up: lookups that found nothing (on
    text that rarely repeats, most) are counted, and output stays plain decoding's."""
    from specdec.draft.ngram import NgramDrafter
    target = load("tiny-llama").model
    V = target.cfg.vocab_size
    prompts = [[1 + (i * 5 + k * k) % (V - 1) for k in range(12)] for i in range(2)]
    ref = SpeculativeGenerator(Engine(target), None).generate([GenRequest(p, max_tokens=30) for p in prompts])

    class ModelOff(CostPlanner):
        seen: list[bool] = []

        def gamma(self, r):
            return 0

        def observe(self, reqs, props, vlen, accepted, **kw):
            self.seen.append(kw.get("looked_up", False) and not any(p.tokens for p in props))
            super().observe(reqs, props, vlen, accepted, **kw)
    drafter = NgramDrafter()
    planner = ModelOff(CostTable.linear(1.0, 0.01))
    gen = SpeculativeGenerator(Engine(target), drafter, gamma=4, plan=planner)
    outs = gen.generate([GenRequest(p, max_tokens=30) for p in prompts])
    assert [o.tokens for o in outs] == [o.tokens for o in ref]
    assert any(planner.seen)                       # steps that looked up and found nothing were told so


AMX_SMOLLM2 = CostTable([1, 8, 16, 17, 32, 33, 64, 65], [21.6, 22.4, 25.3, 28.9, 33.3, 52.1, 71.3, 74.2])  # served


def _prompted(n: int, alpha: float, planner: CostPlanner, first: int = 0):
    """Chat-like requests: 60-token prompts, 64 tokens to emit."""
    return _reqs(n, alpha, planner, first, prompt_len=60, max_tokens=64)


def test_a_catch_up_that_cannot_pay_is_neither_drafted_nor_explored():
    """A model drafter first catches up on the text it has not seen (a new request's prompt). Served chat at 16 and 32
    concurrent requests with the target's w4a8 copy on a Xeon with AMX: a batch size class's first drafting step caught
    16 prompts up in 339 ms (32 in 748) against a 27-45 ms plain step, and explorations after it one prompt each in
    45-85 ms. The catch-up's cost per token is measured from steps that paid one; a request drafts (or explores) only
    where that cost is below what drafting could save over its remaining tokens, verify rows priced by the cost table
    and drafting counted free. Alone, a prompt's catch-up pays; at 16 it does not; a cheap catch-up (a feature drafter)
    pays at 16; a request the drafter has kept up with drafts whatever its prompt cost."""
    from specdec.speculative.propose import Proposal
    planner = CostPlanner(AMX_SMOLLM2, fixed_ms=15.0, draft_ms_per_token=3.0)
    lone = _prompted(1, 0.85, planner)[0]
    planner.begin([lone])
    assert planner.gamma(lone) == 4                                         # no catch-up measured yet
    planner.observe([lone], [Proposal(1, [2] * 4, [0.9] * 4)], [5], [4], draft_ms=75.0, verify_ms=22.0)
    assert planner.catch_up_ms == pytest.approx((75.0 - 15.0) / 60)         # 60 unseen tokens, beyond a steady step
    lone.output += [2] * 5                                                  # committed
    batch = [lone] + _prompted(15, 0.85, planner, first=1)
    for step in range(4 * planner.explore_every):                           # every exploration step included
        planner.begin(batch)
        blocks = [planner.gamma(r) for r in batch]
        assert blocks[1:] == [0] * 15 and (step or blocks[0] == 4)         # kept up with: drafts
        props = [Proposal(1, [2] * k, [0.9] * k) for k in blocks]
        vlen = planner(batch, props)
        planner.observe(batch, props, vlen, [v - 1 for v in vlen], draft_ms=15.0, verify_ms=30.0)
        assert planner.catch_up_ms == pytest.approx(1.0)                    # steady steps teach it nothing
        for r, v in zip(batch, vlen):
            r.output += [2] * v
        for r in batch[1:]:                                                 # the text the drafter has not seen
            r.output = r.output[:1]                                         # grows; keep the requests young
    assert planner.catch_ups_withheld >= 15 * 4 * planner.explore_every     # counted for the metric
    planner.begin(batch[1:3])                                               # the batch down to two: it would pay
    assert planner.catch_up_pays(batch[1], 0.85)
    cheap = CostPlanner(AMX_SMOLLM2, fixed_ms=15.0, draft_ms_per_token=3.0)
    cheap.catch_up_sums = (0.01, 1.0)                                       # 0.01 ms a token
    fresh = _prompted(16, 0.85, cheap)
    cheap.begin(fresh)
    assert [cheap.gamma(r) for r in fresh] == [4] * 16



def test_the_catch_up_rate_weighs_each_catch_up_by_its_tokens():
    """The catch-up's cost per token is summed time over summed tokens (fading), not an average of per-step rates: a
    step that caught up 16 tokens and ran 8 ms over a steady drafting step (noise, at a trained drafter's ~0.05 ms a
    token) must not read as a catch-up ten times dearer. Averaged per step it did, and at 8 served requests the
    trained drafter was withheld from requests that had fallen behind (README, "Catch-ups priced before they are
    paid")."""
    from specdec.speculative.propose import Proposal
    planner = CostPlanner(AMX_SMOLLM2, fixed_ms=15.0, draft_ms_per_token=3.0)
    batch = _prompted(8, 0.4, planner)                                      # 8 new 60-token prompts
    props = [Proposal(1, [2] * 4, [0.9] * 4) for _ in batch]
    planner.observe(batch, props, [5] * 8, [1] * 8, draft_ms=15.0 + 24.0, verify_ms=40.0)
    assert planner.catch_up_ms == pytest.approx(24.0 / 480)
    late = _reqs(1, 0.4, planner, first=8, prompt_len=16, max_tokens=64)    # one joins, 16 tokens behind
    batch += late
    props.append(Proposal(1, [2] * 4, [0.9] * 4))
    planner.observe(batch, props, [5] * 9, [1] * 9, draft_ms=15.0 + 8.0, verify_ms=40.0)
    fade = 1 - planner.ema
    assert planner.catch_up_ms == pytest.approx((fade * 24.0 + 8.0) / (fade * 480 + 16))   # 0.068, not 0.14



def test_in_a_burst_tokens_count_by_how_much_they_shorten_it():
    """Where no request waits for admission the batch only shrinks and lasts as long as its request with the most
    left: a token counts in full for that request; for requests within a block of the most left, by the share of
    them with a draft (each must gain); a request further ahead finishing sooner saves only its row (AHEAD_WORTH at
    least). Past a step in the forward's cost (an AMX GEMM's 16-row block: 13-16 rows ~35 ms, 17 ~39 on a Xeon)
    such tokens do not pay for the rows; with requests waiting, every token counts in full."""
    from specdec.speculative.propose import Proposal
    cost = CostTable([1, 8, 16, 17, 32], [30.0, 34.0, 35.0, 39.0, 44.0])
    planner = CostPlanner(cost)
    planner.cal_copied.prob = lambda c: 0.95
    reqs = _reqs(16, 0.5, planner, max_tokens=64)
    for r in reqs:
        r.output = [7] * 20
    copy, none = Proposal(1, [2] * 4, [1.0] * 4, copied=True), Proposal(1, [], [])
    one = [copy] + [none] * 15
    reqs[0].output = [7] * 40                             # 16 tokens ahead of the others
    assert planner(reqs, one)[0] == 5                     # requests waiting: every token counts as a plain step's
    planner.closed = True
    assert planner.burst_worth(reqs, one) == [AHEAD_WORTH] * 16    # the 15 with the most left have no draft
    assert planner(reqs, one)[0] == 1
    reqs[0].output = [7] * 20
    for r in reqs[1:]:
        r.output = [7] * 30                               # now it alone has the most left: its tokens count in full
    assert planner.burst_worth(reqs, one) == [1.0] + [AHEAD_WORTH] * 15
    assert planner(reqs, one)[0] == 5
    for r in reqs:
        r.output = [7] * 20                               # 16 started together, weaker copies for 8 of them
    planner.cal_copied.prob = lambda c: 0.6
    half = [copy] * 8 + [none] * 8
    planner.closed = False
    assert sum(planner(reqs, half)) > 16
    planner.closed = True
    assert planner.burst_worth(reqs, half) == [AHEAD_WORTH] * 16 and sum(planner(reqs, half)) == 16
    assert planner.burst_worth(reqs, [copy] * 16) == [1.0] * 16          # blocks for all of them: they all count
    planner.closed = False
    everyone = planner(reqs, [copy] * 16)
    planner.closed = True
    assert planner(reqs, [copy] * 16) == everyone and sum(everyone) > 16
    few = reqs[:4]                                        # up to 16 rows verify is nearly free: verified all the same
    assert sum(planner(few, half[:4])) >= 12
    steep = CostPlanner(CostTable.linear(10.0, 10.0))     # where a row costs more than a plain token's share
    steep.closed = True
    reqs[0].output = [7] * 40
    assert steep.burst_worth(reqs, [none] * 16)[0] == pytest.approx(10 * 16 / 170)
