"""Tier gating: uniform layouts whose row count is a compile tier take the compiled kernels, ragged ones (and other
row counts) stay eager, and both give the same logits. Compiling takes ~15 s on 2 cores, hence `slow`."""
import pytest

from specdec.engine.engine import Engine
from specdec.engine.layout import SeqInput
from specdec.engine.registry import load

from .conftest import random_prompt


@pytest.mark.slow
def test_tier_gate_paths_and_logits():
    model = load("tiny-qwen2").model
    V = model.cfg.vocab_size
    # compiled graphs round differently from the batch-invariant kernels, so tiers run with it off (both sides alike)
    tiered, eager = Engine(model, compile_tiers=(6,), batch_invariant=False), Engine(model, batch_invariant=False)
    prefixes = [random_prompt(V, n, seed=n) for n in (5, 11, 3)]
    layouts = {
        "uniform 3x2 (tier 6)": ([2, 2, 2], "compiled"),
        "ragged 1+2+3 (6 rows, not uniform)": ([1, 2, 3], "eager"),
        "uniform 3x1 (3 rows, no tier)": ([1, 1, 1], "eager"),
        "uniform 3x2 again (graph reused)": ([2, 2, 2], "compiled"),
    }
    for name, (ns, path) in layouts.items():
        outs = []
        for e in (tiered, eager):
            seqs = [e.new_sequence() for _ in prefixes]
            e.prefill(seqs, prefixes)                 # prefill lengths differ: ragged, eager on both
            before = dict(e.path_counts)
            out = e.forward([SeqInput(s, random_prompt(V, n, seed=10 + i), logits="all")
                             for i, (s, n) in enumerate(zip(seqs, ns))])
            outs.append((out.logits, {k: e.path_counts[k] - before[k] for k in before}))
            for s in seqs:
                e.release(s)
        (got, moved), (ref, _) = outs
        assert moved[path] == 1, name
        assert (got - ref).abs().max() < 1e-10, name
