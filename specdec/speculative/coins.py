"""Seeded randomness without hidden state.

Every random number the system uses is `coin(seed, position, stream, column)`: a counter-based hash (splitmix64
finaliser) of its four coordinates mapped to a float64 in the open interval (0, 1). A request's whole RNG state is
therefore (seed, committed length): nothing depends on call order, batch composition or process lifetime, which is
what makes replay and resume exact.

`position` is the absolute token position the coin decides (prompt included). `column` indexes within a stream
(a vocabulary id for Gumbel noise, a draft slot never: slots are positions).

Two implementations of one hash: `coin` is the scalar reference in Python integers (what accept_ref uses); the
tensor forms run in torch int64 arithmetic on whatever device the rows live on, so a step never round-trips through
the host per row. int64 wrap-around multiplication and xor have the bits of uint64 arithmetic; only the right shift
differs (arithmetic in int64), hence `_srl` masks the sign bits back out.
"""
from __future__ import annotations

import enum
import functools

import torch

_M64 = (1 << 64) - 1


class Stream(enum.IntEnum):
    GUMBEL = 1      # Gumbel-max sampling: plain seeded decoding (every token no accepted draft decides, the bonus
    #                 row included, in every mode), coupled draft and target
    DRAFT = 2       # draft sampling in rejection mode
    ACCEPT = 3      # accept/reject coin of a draft slot
    RESIDUAL = 4    # the residual draw after a rejected draft (rejection mode)


_MUL1, _MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_GOLDEN, _COLUMN = 0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93


def signed64(x: int) -> int:
    """x mod 2^64 as the int64 with the same bits (how a uint64 coordinate travels in a torch tensor)."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


# ----------------------------------------------------------------------------------------- scalar reference twin

def _mix_int(x: int) -> int:
    x ^= x >> 30
    x = (x * _MUL1) & _M64
    x ^= x >> 27
    x = (x * _MUL2) & _M64
    return x ^ (x >> 31)


def key(seed: int, position: int, stream: int) -> int:
    return _mix_int(_mix_int(_mix_int(seed & _M64) ^ (position & _M64)) ^ ((int(stream) * _GOLDEN) & _M64))


def coin(seed: int, position: int, stream: int, column: int = 0) -> float:
    """One uniform in (0, 1): 52 high bits of the hash, centred in their cell ((k + 0.5) / 2^52 is exact in float64
    and never 0 or 1)."""
    h = _mix_int(key(seed, position, stream) ^ ((column * _COLUMN + 1) & _M64))
    return ((h >> 12) + 0.5) / float(1 << 52)


# ------------------------------------------------------------------------------------------- tensors, any device

def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k).bitwise_and_((1 << (64 - k)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors holding uint64 bits (wrap-around arithmetic is the point). In place
    after the first op: a one-row Gumbel draw is a couple of dozen small ops, so each allocation shows."""
    x = x ^ _srl(x, 30)
    x.mul_(signed64(_MUL1))
    x.bitwise_xor_(_srl(x, 27))
    x.mul_(signed64(_MUL2))
    return x.bitwise_xor_(_srl(x, 31))


def as_coords(values, device=None) -> torch.Tensor:
    """Seeds or positions (Python ints of any sign, reduced mod 2^64, or an int64 tensor) -> int64 tensor."""
    if isinstance(values, torch.Tensor):
        return values.to(device=device or values.device, dtype=torch.int64)
    if isinstance(values, int):
        values = [values]
    return torch.tensor([signed64(int(v)) for v in values], dtype=torch.int64, device=device)


def keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """One key per (seed, position) pair for a stream; every coordinate goes through the mixer so nearby keys
    decorrelate."""
    k = mix(mix(seeds) ^ positions)
    return mix(k ^ signed64(int(stream) * _GOLDEN))


def column_mix(columns: torch.Tensor) -> torch.Tensor:
    return columns * signed64(_COLUMN) + 1


def unit(h: torch.Tensor) -> torch.Tensor:
    return _srl(h, 12).to(torch.float64).add_(0.5).mul_(2.0 ** -52)     # * 2^-52 is exact, = / 2^52


def coins_many(seeds: torch.Tensor, positions: torch.Tensor, stream: int, column: int = 0) -> torch.Tensor:
    """coin(seeds[r], positions[r], stream, column) for every r: float64 [R] on the coordinates' device."""
    return unit(mix(keys(seeds, positions, stream) ^ signed64(column * _COLUMN + 1)))


@functools.lru_cache(maxsize=8)
def _columns(n: int, device: torch.device) -> torch.Tensor:
    return column_mix(torch.arange(n, dtype=torch.int64, device=device))


def _uniforms(k, n_columns: int, device) -> torch.Tensor:
    """The coins of key(s) k (a signed64 int, or int64 [R, 1]) for columns 0..n_columns-1."""
    return unit(mix(_columns(n_columns, torch.device(device)) ^ k))


def uniform_rows(seeds: torch.Tensor, positions: torch.Tensor, n_columns: int, stream: int) -> torch.Tensor:
    """coin(seeds[r], positions[r], stream, c) for c < n_columns: float64 [R, n_columns]."""
    return _uniforms(keys(seeds, positions, stream)[:, None], n_columns, seeds.device)


def gumbel_rows(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int,
                stream: int = Stream.GUMBEL) -> torch.Tensor:
    """Gumbel(0,1) noise over the whole vocabulary for each (seeds[r], positions[r]): float64 [R, V]. Elementwise
    (torch's float64 log gives an element the same bits wherever it sits in the tensor; tested), so a row's noise
    does not depend on which other rows are computed with it."""
    return _gumbel_of(uniform_rows(seeds, positions, vocab_size, stream))


def _gumbel_of(u: torch.Tensor) -> torch.Tensor:
    return u.log_().neg_().log_().neg_()        # -log(-log u), in place


def gumbel_at(seed: int, position: int, columns: torch.Tensor, stream: int = Stream.GUMBEL) -> torch.Tensor:
    """gumbel(seed, position, V, stream)[columns], hashing those vocabulary ids only: float64 [len(columns)]. A draft
    distribution that lives on a few thousand ids need not pay a hash per id of the whole vocabulary."""
    return _gumbel_of(unit(mix(column_mix(columns.to(torch.int64)) ^ signed64(key(seed, position, stream)))))


def gumbel(seed: int, position: int, vocab_size: int, stream: int = Stream.GUMBEL, device=None) -> torch.Tensor:
    """Gumbel(0,1) noise over the whole vocabulary for one position, float64 [V] (the key in Python integers: one
    row is the per-token case, where each tensor op's overhead counts)."""
    return _gumbel_of(_uniforms(signed64(key(seed, position, stream)), vocab_size, device or "cpu"))
