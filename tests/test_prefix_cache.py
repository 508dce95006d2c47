"""The prefix cache (engine/kv_cache.py): a prompt that begins like an earlier one runs only its new rows, and every
logit is bitwise what running all of them gives (the engine is batch-invariant, so a position's K/V do not depend on
the forward that computed them)."""
from __future__ import annotations

import pytest
import torch

from specdec.bench.prompts import encode, load_prompts
from specdec.draft import make_drafter
from specdec.engine.engine import Engine
from specdec.engine.layout import SeqInput
from specdec.engine.registry import load
from specdec.speculative.generator import GenRequest, SpeculativeGenerator
from specdec.speculative.sampling import SamplingParams
from tests.conftest import random_prompt


def _logits(engine: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt: prefilled, two decodes, a 4-row verify that rolls back to the prompt, two prompts in one prefill."""
    out = []
    for p in prompts:
        s = engine.new_sequence()
        out.append(engine.prefill([s], [p]))
        tok = int(out[-1][-1].argmax())
        for _ in range(2):
            out.append(engine.forward([SeqInput(s, [tok], logits="all")]).logits)
            tok = int(out[-1][-1].argmax())
        out.append(engine.forward([SeqInput(s, [tok, 3, 4, 5], start=len(p), logits="all")]).logits)
        engine.release(s)
    a, b = engine.new_sequence(), engine.new_sequence()
    out.append(engine.prefill([a, b], prompts[:2]))
    return out


@pytest.mark.parametrize("name,dtype", [("tiny-llama", "float64"), ("tiny-qwen2", "bfloat16"),
                                        pytest.param("smollm2-135m", "bfloat16", marks=pytest.mark.slow)])
def test_a_cached_prefix_gives_the_bits_of_running_it(name, dtype):
    model = load(name, dtype).model
    V = model.cfg.vocab_size
    system = random_prompt(V, 37, 0)                          # two full pages and a part
    prompts = [system + random_prompt(V, k, 1 + k) for k in (9, 1, 30)] + [random_prompt(V, 20, 9), system[:-3]]
    plain = Engine(model, kv_tokens=2048, prefix_cache=False)
    cached = Engine(model, kv_tokens=2048, prefix_cache=True)
    for a, b in zip(_logits(plain, prompts), _logits(cached, prompts)):
        assert torch.equal(a, b)
    # the second and third prompts skip the system prompt's two full pages; then the third prompt's third page (the
    # system prompt's last 5 tokens, then its own) is cached: the fifth prompt takes one more position from it (its
    # last row always runs), and both of the last prefill take 5 more (the system prompt's tail)
    assert plain.rows_processed - cached.rows_processed == 32 + 32 + 33 + 37 + 37
    assert cached.kv_capacity_tokens - cached.kv_free_tokens == 16 * 4       # a and b: 2 shared pages, 1 each


def test_a_refused_prefill_leaves_the_sequence_empty():
    """A prompt refused after its prefix was matched (a token outside the vocabulary) leaves no pages behind."""
    model = load("tiny-llama", "float64").model
    e = Engine(model, kv_tokens=256)
    p = random_prompt(model.cfg.vocab_size, 40, 0)
    e.prefill([e.new_sequence()], [p])
    s = e.new_sequence()
    with pytest.raises(Exception, match="outside the vocabulary"):
        e.forward([SeqInput(s, p[:36] + [model.cfg.vocab_size])])
    assert e.length(s) == 0
    e.forward([SeqInput(s, p)])
    assert e.length(s) == 40


@pytest.mark.slow
def test_speculative_greedy_text_is_unchanged_by_the_prefix_cache(monkeypatch):
    """Chat prompts share SmolLM2's system prompt; greedy output with n-gram drafting equals the run without the
    cache, which ran more rows. (Prompts prefilled in one forward do not share: none is cached before it runs.)"""
    lm = load("smollm2-135m")
    prompts = [encode(lm.tokenizer, it) for it in load_prompts("chat", 4)]
    outs, rows = [], []
    for pc in (False, True):
        eng = Engine(lm.model, kv_tokens=8192, prefix_cache=pc)
        gen = SpeculativeGenerator(eng, make_drafter("ngram", lm.model), gamma=4)
        outs.append([gen.generate([GenRequest(p, SamplingParams(), 24)])[0].tokens for p in prompts])   # in turn
        rows.append(eng.rows_processed)
    assert outs[0] == outs[1]
    assert rows[1] < rows[0]
