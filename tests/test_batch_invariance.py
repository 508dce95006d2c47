"""Batch invariance on bf16 weights: a row's logits and the KV it writes are bitwise (torch.equal) the same whatever
else is in the forward -- other sequences and their lengths, how many rows, compact or padded verify, prefill chunk
size, verify + rollback -- so a request's output cannot depend on its neighbours.

Float64 tiny models are not covered bitwise: MKL's small float64 GEMMs pick kernels by batch size, so there rows agree
to ~1e-14 (tests/test_engine_packed.py); bf16 and float32 models (float32 attention) are bitwise invariant.
"""
import pytest
import torch

from specdec.engine.engine import Engine
from specdec.engine.layout import SeqInput
from specdec.engine.registry import load
from specdec.speculative.verify import VerifyItem, verify


@pytest.fixture(scope="module")
def tiny_bf16():
    return load("tiny-qwen2", "bf16").model        # Qwen2-shaped: q/k/v bias, untied lm_head, GQA


def _models(request, name):
    return request.getfixturevalue(name) if name == "tiny_bf16" else request.getfixturevalue("smollm2").model


MODELS = [pytest.param("tiny_bf16", id="tiny-qwen2-bf16"),
          pytest.param("smollm2", id="smollm2-bf16", marks=pytest.mark.slow)]


def decode_alone(e: Engine, seq: int, start: int, tokens: list[int]) -> torch.Tensor:
    """Reference: the rows fed one at a time, each its own one-row forward. Logits [n, V]."""
    return torch.cat([e.forward([SeqInput(seq, [t], start=start + j, logits="all")]).rows(0)
                      for j, t in enumerate(tokens)])


def kv_of(e: Engine, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    slots = e.kv.slots(seq, 0, e.length(seq))
    return e.kv.k[:, slots].clone(), e.kv.v[:, slots].clone()


@pytest.mark.parametrize("name", MODELS)
def test_packed_rows_equal_rows_alone(name, request):
    """Random packs: 1..8 sequences, mixed prefix lengths (including none), 1..32 rows in all."""
    model = _models(request, name)
    V, small = model.cfg.vocab_size, name == "tiny_bf16"
    g = torch.Generator().manual_seed(1)
    e = Engine(model, kv_tokens=8192)
    for trial in range(8 if small else 3):
        nseq = int(torch.randint(1, 9, (1,), generator=g))
        rows = torch.randint(1, 5 if nseq > 4 else 9, (nseq,), generator=g).tolist()
        pre = torch.randint(0, 120 if small else 40, (nseq,), generator=g).tolist()
        seqs = [e.new_sequence() for _ in range(nseq)]
        prefixes = [torch.randint(0, V, (n,), generator=g).tolist() for n in pre]
        news = [torch.randint(0, V, (n,), generator=g).tolist() for n in rows]
        if any(pre):
            e.forward([SeqInput(s, p, logits="none") for s, p in zip(seqs, prefixes) if p])
        out = e.forward([SeqInput(s, n, logits="all") for s, n in zip(seqs, news)])
        packed_kv = [kv_of(e, s) for s in seqs]
        for i, (s, p, n) in enumerate(zip(seqs, prefixes, news)):
            alone = decode_alone(e, s, len(p), n)
            assert torch.equal(out.rows(i), alone), (trial, i, len(p), len(n))
            k, v = kv_of(e, s)
            assert torch.equal(k, packed_kv[i][0]) and torch.equal(v, packed_kv[i][1]), (trial, i)
        for s in seqs:
            e.release(s)


@pytest.mark.parametrize("name", MODELS)
def test_compact_and_padded_verify_equal(name, request):
    """The same verify in the compact layout (sum(verify_len) rows) and the padded one (gamma + 1 rows each) gives
    bitwise-equal logits for every verified row, and equal to one-row decodes."""
    model = _models(request, name)
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 17, 30)]
    drafts = [torch.randint(0, V, (4,), generator=g).tolist() for _ in prompts]
    vlen = [1, 3, 5]
    got = {}
    for layout in ("compact", "padded"):
        e = Engine(model, kv_tokens=4096)
        seqs = [e.new_sequence() for _ in prompts]
        e.prefill(seqs, [p[:-1] for p in prompts])
        items = [VerifyItem(s, len(p) - 1, p[-1], d, v) for s, p, d, v in zip(seqs, prompts, drafts, vlen)]
        got[layout], rows = verify(e, items, layout, width=5)
        assert rows == (sum(vlen) if layout == "compact" else 15)
    for i, (p, d, v) in enumerate(zip(prompts, drafts, vlen)):
        assert torch.equal(got["compact"][i], got["padded"][i]), i
        e = Engine(model, kv_tokens=4096)
        s = e.new_sequence()
        e.prefill([s], [p[:-1]])
        assert torch.equal(got["compact"][i], decode_alone(e, s, len(p) - 1, [p[-1]] + d[:v - 1])), i


@pytest.mark.parametrize("name", MODELS)
def test_prefill_chunk_size_does_not_matter(name, request):
    """Chunked prefill (1, 7, 64 rows per forward, or whole) writes equal KV and gives equal last-row logits, with a
    second prompt packed beside it."""
    model = _models(request, name)
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(3)
    n = 90 if name == "tiny_bf16" else 40
    prompts = [torch.randint(0, V, (n,), generator=g).tolist(), torch.randint(0, V, (n // 3,), generator=g).tolist()]
    results = []
    for chunk in (1, 7, 64, 10_000):
        e = Engine(model, kv_tokens=4096)
        seqs = [e.new_sequence() for _ in prompts]
        last = e.prefill(seqs, prompts, chunk_tokens=chunk)
        results.append((chunk, last, [kv_of(e, s) for s in seqs]))
    _, last0, kv0 = results[0]
    for chunk, last, kv in results[1:]:
        assert torch.equal(last, last0), chunk
        for (k, v), (k0, v0) in zip(kv, kv0):
            assert torch.equal(k, k0) and torch.equal(v, v0), chunk


@pytest.mark.parametrize("name", MODELS)
def test_decode_after_verify_and_rollback(name, request):
    """A verify block whose first row is accepted and the rest rolled back leaves no trace: the following decodes
    and the KV equal those of a run that decoded the accepted token alone."""
    model = _models(request, name)
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(4)
    prompt, block, cont = (torch.randint(0, V, (n,), generator=g).tolist() for n in (21, 6, 4))
    runs = []
    for with_verify in (True, False):
        e = Engine(model, kv_tokens=4096)
        s = e.new_sequence()
        e.prefill([s], [prompt])
        e.forward([SeqInput(s, block if with_verify else block[:1], logits="all")])
        e.truncate(s, len(prompt) + 1)
        runs.append((decode_alone(e, s, len(prompt) + 1, cont), kv_of(e, s)))
    (a, (ka, va)), (b, (kb, vb)) = runs
    assert torch.equal(a, b)
    assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("name", MODELS)
def test_decode_step_of_many_sequences_equals_each_alone(name, request, monkeypatch):
    """A decode step of 24 sequences (one row each; contexts 30..200, so several sequences share each padded key
    length and their attention runs as one stacked GEMM), a 3-sequence 5-row verify, and a mixed step (12 sequences
    bringing 1..6 rows, stacked with their rows padded to the widest): each sequence's logits equal its forward
    alone, and the stacked attention equals the one-sequence-at-a-time schedule on the same inputs."""
    from specdec.engine import attention as A
    model = _models(request, name)
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(6)
    import specdec.engine.engine as eng_mod
    plans = []
    monkeypatch.setattr(eng_mod, "plan_groups", lambda *a: plans.append(A.plan_groups(*a)) or plans[-1])
    e = Engine(model, kv_tokens=16384)
    lens = torch.randint(30, 200, (24,), generator=g).tolist()
    seqs = [e.new_sequence() for _ in lens]
    e.prefill(seqs, [torch.randint(0, V, (n,), generator=g).tolist() for n in lens])
    stacked = {}
    for width, idx in ((lambda i: 1, range(24)), (lambda i: 5, range(3)), (lambda i: 1 + i % 6, range(12))):
        news = {i: torch.randint(0, V, (width(i),), generator=g).tolist() for i in idx}
        packed = e.forward([SeqInput(seqs[i], news[i], start=lens[i], logits="all") for i in idx])
        assert any(grp.rows.shape[0] > 1 for grp in plans[-1]), "nothing was stacked"
        stacked[len(stacked)] = plans[-1]
        for k, i in enumerate(idx):
            alone = e.forward([SeqInput(seqs[i], news[i], start=lens[i], logits="all")]).rows(0)
            assert torch.equal(packed.rows(k), alone), (width(i), i)
    assert any(bool((grp.rows < 0).any()) for grp in stacked[2]), "no sequence's rows were padded"
    # the two schedules on identical inputs (random q over the engine's KV pool)
    for groups in (stacked[0], stacked[2]):
        T = int(max(grp.rows.max() for grp in groups)) + 1
        q = torch.randn(T, model.cfg.n_heads, model.cfg.hd, generator=g).to(model.embed.weight.dtype)
        k, v = e.kv.k[0], e.kv.v[0]
        assert torch.equal(A.attend_invariant(q, k, v, groups), A.attend_invariant_ref(q, k, v, groups))


def test_fast_attention_is_the_only_difference(tiny_bf16):
    """batch_invariant=False (one SDPA call per sequence) computes the same thing up to rounding."""
    V = tiny_bf16.cfg.vocab_size
    g = torch.Generator().manual_seed(5)
    prompt, new = torch.randint(0, V, (50,), generator=g).tolist(), torch.randint(0, V, (6,), generator=g).tolist()
    outs = []
    for bi in (True, False):
        e = Engine(tiny_bf16, kv_tokens=1024, batch_invariant=bi)
        s = e.new_sequence()
        e.prefill([s], [prompt])
        outs.append(e.forward([SeqInput(s, new, logits="all")]).rows(0))
    assert (outs[0] - outs[1]).abs().max() < 0.1 * outs[1].abs().max()
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))


def test_compile_tiers_need_batch_invariant_off(tiny_bf16):
    from specdec.errors import InvalidRequest
    with pytest.raises(InvalidRequest, match="batch_invariant=False"):
        Engine(tiny_bf16, compile_tiers=(8,))


def test_the_check_catches_a_non_invariant_forward(tiny_bf16, monkeypatch):
    """Planted bug: an RMSNorm that, like a split-K GEMM heuristic, reduces in two halves once 4 or more rows share
    the call (each half's sum rounded to bf16). Whether the CPU's own kernels switch with row count varies by machine
    (AMD AVX2 SDPA did, Intel AMX does not for this tiny model), so the planted switch is explicit: the
    packed-vs-alone check above must fail on it."""
    import specdec.engine.model as model_mod
    rms_norm = model_mod.rms_norm

    def split_when_packed(x, w, eps):
        if x.shape[0] < 4:
            return rms_norm(x, w, eps)
        h = x.shape[-1] // 2
        ss = x[:, :h].pow(2).sum(-1, keepdim=True) + x[:, h:].pow(2).sum(-1, keepdim=True)     # bf16 partials
        return (x.float() * torch.rsqrt(ss.float() / x.shape[-1] + eps)).to(x.dtype) * w

    monkeypatch.setattr(model_mod, "rms_norm", split_when_packed)
    with pytest.raises(AssertionError):
        test_packed_rows_equal_rows_alone("tiny_bf16", type("R", (), {"getfixturevalue": lambda _, n: tiny_bf16})())


@pytest.mark.parametrize("switch, window", [("gemv", (2, 64)), ("above16", (1, 16)), ("everywhere", (16, 16))])
def test_row_tile_probe_finds_where_a_kernel_switches(switch, window, monkeypatch):
    """Planted BLAS behaviours (each seen on some machine here): a 1-row call that rounds differently (AVX-512 bf16
    GEMV), a kernel change above 16 rows (1 thread), and a kernel whose rows depend on the row count everywhere.
    The probe must pick the window that avoids the switch, and RowTiles must then give each row the same bits."""
    import torch.nn.functional as F
    import specdec.engine.row_tiles as RT

    def planted(x, w, b=None):
        y = F.linear(x, w, b)
        n = x.shape[0]
        bump = {"gemv": n == 1, "above16": n > 16, "everywhere": n % 16}[switch]
        return y + bump * 2 ** -6 * y.abs()             # a few ulps in bf16: another kernel's rounding

    monkeypatch.setattr(RT, "linear", planted)
    monkeypatch.setattr(RT, "_probed", {})
    w = (torch.randn(96, 64, generator=torch.Generator().manual_seed(2)) * 0.1).bfloat16()
    tiles = RT.probe_row_tiles([w])
    assert (tiles.lo, tiles.hi) == window
    x = torch.randn(80, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    alone = torch.cat([tiles(x[i:i + 1], w) for i in range(80)])
    for n in (1, 2, 3, 16, 17, 33, 64, 65, 80):
        assert torch.equal(tiles(x[:n], w), alone[:n]), n
    # without the tiles the planted switch shows (the check above can fail)
    assert not all(torch.equal(planted(x[:n], w), torch.cat([planted(x[i:i + 1], w) for i in range(n)]))
                   for n in (2, 17, 33))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_attention_kernel_equals_the_gemm_schedule_up_to_rounding(dtype):
    """The CPU kernel (attend_kernel: each (row, head) in its own fixed order, float32 cache read in place) that bf16 /
    fp16 models run against the batched-GEMM schedule (attend_gemm) on the same groups: the same attention up to float32
    summation order, so outputs within two units of the output dtype's last place and mostly equal; and stacked
    sequences, padded rows included, get the bits each gets alone. A wrong key/value head, position or scale is far
    outside that."""
    from specdec.engine.attention import attend_gemm, attend_invariant_ref, attend_kernel, plan_groups
    from specdec.engine.kv_cache import KVPool
    from specdec.engine.layout import pack
    g = torch.Generator().manual_seed(3)
    kv = KVPool(1, 2, 64, 2048, page_size=16, dtype=torch.float32)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    seqs = [kv.allocate() for _ in range(3)]
    lay = pack([SeqInput(seqs[0], list(range(70)), logits="none"), SeqInput(seqs[1], list(range(9)), logits="none"),
                SeqInput(seqs[2], list(range(1)), logits="none")], kv, 96, 512)
    groups = plan_groups(lay, dtype, "cpu", 3)
    assert any(bool((grp.rows < 0).any()) for grp in groups)               # a stacked group with padded rows
    q = torch.randn(80, 6, 64, generator=g).to(dtype)
    y, ref = attend_kernel(q, kv.k[0], kv.v[0], groups), attend_gemm(q, kv.k[0], kv.v[0], groups)
    ulp = torch.finfo(dtype).eps * ref.float().abs().clamp_min(2 ** -10)
    assert ((y.float() - ref.float()).abs() <= 2.01 * ulp).all() and (y == ref).float().mean() > 0.9
    assert torch.equal(y, attend_invariant_ref(q, kv.k[0], kv.v[0], groups))
    saved = torch.get_num_threads()
    try:   # other thread counts split the work into other units (rows and heads sharing a kv head): same bits
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(y, attend_kernel(q, kv.k[0], kv.v[0], groups))
    finally:
        torch.set_num_threads(saved)
    wrong_head = attend_kernel(q.roll(1, dims=1), kv.k[0], kv.v[0], groups).view(80, 6, 64).roll(-1, dims=1)
    assert not ((wrong_head.reshape(80, -1).float() - ref.float()).abs() <= 2.01 * ulp).all()


@pytest.mark.parametrize("hd,Hkv,H", [(64, 3, 9), (32, 2, 2), (128, 1, 4), (20, 2, 6)], ids=str)
def test_attention_kernel_gives_its_reference_twins_bits(hd, Hkv, H):
    """The C++ attention kernel against attend_kernel_ref, its arithmetic written as float32 tensor ops: the same bits,
    for sequences of 1, 9 and 70 rows (tail keys outside the 8-key blocks, a head size with a tail outside 8-lane
    vectors), scores from tiny to far below exp's cut-off at -87, and any thread count. It pins the order of every
    sum, so a faster kernel (vectors of other widths, other splits of the work) must keep it."""
    from specdec.engine.attention import attend_kernel, attend_kernel_ref, plan_groups
    from specdec.engine.kv_cache import KVPool
    from specdec.engine.layout import pack
    g = torch.Generator().manual_seed(hd)
    kv = KVPool(1, Hkv, hd, 2048, page_size=16, dtype=torch.float32)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    seqs = [kv.allocate() for _ in range(3)]
    lay = pack([SeqInput(seqs[0], list(range(70)), logits="none"), SeqInput(seqs[1], list(range(9)), logits="none"),
                SeqInput(seqs[2], list(range(1)), logits="none")], kv, 96, 512)
    groups = plan_groups(lay, torch.bfloat16, "cpu", 3)
    saved = torch.get_num_threads()
    try:
        for size in (0.01, 1.0, 30.0):
            q = (size * torch.randn(80, H, hd, generator=g)).bfloat16()
            ref = attend_kernel_ref(q, kv.k[0], kv.v[0], groups)
            for n in (saved, 1, 3):
                torch.set_num_threads(n)
                assert torch.equal(attend_kernel(q, kv.k[0], kv.v[0], groups), ref), (size, n)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hkv", [1, 2])
def test_stacked_attention_equals_each_sequence_alone(dtype, Hkv):
    """Two sequences of 64 and 9 rows share a padded key length, so their attention is one stacked GEMM with the
    short one padded to 64 rows; each must get the bits it gets alone. With one kv head (a TP rank's shard) and one
    thread this failed in float64 while torch.matmul folded a lone sequence's query tiles into one tall GEMM."""
    from specdec.engine.attention import attend_invariant, attend_invariant_ref, plan_groups
    from specdec.engine.kv_cache import KVPool
    from specdec.engine.layout import pack
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        kv = KVPool(1, Hkv, 16, 1024, page_size=16, dtype=dtype)
        kv.k.copy_(torch.randn(kv.k.shape, generator=g))
        kv.v.copy_(torch.randn(kv.v.shape, generator=g))
        a, b = kv.allocate(), kv.allocate()
        lay = pack([SeqInput(a, list(range(64)), logits="none"), SeqInput(b, list(range(9)), logits="none")],
                   kv, 96, 512)
        groups = plan_groups(lay, dtype, "cpu", 2)
        assert [tuple(grp.rows.shape) for grp in groups] == [(2, 64)]
        q = torch.randn(73, 2 * Hkv, 16, generator=g).to(dtype)
        k, v = kv.k[0], kv.v[0]
        assert torch.equal(attend_invariant(q, k, v, groups), attend_invariant_ref(q, k, v, groups))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("name", MODELS)
def test_a_verify_trees_leaves_are_rows_decoded_on_their_path(name, request):
    """Verify trees (layout.py): a leaf (depth d, token x) beside a chain is bitwise the row plain decoding computes
    for x after the chain's first d rows, packed with other sequences and their leaves; the chain's rows are unchanged
    by the leaves; and once a leaf is kept (keep_leaf) the sequence decodes on as if x had been fed."""
    model = _models(request, name)
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(7)
    e = Engine(model, kv_tokens=8192)
    ref = Engine(model, kv_tokens=8192)
    pre = [30, 5, 70]
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in pre]
    chains = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 1, 3)]
    leaves = [[(1, 7), (1, 9), (3, 11), (4, 13)], [], [(2, 17)]]
    seqs = [e.new_sequence() for _ in prompts]
    e.prefill(seqs, prompts)
    out = e.forward([SeqInput(s, c, logits="all", leaves=lv) for s, c, lv in zip(seqs, chains, leaves)])
    for i, (p, c, lv) in enumerate(zip(prompts, chains, leaves)):
        rows = out.rows(i)
        assert rows.shape[0] == len(c) + len(lv)
        s = ref.new_sequence()
        ref.prefill([s], [p])
        assert torch.equal(rows[:len(c)], decode_alone(ref, s, len(p), c)), i
        for j, (d, x) in enumerate(lv):
            alone = decode_alone(ref, s, len(p), c[:d] + [x])[-1]
            assert torch.equal(rows[len(c) + j], alone), (i, d, x)
        ref.release(s)
    # the first sequence keeps its depth-3 leaf: positions .. +3 hold c[:3] + [11]; decoding on equals plain decoding
    p, c = prompts[0], chains[0]
    e.keep_leaf(seqs[0], len(p) + 5 + 2, len(p) + 3, 11)
    e.truncate(seqs[0], len(p) + 4)
    s = ref.new_sequence()
    ref.prefill([s], [p + c[:3] + [11]])
    cont = torch.randint(0, V, (3,), generator=g).tolist()
    assert torch.equal(decode_alone(e, seqs[0], len(p) + 4, cont), decode_alone(ref, s, len(p) + 4, cont))


def test_fast_attention_runs_verify_trees_too(tiny_bf16):
    """Without batch invariance a leaf's row is its path's row up to rounding."""
    V = tiny_bf16.cfg.vocab_size
    g = torch.Generator().manual_seed(8)
    p, c = torch.randint(0, V, (40,), generator=g).tolist(), torch.randint(0, V, (4,), generator=g).tolist()
    e = Engine(tiny_bf16, kv_tokens=4096, batch_invariant=False)
    s, t = e.new_sequence(), e.new_sequence()
    e.prefill([s, t], [p, p])
    rows = e.forward([SeqInput(s, c, logits="all", leaves=[(2, 5)])]).rows(0)
    path = e.forward([SeqInput(t, c[:2] + [5], logits="all")]).rows(0)
    torch.testing.assert_close(rows[-1], path[-1], rtol=0.05, atol=0.05)
    assert not torch.allclose(rows[-1], rows[2], rtol=0.05, atol=0.05)     # it is not the chain's row
