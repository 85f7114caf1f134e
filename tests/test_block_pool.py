"""Block pool: allocation, ref counts, LRU eviction, prefix hits, collision guard."""

import pytest

from mlaserve.cache.block_pool import BlockPool


def test_allocate_free_and_ref_counts():
    pool = BlockPool(4, block_size=2)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free_blocks == 1 and [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    with pytest.raises(RuntimeError, match="exhausted: need 2, have 1"):
        pool.allocate(2)
    pool.free_blocks([2, 0])
    assert pool.num_free_blocks == 3
    # LRU: block 3 (never used) first, then 2 and 0 in the order they were freed
    assert pool.allocate(3) == [3, 2, 0]
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([1, 1])


def test_prefix_hits_share_exact_blocks_and_keep_one_token_to_compute():
    pool = BlockPool(8, block_size=2)
    tokens = [10, 11, 12, 13, 14]
    blocks, hashes = pool.allocate(3), []
    assert blocks == [0, 1, 2]
    assert pool.cache_full_blocks(tokens, blocks, 5, hashes, 0) == 2  # two full blocks
    # same prompt: both full blocks hit; the last token is left to compute
    other_hashes = []
    assert pool.lookup_prefix(tokens, other_hashes) == [0, 1]
    assert other_hashes == hashes
    assert [pool.ref_count(b) for b in (0, 1, 2)] == [2, 2, 1]
    # a 4-token prompt equal to the first two blocks may reuse only one (one token to compute)
    assert pool.lookup_prefix(tokens[:4], []) == [0]
    # a prompt that diverges in the second block hits only the first
    assert pool.lookup_prefix([10, 11, 99, 13, 14], []) == [0]
    assert pool.lookup_prefix([9, 11, 12, 13, 14], []) == []


def test_freed_cached_blocks_are_reused_until_evicted_lru():
    pool = BlockPool(3, block_size=1)
    a, hashes = pool.allocate(3), []
    pool.cache_full_blocks([1, 2, 3], a, 3, hashes, 0)
    pool.free_blocks(a[::-1])  # tail first: 2, 1, 0
    assert pool.lookup_prefix([1, 2, 3, 4], []) == [0, 1, 2]
    pool.free_blocks([2, 1, 0])
    # a fresh allocation evicts the least recently freed block (2) and its hash
    assert pool.allocate(1) == [2]
    assert pool.lookup_prefix([1, 2, 3, 4], []) == [0, 1]


def test_hash_collisions_never_reuse_wrong_tokens():
    pool = BlockPool(6, block_size=2, hash_fn=lambda parent, tokens: 7)  # everything collides
    blocks, hashes = pool.allocate(2), []
    pool.cache_full_blocks([1, 2, 3, 4], blocks, 4, hashes, 0)
    assert pool.lookup_prefix([1, 2, 9], []) == [0]  # first block really matches
    assert pool.lookup_prefix([5, 6, 9], []) == []  # same hash, other tokens: a miss
    assert pool.lookup_prefix([1, 2, 3, 4, 0], []) == [0]  # block 1 was not registered (taken)


def test_prefix_caching_off_never_hits():
    pool = BlockPool(4, block_size=1, enable_prefix_caching=False)
    blocks = pool.allocate(2)
    pool.cache_full_blocks([1, 2], blocks, 2, [], 0)
    assert pool.lookup_prefix([1, 2, 3], []) == []
