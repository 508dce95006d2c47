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
    GUMBEL = 1      # Gumbel-max sampling: plain seeded decoding, coupled draft and target
    DRAFT = 2       # draft sampling in rejection mode
    ACCEPT = 3      # accept/reject coin of a draft slot
    RESIDUAL = 4    # residual (after a rejection) and bonus sampling


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrap-around arithmetic is the point)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key(seed: int, position: int, stream: int) -> np.uint64:
    """One uint64 per (seed, position, stream); each coordinate goes through the mixer so nearby keys decorrelate."""
    with np.errstate(over="ignore"):
        k = _mix(np.array([seed & _M64], dtype=np.uint64))
        k = _mix(k ^ np.uint64(position & _M64))
        k = _mix(k ^ np.uint64((int(stream) * 0x9E3779B97F4A7C15) & _M64))
    return k[0]


def coins(seed: int, position: int, stream: int, columns: np.ndarray | int) -> np.ndarray:
    """Uniforms in (0, 1), float64, one per column. Pure function of its arguments."""
    cols = np.asarray(columns, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _mix(_key(seed, position, stream) ^ (cols * np.uint64(0xD6E8FEB86659FD93) + np.uint64(1)))
    # 53 high bits, centred in their cell: never exactly 0 or 1.
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def coin(seed: int, position: int, stream: int, column: int = 0) -> float:
    return float(coins(seed, position, stream, column))


def gumbel(seed: int, position: int, vocab_size: int, stream: int = Stream.GUMBEL) -> torch.Tensor:
    """Gumbel(0,1) noise over the whole vocabulary for one position, float64."""
    u = coins(seed, position, stream, np.arange(vocab_size, dtype=np.uint64))
    return torch.from_numpy(-np.log(-np.log(u)))
