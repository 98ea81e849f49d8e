"""`suffix` decoding: drafts from suffix trees over the request's own prompt/output and over past responses.

Suffix trees and the SuffixDecoding cache (the semantics of ArcticInference's
``SuffixDecodingCache``, ``method: "suffix"`` in vLLM). Python objects; numpy only to sort
suffixes when a prompt tree is built in one go. No torch.

A ``SuffixTree`` holds one or more token sequences. For every position i of a sequence the
suffix starting at i, truncated to ``max_depth`` tokens, is inserted, so the count of the
node reached by a string x is the number of occurrences of x (len(x) <= max_depth).

The tree is path-compressed: a node is an edge label plus the node at its end. A trie node
is merged into its only child when their counts are equal (no suffix ends there), so a
tree has O(total tokens) nodes, not O(tokens * depth). A label is a slice
``seq[start:start + length]`` of a stored sequence; invariant: ``seq[start - d:start +
length]`` is the whole path from the root, d being the parent's depth. When a sequence is
removed, surviving nodes that still point into it get a private copy of their path
(<= max_depth tokens), so removed sequences are not kept alive.

Appending one token touches only the <= max_depth "active" suffixes of its sequence (those
still shorter than max_depth), each O(1) node operations. Every active suffix ends exactly
at a node boundary. Each node caches its most frequent child (ties: smallest token id);
removals mark the cache stale and it is recomputed on the next read."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Hashable, KeysView, Sequence
from dataclasses import dataclass, field
from numbers import Integral

import numpy as np

from verispec.proposers.base import Proposal, ProposerNeeds
from verispec.request import Request


@dataclass
class Draft:
    """A speculated continuation.

    ``probs[i]`` is the estimated probability of ``token_ids[:i + 1]`` (running product of
    count(child) / count(node)); ``score`` is their sum; ``match_len`` the length of the
    context suffix the draft continues (for an empty draft: the longest suffix found, as
    in ArcticInference; 0 when nothing matched)."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class _Node:
    __slots__ = ("count", "children", "parent", "seq", "start", "length", "best", "stale")

    def __init__(self, count: int, parent: _Node | None, seq: list[int], start: int, length: int):
        self.count = count
        self.children: dict[int, _Node] | None = None
        self.parent = parent
        self.seq = seq
        self.start = start
        self.length = length
        # most frequent child, valid unless stale
        self.best: _Node | None = None
        self.stale = False


def _beats(a: _Node, b: _Node | None) -> bool:
    """Whether child ``a`` ranks above child ``b``: higher count, then smaller token id."""
    if b is None:
        return True
    if a.count != b.count:
        return a.count > b.count
    return a.seq[a.start] < b.seq[b.start]


def _promote(node: _Node, child: _Node) -> None:
    """Update ``node.best`` after ``child``'s count grew (or ``child`` was added)."""
    if not node.stale and _beats(child, node.best):
        node.best = child


def _best_child(node: _Node) -> _Node | None:
    if node.stale:
        node.best = None
        for child in node.children.values() if node.children else ():
            if _beats(child, node.best):
                node.best = child
        node.stale = False
    return node.best


class SuffixTree:
    """Depth-bounded, path-compressed suffix tree over several token sequences."""

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._root = _Node(0, None, [], 0, 0)
        self._seqs: dict[int, list[int]] = {}
        # end nodes of suffixes still < max_depth
        self._active: dict[int, list[_Node]] = {}

    @property
    def num_tokens(self) -> int:
        """Number of inserted suffixes (= tokens over all sequences)."""
        return self._root.count

    def sequence(self, seq_id: int) -> list[int]:
        """The tokens of ``seq_id`` (do not mutate)."""
        return self._seqs[seq_id]

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (created if new): O(max_depth) each.

        The first sequence of an empty tree is built in bulk (sorted suffixes), which is
        several times faster than appending token by token and gives the same tree."""
        if not self._seqs and len(tokens) > 0 and self._add_sorted(seq_id, tokens, want_active=True):
            return
        seq = self._seqs.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, [])
        for token in tokens:
            self._append(seq, active, int(token))

    def insert(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Add a whole new sequence that will not grow (``extend`` + ``seal``): its suffixes
        are merged into the tree in sorted order, the same tree as appending token by token
        and faster where suffixes share paths (text; random tokens seldom do)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already in the tree")
        if not self._add_sorted(seq_id, tokens, want_active=False):
            self.extend(seq_id, tokens)
            self.seal(seq_id)

    def _add_sorted(self, seq_id: int, tokens: Sequence[int], want_active: bool) -> bool:
        """Store a new sequence and merge its suffixes (want_active: it may grow, keep its
        active suffixes). False, storing nothing, where the tokens cannot be sorted."""
        seq = _token_list(tokens)
        if seq is None:
            return False
        self._seqs[seq_id] = seq
        active = self._merge(seq, want_active) if seq else []
        if want_active:
            self._active[seq_id] = active
        return True

    def seal(self, seq_id: int) -> None:
        """No more appends to ``seq_id``: free its active-suffix list."""
        self._active.pop(seq_id, None)

    def _append(self, seq: list[int], active: list[_Node], token: int) -> None:
        root = self._root
        seq.append(token)
        end = len(seq)
        root.count += 1
        active.append(root)
        if len(active) > self.max_depth:
            del active[0]
        for i, node in enumerate(active):
            # fast path: a leaf holding only this suffix
            if node.count == 1 and node is not root:
                node.length += 1
                # (it may point elsewhere after a removal)
                if node.seq is not seq:
                    node.seq, node.start = seq, end - node.length
            else:
                active[i] = self._step(node, token, seq, end)

    def _merge(self, seq: list[int], want_active: bool) -> list[_Node] | None:
        """Insert every depth-truncated suffix of ``seq`` (already stored) in sorted order.
        Neighbours in that order share their longest common prefix (lcp), so each suffix
        starts from the open path of the one before, cut back to the lcp, and walks the
        existing tree from there: O(nodes it passes), not O(max_depth), per suffix.

        ``path`` is the open path, ``ends[k]`` the depth where ``path[k]`` ends and
        ``adds[k]`` the new suffixes through ``path[k]`` not yet in its count (added when it
        closes). Returns the end nodes of the last max_depth suffixes (want_active)."""
        order, lens, lcps = _sorted_suffixes(seq, self.max_depth)
        root, n = self._root, len(seq)
        first_active = max(0, n - self.max_depth)
        active: list[_Node] = [root] * (n - first_active)
        path, ends, adds = [root], [0], [0]
        gc_was_on = gc.isenabled()
        # ~1 node per token: cyclic-GC passes would cost ~40% extra
        gc.disable()
        try:
            for i, length, lcp in zip(order, lens, lcps):
                # nodes below the lcp are complete
                while len(path) > 1 and ends[-2] >= lcp:
                    _close(path, ends, adds)
                # the previous suffix left the top node's label at the lcp: split it there (the
                # lower part is complete, its new suffixes count in both parts)
                if ends[-1] > lcp:
                    lower = path[-1]
                    path[-1] = _split(lower, lcp - ends[-2], seq, i + ends[-2])
                    lower.count += adds[-1]
                    ends[-1] = lcp
                depth = lcp
                while depth < length:
                    node = path[-1]
                    token = seq[i + depth]
                    child = node.children.get(token) if node.children else None
                    if child is None:
                        # a new leaf to the suffix's end
                        child = _Node(0, node, seq, i + depth, length - depth)
                        if node.children is None:
                            node.children = {}
                        node.children[token] = child
                        path.append(child)
                        ends.append(length)
                        adds.append(0)
                        break
                    k = _common(child.seq, child.start, seq, i + depth, min(child.length, length - depth))
                    if k < child.length:
                        # the suffix ends or turns inside the label
                        child = _split(child, k, seq, i + depth)
                    path.append(child)
                    ends.append(depth + k)
                    adds.append(0)
                    depth += k
                adds[-1] += 1
                if want_active and i >= first_active:
                    active[i - first_active] = path[-1]
            while len(path) > 1:
                _close(path, ends, adds)
            root.count += adds[0]
        finally:
            if gc_was_on:
                gc.enable()
        return active if want_active else None

    def _step(self, v: _Node, token: int, seq: list[int], end: int) -> _Node:
        """Extend the suffix that ends at node ``v`` by ``token`` (= seq[end - 1])."""
        root = self._root
        children = v.children
        w = children.get(token) if children else None
        # (a count-1 leaf is extended in place by _append)
        if w is None:
            new = _Node(1, v, seq, end - 1, 1)
            if children is None:
                v.children = {token: new}
            else:
                children[token] = new
            _promote(v, new)
            return new
        if v is not root and v.count == w.count + 1:
            # Only this suffix ends at v and w is v's only child: v is no longer a boundary.
            # w takes v's place, one token longer
            if w.length == 1:
                parent = v.parent
                w.count += 1
                w.length = v.length + 1
                w.seq, w.start = seq, end - w.length
                w.parent = parent
                parent.children[seq[w.start]] = w
                if parent.best is v:
                    parent.best = w
                return w
            # v grows into w by one token
            v.length += 1
            v.seq, v.start = seq, end - v.length
            w.start += 1
            w.length -= 1
            v.children = {w.seq[w.start]: w}
            v.best, v.stale = w, False
            return v
        if w.length == 1:
            w.count += 1
            w.seq, w.start = seq, end - 1
            _promote(v, w)
            return w
        # split w after its first token
        u = _Node(w.count + 1, v, seq, end - 1, 1)
        w.start += 1
        w.length -= 1
        w.parent = u
        u.children = {w.seq[w.start]: w}
        u.best = w
        children[token] = u
        if v.best is w:
            v.best = u
        else:
            _promote(v, u)
        return u

    def remove(self, seq_id: int) -> None:
        """Remove a sequence: decrement its suffixes' counts, drop zero-count nodes."""
        seq = self._seqs.pop(seq_id)
        self._active.pop(seq_id, None)
        n = len(seq)
        for i in range(n):
            self._remove_suffix(seq, i, min(n, i + self.max_depth))

    def _remove_suffix(self, seq: list[int], i: int, stop: int) -> None:
        node = self._root
        node.count -= 1
        idx = i
        while idx < stop:
            token = seq[idx]
            child = node.children[token]
            child.count -= 1
            if child.count == 0:
                del node.children[token]
                if not node.children:
                    node.children = None
                # drop the pointer: it would keep the subtree alive
                if node.best is child:
                    node.best, node.stale = None, True
                break
            if node.best is child:
                node.stale = True
            idx += child.length
            # keep no reference into the removed sequence
            if child.seq is seq:
                child.seq, child.start = seq[i:idx], idx - i - child.length
            node = child
        if node is not self._root and node.children is not None and len(node.children) == 1:
            (child,) = node.children.values()
            if child.count == node.count:
                self._merge_into_child(node, child)

    def _merge_into_child(self, node: _Node, child: _Node) -> None:
        parent = node.parent
        child.length += node.length
        child.start -= node.length
        child.parent = parent
        parent.children[child.seq[child.start]] = child
        if parent.best is node:
            parent.best = child

    def _match(self, pattern: list[int], i: int) -> tuple[_Node, int] | None:
        """Locus (node, tokens of its label consumed) of ``pattern[i:]``, or None."""
        node, used, n = self._root, 0, len(pattern)
        while i < n:
            child = node.children.get(pattern[i]) if node.children else None
            if child is None:
                return None
            k = min(child.length, n - i)
            s = child.start
            if k > 1 and child.seq[s + 1 : s + k] != pattern[i + 1 : i + k]:
                return None
            node, used, i = child, k, i + k
        return node, used

    def count(self, tokens: Sequence[int]) -> int:
        """Number of occurrences of ``tokens`` (0 if absent or longer than max_depth)."""
        locus = self._match(list(tokens), 0)
        return 0 if locus is None else locus[0].count

    def _longest_match(self, pattern: list[int], hi: int) -> int:
        """Largest m <= hi with pattern[-m:] in the tree (existence is monotone in m)."""
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._match(pattern, len(pattern) - mid) is None:
                hi = mid - 1
            else:
                lo = mid
        return lo

    def speculate(
        self, pattern: Sequence[int], max_spec_tokens: int, max_spec_factor: float, min_token_prob: float
    ) -> Draft:
        """Best path draft over the suffixes of ``pattern`` (last max_depth tokens) found in
        the tree, shorter than the whole pattern (as ArcticInference: the whole context is
        never a match). Match length m allows min(max_spec_tokens, floor(m * max_spec_factor))
        tokens; the highest score wins, on equal score the longer match."""
        pattern = [int(t) for t in pattern[-self.max_depth :]]
        n = len(pattern)
        longest = self._longest_match(pattern, max(0, n - 1))
        spec = (max_spec_tokens, max_spec_factor, min_token_prob)
        return self._best_draft(lambda m: self._match(pattern, n - m), longest, longest, *spec)

    def speculate_tail(
        self,
        seq_id: int,
        pattern_len: int,
        max_spec_tokens: int,
        max_spec_factor: float,
        min_token_prob: float,
    ) -> Draft:
        """``speculate(sequence(seq_id)[-pattern_len:], ...)`` for an unsealed sequence: its
        active suffixes are the match loci, so nothing is matched from the root. A tail
        suffix with count 1 occurs only at the very end (nothing follows), and so do the
        longer ones (counts shrink with length): only shorter matches are walked."""
        active = self._active[seq_id]
        # the whole pattern is not a match (as in speculate)
        longest = max(0, min(pattern_len, len(active)) - 1)
        # largest m whose tail suffix occurs more than once
        lo, hi = 0, longest
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if active[-mid].count > 1:
                lo = mid
            else:
                hi = mid - 1
        spec = (max_spec_tokens, max_spec_factor, min_token_prob)
        return self._best_draft(lambda m: (active[-m], active[-m].length), longest, lo, *spec)

    def _best_draft(
        self,
        locate: Callable[[int], tuple[_Node, int] | None],
        longest: int,
        useful: int,
        max_spec_tokens: int,
        max_spec_factor: float,
        min_token_prob: float,
    ) -> Draft:
        """Best draft over match lengths 1..useful (all present; longer ones up to longest
        draft nothing). Lengths go by decreasing bound on their score, skipping those that
        cannot beat the best so far (ties go to the longer match)."""
        # what every empty draft loses to
        best = Draft(match_len=longest)
        for m, bound in _by_bound(useful, max_spec_tokens, max_spec_factor, self.max_depth):
            if bound < best.score or (bound == best.score and m < best.match_len):
                continue
            node, used = locate(m)
            draft = _walk(node, used, bound, min_token_prob)
            if (draft.score, m) > (best.score, best.match_len):
                draft.match_len = m
                best = draft
        return best

    def substring_counts(self) -> dict[tuple[int, ...], int]:
        """Every stored string with its count (for tests and debugging; O(tree) memory)."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, path = stack.pop()
            for k in range(node.length):
                out[path + tuple(node.seq[node.start : node.start + k + 1])] = node.count
            path += tuple(node.seq[node.start : node.start + node.length])
            stack.extend((child, path) for child in (node.children or {}).values())
        return out

    def num_nodes(self) -> int:
        """Number of nodes, root excluded (O(tree) walk)."""
        total, stack = 0, [self._root]
        while stack:
            node = stack.pop()
            children = node.children or {}
            total += len(children)
            stack.extend(children.values())
        return total


@functools.lru_cache(maxsize=4096)
def _by_bound(
    longest: int, max_spec_tokens: int, max_spec_factor: float, depth: int
) -> list[tuple[int, int]]:
    """(m, most tokens a match of length m can draft) for m in 1..longest, best bound
    first, longer m first among equal bounds."""
    out = []
    for m in range(1, longest + 1):
        cap = min(max_spec_tokens, int(m * max_spec_factor + 1e-6), depth - m)
        out.append((m, max(0, cap)))
    return sorted(out, key=lambda mb: (-mb[1], -mb[0]))


def _sorted_suffixes(seq: list[int], depth: int) -> tuple[list[int], list[int], list[int]]:
    """Start positions of the depth-truncated suffixes in lexicographic order, their
    lengths, and each one's lcp with the previous one (0 for the first)."""
    n = len(seq)
    # big-endian, 0 pads: byte order = token order
    keys = np.zeros(n + depth, dtype=">u4")
    # tokens in [0, 2**32 - 1)
    keys[:n] = np.asarray(seq, dtype=np.int64) + 1
    windows = np.ascontiguousarray(np.lib.stride_tricks.sliding_window_view(keys, depth)[:n])
    order = np.argsort(windows.view(np.dtype((np.void, 4 * depth))).ravel(), kind="stable")
    lens = np.minimum(depth, n - order)
    rows = windows[order]
    same = rows[1:] == rows[:-1]
    lcp = np.where(same.all(axis=1), depth, same.argmin(axis=1))
    lcp = np.minimum(lcp, np.minimum(lens[1:], lens[:-1]))
    return order.tolist(), lens.tolist(), [0] + lcp.tolist()


def _token_list(tokens: Sequence[int]) -> list[int] | None:
    """Tokens as a list of ints for the sorted-suffix merge, None where it cannot sort them
    (not a flat integer sequence in [0, 2**32 - 1))."""
    arr = np.asarray(tokens)
    if arr.size == 0:
        return []
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() >= 2**32 - 1:
        return None
    return arr.tolist()


def _common(a: list[int], i: int, b: list[int], j: int, m: int) -> int:
    """Length of the common prefix of a[i:i + m] and b[j:j + m]."""
    if a[i : i + m] == b[j : j + m]:
        return m
    k = 0
    while a[i + k] == b[j + k]:
        k += 1
    return k


def _close(path: list[_Node], ends: list[int], adds: list[int]) -> None:
    """Merge: the top of the open path is complete; its new suffixes join its count and its
    parent's, which may now prefer it."""
    node, added = path.pop(), adds.pop()
    ends.pop()
    node.count += added
    adds[-1] += added
    _promote(path[-1], node)


def _split(node: _Node, k: int, seq: list[int], start: int) -> _Node:
    """Cut ``node`` after ``k`` label tokens; return the new upper part (``node`` keeps the
    lower part and its end). The upper label is ``seq[start:start + k]``, the sequence being
    merged (the lower one may point into a private copy of its own path)."""
    upper = _Node(node.count, node.parent, seq, start, k)
    node.start += k
    node.length -= k
    node.parent = upper
    upper.children = {node.seq[node.start]: node}
    upper.best = node
    parent = upper.parent
    parent.children[upper.seq[upper.start]] = upper
    if parent.best is node:
        parent.best = upper
    return upper


def _walk(node: _Node, used: int, cap: int, min_token_prob: float) -> Draft:
    """Follow the most frequent child from a locus while the running probability (product
    of count(child) / count(node)) stays >= min_token_prob; at most ``cap`` tokens."""
    tokens: list[int] = []
    probs: list[float] = []
    prob = 1.0
    if cap <= 0 or prob < min_token_prob:
        return Draft()
    while True:
        # inside a label: no branching, probability unchanged
        if used < node.length:
            k = min(node.length - used, cap - len(tokens))
            s = node.start + used
            tokens += node.seq[s : s + k]
            probs += [prob] * k
            if len(tokens) >= cap:
                break
        child = _best_child(node) if node.stale else node.best
        if child is None:
            break
        prob *= child.count / node.count
        if prob < min_token_prob:
            break
        node, used = child, 0
    return Draft(tokens, probs, sum(probs))


@dataclass
class _Request:
    # prompt + response so far, sequence 0
    tree: SuffixTree
    # response tokens not yet in this tree: they join it when the request speculates next (the tree is dropped
    # when the request stops, so tokens it never drafted from are never appended to it)
    pending: list[int] = field(default_factory=list)


class SuffixDecodingCache:
    """Per-request prompt trees plus a global tree over responses (ArcticInference's semantics).

    A started request takes a slot in the global tree at once: its response grows there token by token while it
    is generated (running requests draft from each other) and stays after it stops, finished or aborted, until it
    is evicted. At most ``max_cached_requests`` slots, running requests counted, evicted first-in-first-out
    (0 disables the global tree). A request id started again drops its old response at that start."""

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ):
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0, got {max_cached_requests}")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._global = SuffixTree(max_tree_depth)
        self._requests: dict[Hashable, _Request] = {}
        # req_id -> global seq id, oldest first (running requests included)
        self._cached: dict[Hashable, int] = {}
        self._next_seq_id = 0

    @property
    def active_requests(self) -> KeysView[Hashable]:
        return self._requests.keys()

    @property
    def cached_requests(self) -> KeysView[Hashable]:
        return self._cached.keys()

    def start_request(self, req_id: Hashable, prompt_token_ids: Sequence[int]) -> None:
        """Build the request's prompt tree and give its response a slot in the global tree."""
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} is already active")
        tree = SuffixTree(self.max_tree_depth)
        tree.extend(0, prompt_token_ids)
        self._requests[req_id] = _Request(tree)
        if self.max_cached_requests == 0:
            return
        # a reused id: the new response replaces the old one, and goes last in FIFO order
        if req_id in self._cached:
            self.evict_cached_response(req_id)
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        self._global.extend(seq_id, ())
        self._cached[req_id] = seq_id
        # (the new slot is last, and at least one is kept)
        while len(self._cached) > self.max_cached_requests:
            self.evict_cached_response(next(iter(self._cached)))

    def add_active_response(self, req_id: Hashable, token_ids: int | Sequence[int]) -> None:
        """Append response tokens: to the global tree now (other requests draft from them), to the request's own
        tree when it speculates next."""
        tokens = [int(token_ids)] if isinstance(token_ids, Integral) else [int(t) for t in token_ids]
        self._get(req_id).pending.extend(tokens)
        # (none if evicted while running: its later tokens are not cached either)
        seq_id = self._cached.get(req_id)
        if seq_id is not None and tokens:
            self._global.extend(seq_id, tokens)

    def stop_request(self, req_id: Hashable) -> None:
        """Finish or abort a request: drop its prompt tree; its response stays in the global tree until evicted."""
        if self._requests.pop(req_id, None) is None:
            raise ValueError(f"request {req_id!r} is not active")
        seq_id = self._cached.get(req_id)
        if seq_id is not None:
            # it will not grow: free its active suffixes
            self._global.seal(seq_id)

    def evict_cached_response(self, req_id: Hashable) -> None:
        """Remove a request's response from the global tree (a running request's later tokens are then not
        cached either)."""
        if req_id not in self._cached:
            raise ValueError(f"request {req_id!r} is not cached")
        self._global.remove(self._cached.pop(req_id))

    def speculate(self, req_id: Hashable, context_tail: Sequence[int], max_spec_tokens: int) -> Draft:
        """Best draft for the request from its own tree and the global tree. ``context_tail``
        is the request's context (only its last max_tree_depth tokens are used)."""
        req = self._get(req_id)
        tree = req.tree
        if req.pending:
            tree.extend(0, req.pending)
            req.pending = []
        pattern = [int(t) for t in context_tail[-self.max_tree_depth :]]
        args = (max_spec_tokens, self.max_spec_factor, self.min_token_prob)
        seq = tree.sequence(0)
        # the usual case: the request's own tail
        if pattern and seq[-len(pattern) :] == pattern:
            best = tree.speculate_tail(0, len(pattern), *args)
        else:
            best = tree.speculate(pattern, *args)
        if self._global.num_tokens:
            other = self._global.speculate(pattern, *args)
            # on equal scores the request's own tree wins
            if other.score > best.score:
                best = other
        return best

    def _get(self, req_id: Hashable) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            raise ValueError(f"request {req_id!r} is not active")
        return req


class SuffixProposer:
    needs = ProposerNeeds()

    def __init__(
        self, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float
    ):
        self.cache = SuffixDecodingCache(max_tree_depth, max_cached_requests, max_spec_factor, min_token_prob)
        self.depth = max_tree_depth
        # output tokens already handed to the cache
        self._seen: dict[str, int] = {}

    def add_request(self, req: Request) -> None:
        self.cache.start_request(req.request_id, req.prompt_token_ids)
        self._seen[req.request_id] = 0

    def remove_request(self, req: Request, aborted: bool) -> None:
        # (a request aborted while waiting was never added)
        if req.request_id not in self._seen:
            return
        self._sync(req)
        del self._seen[req.request_id]
        # finished or aborted alike: the response stays cached (ArcticInference)
        self.cache.stop_request(req.request_id)

    def _sync(self, req: Request) -> None:
        """Hand the cache the request's output tokens it has not seen."""
        seen = self._seen.get(req.request_id, 0)
        if len(req.output_token_ids) > seen:
            self.cache.add_active_response(req.request_id, req.output_token_ids[seen:])
            self._seen[req.request_id] = len(req.output_token_ids)

    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        # every request's new tokens first, asked or not: the global tree holds running responses, so each
        # request drafts from the others' newest tokens
        for r in reqs:
            self._sync(r)
        drafts, confidence = [], []
        for r, k in zip(reqs, k_max):
            if k <= 0:
                drafts.append([])
                confidence.append([])
                continue
            draft = self.cache.speculate(r.request_id, r.tail(self.depth), k)
            drafts.append(draft.token_ids)
            confidence.append(conditional_probs(draft.probs))
        return Proposal(drafts, confidence=confidence)


def conditional_probs(probs: list[float]) -> list[float]:
    """Running probabilities of a draft's prefixes -> each token's probability given the ones before it."""
    out, prev = [], 1.0
    for p in probs:
        out.append(p / prev if prev > 0 else 0.0)
        prev = p
    return out
