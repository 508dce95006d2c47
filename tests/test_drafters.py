import random

import numpy as np
import pytest
import torch

from specdec.draft import make_drafter
from specdec.draft.corpus import Corpus, save_corpus
from specdec.draft.model import ModelDrafter, layer_skip, restrict_vocab
from specdec.draft.ngram import SuffixIndex, lookup
from specdec.engine.engine import Engine
from specdec.engine.layout import SeqInput
from specdec.engine.registry import load
from specdec.errors import InvalidRequest, SpecdecError
from specdec.speculative.accept import Mode
from specdec.speculative.propose import DraftItem, SessionLost, SparseRows
from specdec.speculative.sampling import SamplingParams


def test_ngram_lookup_latest_longest_match():
    toks = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    assert lookup(toks, 2) == [8, 5]             # latest earlier match of the 3-gram [1, 2, 3]
    assert lookup(toks, 10) == [8, 5, 1, 2, 3]   # continuation may run into the tail itself
    assert lookup([4, 5, 6, 7], 3) == []         # no repeat: nothing proposed
    assert lookup([7, 1, 7], 2) == [1, 7]        # falls back to shorter n-grams


def test_suffix_index_gives_the_scans_answer():
    """The per-session index answers what `lookup`'s scan of the whole context does, call after call as the list
    grows by one token or several, and after the list is rebuilt (a session lost and resent) or cut back."""
    rng = random.Random(0)
    for vocab in (3, 8, 20):
        for max_n, min_n in ((3, 2), (3, 1), (4, 2)):
            index, toks, found = SuffixIndex(max_n, min_n), [], 0
            for _ in range(300):
                r = rng.random()
                if r < 0.05 and toks:
                    toks = toks[:rng.randrange(len(toks) // 2, len(toks))]      # cut back
                elif r < 0.1 and toks:
                    k = rng.randrange(1, 5)                                      # the same length, its
                    toks = toks[:-k] + [rng.randrange(vocab) for _ in toks[-k:]]  # last k rewritten
                else:
                    toks = toks + [rng.randrange(vocab) for _ in range(rng.choice((1, 1, 1, 3)))]
                gamma = rng.randrange(6)
                want = lookup(toks, gamma, max_n, min_n)
                assert index.continuation(toks, gamma) == want, (toks, gamma)
                found += bool(want)
            assert found > 25, (vocab, max_n, min_n)   # repeats are found: the index is exercised


def test_ngram_indexes_are_a_bounded_cache():
    """Sessions never released (a target gone) leave their index behind: at most MAX_INDEXES are kept, the least
    recently used dropped, and a dropped session's next lookup rebuilds it with the same answer."""
    d = make_drafter("ngram")
    d.MAX_INDEXES = 2
    toks = {sid: [1, 2, 3, k, 1, 2] for k, sid in enumerate("abc")}
    for sid in "abac":                                  # a used again: b is the least recent when c's arrives
        assert d.propose([DraftItem(sid, toks[sid], 6, 2)])[0].tokens == [3, "abc".index(sid)]
        toks[sid] = []                                  # the session knows them now
    assert list(d.index) == ["a", "c"]
    assert d.propose([DraftItem("b", [], 6, 2)])[0].tokens == [3, 1] and list(d.index) == ["c", "b"]


def test_ngram_q_is_one_hot_for_sampled_requests():
    d = make_drafter("ngram")
    item = DraftItem("r", [5, 6, 5], 3, 2, SamplingParams(temperature=1.0, seed=1), Mode.REJECTION)
    prop = d.propose([item])[0]
    assert prop.anchor == 5 and prop.tokens == [6, 5]
    assert torch.equal(prop.q_dense(8), torch.nn.functional.one_hot(torch.tensor([6, 5]), 8).double())


def test_release_all_tries_every_session():
    """The scheduler frees a step's finished requests together (Drafter.release_all): one session whose release
    raises does not keep the others' memory (they are all tried, then the error is raised)."""
    d = make_drafter("ngram")
    for sid in "abc":
        d.propose([DraftItem(sid, [1, 2, 1], 3, 2)])
    drop = d.release

    def release(sid):
        if sid == "b":
            raise RuntimeError("b is stuck")
        drop(sid)
    d.release = release
    with pytest.raises(RuntimeError, match="stuck"):
        d.release_all(["a", "b", "c"])
    assert list(d.sessions.tokens) == ["b"] and list(d.index) == ["b"]


def test_session_sync_and_loss():
    d = make_drafter("ngram")
    d.propose([DraftItem("r", [1, 2, 3], 3, 2)])
    d.propose([DraftItem("r", [4, 5], 5, 2)])                      # appended
    assert d.sessions.tokens["r"] == [1, 2, 3, 4, 5]
    # unknown, and no context to rebuild from: None for that item only, the others are answered
    assert d.propose([DraftItem("gone", [7], 9, 2), DraftItem("r", [6], 6, 2)])[0] is None
    with pytest.raises(SessionLost):
        d.sessions.sync(DraftItem("gone", [7], 9, 2))
    d.propose([DraftItem("gone", [7], 4, 2, context=[1, 2, 3, 7])])
    assert d.sessions.tokens["gone"] == [1, 2, 3, 7]


def test_model_drafter_answers_lost_sessions_per_item():
    d = ModelDrafter(load("tiny-llama-draft").model, kv_tokens=1024)
    out = d.propose([DraftItem("a", [1, 2, 3], 3, 2), DraftItem("lost", [5], 9, 2), DraftItem("b", [4, 5], 2, 2)])
    assert out[1] is None and len(out[0].tokens) == 2 and len(out[2].tokens) == 2
    again = d.propose([DraftItem("lost", [5], 9, 2, context=[1, 2, 3, 4, 5, 6, 7, 8, 5])])[0]
    assert len(again.tokens) == 2


def test_model_drafter_rolls_back_to_committed():
    """After a rejection the drafter's KV must match a fresh session on the committed tokens."""
    draft = load("tiny-llama-draft").model
    d = ModelDrafter(draft, kv_tokens=1024)
    first = d.propose([DraftItem("r", [1, 2, 3, 4], 4, 4)])[0]
    committed = [1, 2, 3, 4, first.tokens[0], (first.tokens[1] + 1) % 96]   # one accepted, then a correction
    again = d.propose([DraftItem("r", committed[4:], 6, 3)])[0]
    fresh = ModelDrafter(draft, kv_tokens=1024).propose([DraftItem("x", committed, 6, 3)])[0]
    assert again.tokens == fresh.tokens and again.confidence == pytest.approx(fresh.confidence, abs=1e-12)


def test_layer_skip_shares_weights_and_leaves_target_intact():
    target = load("tiny-qwen2").model
    view = layer_skip(target, "0,2")
    assert view.cfg.n_layers == 2 and target.cfg.n_layers == 3 and len(target.layers) == 3
    assert view.layers[1] is target.layers[2]
    e = Engine(view)
    assert e.forward([SeqInput(e.new_sequence(), [1, 2, 3])]).rows(0).shape == (1, 96)
    with pytest.raises(InvalidRequest, match="draft_layers"):
        layer_skip(target, "0-7")


def test_model_drafter_q_matches_its_sampler():
    draft = load("tiny-llama-draft").model
    d = ModelDrafter(draft)
    p = SamplingParams(temperature=0.9, top_k=10, seed=4)
    prop = d.propose([DraftItem("r", [1, 2, 3], 3, 4, p, Mode.REJECTION)])[0]
    assert prop.q.shape == (4, 96)
    for j, (t, c) in enumerate(zip(prop.tokens, prop.confidence)):
        assert prop.q[j, t] == c > 0 and (prop.q[j] > 0).sum() <= 10


def test_restricted_vocab_drafts_from_the_first_ids_with_exact_q():
    """restrict_vocab: logits over ids < n only (the full head's first n, weights shared), drafts among them, and q
    a distribution over the whole vocabulary that is zero elsewhere (so acceptance stays exact)."""
    draft = load("tiny-llama-draft").model
    cut = restrict_vocab(draft, 48)
    assert cut.lm_head.weight.data_ptr() == draft.embed.weight.data_ptr() and draft.lm_head is None
    e_full, e_cut = Engine(draft), Engine(cut)
    prompt = [5, 60, 7, 90, 3]
    full = e_full.forward([SeqInput(e_full.new_sequence(), prompt)]).rows(0)
    assert torch.allclose(e_cut.forward([SeqInput(e_cut.new_sequence(), prompt)]).rows(0), full[:, :48],
                          rtol=0, atol=1e-12)
    greedy = ModelDrafter(cut).propose([DraftItem("g", prompt, 5, 1)])[0]
    assert greedy.tokens == [int(full[0, :48].argmax())]
    p = SamplingParams(temperature=1.5, seed=3)
    prop = ModelDrafter(cut).propose([DraftItem("r", prompt, 5, 6, p, Mode.REJECTION)])[0]
    assert prop.q.shape == (6, 96) and (prop.q[:, 48:] == 0).all()
    assert torch.allclose(prop.q.sum(-1), torch.ones(6, dtype=prop.q.dtype))
    assert all(t < 48 and prop.q[j, t] == c > 0 for j, (t, c) in enumerate(zip(prop.tokens, prop.confidence)))
    assert restrict_vocab(draft, 0) is draft and restrict_vocab(draft, 96) is draft
    with pytest.raises(InvalidRequest, match="draft_vocab"):
        restrict_vocab(draft, -5)


def test_min_conf_ends_greedy_and_coupled_blocks_only():
    """min_conf: a greedy / coupled block ends at the first slot drafted with less probability (that slot kept), the
    same tokens as the whole block up to there; a rejection request keeps its whole block (its text depends on it)."""
    draft = load("tiny-llama-draft").model
    prompt = [5, 60, 7, 90, 3]
    seeded = SamplingParams(temperature=1.0, seed=11)
    for params, mode in ((SamplingParams(), Mode.GREEDY), (seeded, Mode.COUPLED), (seeded, Mode.REJECTION)):
        whole = ModelDrafter(draft).propose([DraftItem("r", prompt, 5, 6, params, mode)])[0]
        assert len(whole.tokens) == 6
        for cut in sorted(set(whole.confidence)) + [1.01]:       # every threshold between the slots' confidences
            short = ModelDrafter(draft, min_conf=cut).propose([DraftItem("r", prompt, 5, 6, params, mode)])[0]
            end = next((j + 1 for j, c in enumerate(whole.confidence) if c < cut), 6)
            n = 6 if mode is Mode.REJECTION else end
            assert short.tokens == whole.tokens[:n] and short.confidence == whole.confidence[:n], (mode, cut)


def test_sparse_rows_dense():
    s = SparseRows(torch.tensor([[1, 3], [0, 0]]), torch.tensor([[0.25, 0.75], [1.0, 0.0]], dtype=torch.float64))
    assert s.dense(4).tolist() == [[0, 0.25, 0, 0.75], [1.0, 0, 0, 0]]


def test_hybrid_copies_where_the_context_repeats_and_drafts_elsewhere():
    """model+ngram: lookup's continuation where the last 2+ tokens occurred before, the model's block elsewhere;
    the model is not asked where lookup answered, and when it is next asked it catches up, so its blocks are a fresh
    session's on the same tokens: a request's drafts depend on its committed tokens alone (exact replay in rejection
    mode)."""
    draft = load("tiny-llama-draft").model
    d = make_drafter("tiny-llama-draft+ngram", dtype=torch.float64)
    asked = []
    ask = d.model.propose
    d.model.propose = lambda items: asked.append([it.new_tokens for it in items]) or ask(items)
    assert d.name == "tiny-llama-draft+ngram" and d.vocab_size == 96
    seeded = SamplingParams(temperature=1.0, seed=3)
    toks = [5, 60, 7, 90, 3, 8]
    steps = [[44, 60, 7], [11, 12, 13], [60, 7]]        # "60 7" repeats: lookup's turn; "12 13" is new: the model's
    d.propose([DraftItem("r", toks, len(toks), 3, seeded, Mode.REJECTION)])
    copied = []
    for new in steps:
        toks = toks + new
        got = d.propose([DraftItem("r", new, len(toks), 3, seeded, Mode.REJECTION)])[0]
        copy = lookup(toks, 3, 3, 2)
        copied.append(bool(copy))
        if copy:
            assert got.tokens == copy and torch.equal(got.q_dense(96).argmax(-1), torch.tensor(copy))
        else:
            fresh = ModelDrafter(draft).propose([DraftItem("x", toks, len(toks), 3, seeded, Mode.REJECTION)])[0]
            assert got.tokens == fresh.tokens and torch.equal(got.q_dense(96), fresh.q_dense(96))
    assert copied == [True, False, True]
    assert asked == [[toks[:6]], [toks[6:12]]]           # the first call, then the catch-up past the copied step
    d.release("r")
    assert "r" not in d.model.kv and "r" not in d.sessions.tokens and "r" not in d.lookups[0].index


def test_corpus_index_gives_the_scans_answer():
    """The hashed index (every order's most frequent next token, its count, the total) equals scanning the
    documents, for contexts that match at every order, none, or only across a document boundary (which must not
    count)."""
    rng = random.Random(0)
    for vocab, max_n in ((5, 4), (40, 6)):
        docs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(40)]
        corpus = Corpus([t for d in docs for t in d], [len(d) for d in docs], max_n=max_n, min_n=2)
        seen = {"match": 0, "none": 0}
        for _ in range(1500):
            d = rng.choice(docs)
            i = rng.randrange(len(d) + 1)
            ctx = d[max(0, i - rng.randrange(1, 9)):i] if rng.random() < 0.5 else \
                [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
            got = corpus.next(ctx)
            assert got == corpus.next_ref(ctx, docs), ctx
            seen["match" if got else "none"] += 1
        assert min(seen.values()) > 50
    # a context that exists only across two documents' boundary is not in the index
    c = Corpus([1, 2, 3, 4], [2, 2], max_n=3, min_n=2)
    assert c.next([1, 2]) is None and c.next([2, 3]) is None and c.next([3, 4]) is None
    assert Corpus([1, 2, 3, 1, 2, 4, 1, 2, 3], [9], max_n=3).next([1, 2]) == (3, 2, 3)


def test_corpus_drafts_of_a_batch_are_each_contexts_draft():
    """`drafts` (every context and order in one search a slot) gives each context what `draft` (one `next` at a
    time) does, at every min_conf, for contexts shorter than min_n too."""
    rng = random.Random(1)
    for vocab, max_n in ((4, 4), (30, 6)):
        docs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 80))] for _ in range(60)]
        corpus = Corpus([t for d in docs for t in d], [len(d) for d in docs], max_n=max_n, min_n=2)
        ctxs = []
        for _ in range(300):
            d = rng.choice(docs)
            i = rng.randrange(len(d) + 1)
            ctxs.append(d[max(0, i - rng.randrange(0, 12)):i] if rng.random() < 0.7 else
                        [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))])
        for gamma, min_conf in ((1, 0.0), (4, 0.0), (6, 0.3)):
            got = corpus.drafts(ctxs, gamma, min_conf)
            assert got == [corpus.draft(c, gamma, min_conf) for c in ctxs]
            assert sum(len(t) == gamma for t, _ in got) > 20 and sum(not t for t, _ in got) > 20
    # the two-level search finds every key the table holds and no other
    keys = corpus.keys
    idx, hit = corpus.find(keys)
    assert hit.all() and (idx == np.arange(keys.size)).all()
    _, hit = corpus.find(keys + np.uint64(1))
    assert not hit[np.isin(keys + np.uint64(1), keys, invert=True)].any()


def test_corpus_drafts_extend_the_longest_match_and_stop_where_none_holds():
    c = Corpus([7, 8, 9, 10, 11, 0, 5, 8, 9, 12], [6, 4], max_n=3, min_n=2)
    # confidence count / (total + 1): a context seen once says 1/2, one seen twice with two successors 1/3
    assert c.draft([1, 7, 8], 8) == ([9, 10, 11, 0], [0.5] * 4)       # order 3 down to 2: "5 8 9 12" is shadowed
    assert c.draft([5, 8], 2) == ([9, 12], [0.5, 0.5])
    assert c.draft([3, 8, 9], 3, min_conf=0.4) == ([], [])              # "8 9" -> 10 or 12, once each
    assert c.draft([3, 8, 9], 3) == ([10, 11, 0], [1 / 3, 0.5, 0.5])   # a tie goes to the smaller id
    with pytest.raises(ValueError, match="add up"):
        Corpus([1, 2, 3], [2])


def test_hybrid_tries_its_lookups_in_order_then_the_model(tmp_path):
    """model+ngram+corpus: the context's continuation where it has one, else the corpus's, else the model's block;
    corpus blocks are copied (one-hot q) and carry the corpus frequencies as confidence."""
    save_corpus(tmp_path / "corpus.safetensors", [40, 41, 42, 43, 44, 45], [6])
    d = make_drafter("tiny-llama-draft+ngram+corpus", dtype=torch.float64, checkpoint=str(tmp_path))
    assert d.name == "tiny-llama-draft+ngram+corpus"
    seeded = SamplingParams(temperature=1.0, seed=3)
    toks = [5, 60, 7, 90, 3, 8]
    first = d.propose([DraftItem("r", toks, len(toks), 3, seeded, Mode.COUPLED)])[0]
    assert not first.copied and len(first.tokens) == 3                                 # the model's
    toks += [60, 7]
    got = d.propose([DraftItem("r", [60, 7], len(toks), 3, seeded, Mode.COUPLED)])[0]
    assert got.copied and got.tokens == [90, 3, 8]                                      # the context's
    toks += [41, 42]
    got = d.propose([DraftItem("r", [41, 42], len(toks), 3, seeded, Mode.COUPLED)])[0]
    assert got.copied and got.tokens == [43, 44, 45] and got.confidence == [0.5] * 3    # the corpus's
    assert torch.equal(got.q_dense(96).argmax(-1), torch.tensor([43, 44, 45]))
    with pytest.raises(SpecdecError, match="no corpus"):
        make_drafter("ngram+corpus", checkpoint=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="may follow"):
        make_drafter("ngram+layer-skip+corpus")
