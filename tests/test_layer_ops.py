"""The small per-layer CPU kernels (engine/kernels/layer_ops.cpp) that a decode step runs instead of several tensor
ops each: rope and write_kv give the tensor ops' bits exactly; rms_norm is within a rounding of them; all are
row-invariant. (The attention kernel: tests/test_batch_invariance.py.)"""
import pytest
import torch
import torch.nn.functional as F

from specdec.engine import kernels
from specdec.engine import model as model_mod
from specdec.engine.model import rotary_tables

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rms_norm_kernel_matches_torch_and_is_row_invariant(dtype):
    """The one-call RMSNorm (qdot.cpp) that model.rms_norm uses for bf16 / fp16: each output within one rounding of
    torch's float32 F.rms_norm then the weight multiply (its sum of squares runs in another order), mostly equal, and a
    row's bits the same alone or in a pack of any size (it is what every layer of a batch-invariant forward runs)."""
    from specdec.engine import kernels
    g = torch.Generator().manual_seed(7)
    D = 1000                                          # not a multiple of 8: the tail of the partial sums
    x = (torch.randn(37, D, generator=g) * torch.logspace(-3, 3, 37)[:, None]).to(dtype)
    w = torch.randn(D, generator=g).to(dtype)
    y = kernels.rms_norm(x, w, 1e-6)
    ref = (F.rms_norm(x.float(), (D,), eps=1e-6).to(dtype) * w)
    ulp = torch.finfo(dtype).eps * ref.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((y.float() - ref.float()).abs() <= 2.01 * ulp).all() and (y == ref).float().mean() > 0.99
    assert all(torch.equal(kernels.rms_norm(x[i:i + n], w, 1e-6), y[i:i + n]) for i, n in ((0, 1), (3, 5), (9, 28)))
    assert not torch.equal(kernels.rms_norm(x, w.roll(1), 1e-6), y)          # the weight really is applied per column
    assert torch.equal(model_mod.rms_norm(x, w, 1e-6), y)                     # and the model uses it


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_bf16_linear_kernel_is_row_invariant_and_as_close_as_torchs(bias):
    """The dense linear of CPUs without bf16 arithmetic (bf16_linear.cpp; the engine's there): a row's bits are the
    same alone, in any pack of rows (groups of 8 share weight reads, and a tail group is smaller) and at any thread
    count, and every output is as close to the float64 product as torch's bf16 F.linear (one bf16 rounding of a
    float32 sum, in another order)."""
    g = torch.Generator().manual_seed(3)
    N, K = 203, 1536                                  # N not a multiple of the output chunk
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    x = torch.randn(21, K, generator=g).bfloat16()
    y = kernels.bf16_linear(x, w, b)
    assert all(torch.equal(kernels.bf16_linear(x[i:i + n], w, b), y[i:i + n])
               for n in range(1, 21) for i in range(0, 21 - n + 1, 4))
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(kernels.bf16_linear(x, w, b), y)
    finally:
        torch.set_num_threads(threads)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs()
    assert ((y.double() - ref).abs() <= ulp + 1e-3).all()                  # a rounding, and float32 sums' error
    assert (y == F.linear(x, w, b)).float().mean() > 0.9                   # mostly torch's bits too
    assert not torch.equal(kernels.bf16_linear(x, w.roll(1, 1), b), y)     # every column of w counts


def test_engine_uses_bf16_linear_where_bf16_is_emulated(monkeypatch):
    """On a CPU without bf16 arithmetic the engine's dense bf16 linears run bf16_linear (elsewhere torch's or
    oneDNN's prepacked GEMM): checked by counting calls with the CPU's answer forced each way."""
    from specdec.engine import quant
    calls = []
    real = kernels.bf16_linear
    monkeypatch.setattr(kernels, "bf16_linear", lambda *a: calls.append(1) or real(*a))
    x, w = torch.randn(3, 64).bfloat16(), torch.randn(16, 64).bfloat16()
    for emulated in (True, False):
        monkeypatch.setattr(kernels, "bf16_emulated", lambda e=emulated: e)
        calls.clear()
        y = quant.linear(x, w)
        assert len(calls) == emulated and y.shape == (3, 16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_kernel_is_the_tensor_ops_bitwise(dtype):
    """On strided rows (the q|k part of the fused qkv output, as the model passes them) in every dtype."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, 12 * 64, generator=g).to(dtype)
    x = qkv[:, :10 * 64].view(9, 10, 64)                                   # rows strided by 12 heads
    cos, sin = (t.to(dtype) for t in rotary_tables(torch.randn(9, 32, generator=g, dtype=torch.float64) * 50))
    ref = x * cos[:, None, :] + x.roll(32, -1) * sin[:, None, :]
    y = kernels.rope(x, cos, sin)
    assert torch.equal(y, ref) and torch.equal(model_mod.rope(x, cos, sin), ref)
    assert not torch.equal(kernels.rope(x, cos, sin.roll(1, 0)), ref)      # a row's own angles, not a neighbour's


@pytest.mark.parametrize("cache_dtype,dtype", [(torch.float32, torch.bfloat16), (torch.float64, torch.float64),
                                               (torch.bfloat16, torch.bfloat16)], ids=str)
def test_write_kv_kernel_is_index_copy(cache_dtype, dtype):
    g = torch.Generator().manual_seed(2)
    kc, vc = torch.randn(64, 2, 16, generator=g).to(cache_dtype), torch.randn(64, 2, 16, generator=g).to(cache_dtype)
    qkv = torch.randn(5, 6 * 16, generator=g).to(dtype)
    k, v = qkv[:, 2 * 16:4 * 16].view(5, 2, 16), qkv[:, 4 * 16:].view(5, 2, 16)   # strided views, as in the model
    slots = torch.tensor([7, 3, 40, 41, 0])
    rk, rv = kc.clone().index_copy_(0, slots, k.to(cache_dtype)), vc.clone().index_copy_(0, slots, v.to(cache_dtype))
    kernels.write_kv(kc, vc, slots, k, v)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)


def test_a_bf16_forward_runs_every_layer_kernel(monkeypatch):
    """The engine's bf16 forward (inference mode, nn.Parameter weights that still require grad) takes the kernels in
    every layer: through the Python blocks, or, where the weights are prepacked for oneDNN or bf16_linear's, one
    `block` call a layer (which runs the same kernels from C++); and a forward under autograd (the drafter's
    training) takes the tensor ops."""
    from specdec.engine.engine import Engine
    from specdec.engine.layout import SeqInput
    from specdec.engine.prepack import is_prepacked
    from specdec.engine.registry import load
    calls = {}
    count = lambda f, n: lambda *a: calls.__setitem__(n, calls.get(n, 0) + 1) or f(*a)
    for name in ("rms_norm", "attend", "rope", "write_kv"):
        monkeypatch.setattr(kernels, name, count(getattr(kernels, name), name))
    monkeypatch.setattr(model_mod, "block_kernel", count(model_mod.block_kernel, "block"))
    model = load("tiny-qwen2", "bf16").model
    e = Engine(model)
    L = model.cfg.n_layers
    e.forward([SeqInput(e.new_sequence(), [1, 2, 3])])
    wqkv = model.layers[0].attn.wqkv
    if is_prepacked(wqkv.weight) or kernels.bf16_linear_takes(wqkv.weight, wqkv.bias):
        assert calls == {"block": L, "rms_norm": 1}        # the final norm
    else:
        assert calls == {"rms_norm": 2 * L + 1, "attend": L, "rope": L, "write_kv": L}
    calls.clear()
    monkeypatch.setattr(model_mod.Transformer, "_fused_blocks", lambda *a: None)      # the Python blocks, anywhere
    e.forward([SeqInput(e.new_sequence(), [1, 2, 3])])
    assert calls == {"rms_norm": 2 * L + 1, "attend": L, "rope": L, "write_kv": L}
    calls.clear()
    x = torch.randn(3, model.cfg.dim, dtype=torch.bfloat16, requires_grad=True)
    model_mod.rms_norm(x, model.norm.weight, 1e-6).float().sum().backward()
    assert calls == {} and x.grad is not None
