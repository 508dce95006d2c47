"""Seeded randomness without hidden state.

Every random number the system uses is `coin(seed, position, stream, column)`: a counter-based hash (splitmix64
finaliser) of its four coordinates mapped to a float64 in the open interval (0, 1). A request's whole RNG state is
therefore (seed, committed length): nothing depends on call order, batch composition or process lifetime, which is
what makes replay and resume exact.

`position` is the absolute token position the coin decides (prompt included). `column` indexes within a stream
(a vocabulary id for Gumbel noise, a draft slot never: slots are positions).
"""
from __future__ import annotations

import enum

import numpy as np
import torch

_M64 = (1 << 64) - 1


class Stream(enum.IntEnum):
    GUMBEL = 1      # Gumbel-max sampling: plain seeded decoding (every token no accepted draft decides, the bonus
    #                 row included, in every mode), coupled draft and target
    DRAFT = 2       # draft sampling in rejection mode
    ACCEPT = 3      # accept/reject coin of a draft slot
    RESIDUAL = 4    # the residual draw after a rejected draft (rejection mode)


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrap-around arithmetic is the point)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def keys(seeds, positions, stream: int) -> np.ndarray:
    """One uint64 key per (seed, position) pair for a stream; every coordinate goes through the mixer so nearby keys
    decorrelate. seeds/positions: ints or arrays (reduced mod 2^64)."""
    with np.errstate(over="ignore"):
        k = mix(np.asarray(seeds, dtype=np.uint64))
        k = mix(k ^ np.asarray(positions, dtype=np.uint64))
        return mix(k ^ np.uint64((int(stream) * 0x9E3779B97F4A7C15) & _M64))


def column_mix(columns) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(columns, dtype=np.uint64) * np.uint64(0xD6E8FEB86659FD93) + np.uint64(1)


def unit(h: np.ndarray) -> np.ndarray:
    """52 high bits, centred in their cell: (k + 0.5) / 2^52 is exact in float64 and never 0 or 1."""
    return ((h >> np.uint64(12)).astype(np.float64) + 0.5) / float(1 << 52)


def coins(seed: int, position: int, stream: int, columns: np.ndarray | int) -> np.ndarray:
    """Uniforms in (0, 1), float64, one per column. Pure function of its arguments."""
    return unit(mix(keys(seed & _M64, position & _M64, stream) ^ column_mix(columns)))


def coins_many(seeds, positions, stream: int, column: int = 0) -> np.ndarray:
    """coin(seeds[r], positions[r], stream, column) for every r: float64 [R], bit-identical to the scalar form."""
    return unit(mix(keys(seeds, positions, stream) ^ column_mix(column)))


def coin(seed: int, position: int, stream: int, column: int = 0) -> float:
    return float(coins(seed, position, stream, column))


def gumbel(seed: int, position: int, vocab_size: int, stream: int = Stream.GUMBEL) -> torch.Tensor:
    """Gumbel(0,1) noise over the whole vocabulary for one position, float64."""
    u = coins(seed, position, stream, np.arange(vocab_size, dtype=np.uint64))
    return torch.from_numpy(-np.log(-np.log(u)))
