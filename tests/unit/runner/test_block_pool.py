"""verispec/runner/block_pool.py: chained hashes, reference counts, LRU eviction of cached blocks."""

from __future__ import annotations

import pytest

from verispec.runner.block_pool import NULL_BLOCK, ROOT_HASH, BlockPool, block_hash


def test_a_hash_depends_on_the_parent_the_tokens_and_the_salt():
    a = block_hash(ROOT_HASH, [1, 2, 3])
    assert a == block_hash(ROOT_HASH, [1, 2, 3])
    assert a != block_hash(ROOT_HASH, [1, 2, 4])
    assert block_hash(a, [5]) != block_hash(block_hash(ROOT_HASH, [1, 2, 4]), [5])
    assert a != block_hash(ROOT_HASH, [1, 2, 3], "tenant-a")
    assert block_hash(ROOT_HASH, [1, 2, 3], "tenant-a") != block_hash(ROOT_HASH, [1, 2, 3], "tenant-b")


def test_the_null_block_is_never_handed_out():
    pool = BlockPool(4)
    assert NULL_BLOCK not in pool.allocate(3)
    with pytest.raises(ValueError, match="4 KV blocks asked for, 0 free"):
        pool.allocate(4)


def test_a_cached_block_is_found_until_it_is_evicted_least_recently_freed_first():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"A")
    pool.cache(b, b"B")
    pool.free([a])
    pool.free([b])
    pool.free([c])
    # c holds nothing: handed out before the cached blocks, then a (freed before b)
    assert pool.allocate(1) == [c]
    assert pool.lookup([b"A", b"B"]) == [a, b]
    pool.free([a, b])
    # freed tail first: b before a, so a (the prefix's head) is evicted last
    assert pool.allocate(1) == [b]
    assert pool.lookup([b"A", b"B"]) == [a]


def test_lookup_stops_at_the_first_miss_and_references_the_hits():
    pool = BlockPool(5)
    a, b = pool.allocate(2)
    pool.cache(a, b"A")
    pool.cache(b, b"B")
    assert pool.lookup([b"A", b"X", b"B"]) == [a]
    assert pool.ref[a] == 2
    # a block in use is not free; freeing one reference leaves it in use
    pool.free([a])
    assert pool.ref[a] == 1 and pool.num_free == 2


def test_the_same_tokens_computed_twice_keep_the_first_block():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, b"A")
    pool.cache(b, b"A")
    assert pool.lookup([b"A"]) == [a]


def test_reset_forgets_cached_prefixes_only_when_no_block_is_in_use():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, b"A")
    pool.free([a])
    assert not pool.reset()
    pool.free([b])
    assert pool.reset()
    assert pool.lookup([b"A"]) == []


def test_a_draft_mark_holds_while_the_block_keeps_its_hash():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    # no hash yet: nothing to vouch for
    assert not pool.mark_drafted(b) and not pool.drafted(b)
    h = block_hash(ROOT_HASH, [1, 2])
    pool.cache(b, h)
    assert pool.mark_drafted(b) and pool.drafted(b)
    pool.free([b])
    assert pool.lookup([h]) == [b] and pool.drafted(b)
    pool.free([b])
    # evicted and handed out again (it is the only free block left after these two): the mark goes with the hash
    pool.allocate(3)
    assert not pool.drafted(b) and b not in pool.draft_marks
    pool.cache(b, h)
    assert not pool.drafted(b)
