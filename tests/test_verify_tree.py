"""Verify trees (speculative/tree.py, engine/layout.py): leaves beside the chain, exact whatever is kept."""
import pytest
import torch

from specdec.engine.engine import Engine
from specdec.engine.registry import load
from specdec.speculative.accept import Mode
from specdec.speculative.generator import GenRequest, SpeculativeGenerator
from specdec.speculative.plan import CostPlanner, CostTable
from specdec.speculative.propose import Drafter, Proposal
from specdec.speculative.sampling import SamplingParams
from specdec.speculative.tree import kept_leaf, leaf_candidates, plan_leaves

from .conftest import random_prompt
from .test_speculative import target_only


def prop(tokens, conf, alts):
    return Proposal(0, tokens, conf, alts=alts)


def test_candidates_are_valued_by_reach_times_probability():
    props = [prop([5, 6, 7], [0.5, 0.5, 0.5], [[(8, 0.3), (5, 0.2)], [(9, 0.4)], [(10, 0.9)]]),
             prop([1], [0.9], [[(2, 0.2)]]),
             prop([3, 4], [0.9, 0.9], [[(11, 0.6)], [(12, 0.6)]]),
             prop([3], [0.9], None)]
    modes = [Mode.GREEDY, Mode.COUPLED, Mode.REJECTION, Mode.GREEDY]
    got = leaf_candidates(props, [3, 2, 3, 2], modes)
    # request 0: slot 3 unverified (verify_len 3), its chain token 5 never a leaf; rejection and no alts: none
    assert got == [(0.3, 0, 1, 8), (0.2, 0, 2, 9), (0.2, 1, 1, 2)]
    assert plan_leaves(props, [3, 2, 3, 2], modes, budget=2) == [[(1, 8), (2, 9)], [], [], []]
    assert plan_leaves(props, [3, 2, 3, 2], modes, budget=9, min_value=0.25) == [[(1, 8)], [], [], []]
    assert leaf_candidates(props, [3, 2, 3, 2], modes, prob=lambda c: 0.0)[1:] == [(0.2, 1, 1, 2), (0.0, 0, 2, 9)]


def test_kept_leaf_is_the_one_standing_where_the_chain_missed():
    leaves = [(1, 4), (1, 9), (2, 7)]
    assert kept_leaf(0, [9], [3, 5], leaves) == 1                # slot 1 missed, plain decoding emitted 9
    assert kept_leaf(1, [3, 7], [3, 5], leaves) == 2             # slot 2 missed with 7
    assert kept_leaf(1, [3, 8], [3, 5], leaves) is None          # no leaf guessed 8
    assert kept_leaf(2, [3, 5, 7], [3, 5], leaves) is None       # nothing missed: 7 is the bonus row's token
    assert kept_leaf(0, [9], [], leaves) is None


def test_the_planner_adds_leaves_only_while_they_pay():
    props = [prop([5, 6], [0.9, 0.9], [[(8, 0.5), (9, 0.05)], [(10, 0.5)]])]
    reqs = [type("R", (), {"mode": Mode.GREEDY})()]
    cheap = CostPlanner(CostTable.linear(20.0, 0.1))
    assert cheap.leaves(reqs, props, [3], budget=8) == [[(1, 8), (2, 10), (1, 9)]]
    assert cheap.leaves(reqs, props, [3], budget=1) == [[(1, 8)]]
    dear = CostPlanner(CostTable.linear(20.0, 20.0))            # a row costs a whole step: no leaf pays
    assert dear.leaves(reqs, props, [3], budget=8) == [[]]


class Oracle(Drafter):
    """Knows plain decoding's output: drafts it, but with slot `miss` (1, 2, 1, 2, ... by position) wrong and the
    right token among that slot's alternatives (and a wrong one first), so a tree keeps a leaf on every step that
    reaches it."""
    name = "oracle"

    def __init__(self, refs, V):
        self.refs, self.V, self.lookups = refs, V, 0

    def propose(self, items):
        out = []
        for it in items:
            ctx = list(it.context)
            full = next(r for r in self.refs if r[:len(ctx)] == ctx)
            nxt = full[len(ctx):len(ctx) + it.gamma]
            miss = 1 + len(ctx) % 2
            toks = [(t + 1) % self.V if j + 1 == miss else t for j, t in enumerate(nxt)]
            alts = [[((t + 2) % self.V, 0.5), (t, 0.4)] for t in nxt]
            out.append(Proposal(ctx[-1], toks, [0.9] * len(toks), alts=alts))
        return out

    def release(self, sid):
        pass


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen2-bf16"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=3)],
                         ids=["greedy", "coupled"])
def test_kept_leaves_give_plain_decodings_output(name, params):
    """Kept leaves (their K/V moved into place, the token after them emitted) leave the output plain decoding's,
    token for token, in a batch with requests that keep none and with a rejection-sampled one beside them."""
    model = load(name.removesuffix("-bf16"), "bf16" if name.endswith("bf16") else None).model
    V = model.cfg.vocab_size
    prompts = [random_prompt(V, n, seed=n) for n in (3, 9, 17, 30)]
    ref = target_only(model, prompts, params, 20)
    refs = [p + r for p, r in zip(prompts, ref)]
    gen = SpeculativeGenerator(Engine(model, kv_tokens=8192, page_size=8), Oracle(refs, V), gamma=3, mode="coupled",
                               tree_rows=16)
    reqs = [GenRequest(p, params, 20) for p in prompts]
    outs = gen.generate(reqs)
    assert [o.tokens for o in outs] == ref
    kept = sum(o.stats.leaves_kept for o in outs)
    steps = sum(o.stats.steps for o in outs)
    assert kept > steps / 2                           # the path ran: nearly every step kept a leaf
    assert sum(len(o.tokens) for o in outs) / steps > 1.75     # a miss yet 2+ tokens a step (chains: 1-2)
    # chains alone: one token a step fewer where slot 1 missed
    chain = SpeculativeGenerator(Engine(model, kv_tokens=8192, page_size=8), Oracle(refs, V), gamma=3,
                                 mode="coupled").generate(reqs)
    assert [o.tokens for o in chain] == ref and sum(o.stats.steps for o in chain) > steps
    if not params.greedy:            # a rejection-sampled request beside them: no leaves, its own output unchanged
        mixed = SpeculativeGenerator(Engine(model, kv_tokens=8192, page_size=8), Oracle(refs + [prompts[0]], V),
                                     gamma=3, mode="coupled", tree_rows=16)
        got = mixed.generate(reqs + [GenRequest(prompts[0], params, 20, mode="rejection")])
        assert [o.tokens for o in got[:4]] == ref and got[4].stats.leaves == 0


def test_trees_need_the_compact_layout_and_a_backend_that_runs_them():
    model = load("tiny-llama").model
    V = model.cfg.vocab_size
    prompts = [random_prompt(V, 9, seed=9)]
    ref = target_only(model, prompts, SamplingParams(), 12)
    for layout in ("padded",):
        gen = SpeculativeGenerator(Engine(model, kv_tokens=4096), Oracle([prompts[0] + ref[0]], V), gamma=3,
                                   tree_rows=6, layout=layout)
        outs = gen.generate([GenRequest(prompts[0], SamplingParams(), 12)])
        assert outs[0].tokens == ref[0] and outs[0].stats.leaves == 0


def test_the_feature_store_takes_a_kept_leafs_row():
    """In process the block drafter reads the target's hidden states from its forwards (draft/block.py FeatureStore):
    once a leaf is kept, its row (not the chain row it replaced) is the committed position's, with nothing recomputed
    (before, every later draft of the request recomputed its whole context), also when steps whose blocks came from
    lookup ran in between."""
    from specdec.draft.block import FeatureStore
    from specdec.engine.layout import SeqInput

    target = load("tiny-llama").model
    V, layers = target.cfg.vocab_size, (0, 1)
    prompt = random_prompt(V, 12, seed=4)
    store = FeatureStore(target, layers)
    store.tap(target)
    try:
        e = Engine(target, kv_tokens=4096)
        s = e.new_sequence()
        e.forward([SeqInput(s, prompt[:-1], logits="none")])
        chain, x = [prompt[-1], 7, 8, 9], 11                  # anchor + 3 drafts; leaf 11 in place of draft 8
        e.forward([SeqInput(s, chain, logits="all", leaves=[(2, x), (1, 12)])])
        committed = prompt + [7, x, 5]                         # draft 7 accepted, the leaf kept, 5 after it
        e.keep_leaf(s, len(prompt) - 1 + 4, len(prompt) + 1, x)
        e.truncate(s, len(committed) - 1)
        # the next two steps' blocks came from lookup (the drafter was not asked): two more forwards before it is
        for block, gained in (([5, 6, 3], [6, 4]), ([4, 2], [2, 8])):
            e.forward([SeqInput(s, block, logits="all")])
            committed += gained
            e.truncate(s, len(committed) - 1)
        got = store.rows("r", committed, 4)
        assert store.recomputed == 0
        fresh = FeatureStore(target, layers)                  # the same rows computed on its own engine
        torch.testing.assert_close(got, fresh.rows("r", committed, 4))
        assert fresh.recomputed == len(committed) - 1
    finally:
        store.untap()


def test_the_block_drafter_gives_alternatives_only_where_asked():
    """DraftItem.alts: that many other tokens per slot (the first two slots), best first, never the chain's own token;
    none unless asked (they cost the drafter a top-k and a normaliser a slot) and none for rejection-sampled items."""
    import dataclasses

    from specdec.draft.block import BlockDrafter, random_drafter_model
    from specdec.speculative.propose import DraftItem

    target = load("tiny-llama").model
    V = target.cfg.vocab_size
    d = BlockDrafter(random_drafter_model(target, gamma=4, window=8, ffn_dim=64), target, tap=False)
    ctx = random_prompt(V, 12, seed=6)
    sampled = SamplingParams(temperature=0.8, seed=2)
    base = DraftItem("a", ctx, len(ctx), 4, context=ctx)
    asked = [dataclasses.replace(base, sid="b", alts=2),
             dataclasses.replace(base, sid="c", alts=3, params=sampled, mode=Mode.COUPLED),
             dataclasses.replace(base, sid="d", alts=3, params=sampled, mode=Mode.REJECTION)]
    plain, greedy, coupled, rejection = d.propose([base] + asked)
    assert plain.alts is None and rejection.alts is None
    for p, k in ((greedy, 2), (coupled, 3)):
        assert len(p.alts) == 2 and all(len(a) == k for a in p.alts)
        for tok, a in zip(p.tokens, p.alts):
            assert tok not in [x for x, _ in a] and [pr for _, pr in a] == sorted((pr for _, pr in a), reverse=True)
            assert all(0 < pr < 1 for _, pr in a)
    assert greedy.tokens == plain.tokens                # asking for alternatives leaves the draft as it was
