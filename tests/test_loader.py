import pytest
import torch

from specdec.engine import assets
from specdec.engine.loader import load_gguf
from specdec.engine.registry import load


@pytest.mark.slow
def test_converted_weight_cache_is_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    first = load("smollm2-135m").model            # dequantises and writes the cache
    assert list((tmp_path / "converted").glob("*/model.safetensors"))
    second = load("smollm2-135m").model           # reads the cache
    direct = load_gguf(assets.smollm2_gguf_path(), torch.bfloat16)
    for (k, a), b, c in zip(first.state_dict().items(), second.state_dict().values(), direct.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, c), k
    assert first.cfg == second.cfg == direct.cfg


def test_smollm2_config_from_gguf():
    from specdec.engine.loader import gguf_config, read_gguf
    p = assets.smollm2_gguf_path()
    cfg = gguf_config(read_gguf(p), p)
    assert (cfg.arch, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == \
        ("llama", 30, 576, 9, 3, 49152)
    assert cfg.tie_embeddings and not cfg.qkv_bias and cfg.rope_theta == 100000.0
