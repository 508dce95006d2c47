"""Bad input gets a clear, typed error naming the field and the remedy — never a traceback from deep inside."""
import subprocess
import sys

import pytest

from specdec.engine import assets
from specdec.engine.engine import Engine
from specdec.engine.layout import SeqInput
from specdec.engine.registry import PRESETS, load
from specdec.errors import InvalidRequest, KVPoolExhausted, ModelError
from specdec.generate import Request, generate
from specdec.speculative.sampling import SamplingParams


def test_unknown_preset_lists_known():
    with pytest.raises(ModelError) as e:
        load("llama-9000")
    msg = str(e.value)
    assert "llama-9000" in msg and all(p in msg for p in PRESETS)


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelError, match="unknown model"):
        load(str(tmp_path / "absent.gguf"))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelError, match="not a readable GGUF"):
        load(str(bad))
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(assets.smollm2_gguf_path().read_bytes()[:5_000_000])
    with pytest.raises(ModelError, match="corrupt or truncated"):
        load(str(truncated))


def test_corrupt_hf_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 8, "hidden_size": 8, '
                                          '"num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 8}')
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ModelError, match="cannot read weights"):
        load(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelError, match="not supported"):
        load(str(tmp_path))


def test_sha256_mismatch(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    with pytest.raises(ModelError, match="sha256"):
        assets.verify_file(f, 3, "0" * 64)


def test_prompt_beyond_context(tiny_llama):
    e = Engine(tiny_llama, kv_tokens=4096)
    ctx = tiny_llama.cfg.max_seq_len
    with pytest.raises(InvalidRequest) as err:
        generate(e, [Request([1] * (ctx + 5), max_tokens=4)])
    assert err.value.field == "prompt" and str(ctx) in str(err.value) and "shorten" in str(err.value)
    with pytest.raises(InvalidRequest) as err:
        generate(e, [Request([1] * (ctx - 2), max_tokens=10)])
    assert err.value.field == "max_tokens" and "max_tokens <= 2" in str(err.value)


def test_token_outside_vocab(tiny_llama):
    e = Engine(tiny_llama, kv_tokens=1024)
    V = tiny_llama.cfg.vocab_size
    with pytest.raises(InvalidRequest, match=f"token id {V} is outside the vocabulary"):
        generate(e, [Request([1, 2, V], max_tokens=4)])
    with pytest.raises(InvalidRequest, match="token id -1"):
        e.forward([SeqInput(e.new_sequence(), [-1])])


@pytest.mark.parametrize("params,field", [
    (SamplingParams(temperature=-1.0), "temperature"), (SamplingParams(temperature=float("nan")), "temperature"),
    (SamplingParams(temperature=1.0, top_p=0.0), "top_p"), (SamplingParams(temperature=1.0, top_k=-3), "top_k"),
    (SamplingParams(temperature=1.0, min_p=1.0), "min_p"), (SamplingParams(temperature=1.0, seed=-5), "seed"),
])
def test_bad_sampling_params(tiny_llama, params, field):
    e = Engine(tiny_llama, kv_tokens=1024)
    with pytest.raises(InvalidRequest) as err:
        generate(e, [Request([1, 2, 3], params, 4)])
    assert err.value.field == field and field in str(err.value)


def test_kv_pool_exhausted_is_typed_and_engine_recovers(tiny_llama):
    e = Engine(tiny_llama, kv_tokens=32, page_size=8)
    a = e.new_sequence()
    e.forward([SeqInput(a, list(range(1, 25)))])
    b = e.new_sequence()
    with pytest.raises(KVPoolExhausted):            # another prompt: no page of a's to share (the prefix cache)
        e.forward([SeqInput(b, list(range(30, 49)))])
    assert e.length(b) == 0
    e.release(a)                                   # once pages are back, the queued request runs
    e.forward([SeqInput(b, list(range(30, 49)))])
    assert e.length(b) == 19


def test_cli_error_is_one_clear_line():
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", "nope", "--prompt", "x"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "specdec: error: model: unknown model 'nope'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", "tiny-llama", "--prompt", "x",
                        "--temperature", "1", "--top-p", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "top_p" in r.stderr and "Traceback" not in r.stderr
