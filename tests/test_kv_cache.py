import pytest
import torch

from specdec.engine.kv_cache import KVPool
from specdec.errors import InvalidRequest, KVPoolExhausted


def pool(tokens=64, page=4):
    return KVPool(n_layers=1, n_kv_heads=1, head_dim=2, num_tokens=tokens, page_size=page, dtype=torch.float32)


def test_grow_truncate_free_reuses_pages():
    kv = pool()
    a = kv.allocate()
    kv.write([(a, 0, 10)])
    assert kv.length(a) == 10 and kv.free_tokens == 64 - 12
    kv.truncate(a, 5)                       # rollback frees the pages past position 5
    assert kv.length(a) == 5 and kv.free_tokens == 64 - 8
    kv.write([(a, 3, 2)])                   # writing before the end truncates first
    assert kv.length(a) == 5
    kv.free(a)
    assert kv.free_tokens == 64 and a not in kv


def test_slots_are_stable_per_position():
    kv = pool(page=4)
    a, b = kv.allocate(), kv.allocate()
    kv.write([(a, 0, 6), (b, 0, 3)])
    sa, sb = kv.slots(a, 0, 6), kv.slots(b, 0, 3)
    assert len(set(sa.tolist()) | set(sb.tolist())) == 9        # no slot shared
    kv.write([(a, 6, 2)])
    assert kv.slots(a, 0, 6).tolist() == sa.tolist()             # growth never moves old positions


def test_exhaustion_is_typed_and_changes_nothing():
    kv = pool(tokens=16, page=4)
    a, b = kv.allocate(), kv.allocate()
    kv.write([(a, 0, 8)])
    with pytest.raises(KVPoolExhausted) as e:
        kv.write([(a, 8, 4), (b, 0, 8)])    # needs 3 pages, 2 free
    assert e.value.needed == 3 and e.value.free == 2
    assert "KV pool exhausted" in str(e.value) and "--kv-tokens" in str(e.value)
    assert kv.length(a) == 8 and kv.length(b) == 0 and kv.free_tokens == 8


def test_gap_is_refused():
    kv = pool()
    a = kv.allocate()
    with pytest.raises(InvalidRequest, match="gap"):
        kv.write([(a, 2, 1)])
