import random
from collections import Counter

import pytest

from verispec.proposers.suffix import Draft, SuffixDecodingCache, SuffixProposer, SuffixTree
from verispec.request import Request
from verispec.sampling_params import SamplingParams

# ---------------------------------------------------------------- brute-force references


def brute_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: Counter = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                counts[tuple(seq[i:j])] += 1
    return dict(counts)


def brute_speculate(seqs, depth, pattern, k, factor, min_prob) -> Draft:
    """Uncompressed-trie speculation: match lengths shorter than the pattern, ties to the longer match."""
    counts = brute_counts(seqs, depth)
    kids: dict[tuple[int, ...], list[int]] = {}
    for s in counts:
        kids.setdefault(s[:-1], []).append(s[-1])
    pattern = list(pattern)[-depth:]
    best = None
    for m in range(1, len(pattern)):
        cur = tuple(pattern[-m:])
        if cur not in counts:
            break
        cap = max(0, min(k, int(m * factor + 1e-6)))
        toks: list[int] = []
        probs: list[float] = []
        prob = 1.0
        while len(toks) < cap and cur in kids:
            # ties: smallest id
            count, neg_tok = max((counts[cur + (t,)], -t) for t in kids[cur])
            p = prob * (count / counts[cur])
            if p < min_prob:
                break
            prob = p
            toks.append(-neg_tok)
            probs.append(prob)
            cur += (-neg_tok,)
        if best is None or sum(probs) >= best.score:
            best = Draft(toks, probs, sum(probs), m)
    return best if best is not None else Draft()


def check_tree(tree: SuffixTree) -> None:
    """Structural invariants of the compressed tree."""
    root = tree._root
    live = list(tree._seqs.values())
    stack = [(root, [])]
    while stack:
        node, path = stack.pop()
        children = node.children
        assert children is None or len(children) > 0
        children = children or {}
        assert sum(c.count for c in children.values()) <= node.count
        for key, child in children.items():
            assert child.parent is node and child.count > 0 and child.length > 0
            # else it should be merged
            assert child.count < node.count or node is root
            label = child.seq[child.start : child.start + child.length]
            assert len(label) == child.length and label[0] == key
            full = path + label
            assert len(full) <= tree.max_depth
            assert child.start >= len(path)
            assert child.seq[child.start - len(path) : child.start + child.length] == full
            # live or private copy
            assert any(child.seq is s for s in live) or child.seq == full
            stack.append((child, full))
        if children and not node.stale:
            top = max(children.values(), key=lambda c: (c.count, -c.seq[c.start]))
            assert node.best is top


def dump(tree: SuffixTree):
    """Canonical form of the compressed tree (labels, counts, children)."""

    def rec(node):
        label = tuple(node.seq[node.start : node.start + node.length])
        kids = sorted((k, rec(c)) for k, c in (node.children or {}).items())
        return (label, node.count, tuple(kids))

    return rec(tree._root)


def seqs_of(rng: random.Random, n: int, vocab: int, max_len: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randrange(max_len + 1))] for _ in range(n)]


# ---------------------------------------------------------------- tree vs brute force


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("depth", [1, 2, 4, 7])
def test_tree_counts_match_brute_force(seed, depth):
    rng = random.Random(seed * 31 + depth)
    seqs = seqs_of(rng, 4, vocab=3 + seed % 3, max_len=30)
    tree = SuffixTree(depth)
    for i, s in enumerate(seqs):
        tree.extend(i, s)
        check_tree(tree)
    assert tree.substring_counts() == brute_counts(seqs, depth)
    assert tree.num_tokens == sum(map(len, seqs))
    # compressed: O(tokens), not O(tokens*depth)
    assert tree.num_nodes() <= 2 * sum(map(len, seqs))
    for s in seqs:
        for i in range(len(s)):
            assert tree.count(s[i : i + depth]) == brute_counts(seqs, depth)[tuple(s[i : i + depth])]


@pytest.mark.parametrize("seed", range(25))
def test_remove_matches_brute_force(seed):
    """Counts decrement, zero-count nodes vanish, nodes never point into removed sequences."""
    rng = random.Random(seed)
    depth = rng.choice([2, 3, 5, 8])
    seqs = seqs_of(rng, 6, vocab=3, max_len=25)
    tree = SuffixTree(depth)
    for i, s in enumerate(seqs):
        tree.extend(i, s)
        tree.seal(i)
    alive = dict(enumerate(seqs))
    removed = []
    for i in rng.sample(range(6), 6):
        removed.append(tree.sequence(i))
        tree.remove(i)
        del alive[i]
        check_tree(tree)
        assert tree.substring_counts() == brute_counts(list(alive.values()), depth)
        # appending after removals keeps everything consistent
        extra = [rng.randrange(3) for _ in range(rng.randrange(8))]
        tree.extend(100 + i, extra)
        tree.seal(100 + i)
        alive[100 + i] = extra
        check_tree(tree)
        assert tree.substring_counts() == brute_counts(list(alive.values()), depth)
    stack = [tree._root]
    while stack:
        node = stack.pop()
        assert not any(node.seq is r for r in removed)
        stack.extend((node.children or {}).values())
    for i in list(alive):
        tree.remove(i)
    assert tree._root.children is None and tree.num_tokens == 0 and tree.num_nodes() == 0


def test_remove_decrements_and_prunes():
    tree = SuffixTree(3)
    tree.extend(0, [1, 2, 3, 1, 2])
    tree.extend(1, [1, 2, 4])
    assert [tree.count(s) for s in ([1, 2], [2, 3], [2, 4], [3, 1, 2])] == [3, 1, 1, 1]
    tree.remove(0)
    assert [tree.count(s) for s in ([1, 2], [2, 3], [2, 4], [3, 1, 2])] == [1, 0, 1, 0]
    assert tree.substring_counts() == brute_counts([[1, 2, 4]], 3)
    # the paths "1 2 4", "2 4", "4"; "3 ..." pruned
    assert tree.num_nodes() == 3
    check_tree(tree)


@pytest.mark.parametrize("seed", range(30))
def test_interleaved_appends_and_removals(seed):
    """Sequences keep growing while others are removed (ids reused): counts, structure,
    speculation and the active-suffix shortcut all stay exact."""
    rng = random.Random(seed)
    depth, vocab = rng.choice([1, 2, 4, 8, 24]), rng.choice([2, 3, 6])
    tree = SuffixTree(depth)
    seqs: dict[int, list[int]] = {}
    for step in range(60):
        if rng.random() < 0.6 or not seqs:
            sid = rng.randrange(6)
            toks = [rng.randrange(vocab) for _ in range(rng.randrange(1, 15))]
            tree.extend(sid, toks)
            seqs.setdefault(sid, []).extend(toks)
        else:
            sid = rng.choice(list(seqs))
            tree.remove(sid)
            del seqs[sid]
        if step % 6 == 5:
            check_tree(tree)
            assert tree.substring_counts() == brute_counts(list(seqs.values()), depth)
            args = (rng.choice([1, 4, 30]), rng.choice([0.5, 1.0, 4.0]), rng.choice([0.0, 0.1, 0.4]))
            pattern = [rng.randrange(vocab) for _ in range(rng.randrange(10))]
            assert tree.speculate(pattern, *args) == brute_speculate(
                list(seqs.values()), depth, pattern, *args
            )
            for sid, seq in seqs.items():
                n = rng.randrange(1, depth + 2)
                assert tree.speculate_tail(sid, n, *args) == tree.speculate(seq[-n:], *args)


@pytest.mark.parametrize("seed", range(40))
def test_speculate_matches_brute_force(seed):
    rng = random.Random(1000 + seed)
    depth = rng.choice([3, 5, 8, 24])
    seqs = seqs_of(rng, 3, vocab=rng.choice([2, 3, 4]), max_len=40)
    tree = SuffixTree(depth)
    for i, s in enumerate(seqs):
        tree.extend(i, s)
    if rng.random() < 0.5 and seqs[0]:
        tree.remove(0)
        seqs = seqs[1:]
    for _ in range(15):
        pattern = [rng.randrange(4) for _ in range(rng.randrange(12))]
        k = rng.choice([0, 1, 3, 8, 30])
        factor = rng.choice([0.5, 1.0, 2.5])
        min_prob = rng.choice([0.0, 0.1, 0.3, 0.6])
        assert tree.speculate(pattern, k, factor, min_prob) == brute_speculate(
            seqs, depth, pattern, k, factor, min_prob
        )


@pytest.mark.parametrize("seed", range(10))
def test_incremental_equals_scratch(seed):
    rng = random.Random(seed)
    depth = rng.choice([3, 6, 24])
    seq = [rng.randrange(4) for _ in range(80)]
    scratch = SuffixTree(depth)
    scratch.extend(0, seq)
    inc = SuffixTree(depth)
    i = 0
    while i < len(seq):
        j = i + rng.randrange(1, 5)
        inc.extend(0, seq[i:j])
        i = j
    assert dump(inc) == dump(scratch)
    check_tree(inc)
    # same through the cache: prompt + add_active_response vs prompt holding everything (no global tree, which
    # holds b's response only)
    a, b = (
        SuffixDecodingCache(depth, max_cached_requests=0),
        SuffixDecodingCache(depth, max_cached_requests=0),
    )
    a.start_request("r", seq)
    b.start_request("r", seq[:20])
    for t in seq[20:]:
        b.add_active_response("r", t)
    # response tokens wait until the request speculates
    assert b._requests["r"].tree.num_tokens == 20
    for n in range(1, 30):
        assert a.speculate("r", seq[:n], 8) == b.speculate("r", seq[:n], 8)
    assert dump(a._requests["r"].tree) == dump(b._requests["r"].tree)


@pytest.mark.parametrize("seed", range(30))
def test_bulk_build_equals_appends(seed):
    """The first sequence of an empty tree is built from sorted suffixes; same tree, same
    active suffixes (checked by appending more afterwards)."""
    rng = random.Random(seed)
    depth = rng.choice([1, 2, 3, 5, 24])
    seq = [rng.randrange(rng.choice([1, 2, 5, 2**32 - 2])) for _ in range(rng.randrange(1, 120))]
    bulk, inc = SuffixTree(depth), SuffixTree(depth)
    bulk.extend(0, seq)
    for t in seq:
        inc.extend(0, [t])
    assert dump(bulk) == dump(inc)
    check_tree(bulk)
    more = [rng.randrange(3) for _ in range(30)]
    bulk.extend(0, more)
    inc.extend(0, more)
    assert dump(bulk) == dump(inc)
    check_tree(bulk)


@pytest.mark.parametrize("seed", range(40))
def test_insert_equals_extend_and_seal(seed):
    """A sealed sequence merged in sorted order (insert) gives the tree that appending it token by token and sealing
    gives, into trees that hold other sequences and have had some removed (private label copies, stale best
    children), and leaves every invariant in place."""
    rng = random.Random(seed)
    depth, vocab = rng.choice([1, 2, 3, 5, 24]), rng.choice([2, 3, 50])
    merged, appended = SuffixTree(depth), SuffixTree(depth)
    alive: dict[int, list[int]] = {}
    for sid in range(12):
        if alive and rng.random() < 0.3:
            gone = rng.choice(list(alive))
            merged.remove(gone)
            appended.remove(gone)
            del alive[gone]
        else:
            seq = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
            merged.insert(sid, seq)
            appended.extend(sid, seq)
            appended.seal(sid)
            alive[sid] = seq
        check_tree(merged)
        assert dump(merged) == dump(appended)
        assert merged.substring_counts() == brute_counts(list(alive.values()), depth)
        pattern = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
        args = (rng.choice([1, 5, 30]), rng.choice([0.5, 1.0, 3.0]), rng.choice([0.0, 0.2]))
        assert merged.speculate(pattern, *args) == appended.speculate(pattern, *args)
    merged.insert(100, [1])
    with pytest.raises(ValueError, match="already"):
        merged.insert(100, [2])


def test_tokens_outside_bulk_range_fall_back_to_appends():
    seq = [-3, 5, -3, 5, 2**40, -3]
    tree = SuffixTree(4)
    tree.extend(0, seq)
    assert tree.substring_counts() == brute_counts([seq], 4)
    assert tree.speculate([7, -3], 5, 2.0, 0.1).token_ids == [5, -3]


@pytest.mark.parametrize("seed", range(20))
def test_speculate_tail_equals_speculate(seed):
    rng = random.Random(seed)
    depth = rng.choice([3, 8, 24])
    seq = [rng.randrange(3) for _ in range(rng.randrange(1, 60))]
    tree = SuffixTree(depth)
    tree.extend(0, seq[:10])
    tree.extend(0, seq[10:])
    for n in range(0, min(len(seq), depth) + 3):
        args = (rng.choice([1, 5, 30]), rng.choice([0.5, 1.0, 3.0]), rng.choice([0.0, 0.2]))
        tail = seq[-n:] if n else []
        assert tree.speculate_tail(0, n, *args) == tree.speculate(tail, *args)


# ---------------------------------------------------------------- cache: table-driven


@pytest.mark.parametrize(
    "prompt,context,k,factor,tokens,match_len",
    [
        # match 2, factor 1 -> 2 tokens
        ([1, 2, 3, 4, 5, 6], [7, 1, 2], 10, 1.0, [3, 4], 2),
        # factor 0.5 -> 1 token
        ([1, 2, 3, 4, 5, 6], [7, 1, 2], 10, 0.5, [3], 2),
        ([1, 2, 3, 4, 5, 6], [7, 1, 2], 10, 2.0, [3, 4, 5, 6], 2),
        # max_spec_tokens
        ([1, 2, 3, 4, 5, 6], [7, 1, 2], 1, 1.0, [3], 2),
        ([1, 2, 3, 4, 5, 6], [7, 1, 2], 0, 1.0, [], 2),
        ([1, 2, 3, 4, 5, 6], [0, 1, 2, 3], 10, 1.0, [4, 5, 6], 3),
        # no match at all
        ([1, 2, 3, 4, 5, 6], [0, 9], 10, 1.0, [], 0),
        # 2 of 3, then 1 of 2
        ([5, 1, 2, 3, 1, 2, 4, 1, 2, 3], [8, 1, 2], 10, 1.0, [3, 1], 2),
        # own tail matched too
        ([1, 2, 3, 4, 1, 2], [1, 2, 3, 4, 1, 2], 10, 1.0, [3, 4], 2),
    ],
)
def test_prompt_tree_matches(prompt, context, k, factor, tokens, match_len):
    cache = SuffixDecodingCache(max_spec_factor=factor)
    cache.start_request("r", prompt)
    draft = cache.speculate("r", context, k)
    assert (draft.token_ids, draft.match_len) == (tokens, match_len)
    assert draft.score == pytest.approx(sum(draft.probs))


def test_prompt_tree_probabilities():
    cache = SuffixDecodingCache()
    cache.start_request("r", [5, 1, 2, 3, 1, 2, 4, 1, 2, 3])
    draft = cache.speculate("r", [8, 1, 2], 10)
    # "1 2 3": 2 ends, 1 goes on
    assert draft.probs == pytest.approx([2 / 3, 2 / 3 * 1 / 2])
    assert draft.score == pytest.approx(1.0)


def test_response_extends_prompt_tree():
    cache = SuffixDecodingCache()
    cache.start_request("r", [1, 2, 3])
    assert cache.speculate("r", [9, 3, 4], 5).token_ids == []
    cache.add_active_response("r", [4, 5, 6])
    cache.add_active_response("r", 7)
    assert cache.speculate("r", [9, 3, 4], 5).token_ids == [5, 6]


RESPONSES = [[1, 2, 3, 4], [1, 2, 3, 7], [1, 2, 8, 9], [1, 5, 6, 6]]


@pytest.mark.parametrize(
    "min_prob,tokens,probs",
    [
        # 3 of 4, then 2 of 3, then 1 of 2 (tie -> 4)
        (0.0, [2, 3, 4], [3 / 4, 1 / 2, 1 / 4]),
        (0.25, [2, 3, 4], [3 / 4, 1 / 2, 1 / 4]),
        (0.3, [2, 3], [3 / 4, 1 / 2]),
        (0.6, [2], [3 / 4]),
        (0.8, [], []),
    ],
)
def test_probability_cutoff(min_prob, tokens, probs):
    cache = SuffixDecodingCache(max_spec_factor=10.0, min_token_prob=min_prob)
    for i, resp in enumerate(RESPONSES):
        cache.start_request(i, [100 + i])
        cache.add_active_response(i, resp)
        cache.stop_request(i)
    cache.start_request("q", [50])
    draft = cache.speculate("q", [50, 1], 10)
    assert draft.token_ids == tokens
    assert draft.probs == pytest.approx(probs)
    # an empty global draft scores what the prompt tree's (no match) does, which wins the tie
    assert draft.match_len == (1 if tokens else 0)


def finish(cache: SuffixDecodingCache, req_id, prompt, response) -> None:
    cache.start_request(req_id, prompt)
    cache.add_active_response(req_id, response)
    cache.stop_request(req_id)


def test_running_responses_are_in_the_global_tree():
    """A response is in the global tree while it is generated, token by token: running requests draft from each
    other. Prompts are not cached."""
    cache = SuffixDecodingCache()
    cache.start_request("a", [100, 101])
    cache.add_active_response("a", [1, 2, 3, 4, 5])
    cache.start_request("b", [7, 8])
    # "a" still running
    draft = cache.speculate("b", [7, 8, 1, 2], 10)
    assert (draft.token_ids, draft.match_len, draft.probs) == ([3, 4], 2, [1.0, 1.0])
    assert list(cache.active_requests) == ["a", "b"] and list(cache.cached_requests) == ["a", "b"]
    # its next tokens join at once
    cache.add_active_response("a", [6, 7])
    assert cache.speculate("b", [8, 5, 6], 10).token_ids == [7]
    cache.stop_request("a")
    assert list(cache.active_requests) == ["b"] and list(cache.cached_requests) == ["a", "b"]
    assert cache.speculate("b", [7, 8, 1, 2], 10).token_ids == [3, 4]
    assert cache.speculate("b", [0, 100, 101], 10).token_ids == []
    assert cache._global.num_tokens == 7
    check_tree(cache._global)


def test_max_cached_requests_counts_running_requests():
    """Every started request takes a slot, running or not; over max_cached_requests the first started goes
    (first in, first out), even while it runs: its later tokens are then not cached either."""
    cache = SuffixDecodingCache(max_cached_requests=2)
    for i, rid in enumerate(("a", "b", "c")):
        cache.start_request(rid, [0])
        cache.add_active_response(rid, [10 * i + 1, 10 * i + 2, 10 * i + 3])
    # all three running; "a" went when "c" started
    assert list(cache.active_requests) == ["a", "b", "c"] and list(cache.cached_requests) == ["b", "c"]
    cache.add_active_response("a", [4])
    assert cache.speculate("c", [9, 1, 2], 5).token_ids == []
    assert cache.speculate("c", [9, 11, 12], 5).token_ids == [13]
    # "a" stops: nothing to cache; "b" stops and stays; "d" starts: "b" (started before "c") goes
    cache.stop_request("a")
    cache.stop_request("b")
    cache.start_request("d", [0])
    assert list(cache.cached_requests) == ["c", "d"]
    assert cache._global.substring_counts() == brute_counts([[21, 22, 23]], 24)
    check_tree(cache._global)


def test_reused_id_replaces_its_response_at_start():
    """A request id started again drops its old response when the new request starts (not when it stops) and
    goes last in FIFO order."""
    cache = SuffixDecodingCache(max_cached_requests=3)
    finish(cache, "r", [0], [1, 2, 3])
    finish(cache, "s", [0], [4, 5, 6])
    cache.start_request("r", [0])
    assert list(cache.cached_requests) == ["s", "r"]
    assert cache._global.substring_counts() == brute_counts([[4, 5, 6]], 24)
    cache.start_request("q", [0])
    assert cache.speculate("q", [9, 1, 2], 5).token_ids == []
    cache.add_active_response("r", [7, 8, 9])
    assert cache.speculate("q", [9, 7, 8], 5).token_ids == [9]
    # ... and fills the slot whatever it then holds (an empty response too)
    cache.stop_request("r")
    cache.start_request("s", [0])
    cache.stop_request("s")
    assert list(cache.cached_requests) == ["r", "q", "s"]
    assert cache._global.substring_counts() == brute_counts([[7, 8, 9]], 24)
    for rid in ("r", "q", "s"):
        cache.evict_cached_response(rid)
    assert cache._global.num_tokens == 0 and cache._global.num_nodes() == 0
    with pytest.raises(ValueError):
        cache.evict_cached_response("r")


def test_only_matches_shorter_than_the_context():
    """Match lengths run below the context's length (ArcticInference): a context the global tree holds whole
    drafts from its shorter suffixes only, and a one-token context matches nothing."""
    cache = SuffixDecodingCache()
    finish(cache, "old", [0], [1, 2, 3, 4])
    cache.start_request("new", [1, 2])
    draft = cache.speculate("new", [1, 2], 10)
    # [2] matches ([1, 2] would draft [3, 4])
    assert (draft.token_ids, draft.match_len) == ([3], 1)
    assert cache.speculate("new", [2], 10) == Draft()
    tree = SuffixTree(4)
    tree.extend(0, [5, 6, 7, 8])
    assert tree.speculate([5, 6], 4, 1.0, 0.0) == Draft([7], [1.0], 1.0, 1)
    assert tree.speculate([5], 4, 1.0, 0.0) == Draft()
    assert tree.speculate_tail(0, 1, 4, 1.0, 0.0) == Draft()


@pytest.mark.parametrize(
    "prompt,response,context,tokens,match_len",
    [
        pytest.param([1, 2, 3, 4], [5, 1, 2, 9, 9, 9], [7, 5, 1, 2], [9, 9, 9], 3, id="global-longer-match"),
        pytest.param([5, 1, 2, 3, 4, 6], [1, 2, 9, 9], [7, 5, 1, 2], [3, 4, 6], 3, id="prompt-longer-match"),
        pytest.param([1, 2, 3, 8], [1, 2, 9, 9, 1, 2, 9, 7], [7, 1, 2], [3, 8], 2, id="prompt-higher-score"),
        pytest.param([1, 2, 3, 8, 1, 2, 4], [1, 2, 9, 9], [7, 1, 2], [9, 9], 2, id="global-higher-score"),
        # equal scores: the prompt tree, though the global tree's match is longer
        pytest.param([2, 3, 7, 7, 7], [1, 2, 3, 4, 5], [8, 1, 2, 3], [7, 7], 2, id="equal-score-prompt-wins"),
        pytest.param(
            [1, 2, 3, 4, 5], [2, 3, 7, 7, 7], [8, 1, 2, 3], [4, 5], 3, id="equal-score-prompt-longer"
        ),
        pytest.param([1, 2, 3, 4], [1, 2, 9, 9], [7, 1, 2], [3, 4], 2, id="full-tie-prompt-wins"),
    ],
)
def test_best_of_both_trees(prompt, response, context, tokens, match_len):
    cache = SuffixDecodingCache()
    finish(cache, "old", [0], response)
    cache.start_request("new", prompt)
    draft = cache.speculate("new", context, 10)
    assert (draft.token_ids, draft.match_len) == (tokens, match_len)


def test_zero_cached_requests_disables_global_tree():
    cache = SuffixDecodingCache(max_cached_requests=0)
    finish(cache, "a", [9], [1, 2, 3, 4])
    cache.start_request("b", [0])
    cache.add_active_response("b", [5, 6])
    assert list(cache.cached_requests) == [] and cache._global.num_tokens == 0
    assert cache.speculate("b", [1, 2], 5) == Draft()


def test_numpy_inputs():
    import numpy as np

    cache = SuffixDecodingCache()
    cache.start_request("r", np.array([1, 2, 3, 4, 1, 2], dtype=np.int32))
    cache.add_active_response("r", np.int64(3))
    cache.add_active_response("r", np.array([4], dtype=np.int64))
    draft = cache.speculate("r", np.array([1, 2, 3, 4, 1, 2, 3, 4]), 10)
    assert draft.token_ids == [1, 2, 3, 4] and all(type(t) is int for t in draft.token_ids)
    assert cache._global.sequence(0) == [3, 4] and all(type(t) is int for t in cache._global.sequence(0))


def test_request_lifecycle_errors():
    cache = SuffixDecodingCache()
    cache.start_request("a", [1])
    with pytest.raises(ValueError):
        cache.start_request("a", [1])
    cache.stop_request("a")
    for call in (
        lambda: cache.stop_request("a"),
        lambda: cache.add_active_response("a", 1),
        lambda: cache.speculate("a", [1], 3),
    ):
        with pytest.raises(ValueError):
            call()


def _reference_start(cached: dict[int, list[int]], rid: int, max_cached: int) -> None:
    """ArcticInference's start: a slot for the response, the id's old one dropped, FIFO eviction."""
    if max_cached:
        cached.pop(rid, None)
        cached[rid] = []
        while len(cached) > max_cached:
            del cached[next(iter(cached))]


@pytest.mark.parametrize("seed", range(8))
def test_cache_random_against_reference(seed):
    """Random start/add/stop traffic, ids reused; speculation equals a brute-force model (running responses in the
    global tree, FIFO over running and stopped requests, equal scores to the prompt tree)."""
    rng = random.Random(seed)
    depth, max_cached = rng.choice([4, 8, 24]), rng.choice([0, 1, 3, 10])
    factor, min_prob = rng.choice([0.5, 1.0, 3.0]), rng.choice([0.05, 0.2])
    cache = SuffixDecodingCache(depth, max_cached, factor, min_prob)
    # prompt + response of running requests; responses in the global tree
    active: dict[int, list[int]] = {}
    cached: dict[int, list[int]] = {}
    for step in range(150):
        op = rng.random()
        if op < 0.15 or not active:
            rid = rng.randrange(12)
            rid = 100 + step if rid in active else rid
            toks = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
            cache.start_request(rid, toks)
            active[rid] = toks
            _reference_start(cached, rid, max_cached)
        elif op < 0.3:
            rid = rng.choice(list(active))
            del active[rid]
            cache.stop_request(rid)
        else:
            rid = rng.choice(list(active))
            toks = [rng.randrange(3) for _ in range(rng.randrange(1, 4))]
            cache.add_active_response(rid, toks)
            active[rid] += toks
            if rid in cached:
                cached[rid] += toks
            k = rng.choice([1, 4, 10])
            args = (depth, active[rid][-depth:], k, factor, min_prob)
            local = brute_speculate([active[rid]], *args)
            glob = brute_speculate(list(cached.values()), *args)
            assert cache.speculate(rid, active[rid], k) == (glob if glob.score > local.score else local)
    assert list(cache.cached_requests) == list(cached)
    assert cache._global.substring_counts() == brute_counts(list(cached.values()), depth)
    check_tree(cache._global)


# ---------------------------------------------------------------- the proposer


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, None, prompt, SamplingParams(temperature=0))


def test_proposer_drafts_from_running_requests():
    """Every request's new tokens reach the cache before anyone drafts, asked or not: a request drafts what
    another committed since the last step, though that one comes later in the batch and is asked for nothing."""
    prop = SuffixProposer(24, 100, 1.0, 0.1)
    a, b = _req("a", [50, 51]), _req("b", [60, 61])
    prop.add_request(a)
    prop.add_request(b)
    a.output_token_ids += [1, 2, 3, 4, 5]
    b.output_token_ids += [1, 2]
    out = prop.propose([b, a], [4, 0])
    # [1, 2] twice in the global tree (b's own ends there)
    assert out.token_ids == [[3, 4], []] and out.confidence == [[0.5, 1.0], []]


def test_proposer_keeps_an_aborted_response():
    """An aborted request's response stays cached, its last tokens included; one aborted while waiting (never
    added) is ignored."""
    prop = SuffixProposer(24, 100, 1.0, 0.1)
    a = _req("a", [50, 51])
    prop.add_request(a)
    a.output_token_ids += [1, 2, 3, 4]
    prop.remove_request(a, aborted=True)
    prop.remove_request(_req("w", [1]), aborted=True)
    assert list(prop.cache.cached_requests) == ["a"] and list(prop.cache.active_requests) == []
    b = _req("b", [60, 1, 2])
    prop.add_request(b)
    assert prop.propose([b], [4]).token_ids == [[3, 4]]


# ---------------------------------------------------------------- manual timing (not a test)


def _step_costs(cache: SuffixDecodingCache, rid, ctx: list[int], tokens: list[int], k: int = 8):
    """(add_active_response us, speculate us, mean draft length) per step: min over 5 blocks."""
    import time

    blocks, per = [], len(tokens) // 5
    drafted = 0
    for b in range(5):
        t_up = t_spec = 0.0
        for tok in tokens[b * per : (b + 1) * per]:
            t0 = time.perf_counter()
            cache.add_active_response(rid, tok)
            t1 = time.perf_counter()
            ctx.append(tok)
            drafted += len(cache.speculate(rid, ctx[-24:], k).token_ids)
            t_spec += time.perf_counter() - t1
            t_up += t1 - t0
        blocks.append((t_up / per * 1e6, t_spec / per * 1e6))
    return min(u for u, _ in blocks), min(t for _, t in blocks), drafted / (5 * per)


# python tests/unit/proposers/test_suffix.py
def _timing() -> None:
    import time
    import tracemalloc

    import numpy as np

    rng = np.random.default_rng(0)
    uniform = rng.integers(0, 32000, 100_000).tolist()
    # repetitive: edited copies of a 2k "file"
    base = rng.integers(0, 32000, 2_000).tolist()
    repetitive: list[int] = []
    while len(repetitive) < 100_000:
        a = int(rng.integers(0, 1900))
        repetitive += base[a : a + int(rng.integers(20, 100))] + rng.integers(0, 32000, 3).tolist()
    repetitive = repetitive[:100_000]
    for name, prompt in (("uniform", uniform), ("repetitive", repetitive)):
        tree = SuffixTree(24)
        tracemalloc.start()
        tree.extend(0, prompt)
        mem = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        builds = []
        for _ in range(3):
            cache = SuffixDecodingCache()
            t0 = time.perf_counter()
            cache.start_request("r", prompt)
            builds.append(time.perf_counter() - t0)
        print(
            f"{name} 100k prompt: build {min(builds):.2f} s (min of 3), {tree.num_nodes()} nodes, "
            f"{mem / 2**20:.0f} MiB"
        )
        # a response copying the prompt: drafts hit
        copied = base[500:1500] * 2
        # a response never seen: drafts miss
        novel = rng.integers(0, 32000, 2000).tolist()
        for what, resp in (("copying", copied), ("novel", novel)):
            cache.stop_request("r")
            cache.start_request("r", prompt)
            up, spec, drafted = _step_costs(cache, "r", list(prompt), resp)
            print(
                f"  {what} response: add_active_response {up:.1f} us, speculate {spec:.1f} us, "
                f"mean draft {drafted:.1f} tokens"
            )
    for name, pool in (("repetitive", base), ("diverse", uniform)):
        cache = SuffixDecodingCache(max_cached_requests=1000)
        t0 = time.perf_counter()
        for i in range(1500):
            a = int(rng.integers(0, len(pool) - 500))
            finish(cache, i, [0], pool[a : a + 500])
        per_stop = (time.perf_counter() - t0) / 1500
        g = cache._global
        print(
            f"global {name}: 1000 cached x 500 tokens, {g.num_nodes()} nodes; stop_request "
            f"(insert 500 + FIFO-evict 500 tokens) {per_stop * 1e3:.1f} ms"
        )
        cache.start_request("q", pool[:100])
        up, spec, drafted = _step_costs(cache, "q", list(pool[:100]), pool[100:2100])
        print(
            f"  add_active_response {up:.1f} us, speculate (both trees) {spec:.1f} us, "
            f"mean draft {drafted:.1f} tokens"
        )


if __name__ == "__main__":
    _timing()
