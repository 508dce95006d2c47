"""`specdec export-hf MODEL DIR`: a preset, GGUF or HF directory written as an HF model directory (config.json,
model.safetensors, tokenizer files), so that another server (SGLang, vLLM, transformers) serves exactly the weights
the embedded engine serves: the same dequantised tensors, in the dtype asked for."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
               torch.float64: "float64"}


def export_hf(name: str, out: str | Path, dtype: str | None = None) -> Path:
    from .engine.loader import save_hf_dir
    from .engine.registry import load
    lm = load(name, dtype)
    out = save_hf_dir(lm.model, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = DTYPE_NAMES[lm.model.embed.weight.dtype]
    tok = getattr(lm.tokenizer, "hf", None)
    if tok is not None:
        tok.save_pretrained(str(out))
        eos = sorted(lm.tokenizer.eos_ids)
        cfg["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        if tok.bos_token_id is not None:
            cfg["bos_token_id"] = tok.bos_token_id
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def cmd_export_hf(args) -> int:
    out = export_hf(args.model, args.out, args.dtype)
    print(f"wrote {args.model} as an HF directory: {out}")
    return 0


def add_parser(sub) -> None:
    p: argparse.ArgumentParser = sub.add_parser("export-hf", help="write a model as an HF directory (e.g. for SGLang)")
    p.add_argument("model", help="preset, .gguf file or HF directory")
    p.add_argument("out", help="output directory")
    p.add_argument("--dtype", default=None, help="bf16 (default for real models) | fp32 | fp64")
    p.set_defaults(func=cmd_export_hf)
