"""Weight-only quantized execution (engine/quant.py): the GGUF-block conversion, the packed kernels, and exactness
of speculative decoding on quantized models (speculative == target-only, both quantized, token for token)."""
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specdec.draft import make_drafter
from specdec.draft.model import ModelDrafter
from specdec.engine import hugepages
from specdec.engine import quant as Q
from specdec.engine.engine import Engine
from specdec.engine.prepack import dense
from specdec.engine.registry import load
from specdec.engine.row_tiles import UNBOUNDED, RowTiles, probe_row_tiles
from specdec.errors import ModelError
from specdec.generate import Request, generate
from specdec.speculative.generator import GenRequest, SpeculativeGenerator
from specdec.speculative.sampling import SamplingParams

from .conftest import random_prompt

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

F16_OFFSETS = {QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q4_K: [0, 2]}     # byte offsets of a block's f16 fields


def random_blocks(qtype, N: int, K: int, seed: int) -> np.ndarray:
    """Random GGUF blocks for an [N, K] weight: random codes and (sub-)scales, finite f16 scales of weight-like size."""
    rng = np.random.default_rng(seed)
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(N * K // block_elems, block_bytes), dtype=np.uint8)
    for off in F16_OFFSETS[qtype]:
        raw[:, off:off + 2] = rng.uniform(-0.01, 0.01, size=len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(N, -1)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K], ids=lambda t: t.name)
def test_gguf_blocks_convert_bitwise(qtype):
    N, K = 48, 512
    data = random_blocks(qtype, N, K, seed=int(qtype))
    codes, scale, offset = Q.gguf_int4(data, qtype, (N, K))
    ref = torch.from_numpy(dequantize(data, qtype).reshape(N, K).astype(np.float32))
    assert torch.equal(Q.dequantize_int4(codes, scale, offset), ref)          # float32, bitwise

    # The packed layout holds exactly these codes, and the float32 kernel computes fma((q - 8), scale, zero) with
    # zero = offset + 8 * scale: one rounding of zero away from the file (Q4_0: zero = 0, so the file's values).
    lin = Q.QLinear.int4(codes, scale, offset, dtype=torch.float32)
    assert torch.equal(Q.unpack_int4(lin.qweight, N, K), codes)
    kernel_w = lin.mm(torch.eye(K)).t()
    zero = offset + 8 * scale
    fma = ((codes.double().reshape(N, K // 32, 32) - 8) * scale.double()[..., None] + zero.double()[..., None])
    assert torch.equal(kernel_w, fma.reshape(N, K).float())
    if qtype == QT.Q4_0:
        assert torch.equal(kernel_w, ref)
    assert Q.gguf_int4(data, QT.Q8_0, (N, K)) is None                       # other types are requantized

    # w4a8 keeps scale and offset in fp16, the type Q4_0 / Q4_1 store them in: their weights are the file's bitwise;
    # Q4_K's scale (d times a 6-bit sub-block scale) is rounded to fp16 (11-bit mantissa)
    q4 = Q.QLinear.q(4, codes, scale, offset, dtype=torch.float32).dequantize()
    if qtype == QT.Q4_K:
        assert (q4 - ref).abs().max() <= 2 ** -11 * 16 * scale.abs().max() + 2 ** -11 * offset.abs().max()
    else:
        assert torch.equal(q4, ref)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_qlinear_matches_dequantized_matmul(kind, dtype):
    """The kernel equals x @ W^T over its own dequantized weight W up to: rounding the output to `dtype` (half an ulp,
    2^-9 relative in bf16) and rounding each dequantized weight to `dtype` before the multiply (2^-9 |w| each), i.e.
    |y - ref| <= u |ref| + u sum_k |x_k w_k| with u = 2^-8 (bf16) or 2^-20 (float32, with slack for the float32
    accumulation order). A wrong layout or scale misplaces whole weights: errors of order |ref|, far outside."""
    g = torch.Generator().manual_seed(0)
    N, K = 160, 512
    w = torch.randn(N, K, generator=g) * 0.02
    lin = (Q.QLinear.int4(*Q.quantize_int4(w), dtype=dtype) if kind == "int4"
           else Q.QLinear.int8(*Q.quantize_int8(w), dtype=dtype))
    x = torch.randn(16, K, generator=g).to(dtype)
    W = lin.dequantize().double()
    ref = x.double() @ W.t()
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -20
    bound = u * ref.abs() + u * (x.double().abs() @ W.abs().t())
    err = (Q.linear(x, lin).double() - ref).abs()
    assert (err <= bound).all(), (err / bound).max()
    # ... and the bound is tight enough to catch a misplaced group: permute the groups of one row and it fails
    assert not ((x.double() @ W.roll(32, dims=1).t() - ref).abs() <= bound).all()
    # the quantized weight itself is close to the float one (int4: half a step of a 16-level group, int8 of 255)
    step = (w.reshape(N, -1, 32).amax(-1) - w.reshape(N, -1, 32).amin(-1)).amax() / 15 if kind == "int4" \
        else w.abs().amax() / 127
    assert (lin.dequantize() - w).abs().max() <= step * 0.51 + 2 ** -7 * w.abs().max()


def _qlinear(kind: str, w: torch.Tensor, dtype=torch.bfloat16) -> Q.QLinear:
    return {"int4": lambda: Q.QLinear.int4(*Q.quantize_int4(w), dtype=dtype),
            "int8": lambda: Q.QLinear.int8(*Q.quantize_int8(w), dtype=dtype),
            "q4": lambda: Q.QLinear.q(4, *Q.quantize_int4(w), dtype=dtype),
            "q6": lambda: Q.QLinear.q(6, *Q.quantize_q6(w), dtype=dtype),
            "q8": lambda: Q.QLinear.q(8, *Q.quantize_q8(w), dtype=dtype)}[kind]()


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_qdot_matches_its_reference(bits, dtype):
    """Our int8-activation kernel (engine/kernels/qdot.cpp) against its float64 twin (same activation rounding, exact
    sums): the integer dots are exact, so what differs is float32 accumulation and rounding the output to `dtype`:
    |y - ref| <= u |ref| + 2^-20 sum |terms| (u = 2^-8 bf16, 2^-20 float32). A misplaced group or nibble, or a
    wrong scale, is an error of order |ref|, which the same bound catches (checked on a rolled weight)."""
    from specdec.engine import kernels
    g = torch.Generator().manual_seed(2)
    N, K = 200, 576 if bits == 4 else 352              # N: 3 quads of 64 and a padded one; K/32 = 18, 11
    w = torch.randn(N, K, generator=g) * 0.02
    codes, scale, offset = {4: Q.quantize_int4, 6: Q.quantize_q6, 8: Q.quantize_q8}[bits](w)
    lin = Q.QLinear.q(bits, codes, scale, offset, dtype=dtype)
    s16, o16 = lin.group_params()                     # the fp16 scales the kernel reads
    x = torch.randn(9, K, generator=g)
    x[2] *= 300                                       # a row of large activations
    x[4, :32] = 0                                     # an all-zero group
    x = x.to(dtype)
    ref = kernels.qdot_reference(x, codes, s16, o16)
    xq, a = kernels.quantize_activations(x)
    terms = (a.double()[:, None, :] * s16.double()[None]).abs() * \
        torch.einsum("mgj,ngj->mng", xq.double().abs(), codes.reshape(N, -1, 32).double())
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -20
    offsets = (a.double() * xq.double().abs().sum(-1)) @ o16.double().abs().t()
    bound = u * ref.abs() + 2.0 ** -20 * (terms.sum(-1) + offsets)
    y = lin.mm(x)
    assert y.dtype == dtype and ((y.double() - ref).abs() <= bound).all()
    assert not ((kernels.qdot_reference(x, codes.roll(32, dims=1), s16, o16) - ref).abs() <= bound).all()
    # the dequantised weight is what the kernel multiplies, and the rounded activations are near x (half a step)
    assert torch.allclose(x.double() @ lin.dequantize().double().t(), ref, rtol=0.05, atol=0.05 * ref.abs().max())
    assert ((xq * a[..., None]).reshape(x.shape) - x.float()).abs().le(a.repeat_interleave(32, 1) * 0.5001).all()


def test_q6_holds_every_weight_within_half_a_step():
    """The w4a8 head (q6): 64 levels between each group's min and max, and its packed codes (4 low bits as q4's, 2
    rows of high bits) unpack to the quantizer's own: the dequantised weight is scale * code + offset exactly, within
    half a step of the float weight (plus the fp16 rounding of the offset)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(130, 96, generator=g) * 0.05
    w[5, :32] = 0.3                                     # a constant group: every code 0, the offset its value
    codes, scale, offset = Q.quantize_q6(w)
    assert int(codes.max()) == 63 and int(codes.min()) == 0
    lin = Q.QLinear.q(6, codes, scale, offset, dtype=torch.float32)
    exact = (codes.float().reshape(130, 3, 32) * scale[..., None] + offset[..., None]).reshape(130, 96)
    assert torch.equal(lin.dequantize(), exact)
    step = scale.repeat_interleave(32, 1)
    assert ((exact - w).abs() <= 0.5 * step + 2 ** -11 * offset.abs().repeat_interleave(32, 1) + 1e-7).all()


def test_w4a8_head_keeps_the_files_precision():
    """The w4a8 head is 6-bit only where the file holds it in at most Q6_K's 6.56 bits a weight (Qwen 1.5B's Q4_K_M
    file); a Q8_0 or float head (SmolLM2's file, the 0.5B draft's) and a model without a file keep 8 bits."""
    assert Q._kind("w4a8", "lm_head", QT.Q6_K) == "q6" and Q._kind("w4a8", "lm_head", QT.Q4_K) == "q6"
    assert [Q._kind("w4a8", "lm_head", t) for t in (QT.Q8_0, QT.F16, QT.F32, None)] == ["q8"] * 4
    assert Q._kind("w4a8", "layers.0.mlp.w_down", QT.Q6_K) == "q4" and Q._kind("w8a8", "lm_head", QT.Q6_K) == "q8"
    assert Q._kind("int4", "lm_head", QT.Q6_K) == "int8"


@pytest.mark.parametrize("kind", ["int8", "q8", "q6", "q4"])
def test_first_rows_is_the_heads_first_outputs_bitwise(kind):
    """A restricted draft head (draft.model.restrict_vocab) is a view of the head's first rows, and each output of
    these kernels is computed on its own: the cut head gives exactly the full head's first outputs."""
    g = torch.Generator().manual_seed(5)
    lin = _qlinear(kind, torch.randn(200, 96, generator=g) * 0.02)
    cut = lin.first_rows(64)
    x = torch.randn(3, 96, generator=g).to(torch.bfloat16)
    assert cut.shape == (64, 96) and cut.qweight.data_ptr() == lin.qweight.data_ptr()
    assert torch.equal(cut.mm(x), lin.mm(x)[:, :64])
    assert torch.equal(cut[torch.tensor([3, 63])], lin[torch.tensor([3, 63])])
    assert lin.first_rows(200) is lin
    if kind != "int8":      # the packed layout cuts only at whole quads of 64 outputs
        with pytest.raises(ModelError, match="draft_vocab"):
            lin.first_rows(60)


@pytest.mark.parametrize("kind", ["int8", "int4", "q8", "q6", "q4"])
def test_packed_kernels_row_invariant(kind):
    """A row's output bits do not depend on how many rows share the call (the engine probes this at start-up)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(960, 576, generator=g) * 0.02
    lin = _qlinear(kind, w, torch.bfloat16)
    x = torch.randn(40, 576, generator=g).bfloat16()
    alone = torch.cat([lin.mm(x[i:i + 1]) for i in range(40)])
    for n in (1, 2, 3, 4, 5, 7, 8, 16, 17, 33, 40):
        assert torch.equal(lin.mm(x[:n]), alone[:n]), n
    assert probe_row_tiles([lin]) == RowTiles(1, UNBOUNDED if kind in Q.BITS else 64)   # qdot: no split at all


@pytest.mark.parametrize("kind", ["q4", "q6", "q8"])
def test_qdot_tile_schemes_give_the_same_bits(kind):
    """The vector path's two tile schemes (wide: quad-wide tiles of up to 6 rows below 32 rows; narrow: up to 4 rows
    below 8, 8-row one-block tiles from there; the process picks the faster) cut a call's rows differently and give
    the same bits, each row's those of the row alone. On an AVX2 build there is one scheme and the switch is refused."""
    from specdec.engine import kernels
    g = torch.Generator().manual_seed(7)
    w = torch.randn(200, 352, generator=g) * 0.02      # 3 quads and a padded one; 11 groups
    lin = _qlinear(kind, w, torch.bfloat16)
    x = torch.randn(41, 352, generator=g).bfloat16()
    x[9] *= 300
    kept = kernels.qdot_tiles()
    try:
        out = {}
        for scheme in kernels.TILE_SCHEMES:
            if kernels.qdot_tiles(scheme) != scheme:
                assert scheme == "narrow" and kernels.qdot_tiles() == "wide"   # an AVX2 build
                continue
            alone = torch.cat([lin.mm(x[i:i + 1]) for i in range(41)])
            for n in (2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 31, 32, 41):
                out[scheme, n] = lin.mm(x[:n])
                assert torch.equal(out[scheme, n], alone[:n]), (scheme, n)
        assert len(out) in (14, 28)
    finally:
        kernels.qdot_tiles(kept)


def test_qdot_tile_scheme_from_the_environment():
    """SPECDEC_QDOT_TILES=wide|narrow fixes the scheme a process uses (auto, the default, times both at first use);
    an AVX2 build has only wide; another value is refused, naming the variable and its values. Each in a child
    process, since the choice is made once per process."""
    import subprocess
    import sys
    from specdec.engine import kernels
    kept = kernels.qdot_tiles()
    avx2_only = kernels.qdot_tiles("narrow") != "narrow"
    kernels.qdot_tiles(kept)
    child = "from specdec.engine import kernels; print(kernels.qdot_tiles())"
    for scheme in ("wide", "narrow"):
        out = subprocess.run([sys.executable, "-c", child], env={**os.environ, "SPECDEC_QDOT_TILES": scheme},
                             capture_output=True, text=True, check=True, timeout=300).stdout.split()
        assert out[-1] == ("wide" if avx2_only else scheme)
    bad = subprocess.run([sys.executable, "-c", child], env={**os.environ, "SPECDEC_QDOT_TILES": "fast"},
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "SPECDEC_QDOT_TILES" in bad.stderr and "wide or narrow" in bad.stderr


@pytest.mark.parametrize("kind", ["q4", "q6", "q8"])
def test_qdot_prefetch_distance_changes_no_bit(kind):
    """qdot prefetches the weights it streams some bytes ahead (kernels.qdot_prefetch; 0 off): a hint to the cache,
    which must not change an output, at any row count or distance, nor at the matrix's end (prefetches past the
    weights' last byte)."""
    from specdec.engine import kernels
    g = torch.Generator().manual_seed(8)
    w = torch.randn(200, 352, generator=g) * 0.02
    lin = _qlinear(kind, w, torch.bfloat16)
    x = torch.randn(9, 352, generator=g).bfloat16()
    kept = kernels.qdot_prefetch()
    try:
        kernels.qdot_prefetch(0)
        assert kernels.qdot_prefetch() == 0
        ref = {n: lin.mm(x[:n]) for n in (1, 2, 5, 9)}
        for nbytes in (64, 1024, 4096, 1 << 20):
            assert kernels.qdot_prefetch(nbytes) == nbytes
            for n, y in ref.items():
                assert torch.equal(lin.mm(x[:n]), y), (nbytes, n)
    finally:
        kernels.qdot_prefetch(kept)


def test_qdot_prefetch_from_the_environment():
    """SPECDEC_QDOT_PREFETCH=bytes sets the distance for the process (1024 unless set); anything but a number of bytes
    up to 1 MiB is refused, naming the variable and the remedy. In child processes: it is read once."""
    import subprocess
    import sys
    child = "from specdec.engine import kernels; print(kernels.qdot_prefetch())"
    run = lambda v: subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300,
                                   env={**{k: e for k, e in os.environ.items() if k != "SPECDEC_QDOT_PREFETCH"},
                                        **({} if v is None else {"SPECDEC_QDOT_PREFETCH": v})})
    assert run(None).stdout.split()[-1] == "1024"
    assert run("0").stdout.split()[-1] == "0"
    assert run("2560").stdout.split()[-1] == "2560"
    for bad in ("-5", "far", str(1 << 21)):
        out = run(bad)
        assert out.returncode != 0 and "SPECDEC_QDOT_PREFETCH" in out.stderr and "number of bytes" in out.stderr, bad


@pytest.mark.parametrize("kind", ["q4", "q6", "q8"])
def test_qdot_amx_tiles_give_the_vector_paths_bits(kind):
    """On a CPU with AMX (Sapphire Rapids and later) qdot runs whole tiles of 16 rows of a call of 16 rows or more on
    the tile unit: the same exact int32 dots, the same float chain per output, so the same bits as the vector path
    (switched off in the same process) and as each row alone. Skipped on a CPU without AMX, where there is no second
    path."""
    from specdec.engine import kernels
    if not kernels.qdot_amx():
        pytest.skip("this CPU (or kernel) has no AMX tiles")
    g = torch.Generator().manual_seed(6)
    w = torch.randn(200, 352, generator=g) * 0.02     # 3 quads and a padded one; 11 groups (an odd count)
    lin = _qlinear(kind, w, torch.float32)
    x = torch.randn(51, 352, generator=g)             # 3 whole tiles and 3 rows on the vector path
    x[20] *= 500
    x[37, :32] = 0
    try:
        tiles = {n: lin.mm(x[:n]) for n in (16, 35, 51)}
        kernels.qdot_amx(False)
        for n, y in tiles.items():
            assert torch.equal(y, lin.mm(x[:n])), n
        assert torch.equal(tiles[51], torch.cat([lin.mm(x[i:i + 1]) for i in range(51)]))
    finally:
        kernels.qdot_amx(True)


@pytest.mark.parametrize("kind", ["q4", "q6", "q8"])
def test_qdot_avx2_build_gives_the_same_bits(tmp_path, kind):
    """A CPU without AVX-512 runs qdot.cpp's AVX2 path (two ymm for a vector of 16 outputs, maddubs for dpbusd): it
    computes the same exact int32 dots and the same float chain per output, so its bits are this machine's (on an
    AVX2-only CPU both builds are that path). Built in a child process with -mno-avx512f."""
    from specdec.engine import kernels
    if "avx512f" not in kernels._cpu_flags().split():
        # the child would compile the kernels once more (92 s on a 2-core Zen 3) to compare this build with itself;
        # this build is the AVX2 path, checked against its float64 twin by test_qdot_matches_its_reference
        pytest.skip("no AVX-512 here: this CPU's own build is the AVX2 path")
    import subprocess
    import sys
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(4)
    w = torch.randn(200, 352, generator=g) * 0.02
    lin = _qlinear(kind, w, torch.float32)
    x = torch.randn(11, 352, generator=g)             # float32 out: a bf16 output would hide a last-bit difference
    x[3] *= 500
    save_file({"x": x, **lin.state_dict()}, str(tmp_path / "in.safetensors"))
    child = (f"import torch; from safetensors.torch import load_file, save_file; from specdec.engine import kernels\n"
             f"t = load_file({str(tmp_path / 'in.safetensors')!r})\n"
             f"y = kernels.qdot(t['x'], t['qweight'], {Q.BITS[kind]}, 200)\n"
             f"save_file({{'y': y}}, {str(tmp_path / 'out.safetensors')!r})\n")
    env = {**os.environ, "SPECDEC_KERNEL_CFLAGS": "-mno-avx512f"}
    subprocess.run([sys.executable, "-c", child], env=env, check=True, timeout=600)
    from safetensors.torch import load_file
    assert torch.equal(load_file(str(tmp_path / "out.safetensors"))["y"], lin.mm(x))


@pytest.mark.parametrize("mode", ["int4", "w4a8"])
def test_cache_round_trip(tmp_path, mode):
    m = Q.quantize_model(load("tiny-qwen2", "bf16").model, mode)
    Q.save_quantized(m, tmp_path / "q")
    m2 = Q.load_quantized(tmp_path / "q")
    p = random_prompt(m.cfg.vocab_size, 12, seed=3)
    assert torch.equal(Engine(m).score(p), Engine(m2).score(p))
    assert isinstance(m2.lm_head, Q.QLinear) and isinstance(m2.layers[1].mlp.w_down, Q.QLinear)
    if hugepages.available():       # loaded into memory advised for huge pages (hugepages.py)
        assert all(hugepages.advised(t) for t in m2.state_dict().values() if t.numel())


def test_copy_to_huge_pages():
    """The copies are the same bits, dtypes and shapes, each on a 64-byte boundary, in a mapping advised for huge
    pages (Linux); the mapping outlives the dict it came in; a plain allocation is not advised."""
    import gc
    g = torch.Generator().manual_seed(3)
    src = {"a": torch.randint(0, 256, (3, 70), dtype=torch.uint8, generator=g),
           "b": torch.randn(5, 7, generator=g).to(torch.bfloat16), "c": torch.randn(33, generator=g).double(),
           "empty": torch.empty(0, 4), "t": torch.randn(4, 6, generator=g).t()}
    out = hugepages.copy_to_huge_pages(src)
    kept = out["b"]
    for k, v in src.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and torch.equal(out[k], v), k
        assert out[k].data_ptr() % 64 == 0 or not v.numel(), k
    if not hugepages.available():
        pytest.skip("no madvise(MADV_HUGEPAGE) here: plain clones (checked above)")
    assert all(hugepages.advised(out[k]) for k in "abct") and not hugepages.advised(torch.randn(4096))
    del out
    gc.collect()
    assert torch.equal(kept, src["b"]) and hugepages.advised(kept)


@pytest.mark.parametrize("mode", ["int8", "int4", "w4a8"])
def test_tied_embedding_is_read_from_the_int8_head(tmp_path, mode):
    """A tied model keeps one int8 table: the embedding looks rows up in the output head (no bf16 table is left in
    the model), each row bitwise the head's dequantised row, and the cache round trip keeps the link."""
    m = Q.quantize_model(load("tiny-llama", "bf16").model, mode)
    assert isinstance(m.embed, Q.QEmbedding) and m.embed.weight is m.lm_head
    assert not any(k.startswith("embed") for k in m.state_dict())
    toks = torch.tensor([0, 5, 5, m.cfg.vocab_size - 1])
    assert torch.equal(m.embed(toks), m.lm_head.dequantize()[toks].to(torch.bfloat16))
    Q.save_quantized(m, tmp_path / "q")
    m2 = Q.load_quantized(tmp_path / "q")
    assert isinstance(m2.embed, Q.QEmbedding) and m2.embed.weight is m2.lm_head
    p = random_prompt(m.cfg.vocab_size, 12, seed=4)
    assert torch.equal(Engine(m).score(p), Engine(m2).score(p))


def test_untied_embedding_is_its_own_int8_table(tmp_path):
    dense = load("tiny-qwen2", "bf16").model                 # untied
    table = dense.embed.weight.detach().float().clone()
    m = Q.quantize_model(dense, "int4")
    assert isinstance(m.embed, Q.QEmbedding) and m.embed.weight is not m.lm_head
    assert "embed.table.qweight" in m.state_dict() and "embed.weight" not in m.state_dict()
    toks = torch.arange(m.cfg.vocab_size)
    step = table.abs().amax(1, keepdim=True) / 127
    assert ((m.embed(toks).float() - table).abs() <= step * 0.51 + 2 ** -7 * table.abs()).all()
    Q.save_quantized(m, tmp_path / "q")
    m2 = Q.load_quantized(tmp_path / "q")
    p = random_prompt(m.cfg.vocab_size, 12, seed=5)
    assert torch.equal(Engine(m).score(p), Engine(m2).score(p))


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_K], ids=lambda t: t.name)
def test_untied_embedding_read_from_the_gguf_blocks(tmp_path, qtype):
    """GGUFRows: an untied embedding looked up in the file's 4-bit blocks (memmap at the tensor's offset) gives the
    file's dequantised rows rounded to the model dtype, bitwise what the dense loader holds; it survives the cache
    round trip (the cache names the file, it holds no table)."""
    m = Q.quantize_model(load("tiny-qwen2", "bf16").model, "w4a8")
    V, D = m.cfg.vocab_size, m.cfg.dim
    cols = max(D, 256) if qtype == QT.Q4_K else D
    data = random_blocks(qtype, V, cols, seed=5)
    path = tmp_path / "model.gguf"
    with open(path, "wb") as f:
        f.write(b"\0" * 96)                             # a header before the tensor: the offset must be honoured
        f.write(data.tobytes())
    rows = Q.GGUFRows(str(path), 96, int(qtype), V, cols, torch.bfloat16)
    ref = torch.from_numpy(dequantize(data, qtype).reshape(V, cols).astype(np.float32)).to(torch.bfloat16)
    toks = torch.tensor([[0, 3, V - 1], [3, 3, 1]])
    assert torch.equal(rows[toks], ref[toks])
    assert torch.equal(rows.dequantize().to(torch.bfloat16), ref)
    if cols != D:
        return
    m.embed = Q.QEmbedding(rows)
    Q.save_quantized(m, tmp_path / "q")
    assert not any(k.startswith("embed") for k in m.state_dict())
    m2 = Q.load_quantized(tmp_path / "q")
    assert isinstance(m2.embed.weight, Q.GGUFRows) and torch.equal(m2.embed(toks), ref[toks])
    p = random_prompt(V, 12, seed=6)
    assert torch.equal(Engine(m).score(p), Engine(m2).score(p))


def test_kernel_refused_clearly_without_avx2(monkeypatch):
    """On a CPU without AVX2 the int8-activation modes fail with a ModelError naming the field and the remedy, and
    bf16 models run the tensor ops instead of the layer kernels (the same model up to float32 summation order)."""
    from specdec.engine import kernels
    from specdec.errors import ModelError
    model = load("tiny-qwen2", "bf16").model
    prompt = random_prompt(model.cfg.vocab_size, 20, seed=3)
    with_kernels = Engine(model).score(prompt)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: "flags : fpu sse2")
    kernels._load.cache_clear()
    kernels.available.cache_clear()
    try:
        with pytest.raises(ModelError, match="AVX2") as e:
            Q.QLinear.q(4, *Q.quantize_int4(torch.randn(8, 64))).mm(torch.randn(1, 64).bfloat16())
        assert e.value.field == "quant" and "int4" in str(e.value.remedy)
        assert not kernels.available()
        without = Engine(model).score(prompt)
        assert torch.equal(without.argmax(-1), with_kernels.argmax(-1))
        assert (without - with_kernels).abs().max() < 0.05 * with_kernels.abs().max()
    finally:
        kernels._load.cache_clear()
        kernels.available.cache_clear()


def test_kernel_build_lock_left_by_a_killed_process_does_not_hang_the_next():
    """torch's build lock (a file `lock` in the build folder) outlives a process killed while building; a server
    started after that must still load the kernels (it used to wait on the file for good: `make run` stopped during
    the first build, then every start hung)."""
    import subprocess
    import sys
    from specdec.engine import kernels
    if not kernels.available():
        pytest.skip("this CPU does not build the kernels")
    stale = kernels.build_dir() / "lock"
    stale.touch()
    try:
        out = subprocess.run([sys.executable, "-c", "from specdec.engine import kernels; print(kernels.available())"],
                             capture_output=True, text=True, timeout=120,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    finally:
        stale.unlink(missing_ok=True)
    assert out.stdout.strip() == "True", out.stderr


def test_unknown_mode_and_float64_are_refused():
    from specdec.errors import ModelError
    with pytest.raises(ModelError):
        Q.check_mode("int3")
    with pytest.raises(ModelError):
        load("tiny-llama", quant="int4")                # float64: no packed kernel


# -- exactness on quantized models ------------------------------------------------------------------------------------
PAIRS = [("tiny-llama", "tiny-llama-draft"), ("tiny-qwen2", "tiny-qwen2-draft")]


@pytest.fixture(scope="module")
def qmodels():
    """Tiny targets/drafts in bf16, quantized: {(name, mode): model}."""
    return {(n, mode): load(n, "bf16", quant=mode).model for pair, mode in QUANT_PAIRS for n in pair}


def _prompts(V):
    return [random_prompt(V, 17, seed=17), random_prompt(V, 5, seed=99) * 4]


def _target_only(model, prompts, params, n):
    return [generate(Engine(model), [Request(p, params, n)])[0].tokens for p in prompts]      # each prompt alone


def _speculative(model, drafter, prompts, params, n, **kw):
    gen = SpeculativeGenerator(Engine(model, kv_tokens=8192, page_size=8), drafter, **kw)
    return [o.tokens for o in gen.generate([GenRequest(p, params, n) for p in prompts])]


QUANT_PAIRS = [(PAIRS[0], "int8"), (PAIRS[1], "int4"), (PAIRS[0], "w4a8")]


@pytest.mark.parametrize("pair,mode", QUANT_PAIRS, ids=["llama-int8", "qwen2-int4", "llama-w4a8"])
def test_quantized_speculative_equals_target_only(qmodels, pair, mode):
    """(Kept small for `make test`: llama int8, qwen2 int4 which adds the qkv bias, and llama w4a8 (int8 activations,
    whose rounding of a row must not depend on the rows verified beside it).)"""
    target, draft = qmodels[pair[0], mode], qmodels[pair[1], mode]
    assert Q.is_quantized(target) and Q.is_quantized(draft)
    prompts = _prompts(target.cfg.vocab_size)
    drafters = {"model": ModelDrafter(draft, kv_tokens=4096), "layer-skip": make_drafter("layer-skip", target, skip="0")}
    greedy = _target_only(target, prompts, SamplingParams(), 12)
    for name, d in drafters.items():
        for gamma, layout in ((4, "padded"), (8, "compact")):
            assert _speculative(target, d, prompts, SamplingParams(), 12, gamma=gamma, layout=layout) == greedy, \
                (name, gamma, layout)
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    seeded = _target_only(target, prompts, sp, 12)
    assert _speculative(target, drafters["model"], prompts, sp, 12, gamma=4, mode="coupled") == seeded


@pytest.mark.parametrize("mode", ["w4a8", "none", "bf16-emulated"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_fused_blocks_give_the_eager_bits(monkeypatch, name, mode):
    """A model whose linears are all qdot's (w4a8), prepacked for oneDNN (bf16, where this CPU's oneDNN agrees with
    F.linear) or bf16_linear's (bf16 where bf16 is emulated; forced here on any CPU) runs each block as one C++ call
    (kernels/layer_ops.cpp `block`, the Python path's ops in its order): every row's logits are bitwise the eager
    path's, for prefills of two sequences, then a decode row beside a 5-row verify (ragged), then rows after a
    rollback (reading the K/V the fused blocks wrote), then a decode row alone (padded to the row tiles' lo).
    tiny-qwen2 adds the qkv bias and grouped heads."""
    from specdec.engine import kernels
    from specdec.engine import model as M
    from specdec.engine import prepack
    from specdec.engine.layout import SeqInput
    from specdec.engine.prepack import is_prepacked
    if mode == "bf16-emulated":       # as on an AVX2-only CPU: no oneDNN bf16 reorder, bf16_linear for every linear
        monkeypatch.setattr(kernels, "bf16_emulated", lambda: True)
        monkeypatch.setattr(prepack, "available", lambda: False)
    model = load(name, "bf16").model
    if mode == "w4a8":
        model = Q.quantize_model(model, mode)
    V = model.cfg.vocab_size
    real = M.Transformer._fused_blocks
    taken = []

    def run(fused: bool):
        monkeypatch.setattr(M.Transformer, "_fused_blocks", lambda self, *a: (
            taken.append(r := real(self, *a)), r)[1] if fused else None)
        e = Engine(model, kv_tokens=1024, page_size=8, prefix_cache=False)
        a, b = e.new_sequence(), e.new_sequence()
        out = [e.forward([SeqInput(a, random_prompt(V, 19, seed=1), logits="all"),
                          SeqInput(b, random_prompt(V, 7, seed=2), logits="last")]).logits]
        out.append(e.forward([SeqInput(a, [3], start=19, logits="last"),
                              SeqInput(b, random_prompt(V, 5, seed=3), start=7, logits="all")]).logits)
        e.truncate(b, 9)
        out.append(e.forward([SeqInput(b, random_prompt(V, 3, seed=4), start=9, logits="all")]).logits)
        out.append(e.forward([SeqInput(a, [5], start=20, logits="last")]).logits)    # one row (below the tiles' lo)
        return out

    fused = run(True)
    packed = all(isinstance(lin, Q.QLinear) or is_prepacked(lin.weight)
                 or kernels.bf16_linear_takes(lin.weight, lin.bias)
                 for name, lin in model.linears().items() if name.startswith("layers."))
    assert len(taken) == 4 and all((t is not None) == packed for t in taken)   # where it may, the fused path ran
    if mode != "none":
        assert packed            # qdot or bf16_linear everywhere: always fused on a CPU with our kernels
    eager = run(False)
    for x, y in zip(fused, eager):
        assert torch.equal(x, y)


def test_fused_blocks_of_a_layer_skip_view_are_its_own():
    """A layer-skip drafter is a view of the target that copies its attributes: made after the target has run (its
    blocks' kernel arguments built), the view must run its own layers, as the Python path does."""
    from specdec.draft.model import layer_skip
    from specdec.engine import model as M
    from specdec.engine.layout import SeqInput
    model = Q.quantize_model(load("tiny-qwen2", "bf16").model, "w4a8")      # 3 layers: the view keeps 0 and 2
    prompt = random_prompt(model.cfg.vocab_size, 11, seed=5)

    def logits(m):
        e = Engine(m, kv_tokens=256, page_size=8, prefix_cache=False)
        return e.forward([SeqInput(e.new_sequence(), prompt, logits="all")]).logits

    logits(model)                                  # the target's block arguments now exist
    view = layer_skip(model, "0,2")
    fused = logits(view)
    real = M.Transformer._fused_blocks
    try:
        M.Transformer._fused_blocks = lambda self, *a: None
        assert torch.equal(fused, logits(view))
        assert not torch.equal(fused, logits(model))
    finally:
        M.Transformer._fused_blocks = real


# -- SmolLM2 int4 from its own GGUF blocks ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_int4():
    return load("smollm2-135m", quant="int4")


@pytest.mark.slow
def test_smollm2_int4_weights_are_the_files(smollm2_int4, smollm2):
    """The int4 model's weights are the bf16 model's (both from the file's Q4_1 blocks) up to the bf16 rounding of
    each group's scale and zero: a misplaced row (e.g. the Llama q/k un-interleaving) would differ by whole weights."""
    for name in ("attn.wqkv", "mlp.w_down"):
        lin = smollm2_int4.model.layers[3].get_submodule(name)
        ref = dense(smollm2.model.layers[3].get_submodule(name).weight).float()   # an engine may have prepacked it
        assert (lin.dequantize() - ref).abs().max() <= 2 ** -6 * ref.abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int4", "w4a8"])
def test_smollm2_quantized_speculative_equals_target_only(smollm2_int4, mode):
    lm, n = smollm2_int4 if mode == "int4" else load("smollm2-135m", quant=mode), 12
    assert lm.model.lm_head.kind == {"int4": "int8", "w4a8": "q8"}[mode]      # the file's head is Q8_0
    # One short code prompt (`make test` budget): the packed int4 kernel dequantises per row, so prefill rows dominate.
    prompts = [lm.tokenizer.encode("def fibonacci(n):\n    ")]
    d = make_drafter("layer-skip", lm.model, skip="0-11,18-29", kv_tokens=16384)
    greedy = _target_only(lm.model, prompts, SamplingParams(), n)
    assert _speculative(lm.model, d, prompts, SamplingParams(), n, gamma=4) == greedy
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    assert _speculative(lm.model, d, prompts, sp, n, gamma=4, mode="coupled") == _target_only(lm.model, prompts, sp, n)


def test_linear_dispatch_keeps_plain_tensors_on_f_linear():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(Q.linear(x, w), F.linear(x, w))


# -- bad input -----------------------------------------------------------------------------------------------------
def test_bad_quant_values_get_clear_errors(capsys, monkeypatch):
    from specdec.cli import main
    from specdec.engine.backend import open_backend
    from specdec.errors import SpecdecError
    with pytest.raises(SystemExit) as e:                       # argparse names the flag and the choices
        main(["generate", "--model", "tiny-llama", "--quant", "int3", "--prompt", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--quant" in err and "int3" in err and "int8" in err
    with pytest.raises(SystemExit):
        main(["bench", "--target", "tiny-llama", "--draft-quant", "q4"])
    assert "--draft-quant" in capsys.readouterr().err
    # an environment default bypasses argparse's choices: the loader refuses it, naming the field and the remedy
    monkeypatch.setenv("SPECDEC_QUANT", "int3")
    assert main(["generate", "--model", "tiny-llama", "--dtype", "bf16", "--prompt", "x", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "quant" in err and "int3" in err and "int4" in err
    with pytest.raises(SpecdecError, match="tensor parallel"):
        open_backend("tiny-llama", tp=2, dtype="bf16", quant="int4")
