"""`eagle` / `eagle3`: an EAGLE draft model drafts from the target's own hidden states.

The draft is one position "ahead": its position p reads the token x_{p+1} and the target's state at p (EAGLE-1: the
final normed hidden state; EAGLE-3: the residual streams entering three layers, `aux_layers`). The engine hands the
proposer those states for every position a forward committed (`target_hidden = "all"`: prompt chunks, then the
accepted part of each verified step). At each step the draft first catches up on the pairs it
has not seen, up to the newest committed token, in one batched forward whose last position gives draft 1; each
further draft feeds back the previous draft token and the draft's own features. The draft's KV cache has one slot
per request; the positions written while drafting are speculative and are simply overwritten by the next catch-up
(O(1) rollback). Drafts are argmax picks (q one-hot for `probabilistic`, as in vLLM).
"""

from __future__ import annotations

import torch

from verispec.engine.kv_cache import KVCache
from verispec.engine.model_runner import ModelRunner, RowInput
from verispec.engine.request import Request
from verispec.spec.base import Proposal, ProposerNeeds
from verispec.spec.tree import TokenTree


class EagleProposer:
    def __init__(
        self,
        draft: torch.nn.Module,
        runner: ModelRunner,
        aux_layers: tuple[int, ...] = (),
        tree: TokenTree | None = None,
    ):
        """draft: models/eagle.py's EagleDraft, models/eagle3.py's Eagle3Draft or models/mtp.py's MTPLayer, bound to
        the target (embed, draft_ids, draft_topk); runner: the draft's cache and contexts; aux_layers: the target
        layers EAGLE-3 reads; tree: a token tree to draft (None: a chain)."""
        self.draft, self.runner, self.tree = draft, runner, tree
        self.needs = ProposerNeeds(target_hidden="all", aux_layers=aux_layers, runs_forward=True)
        self.cache: KVCache = runner.cache
        self.slot: dict[str, int] = {}
        # draft positions whose K/V pair a committed token with a target state
        self.computed: dict[str, int] = {}
        # target states of positions computed[rid].. not yet read
        self.pending: dict[str, list[torch.Tensor]] = {}

    def add_request(self, req: Request) -> None:
        slot = self.cache.allocate()
        assert slot is not None, "the draft cache has as many slots as the target's"
        self.slot[req.request_id], self.computed[req.request_id], self.pending[req.request_id] = slot, 0, []

    def remove_request(self, req: Request, aborted: bool) -> None:
        slot = self.slot.pop(req.request_id, None)
        if slot is not None:
            self.cache.free(slot)
        self.computed.pop(req.request_id, None)
        self.pending.pop(req.request_id, None)

    def observe_hidden(self, reqs: list[Request], hidden: list[torch.Tensor]) -> None:
        # h [n, H]: positions num_computed - n .. num_computed - 1, in order
        for r, h in zip(reqs, hidden):
            self.pending[r.request_id].append(h)

    @torch.inference_mode()
    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        k = max(k_max, default=0)
        if k == 0:
            return Proposal([[] for _ in reqs])
        rows, states = [], []
        for r in reqs:
            # the newest committed token sits at position `end`
            rid, end = r.request_id, r.num_computed
            start = self.computed[rid]
            rows.append(
                RowInput(self.slot[rid], start, r.tokens_from(start + 1), logits_from=end - start - 1)
            )
            states.extend(self.pending[rid])
            # drafting writes past `end`: overwritten next time
            self.pending[rid], self.computed[rid] = (
                [],
                end,
            )
        ids, positions, ctx, last = self.runner.build_context(rows)
        head_in, state = self.draft(self.draft.embed(ids), torch.cat(states), positions, ctx, self.cache.kv)
        # [B, H] at each request's newest token
        state = state[last]
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
        """Fill the tree level by level: the children of a node are the drafter's top tokens after it. Level d's nodes
        come from one forward over every node above it (tree attention: each sees the prefix and its ancestors), at
        draft positions end + depth - 1."""
        tree, b = self.tree, len(reqs)
        parent, depth, anc = tree.parent, tree.depth, tree.ancestor_mask()
        # [B, 1 + N]
        tokens = torch.zeros(b, tree.size + 1, dtype=torch.long, device=root_state.device)
        # node -> [B, H] its draft state
        states: dict[int, torch.Tensor] = {0: root_state}
        heads: dict[int, torch.Tensor] = {0: root_head}
        for d in range(1, tree.max_depth + 1):
            for node in [n for n in range(tree.size + 1) if depth[n] == d - 1]:
                kids = tree.children(node)
                if kids:
                    # [B, max rank + 1]
                    top = self.draft.draft_topk(heads[node], kids[-1][0] + 1)
                    for rank, child in kids:
                        tokens[:, child] = top[:, rank]
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
        return Proposal(tokens[:, 1:].tolist(), tree=tree)
