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
    # the first prompt, released after its verify, leaves its third page (the system prompt's last 5 tokens, its own
    # 9, then the verify's first 2): the second and third prompts take the system prompt's 37 tokens (two pages and 5
    # positions of that one), the fifth its first 33 (its last row always runs), and in the last prefill the first
    # prompt all but its last row (45) and the second 37
    assert plain.rows_processed - cached.rows_processed == 37 + 37 + 33 + 45 + 37
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


@pytest.mark.parametrize("name,dtype", [("tiny-llama", "float64"), ("tiny-qwen2", "bfloat16")])
def test_a_burst_of_prompts_with_one_system_prompt_runs_it_once(name, dtype):
    """Prompts prefilled together that begin alike: the first runs in a forward of its own (with the others that
    share nothing), the rest after it, taking its full pages; logits bitwise. Below SHARE_MIN_ROWS rows saved, one
    forward as before."""
    model = load(name, dtype).model
    V = model.cfg.vocab_size
    system = random_prompt(V, 50, 0)
    burst = [system + random_prompt(V, k, k) for k in (5, 9, 13)] + [random_prompt(V, 30, 7)]
    plain = Engine(model, kv_tokens=2048, prefix_cache=False)
    cached = Engine(model, kv_tokens=2048, prefix_cache=True)
    want = plain.prefill([plain.new_sequence() for _ in burst], burst)
    forwards = cached.path_counts["eager"]
    assert torch.equal(cached.prefill([cached.new_sequence() for _ in burst], burst), want)
    assert cached.path_counts["eager"] - forwards == 2
    assert plain.rows_processed - cached.rows_processed == 48 + 48     # the first prompt's three full pages, twice
    other = random_prompt(V, 20, 3)
    pair = [other + random_prompt(V, 9, 1), other + random_prompt(V, 9, 2)]      # one page (16 rows) to share
    forwards, rows = cached.path_counts["eager"], cached.rows_processed
    cached.prefill([cached.new_sequence() for _ in pair], pair)
    assert cached.path_counts["eager"] - forwards == 1 and cached.rows_processed - rows == 58


def _turn(engine: Engine, prompt: list[int]) -> tuple[int, list[int], list[torch.Tensor]]:
    """A prefilled prompt, 8 greedy decodes, a 4-row verify that keeps one draft (the bonus token overwrites the
    second row, in a page that fills later), 22 decodes: (sequence, the tokens whose K/V its pages hold, every
    logit)."""
    s = engine.new_sequence()
    out = [engine.prefill([s], [prompt])]
    toks = list(prompt)

    def decode(n):
        for _ in range(n):
            toks.append(int(out[-1][-1].argmax()))
            out.append(engine.forward([SeqInput(s, toks[-1:], logits="all")]).logits)
    decode(8)
    tok = int(out[-1][-1].argmax())
    out.append(engine.forward([SeqInput(s, [tok, 3, 4, 5], start=len(toks), logits="all")]).logits)
    toks += [tok, int(out[-1][0].argmax())]                                # one draft kept, then the bonus token
    out.append(engine.forward([SeqInput(s, toks[-1:], start=len(toks) - 1, logits="all")]).logits)
    decode(22)
    return s, toks, out


@pytest.mark.parametrize("name,dtype", [("tiny-llama", "float64"), ("tiny-qwen2", "bfloat16")])
def test_a_released_sequence_leaves_its_answer_for_the_next_turn(name, dtype):
    """A chat's next turn begins with this turn's prompt and answer: a released sequence's full pages (positions whose
    K/V it wrote, a rolled-back verify's rows overwritten) stay cached, and the next turn runs only the rest, with
    the logits of running it all."""
    model = load(name, dtype).model
    V = model.cfg.vocab_size
    prompt = random_prompt(V, 21, 0)
    plain = Engine(model, kv_tokens=2048, prefix_cache=False)
    cached = Engine(model, kv_tokens=2048, prefix_cache=True)
    (s0, toks0, out0), (s1, toks1, out1) = _turn(plain, prompt), _turn(cached, prompt)
    assert toks0 == toks1 and all(torch.equal(a, b) for a, b in zip(out0, out1))
    plain.release(s0)
    cached.release(s1)
    nxt = toks1 + random_prompt(V, 7, 1)                                     # the next user turn
    rows = cached.rows_processed
    assert torch.equal(plain.prefill([plain.new_sequence()], [nxt]), cached.prefill([cached.new_sequence()], [nxt]))
    assert cached.rows_processed - rows == len(nxt) - len(toks1) // 16 * 16    # only the last partial page runs


def test_a_forward_that_fails_leaves_its_sequence_nothing_to_offer(monkeypatch):
    """K/V half written by a forward that raised are never cached: the sequence's tokens are forgotten."""
    model = load("tiny-llama", "float64").model
    V = model.cfg.vocab_size
    e = Engine(model, kv_tokens=512, prefix_cache=True)
    s = e.new_sequence()
    e.prefill([s], [random_prompt(V, 20, 0)])
    for t in random_prompt(V, 20, 1):                                        # 40 positions: a second full page
        e.forward([SeqInput(s, [t])])
    assert e.kv.cached_pages == 1                                            # the prompt's page, so far

    def boom(*a, **k):
        raise RuntimeError("planted")
    monkeypatch.setattr(e.model, "forward", boom)
    with pytest.raises(RuntimeError, match="planted"):                      # rolls back into the second page
        e.forward([SeqInput(s, random_prompt(V, 22, 2), start=18)])
    monkeypatch.undo()
    e.release(s)
    assert e.kv.cached_pages == 1


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


@pytest.mark.slow
def test_a_second_turn_reuses_the_first_turns_answer():
    """SmolLM2, greedy with n-gram drafting: a chat's second turn (the first turn's prompt and answer, then a user
    turn) gives the text of the run without the cache, and runs fewer rows than its own length."""
    lm = load("smollm2-135m")
    first = encode(lm.tokenizer, load_prompts("chat", 1)[0])
    user = lm.tokenizer.encode("<|im_end|>\n<|im_start|>user\nNow say it in one sentence.<|im_end|>\n"
                               "<|im_start|>assistant\n")
    outs, second_rows = [], []
    for pc in (False, True):
        eng = Engine(lm.model, kv_tokens=8192, prefix_cache=pc)
        gen = SpeculativeGenerator(eng, make_drafter("ngram", lm.model), gamma=4)
        answer = gen.generate([GenRequest(first, SamplingParams(), 48)])[0].tokens
        rows = eng.rows_processed
        outs.append((answer, gen.generate([GenRequest(first + answer + user, SamplingParams(), 24)])[0].tokens))
        second_rows.append(eng.rows_processed - rows)
    assert outs[0] == outs[1]
    assert second_rows[1] <= second_rows[0] - 48      # the first turn's prompt and most of its answer were not run
