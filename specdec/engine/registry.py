"""Named model presets, and `load(name_or_path)` for presets, GGUF files and HF directories alike."""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from ..errors import ModelError
from . import assets, kernels
from .assets import cache_dir
from .loader import load_gguf, load_hf_dir, save_hf_dir, tiny
from .model import ModelConfig, Transformer
from .quant import check_mode as check_quant
from .quant import CACHE_FORMAT as QUANT_FORMAT
from .quant import load_quantized, quantize_model, save_quantized
from .tokenizer import CharTokenizer, Tokenizer, load_tokenizer

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32, "fp64": torch.float64, "float64": torch.float64}


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 bf16 or AMX). Without it (an AVX2 EPYC, say) a bf16 GEMM goes
    through float32 conversions and costs in proportion to its rows: measured on a 2-core Zen 3 EPYC, a 1536x576
    `F.linear` took 130 / 506 / 1,001 us for 1 / 5 / 8 rows in bf16 and 126 / 306 / 300 us in float32."""
    return not kernels.bf16_emulated()


@dataclasses.dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: Tokenizer | CharTokenizer
    load_seconds: float

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg


TINY_LLAMA = ModelConfig(arch="llama", vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                         rope_theta=10000.0, norm_eps=1e-6, max_seq_len=512)
TINY_QWEN2 = dataclasses.replace(TINY_LLAMA, arch="qwen2", n_layers=3, qkv_bias=True, tie_embeddings=False,
                                 rope_theta=1e6)

# tiny-*: seeded random models for exact tests (float64 by default). *-draft: its target plus noise, so the pair
# agrees part of the time, like a real draft.
TINY: dict[str, Callable[[torch.dtype], Transformer]] = {
    "tiny-llama": lambda dt: tiny(TINY_LLAMA, 0, dt),
    "tiny-llama-draft": lambda dt: tiny(TINY_LLAMA, 1, dt, base_seed=0, noise=0.03),
    "tiny-qwen2": lambda dt: tiny(TINY_QWEN2, 2, dt),
    "tiny-qwen2-draft": lambda dt: tiny(TINY_QWEN2, 3, dt, base_seed=2, noise=0.03),
}
GGUF_PRESETS: dict[str, Callable[[], Path]] = {
    "smollm2-135m": assets.smollm2_gguf_path,
    "qwen2.5-coder-1.5b": lambda: assets.qwen_gguf_path("qwen2.5-coder-1.5b"),
    "qwen2.5-coder-0.5b": lambda: assets.qwen_gguf_path("qwen2.5-coder-0.5b"),
}
PRESETS = [*GGUF_PRESETS, *TINY]
DEFAULT_MODEL = "smollm2-135m"


def parse_dtype(name: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    if name is None:
        return default
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelError(f"unknown dtype {name!r}", field="dtype", remedy=f"use one of {', '.join(DTYPES)}") from None


def return_freed_memory() -> None:
    """Fix glibc's mmap threshold at 1 MiB for this process. By default glibc raises the threshold after a large
    block is freed, so later large buffers come from the heap and stay resident after they are freed: loading
    Qwen2.5-Coder-1.5B int4 then held 1,866 MiB after a decode step and peaked at 2,964 MiB (measured), against
    1,736 MiB and no peak with the threshold fixed. No effect where libc is not glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)          # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def load(name: str, dtype: str | torch.dtype | None = None, quant: str | None = None) -> LoadedModel:
    """A preset name, a .gguf file, or an HF model directory. Real models default to bf16, tiny ones to float64.
    `quant`: none | int8 | int4 weight-only quantized linears (engine/quant.py); a GGUF's is cached."""
    t0 = time.perf_counter()
    quant = check_quant(quant)
    if name in TINY:
        model = quantize_model(TINY[name](parse_dtype(dtype, torch.float64)), quant)
        return LoadedModel(name, model, CharTokenizer(model.cfg.vocab_size), time.perf_counter() - t0)
    return_freed_memory()
    dt = parse_dtype(dtype, torch.bfloat16)
    if name in GGUF_PRESETS:
        path = GGUF_PRESETS[name]()
    else:
        path = Path(name)
        if not path.exists():
            raise ModelError(f"unknown model {name!r}: not a preset and no such file or directory", field="model",
                             remedy=f"use a preset ({', '.join(PRESETS)}), a .gguf file or an HF model directory")
    if path.is_dir():
        model = quantize_model(load_hf_dir(path, dt), quant)
        tok = load_tokenizer(path)
    else:
        model = _load_gguf_cached(path, dt) if quant == "none" else _load_quantized_cached(path, dt, quant)
        tok = load_tokenizer(path.parent, path.name)
    return LoadedModel(name, model, tok, time.perf_counter() - t0)


def converted_dir(path: Path, dtype: torch.dtype) -> Path:
    """Where `_load_gguf_cached` keeps a GGUF's dequantised weights (an HF directory; tensor-parallel ranks read
    their shards from it)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{dtype}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{path.stem}-{key}"


def _load_gguf_cached(path: Path, dtype: torch.dtype) -> Transformer:
    """Dequantising a GGUF (and parsing its vocabulary) costs seconds to tens of seconds; the result is kept once
    as safetensors under the cache dir, keyed by file identity and dtype. SPECDEC_WEIGHT_CACHE=0 turns it off."""
    if os.environ.get("SPECDEC_WEIGHT_CACHE", "1") == "0":
        return load_gguf(path, dtype)
    cached = converted_dir(path, dtype)
    if (cached / "model.safetensors").exists():
        return load_hf_dir(cached, dtype)
    model = load_gguf(path, dtype)
    try:
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        save_hf_dir(model, tmp)
        os.replace(tmp, cached)  # atomic: a concurrent loader sees the whole directory or none
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # a full or read-only cache only costs speed
    return model


def _load_quantized_cached(path: Path, dtype: torch.dtype, quant: str) -> Transformer:
    """A GGUF quantized for the packed kernels (from the file's own blocks where it can), cached like the converted
    weights: keyed by file identity, dtype, mode, cache format and torch version (the packed layout is torch's)."""
    def build():
        return quantize_model(_load_gguf_cached(path, dtype), quant, path)
    if os.environ.get("SPECDEC_WEIGHT_CACHE", "1") == "0":
        return build()
    base = converted_dir(path, dtype)
    key = hashlib.sha256(f"{base.name}:{quant}:{QUANT_FORMAT}:{torch.__version__}".encode()).hexdigest()[:8]
    cached = cache_dir() / "quantized" / f"{base.name}-{quant}-{key}"
    if (cached / "model.safetensors").exists():
        try:
            return load_quantized(cached)
        except ModelError:
            pass                                 # another format / torch: rebuild it below
    model = build()
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    try:
        save_quantized(model, tmp)
        shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)                  # atomic: a concurrent loader sees the whole directory or none
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)   # a full or read-only cache only costs speed
    return model
