"""The coins in torch int64 arithmetic on the rows' device: bitwise the coins of the numpy implementation they
replaced (golden values recorded from it), equal to the scalar Python-integer twin, and independent of batching."""
import hashlib

import pytest
import torch

from specdec.speculative import coins
from specdec.speculative.coins import Stream, as_coords, coin, coins_many, gumbel_rows, uniform_rows

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# (seed, position, stream, column) -> coin, recorded from the uint64 numpy implementation before the torch port.
GOLDEN = [((0, 0, 1, 0), "0x1.3c02c05274675p-1"), ((1, 2, 1, 3), "0x1.2c092667f79d9p-1"),
          ((2**64 - 1, 2**63, 2, 0), "0x1.32a83037f0c95p-1"), ((123456789, 987654321, 3, 0), "0x1.edf6decf38b64p-3"),
          ((2**63, 2**64 - 1, 4, 49151), "0x1.24cb71e8a1727p-1"), ((42, 7, 1, 12345), "0x1.e8b483aae845dp-1")]
GOLDEN_ROW = "c8ee50b10c321a7c1a492970f5e016a9c8d31fd444c3df544da2e4dada9ad095"   # sha256, coins(2024, 99, 1, 0..999)


def _row_digest(device):
    u = uniform_rows(as_coords(2024, device), as_coords(99, device), 1000, Stream.GUMBEL)[0]
    return hashlib.sha256(u.cpu().numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("device", DEVICES)
def test_coins_are_the_numpy_implementations_bits(device):
    for (seed, pos, stream, col), want in GOLDEN:
        assert coin(seed, pos, stream, col) == float.fromhex(want)
        got = coins_many(as_coords([seed], device), as_coords([pos], device), stream, col)
        assert got.device.type == device and float(got[0]) == float.fromhex(want)
        assert float(uniform_rows(as_coords(seed, device), as_coords(pos, device), col + 1, stream)[0, col]) \
            == float.fromhex(want)
    assert _row_digest(device) == GOLDEN_ROW


def test_golden_values_catch_a_planted_arithmetic_shift(monkeypatch):
    """int64 `>>` sign-extends; forgetting the mask is the bug an int64 port invites. The checks above see it."""
    monkeypatch.setattr(coins, "_srl", lambda x, k: x >> k)
    assert _row_digest("cpu") != GOLDEN_ROW


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1, 17, 1001, 49152])
def test_gumbel_row_does_not_depend_on_its_batch(device, vocab):
    """Each row's noise is the same alone, first, last or in the middle of a batch of any size (an elementwise log
    whose vector tail rounded differently would break seeded exactness at odd vocabulary sizes)."""
    seeds = as_coords([5, 2**64 - 3, 0, 77, 2**63, 11, 12], device)
    pos = as_coords([0, 1, 2**64 - 1, 40, 41, 3, 9], device)
    alone = [gumbel_rows(seeds[r:r + 1], pos[r:r + 1], vocab) for r in range(len(seeds))]
    for lo in range(len(seeds)):
        for hi in (lo + 1, lo + 2, len(seeds)):
            batch = gumbel_rows(seeds[lo:hi], pos[lo:hi], vocab)
            for r in range(lo, min(hi, len(seeds))):
                assert torch.equal(batch[r - lo], alone[r][0])
    assert torch.equal(alone[3][0], coins.gumbel(77, 40, vocab, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_coins_equal_scalar_twin(device):
    g = torch.Generator().manual_seed(1)
    seeds = [int(x) for x in torch.randint(-2**63, 2**63 - 1, (64,), generator=g)] + [0, -1, 2**64 - 1]
    positions = [int(x) for x in torch.randint(0, 2**62, (64,), generator=g)] + [2**64 - 1, 0, 1]
    for stream in Stream:
        got = coins_many(as_coords(seeds, device), as_coords(positions, device), stream, 3).cpu().tolist()
        assert got == [coin(s, x, stream, 3) for s, x in zip(seeds, positions)]
