"""The KV cache's blocks: a free queue, reference counts and the prefix cache's hash table.

Block 0 is the null block: unused block-table entries point at it and padded query rows write into it; it is never
handed out. A block whose reference count drops to zero goes back to the free queue; if it holds a full block of
committed tokens (it has a hash) it keeps its contents and stays findable by that hash until it is handed out again
(evicted): the least recently freed first, as vLLM's free block queue. Blocks without a hash are handed out first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

NULL_BLOCK = 0
# the hash a request's first block chains from
ROOT_HASH = b""


def block_hash(parent: bytes, tokens: list[int], extra: str | None = None) -> bytes:
    """vLLM's chained block hash: the parent block's hash, this block's token ids and extra keys (a cache salt, on a
    request's first block only), SHA-256 so that one tenant cannot forge another's prefix."""
    h = hashlib.sha256(parent)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    if extra is not None:
        h.update(b"\x00salt\x00" + extra.encode("utf-8", "surrogatepass"))
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"a KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        # block -> hash of the committed tokens it holds (full blocks only)
        self.hash_of: dict[int, bytes] = {}
        self.by_hash: dict[bytes, int] = {}
        # block -> the hash its contents had when a drafter with its own K/V in the same block ids (a draft model
        # paged through this table) finished writing them: valid while the block keeps that hash
        self.draft_marks: dict[int, bytes] = {}
        # free blocks, the next one handed out first; the values are unused
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        """n blocks, each referenced once; a cached block handed out loses its hash (evicted). ValueError if fewer
        than n are free (callers check num_free)."""
        if n > len(self.free_queue):
            raise ValueError(f"{n} KV blocks asked for, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            h = self.hash_of.pop(b, None)
            if h is not None and self.by_hash.get(h) == b:
                del self.by_hash[h]
            self.draft_marks.pop(b, None)
            self.ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block (a request's blocks, in order: the tail is freed first, so a prefix
        stays cached longest)."""
        for b in reversed(blocks):
            if b == NULL_BLOCK:
                continue
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free_queue[b] = None
                if b not in self.hash_of:
                    # nothing to keep: handed out before any cached block
                    self.free_queue.move_to_end(b, last=False)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` found, each referenced once more (taken off the free
        queue if it was there)."""
        hit = []
        for h in hashes:
            b = self.by_hash.get(h)
            if b is None:
                break
            if self.ref[b] == 0:
                del self.free_queue[b]
            self.ref[b] += 1
            hit.append(b)
        return hit

    def cache(self, block: int, h: bytes) -> None:
        """Record that `block` holds the full block of committed tokens hashed h. A hash already held by another
        block keeps that block (the same tokens computed twice)."""
        if block in self.hash_of or h in self.by_hash:
            return
        self.hash_of[block] = h
        self.by_hash[h] = block

    def reset(self) -> bool:
        """Forget every cached prefix; False (nothing done) while a block is in use, as vLLM's reset_prefix_cache."""
        if len(self.free_queue) != self.num_usable:
            return False
        self.hash_of.clear()
        self.by_hash.clear()
        self.draft_marks.clear()
        return True

    def mark_drafted(self, block: int) -> bool:
        """A drafter wrote its K/V of `block`'s committed tokens: valid for as long as the block holds them. False
        (nothing marked) while the block holds no cached hash yet."""
        h = self.hash_of.get(block)
        if h is None:
            return False
        self.draft_marks[block] = h
        return True

    def drafted(self, block: int) -> bool:
        """Whether the drafter's K/V of `block` are those of the committed tokens it holds now."""
        h = self.hash_of.get(block)
        return h is not None and self.draft_marks.get(block) == h
