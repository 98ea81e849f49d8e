"""`draft_model`: a smaller model (the same vocabulary, or its own with `use_heterogeneous_vocab`) drafts K tokens.

It owns a KV cache laid out like the target's, paged through the target's own block table (a request's draft K/V
sit in the blocks its target K/V do; O(1) rollback). Before drafting, it
catches up on the tokens the target committed since its last step (prompt on the first step), then runs K
batched single-token forwards, keeping the draft distribution q for `probabilistic` verification.

Parallel drafting (`parallel_drafting: true`, PARD draft models): the catch-up forward also carries K - 1 mask
tokens (the config's `pard_token`) after the newest token, and the K drafts are read from that one forward's last K
positions (each drawn from its own position's q, so `probabilistic` stays exact).

Cross-tokenizer drafting (`use_heterogeneous_vocab: true`, a `VocabMap`; TLI, see proposers/vocab_map.py): the draft
reads the context in its own vocabulary (each committed target token translated into the draft tokens spelling the
same bytes, the draft's BOS first when its tokenizer adds one), so its cache positions count draft tokens. It picks
only tokens of the intersection (logits masked to it before temperature, top-k/top-p and the argmax or sample), and
proposes their target ids. Its q for `probabilistic` verification is that masked, renormalised distribution carried
over to the target's ids (zero on every target token it cannot propose): exactly the law the draft was drawn from,
so the rejection rule keeps the target's distribution, as with a shared vocabulary. A request whose translated
context leaves no room in the draft cache for the drafts gets none.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate

import torch

from verispec.proposers.base import Proposal, ProposerNeeds, scatter
from verispec.proposers.vocab_map import VocabMap
from verispec.request import Request
from verispec.runner.kv_cache import KVCache
from verispec.runner.model_runner import ModelRunner, RowInput
from verispec.sample import logits as S


class DraftModelProposer:
    needs = ProposerNeeds(runs_forward=True)

    def __init__(
        self,
        runner: ModelRunner,
        num_speculative_tokens: int,
        keep_probs: bool,
        seed: int = 0,
        mask_token: int | None = None,
        sample_drafts: bool = True,
        vocab_map: VocabMap | None = None,
        target_cache: KVCache | None = None,
    ):
        """mask_token: parallel drafting's filler token (None: K sequential draft forwards). sample_drafts
        (draft_sample_method 'probabilistic'): random requests draft samples of q; False ('greedy'): every request
        drafts the argmax, and q is not kept (it is one-hot at the draft). vocab_map: the draft has its own
        vocabulary (None: the target's). target_cache: the target's cache when the draft's is paged through its block
        table (a request's draft slot is then its target slot, its blocks the target's block ids, and a cached
        prefix's draft K/V are reused where the pool says they are the committed tokens')."""
        self.runner, self.k, self.mask_token = runner, num_speculative_tokens, mask_token
        self.map = vocab_map.to(runner.device) if vocab_map is not None else None
        # with a vocab_map: each request's context in draft ids, and how many of its target tokens that covers
        self.draft_ids: dict[str, list[int]] = {}
        self.translated: dict[str, int] = {}
        self.keep_probs, self.sample_drafts = keep_probs and sample_drafts, sample_drafts
        self.cache: KVCache = runner.cache
        self.vocab = runner.model.cfg.vocab_size
        self.slot: dict[str, int] = {}
        # tokens of the request whose K/V the draft cache holds
        self.computed: dict[str, int] = {}
        self.generator = S.make_generator(seed + 1, runner.device)
        self.target = target_cache
        # per request: its leading blocks marked as drafted in the target's pool
        self.marked: dict[str, int] = {}

    def add_request(self, req: Request) -> None:
        slot = req.slot if self.target is not None else self.cache.allocate()
        assert slot is not None, "draft cache has as many slots as the target's"
        self.slot[req.request_id], self.computed[req.request_id] = slot, 0
        self.marked[req.request_id] = 0
        if self.target is None:
            return
        # a cached prefix: its leading blocks whose draft K/V some request finished writing for these very tokens
        pool, blocks = self.target.pool, self.target.blocks[slot]
        n = next(
            (i for i in range(req.num_cached_blocks) if not pool.drafted(blocks[i])), req.num_cached_blocks
        )
        self.computed[req.request_id] = self.marked[req.request_id] = n
        self.computed[req.request_id] *= self.target.block_size

    def remove_request(self, req: Request, aborted: bool) -> None:
        slot = self.slot.pop(req.request_id, None)
        if slot is not None and self.target is None:
            self.cache.free(slot)
        self.computed.pop(req.request_id, None)
        self.marked.pop(req.request_id, None)
        self.draft_ids.pop(req.request_id, None)
        self.translated.pop(req.request_id, None)

    def backlog(self, req: Request) -> int:
        rid = req.request_id
        if self.map is None:
            return req.num_tokens - self.computed[rid]
        # draft ids not yet fed, and target tokens not yet translated (about one draft id each)
        return (
            len(self.draft_ids.get(rid, ()))
            - self.computed[rid]
            + req.num_tokens
            - self.translated.get(rid, 0)
        )

    def _catch_up_rows(self, reqs: list[Request]) -> list[RowInput]:
        if self.map is not None:
            return [self._translated_row(r) for r in reqs]
        rows = []
        for r in reqs:
            n = r.num_tokens
            # rollback of rejected drafts: O(1)
            done = min(self.computed[r.request_id], n - 1)
            rows.append(
                RowInput(self.slot[r.request_id], done, r.tokens_from(done), logits_from=n - done - 1)
            )
            self.computed[r.request_id] = n
        return rows

    def _mark_drafted(self, reqs: list[Request]) -> None:
        """After a catch-up: each request's cached blocks below its caught-up length hold the draft K/V of their
        committed tokens; say so in the target's pool (a later request with this prefix reuses them)."""
        if self.target is None:
            return
        bs, pool = self.target.block_size, self.target.pool
        for r in reqs:
            rid, blocks = r.request_id, self.target.blocks[r.slot]
            i = self.marked[rid]
            while i < min(self.computed[rid] // bs, len(blocks)) and pool.mark_drafted(blocks[i]):
                i += 1
            self.marked[rid] = i

    def _translate(self, r: Request) -> list[int]:
        """The request's committed tokens in draft ids, extended by the tokens committed since the last call."""
        rid = r.request_id
        done = self.translated.get(rid, 0)
        ids = self.draft_ids.setdefault(rid, [])
        if done < r.num_tokens:
            assert self.map is not None
            ids += self.map.translate_ids(r.tokens_from(done), first=done == 0)
            self.translated[rid] = r.num_tokens
        return ids

    def _translated_row(self, r: Request) -> RowInput:
        ids = self._translate(r)
        # rollback of rejected drafts: O(1); at least the newest draft token is fed, for its logits
        done = min(self.computed[r.request_id], len(ids) - 1)
        self.computed[r.request_id] = len(ids)
        return RowInput(self.slot[r.request_id], done, ids[done:], logits_from=len(ids) - done - 1)

    def _fits(self, r: Request, k: int) -> bool:
        """With a vocab_map: the translated context is not empty and it and k drafts fit the draft cache."""
        n = len(self._translate(r))
        return 0 < n and n + k - 1 <= self.cache.scratch

    @torch.inference_mode()
    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        k = max(k_max, default=0)
        if k == 0:
            return Proposal([[] for _ in reqs])
        # only the requests asked (and, with a vocab_map, whose context and drafts fit the draft cache)
        live = [i for i, k_i in enumerate(k_max) if k_i > 0 and (self.map is None or self._fits(reqs[i], k))]
        if len(live) == len(reqs):
            return self._draft(reqs, k_max, k)
        sub = [k_max[i] for i in live]
        return scatter(self._draft([reqs[i] for i in live], sub, max(sub, default=0)), live, len(reqs))

    def _draft(self, reqs: list[Request], k_max: list[int], k: int) -> Proposal:
        """Catch up on each request's tokens, then draft up to k tokens each."""
        if not reqs:
            return Proposal([])
        if self.mask_token is not None:
            return self._propose_parallel(reqs, k_max, k)
        params = [r.params for r in reqs]
        st = S.SamplingTensors.from_params(params, self.runner.device, self.vocab)
        rows = self._catch_up_rows(reqs)
        # drafts that are the argmax (one-hot, in the target's vocabulary): the catch-up also scores the row before
        # each newest token, whose pick the planner judges in hindsight
        judge = self.map is None and (st.all_greedy or not self.sample_drafts)
        if judge:
            rows = [replace(r, logits_from=r.logits_from - 1) if r.logits_from else r for r in rows]
        # logits [B, V] at each request's newest token (and [H, V] before it, H = the requests judged)
        logits, before = self._split_catch_up(self.runner.run(rows).logits, rows)
        # the requests whose catch-up scored the position before their newest token
        judged = [i for i, r in enumerate(rows) if len(r.token_ids) - r.logits_from == 2]
        self._mark_drafted(reqs)
        tokens, probs, confidence = [], [], []
        logits = self._restrict(logits)
        for i in range(k):
            # [B, V]
            q = S.logits_to_probs(logits, st)
            if st.all_greedy or not self.sample_drafts:
                tok = S.greedy(logits)
            else:
                # seeded requests draft reproducibly
                gens = [r.generator for r in reqs]
                noise = S.draw_row_uniforms([1] * len(reqs), gens, logits.device, self.generator)
                tok = torch.where(st.is_greedy, S.greedy(logits), S.sample(q, noise))
            tokens.append(self._proposed(tok))
            confidence.append(draft_confidence(logits, tok))
            if self.keep_probs:
                probs.append(self._target_probs(q))
            if i + 1 < k:
                rows = [RowInput(self.slot[r.request_id], self.computed[r.request_id] + i, [0]) for r in reqs]
                logits = self._restrict(self._step(rows, tok))
        picks = None
        if before is not None:
            # [B]: -1 where the catch-up scored the newest token alone
            pick = torch.full_like(tokens[0], -1)
            pick_conf = torch.zeros_like(confidence[0])
            idx = torch.tensor(judged, device=pick.device)
            tok = S.greedy(before)
            pick[idx], pick_conf[idx] = tok, draft_confidence(before, tok)
            tokens, confidence = tokens + [pick], confidence + [pick_conf]
        # [2, B, K (+1)] drafts and their confidence (and the picks in hindsight): the step's one host sync
        both = torch.stack([torch.stack(tokens, dim=1).double(), torch.stack(confidence, dim=1)]).tolist()
        drafts = [[int(t) for t in d[:c]] for d, c in zip(both[0], k_max)]
        conf = [c_row[:c] for c_row, c in zip(both[1], k_max)]
        if before is not None:
            picks = [(int(d[-1]), c[-1]) if d[-1] >= 0 else None for d, c in zip(both[0], both[1])]
        probs_out = torch.stack(probs, dim=1) if self.keep_probs else None
        return Proposal(drafts, probs_out, confidence=conf, hindsight=picks)

    @staticmethod
    def _split_catch_up(
        logits: torch.Tensor, rows: list[RowInput]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[N, V] logits of catch-up rows scoring one or two positions each -> ([B, V] at each newest token, [H, V]
        at the position before it for the H rows scoring two, or None when none does)."""
        counts = [len(r.token_ids) - r.logits_from for r in rows]
        if all(c == 1 for c in counts):
            return logits, None
        ends = list(accumulate(counts))
        last = torch.tensor([e - 1 for e in ends], device=logits.device)
        prev = torch.tensor([e - 2 for e, c in zip(ends, counts) if c == 2], device=logits.device)
        return logits.index_select(0, last), logits.index_select(0, prev)

    def _propose_parallel(self, reqs: list[Request], k_max: list[int], k: int) -> Proposal:
        """All k drafts from one forward: catch-up tokens, then k - 1 mask tokens; logits at the last k positions."""
        rows = [
            RowInput(row.slot, row.start, row.token_ids + [self.mask_token] * (k - 1), row.logits_from)
            for row in self._catch_up_rows(reqs)
        ]
        # [B * k, V]: the newest token's position, then each mask's
        logits = self._restrict(self.runner.run(rows).logits)
        self._mark_drafted(reqs)
        params = [r.params for r in reqs]
        st = S.SamplingTensors.from_params(params, self.runner.device, self.vocab).repeat_interleave(
            [k] * len(reqs)
        )
        # [B * k, V]
        q = S.logits_to_probs(logits, st)
        tok = S.greedy(logits)
        if not st.all_greedy and self.sample_drafts:
            gens = [r.generator for r in reqs]
            noise = S.draw_row_uniforms([k] * len(reqs), gens, logits.device, self.generator)
            tok = torch.where(st.is_greedy, tok, S.sample(q, noise))
        conf = draft_confidence(logits, tok).view(len(reqs), k)
        both = torch.stack([self._proposed(tok).view(len(reqs), k).double(), conf]).tolist()
        drafts = [[int(t) for t in d[:c]] for d, c in zip(both[0], k_max)]
        confidence = [c_row[:c] for c_row, c in zip(both[1], k_max)]
        q = self._target_probs(q).view(len(reqs), k, -1) if self.keep_probs else None
        return Proposal(drafts, q, confidence=confidence)

    def _restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, Vd] draft logits -> the ones the draft picks from: the intersection's (vocab_map), else all."""
        return logits if self.map is None else self.map.mask_logits(logits)

    def _proposed(self, tok: torch.Tensor) -> torch.Tensor:
        """[N] draft ids -> [N] the target ids they propose."""
        return tok if self.map is None else self.map.to_target(tok)

    def _target_probs(self, q: torch.Tensor) -> torch.Tensor:
        """[N, Vd] draft law -> [N, Vt] the same law over the target's ids."""
        return q if self.map is None else self.map.target_probs(q)

    def _step(self, rows: list[RowInput], tok: torch.Tensor) -> torch.Tensor:
        """One batched draft forward feeding `tok` [B] (kept on device: no host sync per draft token)."""
        # rows in request order: packed ids = tok
        _, positions, ctx, _ = self.runner.build_context(rows)
        m = self.runner.model
        # [B, hidden]
        hidden, _ = m(tok, positions, ctx, self.cache.kv)
        # [B, V]
        return m.compute_logits(hidden)


def draft_confidence(logits: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """The draft model's own probability (untempered softmax) of each drafted token: [N, V], [N] -> [N] float64.
    The planner calibrates it against what the target accepts."""
    return logits.float().softmax(dim=-1).gather(1, tok[:, None]).squeeze(1).double()
