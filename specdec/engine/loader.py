"""Weight loading: GGUF files (dequantised on load), HF model directories (config.json + safetensors), and tiny
seeded random models built in code.

Every source is turned into one canonical form — a ModelConfig and a state dict with Hugging Face tensor names — and
`build` makes the model from that; so the three loaders differ only in where the numbers come from.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelError
from .model import ModelConfig, Transformer, rope_tables
from .prepack import dense_state_dict

# GGUF tensor names -> HF names (per layer names carry "{i}").
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
SUPPORTED_ARCHS = ("llama", "qwen2")


def _check_arch(arch: str, source: Path) -> None:
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"architecture {arch!r} of {source} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})",
                         field="model")


# -- canonical form -> model -------------------------------------------------------------------------------------------
def build(cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype) -> Transformer:
    """Make a model from HF-named tensors: q/k/v and gate/up are fused here, lm_head tied when absent."""
    with torch.device("meta"):  # no memory for random init: every weight is assigned below
        model = Transformer(cfg)

    def take(name):
        try:
            return sd.pop(name)
        except KeyError:
            raise ModelError(f"tensor {name} is missing from the weights", field="model",
                             remedy="check that the file is a complete Llama/Qwen2 checkpoint") from None

    new = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not cfg.tie_embeddings:
        new["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.n_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        new[o + "attn_norm.weight"] = take(p + "input_layernorm.weight")
        new[o + "mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
        new[o + "attn.wqkv.weight"] = torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        if cfg.qkv_bias:
            new[o + "attn.wqkv.bias"] = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        new[o + "attn.wo.weight"] = take(p + "self_attn.o_proj.weight")
        new[o + "mlp.w_gate_up.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        new[o + "mlp.w_down.weight"] = take(p + "mlp.down_proj.weight")
    missing, unexpected = model.load_state_dict(new, strict=False, assign=True)
    if [m for m in missing if "rope" not in m] or unexpected:
        raise ModelError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}", field="model")
    model.rope_cos, model.rope_sin = rope_tables(cfg)  # buffers, not weights: computed, on CPU
    return model.to(dtype).eval()


def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The inverse of `build` (used to export a model as an HF directory, e.g. for parity tests)."""
    cfg, sd = model.cfg, dense_state_dict(model)
    q, kv = cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        out[p + "input_layernorm.weight"] = sd[o + "attn_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[o + "mlp_norm.weight"]
        for x, part in zip("qkv", sd[o + "attn.wqkv.weight"].split([q, kv, kv])):
            out[p + f"self_attn.{x}_proj.weight"] = part
        if cfg.qkv_bias:
            for x, part in zip("qkv", sd[o + "attn.wqkv.bias"].split([q, kv, kv])):
                out[p + f"self_attn.{x}_proj.bias"] = part
        out[p + "self_attn.o_proj.weight"] = sd[o + "attn.wo.weight"]
        gate, up = sd[o + "mlp.w_gate_up.weight"].chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = sd[o + "mlp.w_down.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(cfg: ModelConfig) -> dict:
    return {
        "model_type": cfg.arch, "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[cfg.arch]],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.hd,
        "intermediate_size": cfg.ffn_dim, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.qkv_bias, "hidden_act": "silu", "torch_dtype": "float32",
    }


def save_hf_dir(model: Transformer, path: str | os.PathLike) -> Path:
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(model.cfg), indent=1))
    save_file(to_hf_state_dict(model), str(path / "model.safetensors"))
    return path


# -- HF directories -----------------------------------------------------------------------------------------------
def hf_dir_config(path: Path) -> ModelConfig:
    try:
        c = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path / 'config.json'}: {e}", field="model",
                         remedy="point --model at a Hugging Face model directory") from None
    _check_arch(c.get("model_type", "?"), path)
    return ModelConfig(
        arch=c["model_type"], vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
        n_heads=c["num_attention_heads"], n_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        ffn_dim=c["intermediate_size"], rope_theta=c.get("rope_theta", 10000.0), norm_eps=c.get("rms_norm_eps", 1e-6),
        max_seq_len=c.get("max_position_embeddings", 2048), tie_embeddings=c.get("tie_word_embeddings", False),
        qkv_bias=c["model_type"] == "qwen2" or c.get("attention_bias", False), head_dim=c.get("head_dim"))


def load_hf_dir(path: str | os.PathLike, dtype: torch.dtype) -> Transformer:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = Path(path)
    cfg = hf_dir_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors weights in {path}", field="model")
    sd = {}
    for f in files:
        try:
            # copied out of the file's mapping: it stays mapped (and its pages resident) while any one tensor from it
            # lives, so the weights an engine replaces by prepacked copies (prepack.py) would be held twice
            sd.update({k: t.clone() for k, t in load_file(str(f)).items()})
        except (SafetensorError, OSError) as e:
            raise ModelError(f"cannot read weights {f}: {e}", field="model",
                             remedy="the file is corrupt or truncated; re-download or re-export it") from None
    return build(cfg, sd, dtype)


# -- GGUF ---------------------------------------------------------------------------------------------------------
def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores Llama q/k rows interleaved per rotary pair; undo it to get the rotate-half layout."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | os.PathLike):
    from gguf import GGUFReader
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"model file {path} does not exist", field="model")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/struct errors/IndexError on damaged files
        raise ModelError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})", field="model",
                         remedy="the file is corrupt or truncated; re-install the model package or re-download it") from None


def gguf_config(reader, path) -> ModelConfig:
    f = {k: v for k, v in reader.fields.items()}

    def get(key, default=None):
        if key in f:
            return f[key].contents()
        if default is None:
            raise ModelError(f"{path}: GGUF metadata {key} missing", field="model")
        return default

    arch = get("general.architecture")
    _check_arch(arch, path)
    names = {t.name for t in reader.tensors}
    n_heads = int(get(f"{arch}.attention.head_count"))
    dim = int(get(f"{arch}.embedding_length"))
    return ModelConfig(
        arch=arch, vocab_size=len(f["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in f
        else int(get(f"{arch}.vocab_size")),
        dim=dim, n_layers=int(get(f"{arch}.block_count")), n_heads=n_heads,
        n_kv_heads=int(get(f"{arch}.attention.head_count_kv", n_heads)), ffn_dim=int(get(f"{arch}.feed_forward_length")),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_seq_len=int(get(f"{arch}.context_length", 2048)), qkv_bias="blk.0.attn_q.bias" in names,
        tie_embeddings="output.weight" not in names,
        head_dim=int(get(f"{arch}.attention.key_length", dim // n_heads)))


def load_gguf(path: str | os.PathLike, dtype: torch.dtype) -> Transformer:
    from gguf import GGMLQuantizationType, dequantize
    reader = read_gguf(path)
    cfg = gguf_config(reader, path)
    sd = {}
    for t in reader.tensors:
        i, key = None, t.name
        if t.name.startswith("blk."):
            _, i, rest = t.name.split(".", 2)
            key = "blk.{i}." + rest
        if key not in _GGUF_NAMES:
            continue  # e.g. rope_freqs: recomputed from the config
        try:
            w = t.data if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) \
                else dequantize(t.data, t.tensor_type)
            w = np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        except (ValueError, NotImplementedError) as e:
            raise ModelError(f"{path}: cannot dequantise {t.name} ({t.tensor_type.name}): {e}", field="model") from None
        if cfg.arch == "llama" and key in ("blk.{i}.attn_q.weight", "blk.{i}.attn_k.weight"):
            w = _unpermute(w, cfg.n_heads if key.endswith("q.weight") else cfg.n_kv_heads)
        # Cast tensor by tensor so peak memory stays near the final model size.
        sd[_GGUF_NAMES[key].format(i=i)] = torch.from_numpy(np.require(w, requirements="CW")).to(dtype)
    return build(cfg, sd, dtype)


# -- tiny seeded models ---------------------------------------------------------------------------------------------
def tiny(cfg: ModelConfig, seed: int, dtype: torch.dtype = torch.float64, *, base_seed: int | None = None,
         noise: float = 0.0) -> Transformer:
    """A seeded random model. With base_seed, the weights of that model plus `noise` x N(0, std) perturbations —
    a cheap draft that agrees with its target part of the time."""
    def weights(s):
        # Scales chosen so greedy output stays varied instead of collapsing into one repeated token.
        g = torch.Generator().manual_seed(s)
        sd = {}
        for name, p in to_hf_state_dict(Transformer(cfg)).items():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if "norm" in name:
                sd[name] = 1.0 + 0.1 * r
            elif "embed" in name or "lm_head" in name:
                sd[name] = r
            else:
                sd[name] = 3.0 * r / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.1 * r
        return sd
    if base_seed is None:
        sd = weights(seed)
    else:
        sd, delta = weights(base_seed), weights(seed)
        sd = {k: v + noise * (delta[k] - (1.0 if "norm" in k else 0.0)) for k, v in sd.items()}
    return build(cfg, sd, dtype)
