"""`specdec export-hf`: the directory another server (SGLang, transformers) loads holds exactly the weights the
embedded engine serves, and a tokenizer that encodes the same ids."""
import json

import pytest
import torch

from specdec.cli import main
from specdec.engine.engine import Engine
from specdec.engine.registry import load

from .conftest import random_prompt


def test_tiny_export_round_trips_bitwise(tmp_path):
    assert main(["export-hf", "tiny-qwen2", str(tmp_path / "out")]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["torch_dtype"] == "float64"
    ours, back = load("tiny-qwen2").model, load(str(tmp_path / "out"), "fp64").model
    a, b = ours.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_smollm2_export_serves_the_same_logits_and_tokens(tmp_path):
    from transformers import AutoTokenizer
    out = tmp_path / "smollm2"
    assert main(["export-hf", "smollm2-135m", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    ours = load("smollm2-135m")
    assert cfg["torch_dtype"] == "bfloat16"
    eos = cfg["eos_token_id"]
    assert set(eos if isinstance(eos, list) else [eos]) == set(ours.tokenizer.eos_ids)

    hf_tok = AutoTokenizer.from_pretrained(out)
    for text in ["The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x * 2\n", "ünïcødé 😀 text"]:
        assert hf_tok.encode(text, add_special_tokens=False) == ours.tokenizer.encode(text), text

    back = load(str(out))
    ids = random_prompt(ours.cfg.vocab_size, 24, seed=3)
    assert torch.equal(Engine(back.model, kv_tokens=256).score(ids), Engine(ours.model, kv_tokens=256).score(ids))
