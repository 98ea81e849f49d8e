"""Which requests run: admission into KV slots and blocks (with cached prefixes), room for each decode step's
tokens, recompute preemption when blocks run out, and registering full blocks of committed tokens in the prefix
cache."""

from __future__ import annotations

from collections import deque

from verispec.metrics import EngineCounters
from verispec.request import Request, Status
from verispec.runner.block_pool import ROOT_HASH, block_hash
from verispec.runner.kv_cache import KVCache


class Scheduler:
    def __init__(self, cache: KVCache, counters: EngineCounters, enable_prefix_caching: bool = True):
        """counters: where prefix-cache lookups (in tokens) and preemptions are counted."""
        self.cache, self.counters = cache, counters
        self.enable_prefix_caching = enable_prefix_caching
        # positions a decode step may write past a request's last token (its drafts)
        self.lookahead = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def admit(self, can_hit: bool = True) -> list[Request]:
        """Waiting requests, first come first served, into free slots while their prefill's blocks are free (a
        cached prefix counts as computed). can_hit: False where cached prefixes cannot be used (a drafter needs the
        target's states at every position). -> the requests admitted."""
        admitted = []
        while self.waiting and self.cache.num_free:
            req = self.waiting[0]
            slot = self.cache.allocate()
            hits = self._lookup(req) if self.enable_prefix_caching and can_hit else []
            self.cache.adopt(slot, hits)
            # the prefill, one position for its first token, and a block a running request may need next
            if not self._fits(slot, req.prefill_end + 1, len(self.running)):
                self.cache.free(slot)
                break
            self.waiting.popleft()
            if self.enable_prefix_caching and can_hit and req.params.prompt_logprobs is None:
                self.counters.prefix_cache_queries += req.prefill_end
                self.counters.prefix_cache_hits += len(hits) * self.cache.block_size
            req.slot, req.status = slot, Status.RUNNING
            req.num_computed = len(hits) * self.cache.block_size
            req.num_cached_blocks = len(hits)
            self.running.append(req)
            admitted.append(req)
        return admitted

    def _fits(self, slot: int, n: int, spare: int) -> bool:
        """Grow the slot to n positions if that leaves `spare` blocks free."""
        return self.cache.blocks_needed(slot, n) + spare <= self.cache.pool.num_free and self.cache.grow(
            slot, n
        )

    def _lookup(self, req: Request) -> list[int]:
        """The cached blocks of the request's prefix (referenced for it). At least one token is always left to
        compute: its logits give the next token. Requests asking for prompt logprobs compute every position."""
        if req.params.prompt_logprobs is not None:
            return []
        bs, end = self.cache.block_size, req.prefill_end
        full = (end - 1) // bs
        tokens = req.tokens_from(0)
        chain_hashes(req, tokens, full, bs)
        return self.cache.pool.lookup(req.block_hashes[:full])

    def make_room(self) -> list[Request]:
        """Blocks for every running request's next decode step (its newest token and up to `lookahead` drafts),
        preempting the newest requests while too few are free. -> the preempted requests (back at the front of
        the waiting queue, their blocks freed)."""
        preempted = []
        i = 0
        while i < len(self.running):
            r = self.running[i]
            n = min(self.cache.t_alloc - 1, r.num_computed + 1 + self.lookahead)
            if self.cache.grow(r.slot, n):
                i += 1
                continue
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim)
        return preempted

    def preempt(self, req: Request) -> None:
        """vLLM's recompute preemption: the request's blocks are freed (its full blocks stay cached), it waits at
        the front of the queue, and computes its tokens again when readmitted."""
        self._release(req)
        req.status = Status.WAITING
        req.num_computed, req.num_cached_blocks = 0, 0
        req.recompute_to = req.num_tokens - 1
        self.waiting.appendleft(req)
        self.counters.num_preemptions += 1

    def cache_committed(self, reqs: list[Request]) -> None:
        """Register the requests' newly full blocks of committed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs, pool = self.cache.block_size, self.cache.pool
        for r in reqs:
            # positions past the tokens kept (drafts accepted beyond a stop) hold nothing to cache
            full = min(r.num_computed, r.num_tokens) // bs
            if r.slot is None or full <= r.num_cached_blocks:
                continue
            chain_hashes(r, r.tokens_from(len(r.block_hashes) * bs), full, bs, start=len(r.block_hashes))
            blocks = self.cache.blocks[r.slot]
            for i in range(r.num_cached_blocks, full):
                pool.cache(blocks[i], r.block_hashes[i])
            r.num_cached_blocks = full

    def finish(self, req: Request) -> None:
        if req.status is Status.RUNNING:
            self._release(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)

    def _release(self, req: Request) -> None:
        """A running request out of the batch, its slot and blocks freed."""
        self.running.remove(req)
        self.cache.free(req.slot)
        req.slot = None


def chain_hashes(req: Request, tokens: list[int], full: int, bs: int, start: int = 0) -> None:
    """Extend req.block_hashes to `full` blocks; tokens: the request's tokens from block `start` on."""
    for i in range(len(req.block_hashes), full):
        parent = req.block_hashes[-1] if req.block_hashes else ROOT_HASH
        j = (i - start) * bs
        req.block_hashes.append(block_hash(parent, tokens[j : j + bs], req.cache_salt if i == 0 else None))
