"""`eagle` / `eagle3`: an EAGLE draft model drafts from the target's own hidden states.

The draft is one position "ahead": its position p reads the token x_{p+1} and the target's state at p (EAGLE-1: the
final normed hidden state; EAGLE-3: the residual streams entering three layers, `aux_layers`). The engine hands the
proposer those states for every position a forward committed (`target_hidden = "all"`: prompt chunks, then the
accepted part of each verified step). At each step the draft first catches up on the pairs it
has not seen, up to the newest committed token, in one batched forward whose last position gives draft 1; each
further draft feeds back the previous draft token and the draft's own features. The draft's KV cache has one slot
per request; the positions written while drafting are speculative and are simply overwritten by the next catch-up
(O(1) rollback). Drafts are argmax picks (q one-hot for `probabilistic`, as in vLLM).

P-EAGLE (`parallel_drafting`, a checkpoint with a learned `mask_hidden`): the catch-up forward carries k - 1 more
rows at the positions after the newest token, each fed the mask token and `mask_hidden` as its state, under causal
attention; the k drafts are the argmax at the newest token's row and at those k - 1 rows. One draft forward a step.

Token trees: a static tree's children are the drafter's top-ranked tokens; under `probabilistic` a random request's
children are instead drawn without replacement from the drafter's distribution (at the request's temperature), which
the proposal carries for recursive rejection sampling (sample/tree_verify.py). A dynamic tree (EAGLE-2) is grown
where the drafter's path confidence is highest and reranked to its node budget, per request.
"""

from __future__ import annotations

import torch

from verispec.proposers.base import Proposal, ProposerNeeds, argmax_drafts, asked, scatter
from verispec.proposers.state_slots import StateSlots
from verispec.request import Request
from verispec.runner.model_runner import ModelRunner, RowInput
from verispec.sample.logits import draw_noise
from verispec.sample.tree import DynamicTree, TokenTree, TreeBatch, ancestors_of
from verispec.sample.tree_verify import sample_children


class EagleProposer(StateSlots):
    def __init__(
        self,
        draft: torch.nn.Module,
        runner: ModelRunner,
        aux_layers: tuple[int, ...] = (),
        tree: TokenTree | DynamicTree | None = None,
        sample_children: bool = False,
        mask_token: int | None = None,
    ):
        """draft: models/eagle.py's EagleDraft, models/eagle3.py's Eagle3Draft or models/mtp.py's MTPLayer, bound to
        the target (embed, draft_ids, draft_topk, draft_logits); runner: the draft's cache and contexts; aux_layers:
        the target layers EAGLE-3 reads; tree: a token tree to draft (None: a chain); sample_children: a static
        tree's children of random requests are sampled (the `probabilistic` rule); mask_token: P-EAGLE's (a chain
        drafted in one forward, the draft's `mask_hidden` loaded), None: drafts one forward each."""
        self.draft, self.runner, self.tree = draft, runner, tree
        self.sample_children, self.mask_token = sample_children, mask_token
        self.needs = ProposerNeeds(target_hidden="all", aux_layers=aux_layers, runs_forward=True)
        self._init_slots(runner.cache)

    @torch.inference_mode()
    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        k = max(k_max, default=0)
        if k == 0:
            return Proposal([[] for _ in reqs])
        # a chain drafts only for the requests asked (a tree step drafts for every request)
        live = asked(k_max) if self.tree is None else None
        if live is None:
            return self._draft(reqs, k_max, k)
        return scatter(self._draft([reqs[i] for i in live], [k_max[i] for i in live], k), live, len(reqs))

    def _draft(self, reqs: list[Request], k_max: list[int], k: int) -> Proposal:
        """Catch up on each request's unread states, then draft up to k tokens (a tree: the whole tree)."""
        # P-EAGLE: k - 1 masked rows after the catch-up give drafts 2..k in the same forward
        masks = k_max if self.mask_token is not None else [1] * len(reqs)
        rows, states = [], []
        for r, m in zip(reqs, masks):
            # the newest committed token sits at position `end`
            rid, end = r.request_id, r.num_computed
            start = self.computed[rid]
            tokens = r.tokens_from(start + 1) + [self.mask_token] * (m - 1)
            rows.append(RowInput(self.slot[rid], start, tokens, logits_from=end - start - 1))
            states.extend(self.pending[rid])
            if m > 1:
                states.append(self.draft.mask_hidden.expand(m - 1, -1))
            # drafting writes past `end`: overwritten next time
            self.pending[rid], self.computed[rid] = [], end
        ids, positions, ctx, last = self.runner.build_context(rows)
        head_in, state = self.draft(self.draft.embed(ids), torch.cat(states), positions, ctx, self.cache.kv)
        if self.mask_token is not None:
            # P-EAGLE: draft i is the argmax at the i-th logits row (the newest token's, then its masks')
            return argmax_drafts(self.draft, head_in, last, k_max)
        # [B, H] at each request's newest token
        state = state[last]
        if isinstance(self.tree, DynamicTree):
            return self._propose_dynamic(reqs, head_in[last], state, min(k, self.tree.depth))
        if self.tree is not None:
            return self._propose_tree(reqs, head_in[last], state)
        # [B] draft 1
        token = self.draft.draft_ids(head_in[last])
        drafts = [token]
        # draft i + 1 comes from position end + i - 1, which reads draft i (= x_{end+i}) and the draft's own state
        for i in range(1, k):
            rows = [RowInput(self.slot[r.request_id], r.num_computed + i - 1, [0]) for r in reqs]
            _, positions, ctx, _ = self.runner.build_context(rows)
            head_in, state = self.draft(self.draft.embed(token), state, positions, ctx, self.cache.kv)
            token = self.draft.draft_ids(head_in)
            drafts.append(token)
        # [B, K]: the step's one host sync
        ids = torch.stack(drafts, dim=1).tolist()
        return Proposal([d[:c] for d, c in zip(ids, k_max)])

    def _propose_tree(
        self, reqs: list[Request], root_head: torch.Tensor, root_state: torch.Tensor
    ) -> Proposal:
        """Fill the tree level by level: the children of a node are the drafter's top tokens after it (a random
        request's under `probabilistic`: draws without replacement from its distribution). Level d's nodes come from
        one forward over every node above it (tree attention: each sees the prefix and its ancestors), at draft
        positions end + depth - 1."""
        tree, b = self.tree, len(reqs)
        parent, depth, anc = tree.parent, tree.depth, tree.ancestor_mask()
        dev = root_state.device
        # [B] bool, or None when every child is a top-ranked token
        sampled = None
        if self.sample_children and not all(r.params.is_greedy for r in reqs):
            sampled = torch.tensor([not r.params.is_greedy for r in reqs], device=dev)
            temps = torch.tensor(
                [1.0 if r.params.is_greedy else r.params.temperature for r in reqs], device=dev
            )
            gens = [r.generator for r in reqs]
        # [B, 1 + N]
        tokens = torch.zeros(b, tree.size + 1, dtype=torch.long, device=dev)
        # [B, 1 + N, V] the drafter's distribution at each node (its children's law), when sampling
        probs = None
        # node -> [B, H] its draft state
        states: dict[int, torch.Tensor] = {0: root_state}
        heads: dict[int, torch.Tensor] = {0: root_head}
        for d in range(1, tree.max_depth + 1):
            for node in [n for n in range(tree.size + 1) if depth[n] == d - 1]:
                kids = tree.children(node)
                if not kids:
                    continue
                if sampled is None:
                    # [B, max rank + 1]
                    top = self.draft.draft_topk(heads[node], kids[-1][0] + 1)
                    for rank, child in kids:
                        tokens[:, child] = top[:, rank]
                    continue
                # [B, V]
                q = (self.draft.draft_logits(heads[node]).float() / temps[:, None]).softmax(dim=-1)
                if probs is None:
                    probs = q.new_zeros(b, tree.size + 1, q.shape[-1])
                probs[:, node] = q
                top = q.topk(kids[-1][0] + 1, dim=-1).indices
                # the i-th child in rank order holds the i-th draw
                drawn = sample_children(q, len(kids), draw_noise([1] * b, gens, q.shape[-1], dev))
                for i, (rank, child) in enumerate(kids):
                    tokens[:, child] = torch.where(sampled, drawn[:, i], top[:, rank])
            # nodes 1..m: every level down to d
            m = sum(1 for x in depth[1:] if x <= d)
            if d == tree.max_depth:
                break
            rows = [
                RowInput(
                    self.slot[r.request_id],
                    r.num_computed,
                    [0] * m,
                    tree_mask=anc[1 : m + 1, 1 : m + 1],
                    depths=[x - 1 for x in depth[1 : m + 1]],
                )
                for r in reqs
            ]
            _, positions, ctx, _ = self.runner.build_context(rows)
            # [B, m, H]
            parents = torch.stack([states[parent[n]] for n in range(1, m + 1)], dim=1)
            emb = self.draft.embed(tokens[:, 1 : m + 1].reshape(-1))
            head_in, state = self.draft(emb, parents.reshape(b * m, -1), positions, ctx, self.cache.kv)
            head_in, state = head_in.view(b, m, -1), state.view(b, m, -1)
            for n in range(1, m + 1):
                heads[n], states[n] = head_in[:, n - 1], state[:, n - 1]
        # the step's one host sync
        return Proposal(tokens[:, 1:].tolist(), draft_probs=probs, tree=tree)

    def _propose_dynamic(
        self, reqs: list[Request], root_head: torch.Tensor, root_state: torch.Tensor, depth: int
    ) -> Proposal:
        """EAGLE-2: the root's top-k tokens are level 1; each further step runs the drafter over the newest level's
        k nodes (with every expanded node above them, under tree attention) and gives each its top-k children,
        scored by path confidence (sum of draft log-probs from the root); the k best of those k * k are the next
        level. Finally the num_nodes best of all drafted nodes form the request's tree (a node's confidence is at
        most its parent's, and a stable sort puts the parent first on ties, so every kept node's parent is kept).
        Children are top-ranked tokens, never sampled: a q-based test would be biased by choosing nodes by their
        own draft probabilities, so the engine verifies dynamic trees with the target's own picks."""
        spec, b, dev = self.tree, len(reqs), root_state.device
        k = spec.topk
        # [B, k]
        score, tok = self.draft.draft_logits(root_head).float().log_softmax(dim=-1).topk(k, dim=-1)
        # every drafted node, level by level: token, confidence, parent (0: the root, c + 1: candidate c), depth
        c_tok, c_score = [tok], [score]
        c_parent = [torch.zeros(b, k, dtype=torch.long, device=dev)]
        c_depth = [1] * k
        # the expanded levels: candidate ids + 1 [B, k], confidence [B, k], draft state [B, k, H]
        f_ids = [torch.arange(1, k + 1, device=dev).expand(b, k)]
        f_score = [score]
        f_state: list[torch.Tensor] = []
        # [B, k] the parent's index in the previous level
        f_up: list[torch.Tensor] = [torch.zeros(b, k, dtype=torch.long, device=dev)]
        # [B, m, m] ancestor-or-self among the expanded nodes
        anc = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)
        tokens_f = [tok]
        for d in range(1, depth):
            m = k * d
            rows = [
                RowInput(
                    self.slot[r.request_id],
                    r.num_computed,
                    [0] * m,
                    tree_mask=anc[i],
                    depths=[x for x in range(d) for _ in range(k)],
                )
                for i, r in enumerate(reqs)
            ]
            _, positions, ctx, _ = self.runner.build_context(rows)
            # [B, m, H] each node's parent state
            ups = [root_state[:, None].expand(b, k, -1)]
            ups += [
                torch.gather(s, 1, u[:, :, None].expand(-1, -1, s.shape[-1]))
                for s, u in zip(f_state, f_up[1:])
            ]
            parents = torch.cat(ups, dim=1)
            emb = self.draft.embed(torch.cat(tokens_f, dim=1).reshape(-1))
            head_in, state = self.draft(emb, parents.reshape(b * m, -1), positions, ctx, self.cache.kv)
            head_in, state = head_in.view(b, m, -1), state.view(b, m, -1)
            f_state.append(state[:, -k:])
            # [B, k, V] -> [B, k, k] the newest level's children
            lp = self.draft.draft_logits(head_in[:, -k:].reshape(b * k, -1)).float().log_softmax(dim=-1)
            s, t = lp.view(b, k, -1).topk(k, dim=-1)
            cand_score = (f_score[-1][:, :, None] + s).reshape(b, k * k)
            cand_tok = t.reshape(b, k * k)
            base = 1 + sum(x.shape[1] for x in c_tok)
            c_tok.append(cand_tok)
            c_score.append(cand_score)
            c_parent.append(f_ids[-1][:, :, None].expand(b, k, k).reshape(b, k * k))
            c_depth += [d + 1] * (k * k)
            if d + 1 == depth:
                break
            # the next level to expand: the k most confident children
            fs, fi = cand_score.topk(k, dim=-1)
            f_ids.append(base + fi)
            f_score.append(fs)
            f_up.append(fi // k)
            tokens_f.append(cand_tok.gather(1, fi))
            # [B, k]: parent's index among the expanded nodes
            up = (d - 1) * k + fi // k
            grown = torch.zeros(b, m + k, m + k, dtype=torch.bool, device=dev)
            grown[:, :m, :m] = anc
            grown[:, m:, :m] = torch.gather(anc, 1, up[:, :, None].expand(-1, -1, m))
            grown[:, m:, m:] = torch.eye(k, dtype=torch.bool, device=dev)
            anc = grown
        # [B, C]
        all_tok, all_score, all_parent = torch.cat(c_tok, 1), torch.cat(c_score, 1), torch.cat(c_parent, 1)
        return _best_nodes(all_tok, all_score, all_parent, c_depth, spec.num_nodes, depth, k)


def _best_nodes(
    all_tok: torch.Tensor,
    all_score: torch.Tensor,
    all_parent: torch.Tensor,
    c_depth: list[int],
    num_nodes: int,
    depth: int,
    k: int,
) -> Proposal:
    """Every drafted candidate ([B, C] tokens, path confidences, parents as candidate id + 1; depths [C]) -> the
    num_nodes most confident per request as one tree each (EAGLE-2's final selection)."""
    b, dev = all_tok.shape[0], all_tok.device
    n = min(num_nodes, all_tok.shape[1])
    # [B, n] kept candidates by path confidence, most confident first: a parent comes before its children (it
    # is at least as confident, and drafted earlier for the stable sort), so every prefix is a tree (the
    # planner's node budget keeps one)
    keep = torch.sort(all_score, dim=1, descending=True, stable=True).indices[:, :n]
    # candidate id + 1 -> node index (root 0)
    remap = torch.zeros(b, all_tok.shape[1] + 1, dtype=torch.long, device=dev)
    remap.scatter_(1, keep + 1, torch.arange(1, n + 1, device=dev).expand(b, n))
    root = torch.full((b, 1), -1, dtype=torch.long, device=dev)
    parent = torch.cat([root, remap.gather(1, all_parent.gather(1, keep))], dim=1)
    node_depth = torch.tensor([0] + c_depth, device=dev)[torch.cat([root + 1, keep + 1], dim=1)]
    # depth doublings reach every ancestor (further ones change nothing)
    ancestors = ancestors_of(parent, depth)
    # [B, n] each node's draft probability at its parent: exp(its path score - the parent's)
    kept_score = all_score.gather(1, keep)
    up_score = torch.cat([torch.zeros_like(kept_score[:, :1]), kept_score], 1).gather(1, parent[:, 1:])
    conf = (kept_score - up_score).exp()
    # the step's one host sync: [B, 4n] the kept tokens, their parents, depths and confidences (float64 holds
    # the integers exactly)
    host = torch.cat([all_tok.gather(1, keep), parent[:, 1:], node_depth[:, 1:], conf], 1).double().tolist()
    tokens = [[int(x) for x in row[:n]] for row in host]
    parents = [[-1] + [int(x) for x in row[n : 2 * n]] for row in host]
    depths = [[0] + [int(x) for x in row[2 * n : 3 * n]] for row in host]
    max_depth = max(max(d) for d in depths)
    tree = TreeBatch(parent, node_depth, ancestors, max_depth, k, parents, depths)
    return Proposal(tokens, tree=tree, confidence=[row[3 * n :] for row in host])
