"""The model: a decoder-only transformer of the Llama / Qwen2 families, readable top to bottom.

RMSNorm, rotary embeddings (rotate-half convention, the config's theta), grouped-query attention, SwiGLU MLP,
optional q/k/v bias (Qwen2), tied or untied lm_head.

The forward pass is *packed*: the new tokens of many sequences arrive as one flat [T] tensor, every linear layer runs
once over the T real rows, and only attention looks at sequence boundaries (through `Layout`, built by
engine.layout from the KV cache). Nothing here knows about requests, batching policy or sampling.

Tensor parallelism comes later: each linear keeps its own weight (q/k/v fused head-aligned, gate/up fused), so a
column shard is a slice of whole heads / ffn columns and a row shard is a slice of the input dim; the two all-reduce
points are after `wo` and after `w_down`.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .attention import attend_fast, attend_invariant, kernel_attention
from .kernels import block as block_kernel      # Transformer.forward's `kernels` argument shadows the module
from .prepack import is_prepacked
from .quant import BITS, QLinear
from .quant import linear as qlinear   # F.linear, or the packed kernel for a quantized weight (engine/quant.py)
from .row_tiles import RowTiles


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str                # "llama" | "qwen2"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    qkv_bias: bool = False
    tie_embeddings: bool = True
    head_dim: int | None = None

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.hd
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.hd, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.hd, cfg.dim, bias=False)

    def attend(self, q, k, v, layout, k_cache, v_cache):
        """Write this step's keys/values at their positions' slots (rollback is just overwriting), then let each
        row attend to its sequence's cached prefix + causally within its new rows. The ragged part: always eager."""
        if kernels.usable(k, v):     # the two casts and copies below in one call
            kernels.write_kv(k_cache, v_cache, layout.write_slots, k, v)
        else:
            k_cache.index_copy_(0, layout.write_slots, k.to(k_cache.dtype))     # a float32 cache under the invariant
            v_cache.index_copy_(0, layout.write_slots, v.to(v_cache.dtype))     # attention (engine.py)
        if layout.attn_groups is not None:
            return attend_invariant(q, k_cache, v_cache, layout.attn_groups)
        return attend_fast(q, k_cache, v_cache, layout)


# The dense parts of a block as pure functions of (activations, weights): one compiled graph per row-count tier
# serves every layer (weights are arguments, not attributes the compiler would guard on).
def pre_attention(x, norm_w, eps: float, wqkv, bqkv, cos, sin, n_heads: int, n_kv_heads: int, hd: int,
                  linear=qlinear):
    T = x.shape[0]
    qk, v = linear(rms_norm(x, norm_w, eps), wqkv, bqkv).split([(n_heads + n_kv_heads) * hd, n_kv_heads * hd], dim=-1)
    q, k = rope(qk.view(T, n_heads + n_kv_heads, hd), cos, sin).split([n_heads, n_kv_heads], dim=1)  # one rotation
    return q, k, v.view(T, n_kv_heads, hd)


def post_attention(x, attn, wo, norm_w, eps: float, w_gate_up, w_down, linear=qlinear, reduce=None):
    """`reduce`: tensor parallelism's all-reduce of the row-parallel outputs (wo, w_down); None on one device."""
    reduce = reduce or (lambda t: t)
    x = x + reduce(linear(attn, wo))
    gate, up = linear(rms_norm(x, norm_w, eps), w_gate_up).chunk(2, dim=-1)
    return x + reduce(linear(F.silu(gate) * up, w_down))


def _eager(f, base, linear) -> bool:
    """Whether f is `base`, or `base` with `linear` bound and nothing else (the engine's row-tiled eager path)."""
    return f is base or (isinstance(f, functools.partial) and f.func is base and not f.args
                         and f.keywords == {"linear": linear})


def rms_norm(x, w, eps: float):
    # Normalise in float32 at least (as the reference implementations do), then scale in the model dtype.
    if x.dtype in (torch.bfloat16, torch.float16) and kernels.usable(x, w):
        return kernels.rms_norm(x, w, eps)     # one call, not ~8 (decode is dispatch-bound); within a rounding
    xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    return F.rms_norm(xf, (x.shape[-1],), eps=eps).to(x.dtype) * w


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_seq_len, hd] (see rotary_tables) in float64: exact for float64 tests, correctly rounded when
    cast down."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.hd, 2, dtype=torch.float64) / cfg.hd))
    return rotary_tables(torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq))


def rotary_tables(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """angles [P, hd/2] -> full-width (cos, cos) and (-sin, sin) tables [P, hd], the form `rope` multiplies by."""
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding, x [T, heads, hd] with cos/sin [T, hd] from rotary_tables:
    [x1 c - x2 s, x2 c + x1 s] as x * cos + roll(x) * sin (bit for bit: negating s is exact), four ops instead of
    eight (decode is dispatch-bound); on a CPU with our kernels, one call with the same bits."""
    if kernels.usable(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return kernels.rope(x, cos, sin)
    return x * cos[:, None, :] + x.roll(x.shape[-1] // 2, -1) * sin[:, None, :]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate_up = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim, cfg.norm_eps), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.dim, cfg.norm_eps), MLP(cfg)

    def forward(self, x, cos, sin, layout, k_cache, v_cache, kernels):
        pre, post = kernels
        a, m = self.attn, self.mlp
        q, k, v = pre(x, self.attn_norm.weight, self.attn_norm.eps, a.wqkv.weight, a.wqkv.bias, cos, sin,
                      a.n_heads, a.n_kv_heads, a.hd)
        o = a.attend(q, k, v, layout, k_cache, v_cache)
        return post(x, o, a.wo.weight, self.mlp_norm.weight, self.mlp_norm.eps, m.w_gate_up.weight, m.w_down.weight)

    def block_args(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """kernels.block's weights and sizes for this block, or None unless each linear is qdot's, prepacked, or
        bf16_linear's."""
        a, m = self.attn, self.mlp
        w, meta = [self.attn_norm.weight], [a.n_heads, a.n_kv_heads, a.hd]
        for i, lin in enumerate((a.wqkv, a.wo, m.w_gate_up, m.w_down)):
            if isinstance(lin, QLinear) and lin.kind in BITS:
                weight, kind = lin.qweight, BITS[lin.kind]
            elif is_prepacked(lin.weight):
                weight, kind = lin.weight, 0
            elif kernels.bf16_linear_takes(lin.weight, lin.bias):    # where bf16 is emulated
                weight, kind = lin.weight, -1
            else:
                return None
            w.append(weight)
            if i == 0:                  # the qkv bias (Qwen2), or none
                w.append(lin.bias if lin.bias is not None else weight.new_empty(0, dtype=self.attn_norm.weight.dtype))
            elif i == 1:
                w.append(self.mlp_norm.weight)
            meta += [kind, lin.out_features]
        return w, meta


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def output_weight(self):
        """The output head's weight: the embedding's where they are tied (no lm_head)."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def linears(self) -> dict[str, nn.Module | None]:
        """The linear layers by module name: every block's four, and the output head ("lm_head": None when tied)."""
        out = {}
        for i, b in enumerate(self.layers):
            out.update({f"layers.{i}.attn.wqkv": b.attn.wqkv, f"layers.{i}.attn.wo": b.attn.wo,
                        f"layers.{i}.mlp.w_gate_up": b.mlp.w_gate_up, f"layers.{i}.mlp.w_down": b.mlp.w_down})
        out["lm_head"] = self.lm_head
        return out

    def forward(self, tokens, layout, kv, logit_rows=None, hidden_layers=(), kernels=None):
        """tokens [T] (packed rows of all sequences) -> (logits [R, V] for `logit_rows` (None: all rows),
        {layer: hidden [T, dim]} for the requested layers; layer i is the output of block i, -1 the embeddings).
        `kernels`: (pre_attention, post_attention, linear) to use, e.g. compiled or row-tiled ones (None: eager)."""
        pre, post, linear = kernels or (pre_attention, post_attention, qlinear)
        dtype = self.embed.weight.dtype
        cos = self.rope_cos[layout.positions].to(dtype)
        sin = self.rope_sin[layout.positions].to(dtype)
        x = self.embed(tokens)
        hidden = {-1: x} if -1 in hidden_layers else {}
        fused = self._fused_blocks(x, layout, kv, pre, post, linear)
        if fused:
            attn = [t for g in layout.attn_groups for t in (g.rows, g.slots, g.lens)]
            eps, scale = self.cfg.norm_eps, 1.0 / math.sqrt(self.cfg.hd)     # attention.attend_kernel's scale
            lo = linear.lo if isinstance(linear, RowTiles) else 1          # a decode's row padded as RowTiles pads
        for i, block in enumerate(self.layers):
            if fused:        # the same ops as block(...), in one C++ call (kernels/layer_ops.cpp `block`)
                x = block_kernel(x, *fused[i], eps, cos, sin, kv.k[i], kv.v[i], layout.write_slots, attn, scale, lo)
            else:
                x = block(x, cos, sin, layout, kv.k[i], kv.v[i], (pre, post))
            if i in hidden_layers:
                hidden[i] = x
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)
        x = self.norm(x)
        logits = linear(x, self.output_weight)
        return logits, hidden

    def _fused_blocks(self, x, layout, kv, pre, post, linear) -> list | None:
        """Each block's kernels.block arguments where one C++ call per block gives the eager path's bits: every
        linear qdot's, prepacked for oneDNN or bf16_linear's, never split into row tiles (fewer rows than
        the tiles' lo are padded to it inside, as RowTiles pads them); the batch-invariant kernel
        attention (attention.attend_kernel); the layer kernels usable. Else None."""
        if not (_eager(pre, pre_attention, linear) and _eager(post, post_attention, linear)) \
                or layout.attn_groups is None:
            return None
        if linear is not qlinear and not (isinstance(linear, RowTiles) and x.shape[0] <= linear.hi):
            return None
        if not kernel_attention(x, kv.k[0]):     # bf16 / fp16, a float32 cache, the kernels usable
            return None
        first = self.layers[0].attn.wqkv
        key = (self.layers, first.qweight if isinstance(first, QLinear) else first.weight)
        # built once; again for another layer list (a layer-skip view copies this model's attributes, these
        # included) or replaced weights (.to())
        if any(a is not b for a, b in zip(getattr(self, "_block_key", (None, None)), key)):
            args = [b.block_args() for b in self.layers]
            self._block_args, self._block_key = (args if all(a is not None for a in args) else None), key
        return self._block_args
