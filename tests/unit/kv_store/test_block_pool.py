import pytest

from kv_store.block_pool import BlockPool


def test_allocate_in_id_order_and_refuse_without_taking():
    pool = BlockPool(11)
    assert pool.allocate(4) == [0, 1, 2, 3]
    assert pool.allocate(8) is None
    assert pool.num_free_blocks == 7
    assert pool.allocate(7) == [4, 5, 6, 7, 8, 9, 10]
    assert pool.num_free_blocks == 0


def test_release_order_is_eviction_order_and_cached_blocks_stay_findable():
    pool = BlockPool(4)
    a = pool.allocate(3)
    for block_id, key in zip(a, (100, 101, 102)):
        pool.cache(block_id, key)
    pool.release(reversed(a))  # tail first
    assert pool.num_free_blocks == 4
    assert pool.match_prefix([100, 101, 102, 103]) == [0, 1, 2]
    # free queue is now [3, 2, 1, 0]: the uncached block first, then the tail, the root last.
    assert pool.allocate(2) == [3, 2]
    assert pool.match_prefix([100, 101, 102]) == [0, 1]
    assert pool.block_key(2) is None
    assert pool.num_cached_blocks == 2


def test_acquire_shares_a_cached_block_and_removes_it_from_the_free_queue():
    pool = BlockPool(3)
    [b] = pool.allocate(1)
    pool.cache(b, 7)
    pool.release([b])
    hit = pool.match_prefix([7])
    pool.acquire(hit)
    pool.acquire(hit)
    assert pool.ref_count(b) == 2
    assert pool.num_free_blocks == 2
    assert pool.allocate(2) == [1, 2]
    pool.release(hit)
    pool.release(hit)
    assert pool.num_free_blocks == 1
    assert pool.match_prefix([7]) == [b]


def test_duplicate_key_keeps_the_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, 5)
    pool.cache(b, 5)
    assert pool.match_prefix([5]) == [a]
    assert pool.block_key(b) is None


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    [a] = pool.allocate(1)
    pool.cache(a, 5)
    assert pool.match_prefix([5]) == []


def test_double_release_is_caught():
    pool = BlockPool(1)
    [a] = pool.allocate(1)
    pool.release([a])
    with pytest.raises(AssertionError):
        pool.release([a])
