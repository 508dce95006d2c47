"""Our own CPU kernels, compiled on first use for the machine they run on (torch.utils.cpp_extension, ninja, the
system C++ compiler; -march=native, so the build is cached per CPU and source).

    from specdec.engine import kernels
    y = kernels.qdot(x, packed, bits=4, n=N)                  # qdot.cpp: 4/6/8-bit weights x int8 activations
    y = kernels.rms_norm(x, w, eps)                          # layer_ops.cpp: a row's RMSNorm in one call, and
    kernels.attend(...), kernels.rope(...), kernels.write_kv(...)   # attention, rotary, KV writes (decode's small ops)
    x = kernels.block(x, w, meta, ...)                       # layer_ops.cpp: a whole block in one call
    y = kernels.bf16_linear(x, w, b)                         # bf16_linear.cpp: dense bf16 where bf16 is emulated

PyTorch has no CPU kernel that multiplies 4-bit weights by int8 activations: its `_weight_int4pack_mm_for_cpu`
dequantises the weights for every row of x in bf16, so it is compute-bound (~17 GB/s of weights for one row on a
2-core EPYC) and its cost grows with the rows of a verify. qdot reads each weight group once per tile of rows and
multiplies it in int8 with VNNI (or AVX2), as llama.cpp does.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
from pathlib import Path

import torch

from ...errors import ModelError

SOURCES = [Path(__file__).with_name(f) for f in ("qdot.cpp", "layer_ops.cpp", "bf16_linear.cpp")]
HEADERS = [Path(__file__).with_name("fixed_sums.h")]     # included by the sources: part of the build's key


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _extra_cflags() -> list[str]:
    # SPECDEC_KERNEL_CFLAGS: extra compiler flags, e.g. "-mno-avx512vnni" to build (and test) the AVX2 path
    return os.environ.get("SPECDEC_KERNEL_CFLAGS", "").split()


def build_dir() -> Path:
    """Where the kernels are built: one folder per source, torch installation, CPU and flags. The installation, not
    just its version: torch's build file names its headers by path, so two venvs (a checkout and a clean clone's CI
    run) sharing a folder rebuilt it in turn, each waiting out the other's build."""
    from ..assets import cache_dir
    key = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES + HEADERS) + torch.__version__.encode()
                         + str(Path(torch.__file__).resolve().parent).encode()
                         + _cpu_flags().encode() + " ".join(_extra_cflags()).encode()).hexdigest()[:12]
    return cache_dir() / "kernels" / f"qdot-{key}"


@functools.cache
def _load() -> None:
    from torch.utils import cpp_extension

    flags = _cpu_flags()
    if " avx2" not in flags or " fma" not in flags:
        raise ModelError("the int8-activation kernels need a CPU with AVX2 and FMA", field="quant",
                         remedy="use --quant int4 or int8 (PyTorch's weight-only kernels)")
    extra = _extra_cflags()
    build = build_dir()
    build.mkdir(parents=True, exist_ok=True)
    try:   # the ninja package's binary, where PATH lacks one (a venv run without activating it)
        import ninja
        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    except ImportError:
        pass
    try:
        # torch's own build lock is a file that only its creator removes: a process killed mid-build (a server
        # stopped during its first start) left every later one waiting on it for good. An flock is released when its
        # holder dies; under it no other process of ours is building, so a `lock` file found there is stale.
        with open(build / "specdec.lock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (build / "lock").unlink(missing_ok=True)
            cpp_extension.load(name="specdec_qdot", sources=[str(f) for f in SOURCES], build_directory=str(build),
                               extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", *extra],
                               is_python_module=False, verbose=os.environ.get("SPECDEC_VERBOSE_BUILD") == "1")
    except Exception as e:   # no compiler / ninja: say so rather than fail deep inside a forward
        raise ModelError(f"could not build the int8-activation kernels: {e}", field="quant",
                         remedy="install a C++ compiler (g++) and ninja, or use --quant int4 / int8") from None


def qdot(x: torch.Tensor, packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """y [M, n] = x [M, K] @ W^T with W[n, 32g:32g+32] = scale[n, g] * codes + offset[n, g], in qdot.cpp's packed
    layout (quant.QLinear.q packs it); x's dtype in and out, float32 inside."""
    _load()
    _qdot_choices()
    return torch.ops.specdec.qdot(x, packed, bits, n)


def block(x, w, meta, eps: float, cos, sin, k_cache, v_cache, write_slots, attn, scale: float,
          lo: int = 1) -> torch.Tensor:
    """One transformer block whose linears are qdot's, prepacked for oneDNN or bf16_linear's, in one call:
    model.Block.forward's ops in its order (the same bits); w, meta: model.Block.block_args(); attn: each attention
    group's rows, slots and lens; lo: fewer rows are zero-padded to lo for each linear (row_tiles.RowTiles)."""
    _load()
    _qdot_choices()
    return torch.ops.specdec.block(x, w, meta, eps, cos, sin, k_cache, v_cache, write_slots, attn, scale, lo)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row in one call (qdot.cpp): T(T(x / rms(x)) * w), float32 inside (what model.rms_norm computes
    with ~8 tensor ops, up to the order of the sum of squares)."""
    _load()
    return torch.ops.specdec.rms_norm(x, w, eps)


def attend(q, k, v, rows, slots, lens, scale: float, out: torch.Tensor) -> None:
    """Batch-invariant attention of one AttnGroup (engine/attention.py attend_kernel), written into out [T, H * hd]."""
    _load()
    torch.ops.specdec.attend(q, k, v, rows, slots, lens, scale, out)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """model.rope in one call, bitwise (x [T, heads, hd] with dense head vectors)."""
    _load()
    return torch.ops.specdec.rope(x, cos, sin)


def write_kv(k_cache, v_cache, slots, k, v) -> None:
    """k_cache[slots] = k and v_cache[slots] = v (cast to the cache dtype) in one call (Attention.attend)."""
    _load()
    torch.ops.specdec.write_kv(k_cache, v_cache, slots, k, v)


def bf16_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for bf16 x [M, K] and w [N, K] on a CPU without bf16 arithmetic (bf16_linear.cpp): float32 sums,
    rows sharing each weight read, a row's bits a function of that row alone."""
    _load()
    return torch.ops.specdec.bf16_linear(x, w, b)


@functools.cache
def bf16_emulated() -> bool:
    """Whether this CPU lacks bf16 arithmetic (AVX-512 bf16 or AMX): there PyTorch's bf16 GEMM costs every row like
    the first (registry.native_bf16 has figures), and bf16_linear is the engine's dense linear."""
    return not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def bf16_linear_takes(w, b: torch.Tensor | None) -> bool:
    """Whether bf16_linear is this weight's linear (for bf16 rows of x): a plain bf16 tensor (not a QLinear, not
    prepacked), K a multiple of 8, a bf16 bias or none, on a CPU without bf16 arithmetic."""
    # bf16_emulated first: every dense linear of a forward asks, and on most CPUs the answer ends there
    return (bf16_emulated() and isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.dim() == 2
            and w.shape[1] % 8 == 0 and not w.is_mkldnn and (b is None or b.dtype == torch.bfloat16))


def bf16_linear_usable(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether quant.linear runs bf16_linear for this call: bf16_linear_takes the weight, x is bf16 [M, K], and the
    kernels may run (no autograd)."""
    return (bf16_linear_takes(w, b) and x.dtype == torch.bfloat16 and x.dim() == 2
            and usable(x, w, *(() if b is None else (b,))))


@functools.cache
def available() -> bool:
    """Whether this CPU builds and runs our kernels (AVX2 + FMA and a compiler)."""
    try:
        _load()
        return True
    except ModelError:
        return False


def usable(*ts: torch.Tensor) -> bool:
    """Whether an op on these tensors may run one of the layer kernels instead of its tensor ops: on a CPU that builds
    them, not where autograd needs the graph (the drafter's training; a model's parameters require grad even in
    inference mode, so the question is whether grad is enabled) and not while torch.compile traces the tensor ops."""
    return (ts[0].device.type == "cpu" and not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))
            and not torch.compiler.is_compiling() and available())


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K/32, 32] in -127..127 as float32, a [M, K/32]): qdot's per-group int8 rounding."""
    M, K = x.shape
    xg = x.float().reshape(M, K // 32, 32)
    a = xg.abs().amax(-1) / 127
    xq = torch.where(a[..., None] > 0, xg / torch.where(a > 0, a, 1)[..., None], 0).round()
    return xq, a


def qdot_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The slow twin of qdot in float64: codes unpacked uint8 [N, K]. The same activation rounding, exact sums."""
    N, K = codes.shape
    xq, a = quantize_activations(x)
    dots = torch.einsum("mgj,ngj->mng", xq.double(), codes.reshape(N, K // 32, 32).double())
    sums = (a.double() * xq.double().sum(-1))                                   # a * sum(xq) per group
    return (dots * (a.double()[:, None, :] * scale.double()[None])).sum(-1) + sums @ offset.double().t()


TILE_SCHEMES = ("wide", "narrow")


def qdot_tiles(scheme: str | None = None) -> str:
    """The tile scheme of qdot's vector path (qdot.cpp's header): "wide" (quad-wide tiles of up to 6 rows below 32
    rows) or "narrow" (quad-wide tiles of up to 4 rows below 8, 8-row one-block tiles from 8); `scheme` switches it for
    this process. The bits are the same either way; which is faster depends on the CPU. The AVX2 build has one."""
    _load()
    _qdot_choices()
    return TILE_SCHEMES[torch.ops.specdec.qdot_tiles(-1 if scheme is None else TILE_SCHEMES.index(scheme))]


@functools.cache
def _qdot_choices() -> None:
    """qdot's per-process choices (tile scheme, prefetch distance), made once, at the first qdot or block call (after
    _load): not at every kernel's first use, since a bf16 model that never calls qdot need not time tiles."""
    _pick_tiles()
    _set_prefetch()


def _pick_tiles() -> None:
    """Choose the tile scheme once per process, at its first qdot: SPECDEC_QDOT_TILES=wide|narrow, else (auto) time
    both at 8 rows of a Qwen-1.5B-sized weight (2048 x 1536, 4-bit; ~11 ms in all) and keep wide unless narrow takes
    under 0.95 of its time. Measured: narrow 0.82-0.87x wide's time at 8-16 rows on a Zen 4 EPYC; on a Sapphire
    Rapids Xeon quad-wide tiles took 0.63x the time of 8-row one-block tiles at 8 rows."""
    choice = os.environ.get("SPECDEC_QDOT_TILES", "auto")
    if choice not in ("auto", *TILE_SCHEMES):
        raise ModelError(f"SPECDEC_QDOT_TILES={choice!r} is not a tile scheme", field="SPECDEC_QDOT_TILES",
                         remedy="set it to auto (the default), wide or narrow, or unset it")
    if choice in TILE_SCHEMES:
        torch.ops.specdec.qdot_tiles(TILE_SCHEMES.index(choice))
        return
    if torch.ops.specdec.qdot_tiles(1) != 1:          # one scheme only (AVX2)
        return
    import statistics
    import time
    g = torch.Generator().manual_seed(0)
    N, K = 2048, 1536
    # codes 0..15, scale 1/64, offset -1/8 in fp16, in the packed layout's record order (values do not matter)
    rec = torch.randint(0, 256, (N // 64, K // 32, 4, 4 * 64 + 64), dtype=torch.uint8, generator=g)
    rec[..., 256:] = torch.tensor([1 / 64] * 16 + [-1 / 8] * 16, dtype=torch.float16).view(torch.uint8)
    x = torch.randn(8, K, generator=g).to(torch.bfloat16)
    times: dict[int, list[float]] = {0: [], 1: []}
    with torch.inference_mode():
        for _ in range(5):
            for scheme in (0, 1):
                torch.ops.specdec.qdot_tiles(scheme)
                torch.ops.specdec.qdot(x, rec, 4, N)
                t = time.perf_counter()
                for _ in range(4):
                    torch.ops.specdec.qdot(x, rec, 4, N)
                times[scheme].append(time.perf_counter() - t)
    narrow = statistics.median(times[1]) < 0.95 * statistics.median(times[0])
    torch.ops.specdec.qdot_tiles(1 if narrow else 0)


def qdot_prefetch(nbytes: int | None = None) -> int:
    """How far ahead (bytes) qdot prefetches the weights it streams, 0 for not at all (qdot.cpp's prefetch_bytes);
    `nbytes` sets it for this process. The bits are the same either way."""
    _load()
    _qdot_choices()
    return torch.ops.specdec.qdot_prefetch(-1 if nbytes is None else nbytes)


def _set_prefetch() -> None:
    """SPECDEC_QDOT_PREFETCH=bytes (0: off) overrides the built-in 1024, once per process at its first qdot. The
    distance was chosen on a Sapphire Rapids Xeon: a Qwen 1.5B decode step 0.87x the time with it, 0.83-0.86x at
    2560 bytes, the 0.5B's 0.92x at 1024 and 1.0x at 2560."""
    value = os.environ.get("SPECDEC_QDOT_PREFETCH")
    if value is None:
        return
    if not value.isdigit() or int(value) > 1 << 20:
        raise ModelError(f"SPECDEC_QDOT_PREFETCH={value!r} is not a prefetch distance", field="SPECDEC_QDOT_PREFETCH",
                         remedy="set it to a number of bytes from 0 (no prefetch) to 1048576, or unset it")
    torch.ops.specdec.qdot_prefetch(int(value))


def qdot_amx(enable: bool | None = None) -> bool:
    """Whether qdot runs whole tiles of 16 rows on AMX (a CPU that has it, Linux granting the tile state); `enable`
    switches it for this process (same bits either way: tests compare the two)."""
    _load()
    return torch.ops.specdec.qdot_amx(-1 if enable is None else int(enable))
