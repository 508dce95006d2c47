"""Prepacked bf16 linears (engine/prepack.py): an engine's outputs are bitwise those of the plain weights."""
from __future__ import annotations

import copy

import pytest
import torch

from specdec.draft.model import restrict_vocab
from specdec.engine import prepack
from specdec.engine.engine import Engine
from specdec.engine.layout import SeqInput
from specdec.engine.loader import to_hf_state_dict
from specdec.engine.registry import load
from tests.conftest import random_drafter_case, random_prompt

pytestmark = pytest.mark.skipif(not prepack.available(), reason="no oneDNN bf16 reorder in this torch build or on this CPU (AVX2 only)")


def _logits(engine: Engine, vocab: int) -> list[torch.Tensor]:
    """A 40-token prefill, three decodes, a 4-row verify, and two sequences packed in one forward."""
    s, t = engine.new_sequence(), engine.new_sequence()
    out = [engine.forward([SeqInput(s, random_prompt(vocab, 40, 1), logits="all")]).logits]
    tok = int(out[-1][-1].argmax())
    for _ in range(3):
        out.append(engine.forward([SeqInput(s, [tok], logits="all")]).logits)
        tok = int(out[-1][-1].argmax())
    out.append(engine.forward([SeqInput(s, [tok, 3, 4, 5], logits="all"),
                               SeqInput(t, random_prompt(vocab, 7, 2), logits="all")]).logits)
    return out


def _plain_and_prepacked(model, monkeypatch):
    plain = copy.deepcopy(model)
    with monkeypatch.context() as m:
        m.setattr(prepack, "available", lambda: False)
        e_plain = Engine(plain)
    return e_plain, Engine(model)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])      # tied; q/k/v bias and an untied head
def test_prepacked_engine_gives_the_plain_weights_bits(name, monkeypatch):
    model = load(name, "bfloat16").model
    e_plain, e_packed = _plain_and_prepacked(model, monkeypatch)
    weights = [m.weight for L in model.layers for m in (L.attn.wqkv, L.attn.wo, L.mlp.w_gate_up, L.mlp.w_down)]
    assert all(prepack.is_prepacked(w) for w in weights)
    if model.lm_head is not None:
        assert prepack.is_prepacked(model.lm_head.weight)
    assert not prepack.is_prepacked(model.embed.weight)             # the lookup needs plain rows
    for a, b in zip(_logits(e_plain, model.cfg.vocab_size), _logits(e_packed, model.cfg.vocab_size)):
        assert torch.equal(a, b)
    Engine(model)                                                    # a second engine on the same model: no-op
    assert prepack.prepack_linears(model) == 0


def test_weights_whose_prepacked_product_differs_stay_plain(monkeypatch):
    """The start-up check is what keeps the bits: a prepacked product that rounds differently is refused."""
    monkeypatch.setattr(prepack, "_agrees", {})
    real = prepack.prepacked_linear
    monkeypatch.setattr(prepack, "prepacked_linear", lambda x, w, b=None: real(x, w, b) * (1 + 2 ** -7))
    model = load("tiny-llama", "bfloat16").model
    assert prepack.prepack_linears(model) == 0
    assert not any(prepack.is_prepacked(p) for p in model.parameters())
    assert set(prepack._agrees.values()) == {0}


def test_a_product_that_parts_above_the_row_window_is_packed_within_it(monkeypatch):
    """Where packed and plain products part only above BOUNDED_ROWS rows (oneDNN's bf16 on an AMX Xeon: at 33), a
    batch-invariant engine packs and keeps its row window within the rows that agreed, so a 70-token prefill (split
    into calls) still gives the plain weights' bits; an engine that calls with any number of rows does not pack."""
    import specdec.engine.row_tiles as RT
    real = prepack.prepacked_linear
    monkeypatch.setattr(prepack, "_agrees", {})
    monkeypatch.setattr(RT, "_probed", {})
    monkeypatch.setattr(prepack, "prepacked_linear",
                        lambda x, w, b=None: real(x, w, b) * (1 + 2 ** -7 * (x.shape[0] > prepack.BOUNDED_ROWS)))
    model = load("tiny-llama", "bfloat16").model
    e_plain, e_packed = _plain_and_prepacked(model, monkeypatch)
    assert all(prepack.rows_limit(m.weight) == prepack.BOUNDED_ROWS for m in model.linears().values() if m)
    assert e_packed.row_tiles.hi <= prepack.BOUNDED_ROWS
    prompt = random_prompt(model.cfg.vocab_size, 70, 3)
    logits = []
    for e in (e_plain, e_packed):
        logits.append(e.forward([SeqInput(e.new_sequence(), prompt, logits="all")]).logits)
    assert torch.equal(*logits)
    other = load("tiny-llama", "bfloat16").model
    Engine(other, batch_invariant=False)
    assert not any(prepack.is_prepacked(p) for p in other.parameters())


def test_what_reads_weights_sees_the_plain_ones_after_prepacking(monkeypatch):
    """Export (an HF state dict) and a restricted draft head read plain tensors, bitwise the originals."""
    model = load("tiny-qwen2", "bfloat16").model
    before = {k: v.clone() for k, v in to_hf_state_dict(model).items()}
    head = model.lm_head.weight.detach().clone()
    Engine(model)
    assert prepack.is_prepacked(model.lm_head.weight)
    after = to_hf_state_dict(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    view = restrict_vocab(model, 50)
    assert torch.equal(view.lm_head.weight, head[:50])


@pytest.mark.slow
def test_smollm2_prepacked_forward_is_bitwise_the_plain_one(monkeypatch):
    model = load("smollm2-135m", "bfloat16").model
    e_plain, e_packed = _plain_and_prepacked(model, monkeypatch)
    assert sum(prepack.is_prepacked(p) for p in model.parameters()) == 4 * model.cfg.n_layers
    for a, b in zip(_logits(e_plain, model.cfg.vocab_size), _logits(e_packed, model.cfg.vocab_size)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["block", "eagle"])
def test_block_drafter_linears_prepacked_give_the_same_drafts(kind, monkeypatch, tmp_path):
    """The drafter's own nn.Linears (row_tiles.tile_linears, as BlockDrafter does): every one prepacked, every slot's
    logits and confidence bitwise the plain module's, and a checkpoint written from the packed model is the plain
    one's."""
    from specdec.draft.block import BlockDrafter, save_checkpoint
    from specdec.engine.row_tiles import TiledLinear
    target, plain, feats, nxt, valid, prev = random_drafter_case(kind)
    packed = BlockDrafter(copy.deepcopy(plain), target, features="wire").model
    n_linear = sum(type(m) is torch.nn.Linear for m in plain.modules())
    assert n_linear == sum(isinstance(m, TiledLinear) and prepack.is_prepacked(m.weight) for m in packed.modules())
    with torch.inference_mode():
        for a, b in zip(plain.forward_train(feats, nxt, valid, prev), packed.forward_train(feats, nxt, valid, prev)):
            assert torch.equal(a, b)
    save_checkpoint(plain, tmp_path / "plain")
    save_checkpoint(packed, tmp_path / "packed")
    assert (tmp_path / "plain" / "drafter.safetensors").read_bytes() == \
        (tmp_path / "packed" / "drafter.safetensors").read_bytes()
