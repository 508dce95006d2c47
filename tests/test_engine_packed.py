"""Packed ragged forward and KV rollback on float64 tiny models: exact to ~1e-12."""
import pytest
import torch

from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVPool
from specdec.engine.layout import SeqInput
from specdec.engine.model import rope, rotary_tables
from specdec.engine.registry import load

from .conftest import random_prompt

TOL = 1e-12  # float64: only summation order differs between packed and separate runs


def alone(model, prefix, new):
    """Reference: a fresh engine, prefix then new rows of one sequence, logits of the new rows."""
    e = Engine(model, kv_tokens=1024, page_size=8)
    s = e.new_sequence()
    if prefix:
        e.forward([SeqInput(s, prefix, logits="none")])
    return e.forward([SeqInput(s, new, logits="all")]).rows(0)


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_qwen2"])
def test_ragged_equals_separate(model_name, request):
    model = request.getfixturevalue(model_name)
    V = model.cfg.vocab_size
    # different prefix lengths (incl. none, and across page boundaries) and new-row counts (incl. a single row)
    shapes = [(0, 5), (13, 1), (7, 9), (30, 3), (1, 17)]
    prefixes = [random_prompt(V, p, seed=i) if p else [] for i, (p, _) in enumerate(shapes)]
    news = [random_prompt(V, n, seed=100 + i) for i, (_, n) in enumerate(shapes)]
    e = Engine(model, kv_tokens=2048, page_size=8)
    seqs = [e.new_sequence() for _ in shapes]
    pre = [SeqInput(s, p, logits="none") for s, p in zip(seqs, prefixes) if p]
    e.forward(pre)  # prefixes packed together too
    out = e.forward([SeqInput(s, n, logits="all") for s, n in zip(seqs, news)])
    assert out.layout.tokens.numel() == sum(n for _, n in shapes)  # only the real rows ran
    for i, (p, n) in enumerate(zip(prefixes, news)):
        ref = alone(model, p, n)
        assert out.rows(i).shape == ref.shape
        assert (out.rows(i) - ref).abs().max() < TOL


def test_rollback_equals_fresh(tiny_llama):
    V = tiny_llama.cfg.vocab_size
    prefix, wrong, right = random_prompt(V, 11, 1), random_prompt(V, 6, 2), random_prompt(V, 4, 3)
    e = Engine(tiny_llama, kv_tokens=1024, page_size=4)
    s = e.new_sequence()
    e.forward([SeqInput(s, prefix, logits="none")])
    e.forward([SeqInput(s, wrong, logits="all")])             # a rejected draft block
    assert e.length(s) == 17
    e.truncate(s, 12)                                         # keep 1 accepted row
    out = e.forward([SeqInput(s, right, logits="all")]).rows(0)
    ref = alone(tiny_llama, prefix + wrong[:1], right)
    assert (out - ref).abs().max() < TOL
    # rollback by writing at an earlier start overwrites the same way
    out2 = e.forward([SeqInput(s, right, start=12, logits="all")]).rows(0)
    assert (out2 - ref).abs().max() < TOL


def test_chunked_prefill_equals_one_forward(tiny_llama):
    V = tiny_llama.cfg.vocab_size
    prompts = [random_prompt(V, n, seed=n) for n in (40, 3, 25)]
    e = Engine(tiny_llama, kv_tokens=2048, page_size=8)
    seqs = [e.new_sequence() for _ in prompts]
    last = e.prefill(seqs, prompts, chunk_tokens=16)          # forces chunks and prompts split across forwards
    for i, p in enumerate(prompts):
        assert e.length(seqs[i]) == len(p)
        assert (last[i] - alone(tiny_llama, [], p)[-1]).abs().max() < TOL


def test_hidden_states_and_logit_rows(tiny_llama):
    V, L = tiny_llama.cfg.vocab_size, tiny_llama.cfg.n_layers
    e = Engine(tiny_llama, kv_tokens=512)
    a, b = e.new_sequence(), e.new_sequence()
    out = e.forward([SeqInput(a, random_prompt(V, 5, 1), logits="last"), SeqInput(b, random_prompt(V, 3, 2),
                                                                                    logits="all")],
                    hidden_layers=(-1, 0, L - 1))
    assert out.rows(0).shape == (1, V) and out.rows(1).shape == (3, V)
    assert set(out.hidden) == {-1, 0, L - 1} and out.hidden[0].shape == (8, tiny_llama.cfg.dim)
    # the final layer's hidden state, normed and projected, is the logits
    h = tiny_llama.norm(out.hidden[L - 1][5:8])
    assert (h @ tiny_llama.embed.weight.T - out.rows(1)).abs().max() < TOL


def test_padding_free_rows_counted(tiny_llama):
    e = Engine(tiny_llama, kv_tokens=512)
    s = [e.new_sequence() for _ in range(3)]
    e.forward([SeqInput(x, [1, 2, 3][: i + 1]) for i, x in enumerate(s)])
    assert e.rows_processed == 6


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rope_equals_rotate_half(dtype):
    """rope's x * cos + roll(x) * sin is the rotate-half formula bit for bit (negating sin is exact)."""
    angles = torch.rand(11, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 100
    x = torch.randn(11, 5, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    c, s = (t.to(dtype)[:, None, :] for t in (angles.cos(), angles.sin()))
    x1, x2 = x.chunk(2, dim=-1)
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    assert torch.equal(rope(x, *(t.to(dtype) for t in rotary_tables(angles))), ref)


def test_float32_kv_cache_changes_no_bit():
    """The invariant engine stores a bf16 model's keys/values in float32 (the attention's dtype): the logits are
    those of a bf16 cache cast at every read, bit for bit, for prefill, decode and a verify block."""
    model = load("tiny-llama", "bf16").model
    wide = Engine(model, kv_tokens=512, page_size=8)
    narrow = Engine(model, kv_tokens=512, page_size=8)
    narrow.kv = KVPool(model.cfg.n_layers, model.cfg.n_kv_heads, model.cfg.hd, 512, page_size=8,
                       dtype=torch.bfloat16)
    assert wide.kv.k.dtype == torch.float32
    V = model.cfg.vocab_size
    steps = [(random_prompt(V, 37, seed=0), 0), (random_prompt(V, 1, seed=1), 37), (random_prompt(V, 6, seed=2), 38)]
    outs = []
    for e in (wide, narrow):
        s = e.new_sequence()
        outs.append([e.forward([SeqInput(s, toks, start=start, logits="all")]).rows(0) for toks, start in steps])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
